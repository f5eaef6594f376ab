"""Splice mode: place upstream segments inside the receiver's own context.

In most agent frameworks each agent has its own system prompt and receives upstream
output as messages inside its own context. An upstream agent's cache for those
messages was computed at other positions and after another prefix, so it is not a
prefix of the receiver's context. :func:`assemble` builds the receiver's cache as::

    [own prefix: prefilled]  [segment 1: moved]  [gap]  [segment 2: moved]  ...  | rest: prefilled by generate

- *Positions* (:data:`Placement`): ``"end"`` -- the position-reset policy: each segment
  is re-based to start right where the receiver's context is (contiguous positions,
  what a text prompt would have). Right for short exchanges; lossy for long-range
  dependencies, since a segment no longer sits where it was in the session's timeline.
  ``"global"`` -- keep each segment's absolute position from the session's global
  position counter (no re-rotation; positions may jump). An ``int`` places the first
  segment at that explicit offset. Segments may never overlap the receiver's own tokens.
- *Gaps* between segments (e.g. the end-of-turn tokens a sender never cached) get
  placeholder slots that are always recomputed.
- *Recompute* (:class:`Recompute`): a segment's keys and values were computed after
  the sender's prefix, not the receiver's, so splicing is approximate. A fraction ``R``
  of the spliced tokens is recomputed (``R = 1``: everything, exactly text mode's
  computation), chosen by :data:`Selection`:

  - ``"attention+start"`` (default): half of the budget goes to the slots the receiver reads most -- the
    largest attention weight any head gives a slot while the last :attr:`Recompute.probe` tokens of the
    receiver's own turn (the tokens after the last segment, where its reply starts) are run over the spliced
    segments, summed over layers -- and half to the first spliced slots (the start of the first segment, right
    after the receiver's own prefix), taking turns between the two rankings;
  - ``"attention+deviation"``: the start's half goes to the slots whose K/V deviate most at an early layer
    (CacheBlend's signal) instead;
  - ``"kv-deviation"``: CacheBlend's criterion alone (largest K/V deviation at ``select_layer``);
  - ``"attention"``: the receiver's reading alone.

  Why two halves: measured per slot (BENCHMARKS.md, splice), the error a stale slot puts into the receiver's
  output is its deviation *at the layers the receiver reads it* times how much it is read. The attention probe
  finds the last turns before the receiver's own, whose deep-layer K/V deviate most and which the receiver reads
  most. The start of the first segment is read less but deviates most early: its K/V were computed right after
  the sender's prefix, which differs from the receiver's, and the dependence fades with distance. Layer-1
  deviation ranks exactly these slots first, so its half was replaced by their order: the same KL against an
  exact recomputation on three pipelines (8.9e-5 / 2.2e-4 / 7.4e-5 against 1.2e-4 / 2.1e-4 / 8.1e-5), for no
  pass at all (layer-1 deviation is a prefill of the whole context through two layers; BENCHMARKS.md, section
  11). EPIC's remedy, the first ``k`` tokens of *every* segment, is :attr:`Recompute.first`.

  Why the last 4 tokens probe, not the whole turn: the probe is a forward pass of the tokens it runs, and a whole
  turn of 66 tokens cost as much as prefilling that turn again (0.47 s of a 1.5 s TTFT, the coder model in int8).
  Reading with the last 4: the KL against text mode was the same as with the whole turn on HumanEval pipelines of
  both offline models; against an exact recomputation it was 1.2-1.9x the whole turn's, still 8-10x below R = 0's
  and 5x below K/V deviation's alone (BENCHMARKS.md, splice: the attention probe's length). The probe reads the
  spliced segments only: the receiver's own tokens before them are not computed yet (nor the gaps), and hidden
  from it. That keeps the probe at 4 rows (on a CPU int8's short-pass kernel, ~70 ms a pass, against
  ~250 ms with the ~20 own rows in it), and it ranked better on all three pipelines (the attention half alone:
  exact KL 2.8e-4 / 1.7e-4 / 8.8e-5 against 3.1e-4 / 2.1e-4 / 1.4e-4 reading the own prefix too), likely
  because the receiver's system prompt holds the attention sink, which otherwise takes most of every head's
  weight.

Staleness and the guard. The one pass that computes the recomputed share also sees what those slots held as
received: :attr:`Spliced.staleness` is, per segment, the mean relative change of its recomputed slots' K/V over
every layer. It tells apart a chain's splice (a segment computed after another system prompt) from a merge's
(sibling candidates computed without each other: 3-4x higher on both offline models), but not, within a kind,
the splices whose output moved (BENCHMARKS.md, section 11). :attr:`Recompute.guard` recomputes exactly from the
first segment over that bound to the end: one more causal pass after what comes before it.

Passes. On a CPU every forward pass streams all of the model's weights once, a fixed cost whatever its rows
(~120 ms for the coder model in int8: a pass of 9 rows takes 171 ms, of 48 rows 371 ms). A splice therefore
computes everything the receiver computes in one pass (:func:`kvwire.hf.fill`): its own tokens before the first
segment, the gaps, the recomputed share and -- with ``through`` -- its own turn, whose last logits give the first
reply token. Only the attention probe runs before it, on its 4 tokens. Four passes (own prefix, probe,
recompute, turn) became two, and then a short one and a long one (BENCHMARKS.md, section 11).

Talks to the model only through :mod:`kvwire.hf`. Sliding-window models are refused
(selective recompute needs every slot of every layer).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from .. import hf
from ..wire import rope
from ..errors import ChainError, ModelError, PacketError
from ..wire.packet import Packet
from ..wire.spec import ModelSpec

Placement = Literal["end", "global"] | int
Selection = Literal["attention+start", "attention+deviation", "kv-deviation", "attention"]
SELECTIONS: tuple[str, ...] = get_args(Selection)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recompute:
    """Which spliced tokens to recompute (always also every gap token)."""

    fraction: float = 0.0  # R: share of spliced tokens to recompute, chosen by `select`
    first: int = 0  # EPIC: the first k tokens of every segment
    select_layer: int = 1  # K/V deviation layer; layer 0 K/V depend only on token and position
    select: Selection = "attention+start"  # how the R share is chosen (module docstring)
    probe: int = 4  # the attention ranking reads with the turn's last `probe` tokens; 0: all of them
    guard: float = 0.0  # recompute from the first segment whose staleness is over this, exactly (0: no guard)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"recompute fraction must be in [0, 1], got {self.fraction}")
        if self.first < 0 or self.select_layer < 0 or self.probe < 0 or self.guard < 0:
            raise ValueError("recompute first, select_layer, probe and guard must be >= 0")
        if self.select not in SELECTIONS:
            raise ValueError(f"recompute select must be one of {', '.join(SELECTIONS)}, got {self.select!r}")

    def describe(self) -> str:
        parts = [f"R={self.fraction:g}"] + ([f"first={self.first}"] if self.first else [])
        if self.select != Recompute.select and 0.0 < self.fraction < 1.0:
            parts.append(f"select={self.select}")
        if self.probe != Recompute.probe and self.select != "kv-deviation" and 0.0 < self.fraction < 1.0:
            parts.append(f"probe={self.probe or 'all'}")
        if self.guard and self.fraction < 1.0:
            parts.append(f"guard={self.guard:g}")
        return ",".join(parts)


@dataclass
class Segment:
    """An upstream packet and where it goes: ``offset`` is its first token's index in the
    receiver's context ids."""

    offset: int
    packet: Packet


@dataclass
class Spliced:
    """The assembled cache and what it cost."""

    cache: Any  # hf DynamicCache covering context_ids[:length]
    length: int  # context tokens the cache covers (up to the end of the last segment; all of them ``through``)
    positions: torch.Tensor  # [N] position of every context token (slot order)
    spliced: int  # segment tokens kept as received
    recomputed: int  # segment tokens recomputed (selected + first-k)
    gaps: int  # gap tokens (always recomputed)
    timings: dict[str, float] = field(default_factory=dict)  # place_s, select_s, recompute_s
    selected: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # slots computed last
    first_logits: torch.Tensor | None = None  # fp32 [V] after the whole context (``through``): the first reply token
    staleness: list[float | None] = field(default_factory=list)  # per segment (:func:`_staleness`)
    guarded: int = 0  # spliced tokens the guard recomputed (0: it did not fire)

    @property
    def contiguous(self) -> bool:
        return bool(torch.equal(self.positions, torch.arange(self.positions.numel())))

    @property
    def compute_s(self) -> float:
        """Seconds the splice computed: choosing what to recompute, recomputing it, and the guard's pass."""
        return sum(self.timings.get(key, 0.0) for key in ("select_s", "recompute_s", "guard_s"))


When = Literal["cheaper", "always"]
WHEN: tuple[str, ...] = get_args(When)  # splice where estimate() says it pays, or whatever is found

# A splice's costs beyond the tokens it computes, in tokens prefilled: fitted to graph merges on the
# default model (2-core CPU; BENCHMARKS.md, graphs: splice or prefill). FIXED_TOKENS is the prior for its extra
# passes where the model's own pass cost is not measured (kvwire.hf.pass_cost, which `estimate` takes instead).
FIXED_TOKENS = 100  # its extra forward passes (selection, recompute): Python through every layer
COPY_SHARE = 1 / 20  # its extra copies of the assembled cache, per context token
SEGMENT_TOKENS = 5  # fetching, checking, decoding and re-rotating one segment's packet


@dataclass(frozen=True)
class Estimate:
    """What reaching the first token costs spliced and prefilled, in tokens prefilled."""

    between: int  # context tokens after the exact prefix, before the receiver's own tail
    prefill_tokens: float  # prefill them (and the tail) after the exact prefix: exact
    splice_tokens: float  # splice them: the tail, selection probes, gaps, recomputed share, fixed costs

    @property
    def splice_pays(self) -> bool:
        return self.splice_tokens < self.prefill_tokens

    def describe(self) -> str:
        return f"est. {self.prefill_tokens:.0f} tokens prefilled vs {self.splice_tokens:.0f} to splice"


def estimate(context_length: int, exact_prefix: int, spans: list[tuple[int, int]], recompute: Recompute,
             num_layers: int, pass_cost: Any | None = None, *, through: bool = False) -> Estimate:
    """Splicing the segments at ``spans`` ((start, end) context offsets, in order) against prefilling
    everything after the ``exact_prefix`` tokens a cache already covers.

    Both ways prefill the tail after the last segment (``T`` tokens: the receiver's own turn).
    Prefilling adds every token between the prefix and the tail. Splicing adds: the gaps between
    segments; the recomputed share ``R`` of the segments' ``S`` tokens (and the first ``k`` of
    each); when a selection runs (0 < R < 1), a probe of the tail's last ``probe`` tokens through every layer
    (``attention``) and of the segments through ``select_layer + 1`` layers (``deviation``); and
    the fixed costs above. Short segments are cheaper to prefill -- and exact that way.

    ``pass_cost`` (:class:`kvwire.hf.pass_cost.PassCost`, measured on the model): each extra pass is priced at
    its fixed part -- the selection's, and the recompute's unless it shares the tail's pass (``through``, as
    :func:`assemble` computes it) -- instead of the prior :data:`FIXED_TOKENS`.
    """
    spans = [(start, end) for start, end in spans if end > start]
    last = max([end for _, end in spans] or [exact_prefix])
    between = max(0, last - exact_prefix)
    tail = context_length - last
    segment_tokens = sum(end - start for start, end in spans)
    gaps = max(0, between - segment_tokens)
    budget = round(recompute.fraction * segment_tokens)
    recomputed = min(segment_tokens, budget + recompute.first * len(spans))
    selection, passes = 0.0, 0
    if 0 < budget < segment_tokens:
        if "attention" in recompute.select:
            selection += min(tail, recompute.probe) if recompute.probe else tail  # the turn's tokens it reads with
            passes += 1
        if "deviation" in recompute.select:
            selection += between * min(recompute.select_layer + 1, num_layers) / num_layers
            passes += 1
    if not through and recomputed + gaps:
        passes += 1  # the recompute's own pass, then the tail's
    fixed = FIXED_TOKENS if pass_cost is None else passes * pass_cost.fixed_tokens
    splice_tokens = (tail + selection + gaps + recomputed + fixed + COPY_SHARE * context_length
                     + SEGMENT_TOKENS * len(spans))
    return Estimate(between, float(between + tail), splice_tokens)


def assemble(model: Any, spec: ModelSpec, tables: list[rope.RopeTable], context_ids: list[int],
             segments: list[Segment], *, recompute: Recompute | None = None,
             placement: Placement = "end", prefix: Any | None = None, through: bool = False) -> Spliced:
    """Build the receiver's cache for ``context_ids`` from its own prefix and ``segments``.

    Every segment must come from this model, match ``context_ids`` at its offset, and
    segments must be in order without overlap. ``prefix``, a cache of the first ``k``
    context ids (``k`` <= the first segment's offset; a received exact prefix, say), is
    grown in place instead of prefilling those ``k`` tokens. Raises :class:`PacketError` /
    :class:`ChainError` naming the mismatch; never returns a wrongly positioned cache.

    ``through``: also compute the context after the last segment (the receiver's own turn), so that the cache
    covers every context id and :attr:`Spliced.first_logits` gives the first reply token (``hf.generate(...,
    first_logits=...)``); otherwise the cache ends with the last segment and the caller prefills the rest.

    The receiver computes its own tokens before the first segment, the gaps, the recomputed share (and with
    ``through`` its own turn) in **one** forward pass (:func:`kvwire.hf.fill`), after the selection's probes. On a
    CPU every pass streams all the weights, a fixed cost a splice used to pay once for each of these
    (BENCHMARKS.md, section 11).
    """
    recompute = recompute or Recompute()
    if not segments:
        raise ChainError("nothing to splice: no segments")
    n = len(context_ids)
    _check_segments(spec, tables, context_ids, segments)
    device = hf.model_device(model)  # ids, positions and slot indices follow the model; scores come back
    positions = _positions(segments, n, placement).to(device)
    timings: dict[str, float] = {}
    ids = torch.tensor([context_ids], device=device)

    mark = time.perf_counter()
    cache, done, own = _own_prefix(model, spec, prefix, segments[0].offset, device)
    gap_slots, end = _place(cache, spec, tables, segments, positions)
    timings["place_s"] = time.perf_counter() - mark

    mark = time.perf_counter()
    chosen = _choose(model, cache, ids, positions, end, done, own, gap_slots, segments, recompute)
    timings["select_s"] = time.perf_counter() - mark
    selected = torch.tensor(sorted(set(own) | set(gap_slots) | chosen), dtype=torch.long, device=device)

    mark = time.perf_counter()
    tail = (ids[:, end:], positions[end:]) if through else (None, None)
    filled = hf.fill(model, cache, ids[:, :end], positions[:end], selected, *tail)
    timings["recompute_s"] = time.perf_counter() - mark
    staleness = _staleness(segments, selected, filled.deviation, set(chosen))
    spliced_total = sum(s.packet.length for s in segments)
    kept, logits, guarded = spliced_total - len(chosen), filled.logits, 0
    over = [k for k, value in enumerate(staleness) if recompute.guard and value is not None and value > recompute.guard]
    if over:
        mark = time.perf_counter()
        logits, guarded, unchosen = _guard(model, cache, ids, positions, segments[over[0]:], chosen)
        timings["guard_s"] = time.perf_counter() - mark
        kept -= unchosen
        log.info("splice guard: segment %d's staleness %.3f is over %.3f; recomputed its %d spliced tokens and the "
                 "rest exactly", over[0], staleness[over[0]], recompute.guard, guarded)
    return Spliced(cache, n if through else end, positions, kept, spliced_total - kept, len(gap_slots),
                   timings, selected, logits if through else None, staleness, guarded)


def _own_prefix(model: Any, spec: ModelSpec, prefix: Any | None, first: int,
                device: Any) -> tuple[Any, int, list[int]]:
    """The receiver's cache up to the first segment at ``first``: ``prefix`` (or a new cache) holding the ``done``
    tokens already computed, then placeholders for its own tokens after them (``own``, computed in the fill)."""
    cache = hf.new_cache(model) if prefix is None else prefix
    done = hf.cache_length(cache)
    if done > first:
        raise PacketError(f"the prefix cache covers {done} tokens, past the first segment at {first}")
    own = list(range(done, first))
    if own:
        hf.append_placeholders(cache, spec, len(own), device=device)
    return cache, done, own


def _guard(model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor, later: list[Segment],
           chosen: set[int]) -> tuple[Any, int, int]:
    """Recompute ``later`` (the first segment over the guard's bound and every one after it) and the rest of
    ``cache`` exactly. Returns the logits after the last slot, how many spliced tokens those segments brought, and
    how many of them had been kept as received (the ones the selection had not already recomputed)."""
    logits = _recompute_from(model, cache, ids, positions, later[0].offset)
    guarded = sum(s.packet.length for s in later)
    return logits, guarded, guarded - sum(1 for c in chosen if c >= later[0].offset)


def _recompute_from(model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor, start: int) -> Any:
    """The guard: recompute every slot of ``cache`` from ``start`` on, exactly (one causal prefill after what comes
    before it); the logits after its last slot."""
    length = hf.cache_length(cache)
    rows = torch.arange(start, length, dtype=torch.long, device=positions.device)
    return hf.fill(model, cache, ids[:, :length], positions[:length], rows).logits


def _staleness(segments: list[Segment], selected: torch.Tensor, deviation: torch.Tensor | None,
               chosen: set[int]) -> list[float | None]:
    """Per segment, the mean :attr:`kvwire.hf.Filled.deviation` of its recomputed slots: how far the receiver's
    context moved the K/V that segment brought (None: none of its slots was recomputed). The recomputed slots are
    the most read and the first ones, so this reads high against the segment's average; it compares splices."""
    if deviation is None:
        return [None] * len(segments)
    slots = selected.tolist()
    out: list[float | None] = []
    for segment in segments:
        values = [float(deviation[i]) for i, slot in enumerate(slots)
                  if slot in chosen and segment.offset <= slot < segment.offset + segment.packet.length]
        out.append(sum(values) / len(values) if values else None)
    return out


def _place(cache: Any, spec: ModelSpec, tables: list[rope.RopeTable], segments: list[Segment],
           positions: torch.Tensor) -> tuple[list[int], int]:
    """Append the segments to ``cache`` (which ends where the first one starts), each re-rotated to its
    ``positions``, with placeholders for the gaps between them: ``(the gap slots, the end of the last segment)``."""
    gap_slots: list[int] = []
    end = segments[0].offset
    placed: list[Packet] = []  # appended together: one copy of the cache per run of adjacent segments
    for segment in segments:
        if segment.offset > end:
            hf.append(cache, *placed)
            placed = []
            gap_slots += range(end, segment.offset)
            hf.append_placeholders(cache, spec, segment.offset - end)
        placed.append(rope.move(segment.packet, tables, int(positions[segment.offset])))
        end = segment.offset + segment.packet.length
    hf.append(cache, *placed)
    return gap_slots, end


def _check_segments(spec: ModelSpec, tables: list[rope.RopeTable], context_ids: list[int],
                    segments: list[Segment]) -> None:
    previous_end = 0
    for index, segment in enumerate(segments):
        packet = segment.packet
        spec.check_same_model(packet.spec, what=f"segment {index} from {packet.producer or 'an agent'}")
        if packet.batch_size != 1 or bool((packet.mask == 0).any()):
            raise PacketError(f"segment {index} is batched or padded; splicing takes single unpadded segments")
        if packet.rotary != "applied":
            raise PacketError(f"segment {index} is position-free; place it with rope.apply_at first")
        if segment.offset < previous_end or (index == 0 and segment.offset < 0):
            raise PacketError(f"segment {index} at offset {segment.offset} overlaps the receiver's own tokens "
                              f"or the previous segment (which ends at {previous_end})")
        stop = segment.offset + packet.length
        if stop > len(context_ids) - 1:
            raise PacketError(f"segment {index} ends at {stop}, beyond the context's {len(context_ids)} tokens "
                              "(leave at least one token to prefill)")
        if packet.token_ids[0].tolist() != context_ids[segment.offset:stop]:
            raise ChainError(f"segment {index} ({packet.id[:12]}) holds other tokens than the receiver's context "
                             f"at {segment.offset}..{stop}", "the segment does not belong to this conversation")
        previous_end = stop
    if tables and len(tables) != spec.num_layers:
        raise PacketError(f"{len(tables)} RoPE tables for {spec.num_layers} layers")


def _positions(segments: list[Segment], n: int, placement: Placement) -> torch.Tensor:
    """Position of every context token: contiguous, except where placement moves segments.

    Example: own prefix of 4 tokens, one segment of 3 at offset 4 whose packet starts at
    global position 100, then 2 more tokens: "end" -> [0..8]; "global" -> [0, 1, 2, 3,
    100, 101, 102, 103, 104]; 50 -> [0, 1, 2, 3, 50, 51, 52, 53, 54].
    """
    positions = torch.arange(n)
    if placement == "end":
        return positions
    first = segments[0].offset
    if placement == "global":
        shift = segments[0].packet.start - first
    elif isinstance(placement, int) and not isinstance(placement, bool):
        shift = placement - first
    else:
        raise ValueError(f"placement must be 'end', 'global' or an int offset, got {placement!r}")
    if shift < 0:
        raise PacketError(f"placing the first segment at position {first + shift} overlaps the receiver's own "
                          f"tokens, which reach position {first - 1}", "place segments at or after the receiver's end")
    positions[first:] += shift
    if placement == "global":  # every later segment keeps its own global start too
        for segment in segments[1:]:
            here = int(positions[segment.offset])
            if segment.packet.start < here:
                raise PacketError(f"segment at global position {segment.packet.start} overlaps tokens the receiver "
                                  f"already placed up to {here - 1}")
            positions[segment.offset:] += segment.packet.start - here
    return positions


def _choose(model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor, end: int, exact: int,
            own: list[int], gap_slots: list[int], segments: list[Segment], recompute: Recompute) -> set[int]:
    """The spliced slots to recompute: the first k of every segment, and a budget of ``round(R * spliced)`` slots
    ranked by ``recompute.select``. ``ids`` [1, n] and ``positions`` [n] cover the whole context; ``cache`` covers
    its first ``end`` slots: ``exact`` exact ones (a received prefix), then the receiver's ``own`` tokens and the
    ``gap_slots`` as placeholders, and the spliced segments. Nothing is computed into it."""
    chosen: set[int] = set()
    if recompute.first:
        for segment in segments:
            chosen |= set(range(segment.offset, segment.offset + min(recompute.first, segment.packet.length)))
    slots = torch.tensor([slot for s in segments for slot in range(s.offset, s.offset + s.packet.length)])
    budget = round(recompute.fraction * len(slots))
    if budget >= len(slots):
        return chosen | set(slots.tolist())
    if budget <= 0:
        return chosen
    rankings = []
    reading = None
    if "attention" in recompute.select:
        try:
            reading = _by_attention(model, cache, ids, positions, end, own + gap_slots, slots, recompute.probe)
        except ModelError as err:  # no attention module found: nothing ran
            log.warning("%s; choosing recompute slots by K/V deviation", err)
        else:
            if reading is None:  # a model whose attention layers return no weights
                log.warning("%s does not return attention weights; choosing recompute slots by K/V deviation",
                            type(model).__name__)
            else:
                rankings.append(reading)
    if recompute.select == "attention+start":
        rankings.append(slots)  # in context order: the first segment's start first
    if "deviation" in recompute.select or reading is None:
        rankings.append(_by_deviation(model, cache, ids[:, :end], positions[:end], slots, recompute.select_layer,
                                      exact=exact))
    return chosen | set(_interleave(rankings, budget))


def _by_attention(model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor, end: int, hidden: list[int],
                  slots: torch.Tensor, probe: int) -> torch.Tensor | None:
    """``slots`` ordered by how much the receiver's own turn (``ids[end:]``, computed next) reads them: per layer
    the largest weight any head of any of its last ``probe`` tokens (0: all of them) gives the slot, summed over
    layers; None for a model whose attention returns no weights. One forward pass of those tokens alone: they see
    the cache but not the turn's earlier tokens, nor the ``hidden`` slots (placeholders: the receiver's own prefix
    and the gaps, computed later)."""
    start = max(end, ids.shape[1] - probe) if probe else end
    device = positions.device
    filled = hf.fill(model, cache, ids[:, :end], positions[:end], torch.zeros(0, dtype=torch.long, device=device),
                     ids[:, start:], positions[start:], keep_tail=False,
                     hidden=torch.tensor(sorted(hidden), dtype=torch.long, device=device), reads=ids.shape[1] - start)
    if filled.reads is None:
        return None
    score = filled.reads[:, slots.to(filled.reads.device)].sum(dim=0).cpu()
    return slots[torch.argsort(score, descending=True, stable=True)]


def _by_deviation(model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  select_layer: int, exact: int = 0) -> torch.Tensor:
    """``slots`` ordered by how far their kept K/V at ``select_layer`` are from what the
    receiver computes there (CacheBlend): about ``(select_layer + 1) / L`` of a prefill of
    the tokens after the cache's first ``exact`` slots, which hold exact K/V (a received
    prefix: the fresh computation reads them instead of recomputing them; the slots after them
    are computed fresh, placeholders included)."""
    layer = min(select_layer, len(cache.layers) - 1)
    fresh_k, fresh_v = hf.layer_kv(model, ids[:, exact:], positions[None, exact:], layer, past=cache,
                                   past_length=exact)
    on = slots.to(fresh_k.device)
    here = on - exact  # slots are spliced segment slots: all at or after the exact prefix
    kept_k = cache.layers[layer].keys[:, :, on]
    kept_v = cache.layers[layer].values[:, :, on]
    # deviation per slot: squared distance of K and V over heads and dims, each relative to its scale
    # (the mean square over the whole context, the exact prefix's slots included)
    dk = (fresh_k[:, :, here] - kept_k).pow(2).sum(dim=(0, 1, 3)) / _scale(cache.layers[layer].keys, exact, fresh_k)
    dv = (fresh_v[:, :, here] - kept_v).pow(2).sum(dim=(0, 1, 3)) / _scale(cache.layers[layer].values, exact, fresh_v)
    return slots[torch.argsort((dk + dv).cpu(), descending=True, stable=True)]


def _scale(kept: torch.Tensor, exact: int, fresh: torch.Tensor) -> torch.Tensor:
    """Mean square of a layer's K (or V) over the context: ``kept``'s first ``exact`` slots, then ``fresh``."""
    head = kept[:, :, :exact]
    total = head.pow(2).sum() + fresh.pow(2).sum()
    return (total / (head.numel() + fresh.numel())).clamp_min(1e-12)


def _interleave(rankings: list[torch.Tensor], budget: int) -> list[int]:
    """The first ``budget`` distinct slots taking turns between ``rankings`` (each a full
    order of the same slots), so each ranking gets an equal share of the budget.

    Example: [5, 1, 2, 7] and [5, 7, 1, 2], budget 3 -> [5, 7, 1].
    """
    orders = [ranking.tolist() for ranking in rankings]
    picked: list[int] = []
    seen: set[int] = set()
    cursors = [0] * len(orders)
    while len(picked) < budget and any(c < len(order) for c, order in zip(cursors, orders)):
        for index, order in enumerate(orders):
            while cursors[index] < len(order) and order[cursors[index]] in seen:
                cursors[index] += 1
            if cursors[index] < len(order) and len(picked) < budget:
                seen.add(order[cursors[index]])
                picked.append(order[cursors[index]])
    return picked
