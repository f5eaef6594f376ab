"""What a graph agent reads: its conversation rebuilt from its upstream handoffs, and for a
merging agent the cache of that conversation spliced from its branches.

A merging agent's context is the turns its branches share, then each branch's own turns in
``after`` order, then its own instruction (:meth:`kvwire.pipeline.spec.Graph.conversation`).
The first branch's chain covers the start exactly (the shared turns and the first branch:
its context extends them), so it is used as it is. Every later turn was computed right
after the shared part too, so its K/V sit at positions that overlap the first branch's:
its packet's tail (the turn's own tokens) is a *segment*, re-rotated to where the turn
sits in the merged context and partly recomputed by :func:`kvwire.kv.splice.assemble`
(CacheBlend-style ``R``, EPIC-style first ``k``). The tokens between segments -- the end
of each answer and the template's closing text, which no sender cached -- are gaps,
always recomputed. A branch whose packet is missing, broken, or made by other weights is
not spliced: its tokens are recomputed like a gap, and the event is counted.

Splicing is not always the cheaper way in. It saves prefilling the later branches' tokens, but
costs a selection pass of the agent's own turn, the recompute pass, copies of the assembled
cache and one fetch per branch; short branches are faster to prefill after the first branch's
exact chain -- and that is exact. :func:`plan` estimates both in tokens prefilled and picks
(``merge="auto"``); ``"splice"`` or ``"prefill"`` force one. Measured on the default model
(2-core CPU): the review board's chair (three ~60-token reviews after a 1760-token chain)
reaches its first token in 0.40 s prefilled against 0.61 s spliced; the map-reduce reducer
(three ~370-token summaries of their own chunks) in 0.87 s spliced against 1.87 s prefilled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import hf
from ..kv import splice
from ..errors import ChainError
from ..kv.receive import Reason, Refusal
from .handoff import Handoff
from ..wire.packet import Packet
from ..wire.spec import ModelSpec
from .transcript import ChatTranscript
from .spec import Graph, Item

log = logging.getLogger(__name__)


@dataclass
class Turn:
    """One message pair of a conversation: an agent's instruction and its answer."""

    user: dict[str, str]
    assistant: dict[str, str]
    generated: list[int] | None  # the ids the model generated for the answer (None: unknown)
    packet: str | None  # the packet of the agent that took this turn (its chain head)


@dataclass
class Conversation:
    """The turns an agent reads (``items``) and each turn's messages, from upstream handoffs."""

    items: tuple[Item, ...]
    turns: dict[Item, Turn]
    first: Handoff | None  # the handoff of the first agent it reads (its context extends that one's)
    first_items: int  # how many of ``items`` the first handoff covers

    @property
    def messages(self) -> list[dict[str, str]]:
        return [m for item in self.items for m in (self.turns[item].user, self.turns[item].assistant)]

    @property
    def generated(self) -> dict[int, list[int]]:
        """Message index (without a system prompt) -> generated ids of that answer."""
        return {2 * j + 1: self.turns[item].generated for j, item in enumerate(self.items)
                if self.turns[item].generated is not None}


def needed(graph: Graph, node: int, round: int) -> list[Item]:
    """The turns whose handoffs agent ``node`` reads: the agents it reads, and (to splice them)
    every turn past its first branch."""
    reads = list(graph.reads(node, round))
    if not reads:
        return []
    first = len(graph.conversation(reads[0][1], reads[0][0])) + 1
    return reads + [item for item in graph.conversation(node, round)[first:] if item not in reads]


def conversation(graph: Graph, node: int, round: int, handoffs: dict[Item, Handoff]) -> Conversation:
    """Agent ``node``'s conversation in ``round``, from the handoffs :func:`needed` names."""
    turns: dict[Item, Turn] = {}
    reads = graph.reads(node, round)
    for r, u in reads:
        handoff = handoffs[(r, u)]
        items = graph.conversation(u, r) + ((r, u),)
        if len(handoff.messages) != 2 * len(items):
            raise ChainError(f"the handoff of {graph.names[u]} (round {r}) holds {len(handoff.messages)} messages, "
                             f"its place in the graph needs {2 * len(items)}",
                             "every agent of a run must use the same pipeline file")
        for j, item in enumerate(items):
            if item not in turns:
                user, assistant = handoff.messages[2 * j], handoff.messages[2 * j + 1]
                turns[item] = Turn(user, assistant, handoff.generated.get(2 * j + 1), None)
    for item, handoff in handoffs.items():
        if item in turns:
            turns[item].packet = handoff.packet
    if not reads:
        return Conversation((), turns, None, 0)
    (r, u) = reads[0]
    return Conversation(graph.conversation(node, round), turns, handoffs[reads[0]], len(graph.conversation(u, r)) + 1)


def transcript(tokenizer: Any, opening: list[dict[str, str]], conv: Conversation, *,
               from_text: bool) -> tuple[ChatTranscript, list[tuple[Item, int, int]]]:
    """The transcript of ``conv`` after ``opening`` (the system prompt, and the input when several
    agents share it: :meth:`kvwire.pipeline.spec.PipelineSpec.opening`), and where each turn past the
    first handoff's starts and ends (``(item, start, end)`` token offsets).

    ``from_text``: tokenize every message from its string (text mode, what frameworks do).
    Otherwise continue the first handoff's exact ids and append later turns with their
    generated ids (so the ids a cache covers are the ids the model saw).
    """
    head = [dict(m) for m in opening]
    if from_text:
        return ChatTranscript.from_messages(tokenizer, head + conv.messages), []
    if conv.first is None:
        return ChatTranscript.from_messages(tokenizer, head), []
    first = conv.first
    script = ChatTranscript(tokenizer, head + [dict(m) for m in first.messages], first.ids,
                            {k + len(head): v for k, v in first.generated.items()})
    starts = []
    for item in conv.items[conv.first_items:]:
        turn = conv.turns[item]
        start = len(script.ids)
        script.add(turn.user["role"], turn.user["content"])
        script.open_assistant_turn()
        ids = turn.generated
        if ids is None:  # not known: what a tokenizer makes of the text
            ids = tokenizer(turn.assistant["content"], add_special_tokens=False)["input_ids"]
        script.add_generated(list(ids), frozenset())
        starts.append((item, start, len(script.ids)))
    return script, starts


MergeStrategy = Literal["auto", "splice", "prefill"]
MERGE_STRATEGIES: tuple[str, ...] = ("auto", "splice", "prefill")


@dataclass(frozen=True)
class MergePlan:
    """How a merging agent gets its cache, and the estimate behind the choice (tokens prefilled)."""

    choice: Literal["splice", "prefill"]
    cost: splice.Estimate  # between: the tokens after the first branch's chain, before the agent's own turn
    exact_prefix: int  # tokens the first branch's chain covers (0: no usable chain came)
    why: str = ""  # a forced choice: what forced it

    def describe(self) -> str:
        cost = self.cost
        why = self.why or cost.describe()
        if self.choice == "splice":
            return f"merge spliced its {cost.between} branch tokens ({why})"
        if not self.exact_prefix:
            return f"merge prefilled its whole context before its turn ({cost.between} tokens: no chain came; {why})"
        return f"merge prefilled its {cost.between} branch tokens exactly ({why})"


def plan(context_length: int, exact_prefix: int, starts: list[tuple[Item, int, int]], recompute: splice.Recompute,
         num_layers: int, strategy: MergeStrategy = "auto", why: str = "", pass_cost: Any = None) -> MergePlan:
    """Splice the later branches or prefill them (:func:`kvwire.kv.splice.estimate`, priced with ``pass_cost``
    where the model's was measured)? ``exact_prefix``: tokens the first branch's chain covers (0 when none came);
    ``starts``: the later turns' (item, start, end) in the context. A forced ``strategy`` says so (``why``: what
    forced it)."""
    if strategy not in MERGE_STRATEGIES:
        raise ValueError(f"merge strategy must be one of {', '.join(MERGE_STRATEGIES)}, got {strategy!r}")
    spans = [(start, end) for _, start, end in starts if end > start]
    cost = splice.estimate(context_length, exact_prefix, spans, recompute, num_layers, pass_cost)
    if strategy == "auto":
        return MergePlan("splice" if spans and cost.splice_pays else "prefill", cost, exact_prefix)
    return MergePlan(strategy, cost, exact_prefix, why or f"merge={strategy}")  # type: ignore[arg-type]


@dataclass
class MergeCache:
    """A merging agent's cache (``None``: nothing usable, prefill it all) and what it cost."""

    cache: Any
    extends_prefix: bool  # the cache starts with the first branch's chain, exactly
    spliced: int = 0
    recomputed: int = 0
    compute_s: float = 0.0
    events: list[str] = field(default_factory=list)
    staleness: list[float | None] = field(default_factory=list)  # per spliced branch (kvwire.kv.splice)
    guarded: int = 0  # spliced tokens the fidelity guard recomputed


def splice_branches(model: Any, spec: ModelSpec, tables: list[Any], context_ids: list[int], prefix: Packet | None,
                    starts: list[tuple[Item, int, int]], conv: Conversation,
                    fetch: Callable[[str], Packet | Refusal], recompute: splice.Recompute) -> MergeCache:
    """Assemble a merging agent's cache: ``prefix`` (the first branch's received chain, or ``None``)
    then every later turn's segment. ``fetch(packet_id)`` returns a verified packet on the model's device,
    or the :class:`~kvwire.kv.receive.Refusal` that stands for it (that turn is recomputed instead)."""
    events: list[str] = []
    segments = []
    for item, offset, stop in starts:
        turn = conv.turns[item]
        if turn.packet is None:
            events.append(Refusal(Reason.BROKEN_CHAIN, f"turn {item} has no packet").pipeline_event)
            continue
        packet = fetch(turn.packet)
        if isinstance(packet, Refusal):
            events.append(packet.pipeline_event)
            continue
        segment = _tail_segment(packet, context_ids[offset:stop])
        if segment is None:
            events.append(Refusal(Reason.MISMATCH, f"packet {turn.packet[:12]} does not end with turn {item}'s "
                                                   "tokens").pipeline_event)
            continue
        segments.append(splice.Segment(offset, segment))
    for event in events:
        log.warning("merge rebuilds part of its context (recomputed, not spliced): %s", event)
    base = hf.build_cache(prefix, model, spec) if prefix is not None else None
    if not segments:
        return MergeCache(base, base is not None, events=events)
    spliced = splice.assemble(model, spec, tables, context_ids, segments, recompute=recompute, placement="end",
                              prefix=base)
    return MergeCache(spliced.cache, base is not None, spliced.spliced, spliced.recomputed, spliced.compute_s, events,
                      spliced.staleness, spliced.guarded)


def _tail_segment(packet: Packet, turn_ids: list[int]) -> Packet | None:
    """The end of ``packet`` holding the head of ``turn_ids`` (a turn's instruction, the generation
    prompt and its answer as far as its producer cached it), as a standalone segment."""
    if packet.batch_size != 1:
        return None
    ids = packet.token_ids[0].tolist()
    for k in range(min(len(ids), len(turn_ids)), 0, -1):
        if ids[-k:] == turn_ids[:k]:
            break
    else:
        return None
    if k < len(turn_ids) // 2:  # a match this short is not this turn
        return None
    return Packet(spec=packet.spec, keys=tuple(t[:, :, -k:] for t in packet.keys),
                  values=tuple(t[:, :, -k:] for t in packet.values), token_ids=packet.token_ids[:, -k:],
                  mask=packet.mask[:, -k:], start=packet.end - k, attention="segment", rotary=packet.rotary,
                  producer=packet.producer, session=packet.session, round=packet.round,
                  created_at=packet.created_at).validate()
