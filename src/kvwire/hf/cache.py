"""DynamicCache <-> packets, and the cache surgery splicing needs (transformers side).

Uses transformers' public cache surface: ``DynamicCache(config=...)``,
``cache.update(k, v, layer_idx)``, ``cache.layers[i].keys / .values`` (shape
``[B, H_kv, T, D]``, the packet layout, so nothing is transposed) and, for
sliding-window layers, ``cumulative_length`` (the true length; the layer itself
keeps only ``sliding_window - 1`` tokens).

Forward passes grow a ``DynamicCache`` by ``torch.cat`` and never write existing
tensors in place, so packet tensors (views of a received buffer) stay intact;
the in-place writes below only touch tensors a forward pass just created, and
:func:`reserved` writes only into a buffer of its own.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..errors import ModelError, PacketError
from ..wire.packet import Packet, check_chain
from ..wire.spec import DTYPES, ModelSpec
from .attention import _switch as _ATTENTION_SWITCH  # one switch of a model's attention implementation at a time
from .linears import fast_linears
from .loading import model_device, model_spec


def new_cache(model: Any) -> DynamicCache:
    return DynamicCache(config=model.config)


_LAYOUT_OK: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # model -> the spec it was checked for


def check_layout(cache: DynamicCache, spec: ModelSpec) -> None:
    """Refuse (:class:`ModelError`) a cache that is not the ``[B, H_kv, T, D]`` per layer its spec, read from the
    model's config, describes: a recurrent or linear-attention layer with no keys, multi-latent attention (keys and
    values of other widths), multi-query heads the config does not count. Such a model passes no caches; text
    mode still runs it."""
    what = f"{spec.model_type} models"
    if len(cache.layers) != spec.num_layers:
        raise ModelError(f"{what} hold {len(cache.layers)} cache layers, not the {spec.num_layers} their config "
                         "describes (layers that share or skip their cache)", "run this model's agents in text mode")
    want = (spec.num_kv_heads, spec.head_dim)
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() != 4:
            raise ModelError(f"{what} keep no attention keys and values in cache layer {index} (a recurrent or "
                             "linear-attention layer): kvwire passes attention caches only",
                             "run this model's agents in text mode")
        if (keys.shape[1], keys.shape[3]) != want or (values.shape[1], values.shape[3]) != want:
            raise ModelError(f"{what} cache keys {list(keys.shape)} and values {list(values.shape)} in layer {index}, "
                             f"not the [B, {want[0]}, T, {want[1]}] their config describes (multi-latent attention, "
                             "or key/value heads the config does not count: a layout kvwire does not model)",
                             "run this model's agents in text mode")


@torch.inference_mode()
def check_model_layout(model: Any, spec: ModelSpec) -> None:
    """:func:`check_layout` on the cache of a two-token forward pass, once per model and spec: what a mode that
    passes caches runs before any agent's turn, so a model it cannot serve is refused before work is spent."""
    if _LAYOUT_OK.get(model) == spec.fingerprint:
        return
    cache = new_cache(model)
    ids = torch.tensor([[1, 2]], device=model_device(model)) % max(2, spec.vocab_size)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    check_layout(cache, spec)
    _LAYOUT_OK[model] = spec.fingerprint


def cache_length(cache: DynamicCache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def packet_start(token_ids: torch.Tensor, parent: Packet | None, start: int | None, what: str) -> tuple[int, bool]:
    """Where a packet of the K/V of ``token_ids`` [B, N] (held by ``what``: "the cache", "the row") starts,
    and whether it is a standalone segment: after ``parent`` (whose ids it must extend), else at ``start``
    (a segment when > 0), else at 0."""
    n = token_ids.shape[1]
    if parent is not None:
        if start is not None and start != parent.end:
            raise PacketError(f"a continuation of {parent.id[:12]} starts at {parent.end}, not {start}")
        start = parent.end
        # compared on the CPU: a parent read from a store is there, a cache's ids may be on the model's device
        covered = token_ids[:, start - parent.length:start].cpu()
        if parent.length > n or not torch.equal(parent.token_ids.cpu(), covered):
            raise PacketError(f"{what} does not extend its parent packet {parent.id[:12]}: the token ids differ")
    segment_only = parent is None and bool(start)
    start = start or 0
    if not 0 <= start <= n:
        raise PacketError(f"segment start {start} outside {what}'s {n} tokens")
    return start, segment_only


def extract(cache: DynamicCache, spec: ModelSpec, token_ids: torch.Tensor, *, parent: Packet | None = None,
            start: int | None = None, mask: torch.Tensor | None = None, **provenance: Any) -> Packet:
    """A packet of the tokens ``cache`` holds from ``start`` on (default: after ``parent``, or 0).

    ``token_ids`` [B, N] are the ids the cache covers (``N == cache length``); ``mask``
    [B, N] marks padding (default: none). With ``parent`` the packet continues that
    chain link; with only ``start`` it is a standalone segment (``attention="segment"``)
    to be spliced elsewhere. The packet's tensors are views of the cache's; the codec
    copies them when encoding.
    """
    n = cache_length(cache)
    if token_ids.dim() != 2 or token_ids.shape[1] != n:
        raise PacketError(f"token_ids must be [B, {n}] (the cache length), got {list(token_ids.shape)}")
    device = cache.layers[0].keys.device if n else token_ids.device  # the packet lives where its K/V does
    token_ids = token_ids.to(device)
    mask = torch.ones_like(token_ids, dtype=torch.uint8) if mask is None else mask.to(device, torch.uint8)
    start, segment_only = packet_start(token_ids, parent, start, "the cache")
    if len(cache.layers) != spec.num_layers:
        raise PacketError(f"cache has {len(cache.layers)} layers, the spec {spec.num_layers}")
    if n:
        check_layout(cache, spec)
    segment = n - start
    keys, values = [], []
    for index, layer in enumerate(cache.layers):
        kept = spec.kept_tokens(index, segment)
        stored = int(layer.keys.shape[-2])
        if kept > stored:
            raise PacketError(f"layer {index} holds {stored} tokens, {kept} needed for the segment")
        # [B, H, stored, D] -> the last `kept` tokens: [B, H, kept, D]
        keys.append(layer.keys[:, :, stored - kept : stored, :])
        values.append(layer.values[:, :, stored - kept : stored, :])
    return Packet(
        spec=spec,
        keys=tuple(keys),
        values=tuple(values),
        token_ids=token_ids[:, start:].to(torch.int64),
        mask=mask[:, start:].contiguous(),
        start=start,
        attention="segment" if segment_only else "causal",
        parent=parent.id if parent is not None else None,
        parent_checksum=parent.checksum if parent is not None else None,
        **provenance,
    ).validate()


def build_cache(packet: Packet | Sequence[Packet], model: Any, spec: ModelSpec | None = None) -> DynamicCache:
    """A fresh ``DynamicCache`` holding ``packet`` -- or a chain of packets, root first -- as the model's
    context prefix.

    The packet (the chain's root) must start at position 0 with its keys rotated there, and be
    made by this model (``spec``, computed if not given); a chain must be contiguous
    (:func:`~kvwire.wire.packet.check_chain`), and is copied into the cache once, where joining it
    first (:func:`~kvwire.wire.packet.join`) copies it twice. A padded (batched) packet is fine:
    generate with ``attention_mask = cat(packet.mask, new_mask)``. The result is the
    caller's to grow.
    """
    packets = [packet] if isinstance(packet, Packet) else list(packet)
    check_chain(packets)
    spec = spec or model_spec(model)
    first = packets[0]
    for link in packets:
        link.validate()
        spec.check_same_model(link.spec)
        _require_on(link, model_device(model), "the model")
    if first.rotary != "applied":
        raise PacketError("packet keys are position-free (RoPE stripped)", "place them with kvwire.rope.apply_at")
    if first.start != 0:
        raise PacketError(f"packet starts at position {first.start}; a prefix cache starts at 0",
                          "assemble the whole chain first (kvwire.chain.receive), or splice it")
    cache = new_cache(model)
    append(cache, *packets)
    return cache


def append(cache: DynamicCache, *packets: Packet) -> None:
    """Append packets' K/V, in order, at the end of ``cache`` (keys must already sit at their
    positions): one copy of each layer's cache however many packets are appended."""
    if not packets:
        return
    for packet in packets:
        if packet.is_partial:
            raise PacketError("a partial-layer packet carries only some layers' K/V",
                              "build its cache with kvwire.hf.partial.complete")
        if packet.rotary != "applied":
            raise PacketError("cannot append position-free keys; place them with kvwire.rope.apply_at first")
        if len(cache.layers) != packet.spec.num_layers:
            raise PacketError(f"cache has {len(cache.layers)} layers, the packet {packet.spec.num_layers}")
        if cache.layers and cache.layers[0].is_initialized:
            _require_on(packet, cache.layers[0].keys.device, "the cache")
    before = cache_length(cache)
    added = sum(packet.length for packet in packets)
    for index, layer in enumerate(cache.layers):
        keys = [packet.keys[index] for packet in packets]
        values = [packet.values[index] for packet in packets]
        if type(layer) is DynamicLayer and not layer.is_initialized:  # one copy (update would cat onto nothing)
            layer.lazy_initialization(keys[0], values[0])
            layer.keys, layer.values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
            continue
        cache.update(torch.cat(keys, dim=2) if len(keys) > 1 else keys[0],
                     torch.cat(values, dim=2) if len(values) > 1 else values[0], index)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = before + added  # holds only the window; record the true length
    if cache_length(cache) != before + added:
        raise PacketError(f"cache has length {cache_length(cache)} after appending, expected {before + added}")


def _require_on(packet: Packet, device: torch.device, what: str) -> None:
    """Copies between devices are explicit (and counted where a pipeline makes them): a packet elsewhere than
    ``what`` is refused with the call that moves it, not a device mismatch deep inside attention."""
    if packet.device != device:
        raise PacketError(f"the packet is on {packet.device}, {what} on {device}",
                          f"move it first: packet.to({str(device)!r}) (a counted, explicit copy)")


def append_placeholders(cache: DynamicCache, spec: ModelSpec, count: int, batch: int = 1,
                        device: torch.device | str | None = None) -> None:
    """Append ``count`` zero K/V slots, to be filled by :func:`fill` before any attention uses them. An empty cache
    gets them in the spec's layout and dtype, on ``device`` (the model's; the CPU by default)."""
    if count <= 0:
        return
    _require_full_attention(spec, "placeholders")
    for index, layer in enumerate(cache.layers):
        if layer.is_initialized:
            like = layer.keys
            zeros = like.new_zeros(batch, like.shape[1], count, like.shape[3])
        else:
            zeros = torch.zeros(batch, spec.num_kv_heads, count, spec.head_dim, dtype=DTYPES[spec.dtype],
                                device=device)
        cache.update(zeros, zeros.clone(), index)


class _ReservedLayer(DynamicLayer):
    """A full-attention layer with room reserved after its tokens: ``update`` writes the new K/V into the
    room and hands attention a view, instead of concatenating a new copy of the whole layer every step
    (at 1,700 tokens the copies were a third of a decode step). Past the room, or once anything else
    replaced ``keys``, it concatenates as :class:`DynamicLayer` does."""

    def __init__(self, layer: DynamicLayer, room: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True
        self.length = int(layer.keys.shape[-2])
        self._keys = _with_room(layer.keys, room)
        self._values = _with_room(layer.values, room)
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + int(key_states.shape[-2])
        if (self._keys is None or end > self._keys.shape[-2] or self.keys.data_ptr() != self._keys.data_ptr()
                or self.keys.shape[-2] != self.length or key_states.shape[0] != self._keys.shape[0]):
            self._keys = self._values = None  # the room is gone for good: plain concatenation from here on
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.length = int(keys.shape[-2])
            return keys, values
        self._keys[:, :, self.length: end] = key_states
        self._values[:, :, self.length: end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values


def _with_room(tensor: torch.Tensor, room: int) -> torch.Tensor:
    B, H, T, D = tensor.shape
    buffer = tensor.new_empty(B, H, T + room, D)
    buffer[:, :, :T] = tensor
    return buffer


@contextlib.contextmanager
def reserved(cache: DynamicCache, room: int) -> Iterator[DynamicCache]:
    """Within the block, ``cache``'s full-attention layers grow into ``room`` reserved slots without
    copying themselves every step (:class:`_ReservedLayer`); on leaving, each is a plain
    :class:`DynamicLayer` again, its K/V contiguous and bit-identical to what concatenation gives."""
    swapped = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
            cache.layers[index] = _ReservedLayer(layer, room)
            swapped.append(index)
    try:
        yield cache
    finally:
        for index in swapped:
            grown = cache.layers[index]
            plain = DynamicLayer()
            plain.dtype, plain.device, plain.is_initialized = grown.dtype, grown.device, True
            plain.keys, plain.values = grown.keys.contiguous(), grown.values.contiguous()
            cache.layers[index] = plain


def clone_cache(cache: DynamicCache, model: Any) -> DynamicCache:
    """An independent copy (for measuring one context twice)."""
    copy = new_cache(model)
    for index, (layer, theirs) in enumerate(zip(copy.layers, cache.layers)):
        copy.update(theirs.keys.clone(), theirs.values.clone(), index)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = theirs.cumulative_length
    return copy


class _Stop(Exception):
    """Raised by a forward hook to end a forward pass after the layer of interest."""


@torch.inference_mode()
def layer_kv(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, layer: int, *,
             past: DynamicCache | None = None, past_length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh K/V ``[B, H, N, D]`` of decoder layer ``layer`` for ``input_ids``, computing only
    layers ``0..layer-1`` and the attention of ``layer`` (a forward hook on it stops the pass
    there): about (layer + 1/3)/L of a prefill.

    ``past``: a cache whose first ``past_length`` slots hold the exact K/V of tokens that
    come *before* ``input_ids`` (e.g. a received prefix): ``input_ids`` then attend to them
    and only their own K/V are computed and returned -- the same numbers as computing the
    whole context from scratch, for a share ``N / (past_length + N)`` of the work.
    """
    layers = decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer {layer} out of range 0..{len(layers) - 1}")
    cache = new_cache(model)
    if past is not None and past_length > 0:
        if past_length > cache_length(past):
            raise PacketError(f"past_length {past_length} is beyond the {cache_length(past)} slots of the past cache")
        if any(isinstance(kind, DynamicSlidingWindowLayer) for kind in (*cache.layers, *past.layers)):
            raise ModelError("layer_kv over a past cache needs full-attention layers (this model has sliding windows)")
        for index in range(layer + 1):
            cache.update(past.layers[index].keys[:, :, :past_length], past.layers[index].values[:, :, :past_length],
                         index)

    def stop(module: Any, args: Any, output: Any) -> None:
        raise _Stop

    handle = _attention_module(layers[layer]).register_forward_hook(stop)
    try:
        with fast_linears(model, input_ids.numel(), input_ids.shape[0]):
            model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    except _Stop:
        pass
    finally:
        handle.remove()
    keys, values = cache.layers[layer].keys, cache.layers[layer].values
    return keys[:, :, past_length:], values[:, :, past_length:]


@dataclass
class Filled:
    """What :func:`fill` gives besides the cache it fills."""

    logits: torch.Tensor | None = None  # fp32 [V]: the next-token distribution after the last token computed
    reads: torch.Tensor | None = None  # [L, n]: per layer the largest weight any head of the reading tokens gave a slot
    deviation: torch.Tensor | None = None  # [S]: per computed slot, how far its fresh K/V moved from what it held


@torch.inference_mode()
def fill(model: Any, cache: DynamicCache, slot_ids: torch.Tensor | None, slot_positions: torch.Tensor,
         rows: torch.Tensor, tail_ids: torch.Tensor | None = None, tail_positions: torch.Tensor | None = None, *,
         keep_tail: bool = True, hidden: torch.Tensor | None = None, reads: int = 0) -> Filled:
    """Compute, in **one forward pass** through every layer, the K/V of the cache slots ``rows`` (in place) and of
    ``tail_ids`` placed after the cache.

    ``slot_ids`` [1, n] and ``slot_positions`` [n] describe every slot of ``cache`` (``slot_ids`` may be None when
    ``rows`` is empty); ``rows`` [S] (sorted slot indices) are computed as fresh tokens at their positions:
    placeholders, or stale spliced slots. ``tail_ids`` [1, E] at ``tail_positions`` [E] are tokens after the cache:
    appended to it (``keep_tail``), or only run (a probe). Each computed token attends causally, by position, to
    every slot that is neither computed nor ``hidden`` (kept as it is: a spliced segment, an exact prefix) and to
    the computed tokens at or before its position; never to the stale values of a computed slot, nor to a hidden
    one (a placeholder computed later).

    ``reads``: also return the attention the last ``reads`` computed tokens give the cache's slots (eager attention
    for the call; the switch holds the lock the batched engine's switch holds, so a plain forward on the same model
    from another thread meanwhile runs eager too, which computes the same function). ``Filled.reads`` is None for
    a model whose attention layers return no weights.

    Every slot from some index on and a tail, at increasing positions, nothing hidden or read, is an ordinary
    causal prefill (the model's fast kernel): after exact slots, the exact result. Why one pass: on a CPU a pass
    streams every weight once, a fixed cost (~120 ms for the coder model in int8) that splitting a splice into a
    prefix, a recompute and a tail pass paid three times (BENCHMARKS.md, section 11).
    """
    if any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers):
        raise ModelError("computing chosen cache slots needs every slot of every layer; this cache has "
                         "sliding-window layers", "use prefix or text mode for this model")
    n = cache_length(cache)
    device = slot_positions.device
    rows = rows.to(device, torch.long)
    S = int(rows.numel())
    E = 0 if tail_ids is None else int(tail_ids.shape[-1])
    _check_fill(n, slot_ids, slot_positions, rows, tail_ids, tail_positions, reads)
    if S + E == 0:
        return Filled()
    query_pos = torch.cat([slot_positions[rows], tail_positions.to(device)]) if E else slot_positions[rows]
    query_ids = torch.cat([slot_ids.to(device)[:, rows], tail_ids.to(device)], dim=1) if S and E else \
        (tail_ids.to(device) if E else slot_ids.to(device)[:, rows])
    first = int(rows[0]) if S else n
    hidden = None if hidden is None or hidden.numel() == 0 else hidden.to(device, torch.long)
    ordered = bool((slot_positions[1:] > slot_positions[:-1]).all()) and bool((query_pos[1:] > query_pos[:-1]).all())
    if (reads == 0 and hidden is None and (keep_tail or not E) and S == n - first and ordered
            and (first == 0 or int(slot_positions[first - 1]) < int(query_pos[0]))):
        for layer in cache.layers:  # every slot from `first` on, then the tail: a causal prefill of the suffix
            layer.keys, layer.values = layer.keys[:, :, :first], layer.values[:, :, :first]
        with fast_linears(model, S + E, 1):
            out = model(input_ids=query_ids, position_ids=query_pos[None], past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        return Filled(logits=out.logits[0, -1].float().cpu())
    out, read = _masked_pass(model, cache, query_ids, query_pos, slot_positions, rows, hidden, reads)
    moved = _deviation(cache, n, rows)
    _place_fresh(cache, n, rows, keep_tail=bool(E) and keep_tail)
    return Filled(logits=out.logits[0, -1].float().cpu(), reads=read, deviation=moved)


def _check_fill(n: int, slot_ids: torch.Tensor | None, slot_positions: torch.Tensor, rows: torch.Tensor,
                tail_ids: torch.Tensor | None, tail_positions: torch.Tensor | None, reads: int) -> None:
    """:func:`fill`'s arguments describe a cache of ``n`` slots, sorted rows inside it and a tail, or raise."""
    S, E = int(rows.numel()), 0 if tail_ids is None else int(tail_ids.shape[-1])
    if slot_positions.shape != (n,) or (S and (slot_ids is None or tuple(slot_ids.shape) != (1, n))):
        raise PacketError(f"slot_ids [1, {n}] and slot_positions [{n}] must describe every cache slot")
    if E and (tail_ids.dim() != 2 or tail_ids.shape[0] != 1 or tail_positions is None
              or tuple(tail_positions.shape) != (E,)):
        raise PacketError(f"tail_ids [1, E] and tail_positions [E] expected, got {list(tail_ids.shape)} and "
                          f"{None if tail_positions is None else list(tail_positions.shape)}")
    if S and (bool((rows[1:] <= rows[:-1]).any()) or int(rows[0]) < 0 or int(rows[-1]) >= n):
        raise PacketError("the slots to compute must be sorted, unique and inside the cache")
    if not 0 <= reads <= S + E:
        raise PacketError(f"cannot read with {reads} tokens: {S + E} are computed")


def _masked_pass(model: Any, cache: DynamicCache, query_ids: torch.Tensor, query_pos: torch.Tensor,
                 slot_positions: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor | None,
                 reads: int) -> tuple[Any, torch.Tensor | None]:
    """:func:`fill`'s pass: the query tokens appended after the cache's ``n`` slots, each attending by position to
    the slots neither computed (``rows``) nor ``hidden`` and to the query tokens at or before it; with ``reads``,
    the largest weight any head of the last ``reads`` queries gives each slot, per layer (None where a layer
    returned no weights). Returns the model's output and those weights."""
    n, device = slot_positions.numel(), slot_positions.device
    stale = torch.zeros(n, dtype=torch.bool, device=device)
    stale[rows] = True
    if hidden is not None:
        stale[hidden] = True
    allowed = torch.cat([(slot_positions[None, :] <= query_pos[:, None]) & ~stale[None, :],  # kept slots [Q, n]
                         query_pos[None, :] <= query_pos[:, None]], dim=1)  # the computed tokens [Q, Q]
    dtype = cache.layers[0].keys.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    layers = decoder_layers(model)
    weights: list[torch.Tensor | None] = [None] * len(layers)

    def keep(index: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [1, H, Q, n + Q]
            if isinstance(probs, torch.Tensor):
                weights[index] = probs[0, :, -reads:, :n].amax(dim=(0, 1)).float()
        return hook

    with contextlib.ExitStack() as stack:
        if reads:
            handles: list[Any] = []
            stack.callback(lambda: [handle.remove() for handle in handles])  # also those hooked before a failure
            for index, layer in enumerate(layers):
                handles.append(_attention_module(layer).register_forward_hook(keep(index)))
            stack.enter_context(_eager(model))
        with fast_linears(model, int(query_ids.shape[-1]), 1):
            out = model(input_ids=query_ids, position_ids=query_pos[None], attention_mask=mask[None, None],
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
    read = None if not reads or any(w is None for w in weights) else torch.stack(weights)  # type: ignore[arg-type]
    return out, read


def _deviation(cache: DynamicCache, n: int, rows: torch.Tensor) -> torch.Tensor | None:
    """After :func:`_masked_pass`: per computed slot, ``|fresh - held| / |fresh|`` over its keys and values in
    every layer (the fresh rows sit at ``n..n+S``; what the slot held -- a stale spliced token, or a placeholder --
    at ``rows``). A spliced slot's value says how much the receiver's context changed it (its staleness)."""
    S = int(rows.numel())
    if not S:
        return None
    diff = torch.zeros(S, dtype=torch.float32, device=rows.device)
    norm = torch.zeros(S, dtype=torch.float32, device=rows.device)
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):  # [1, H, n + S + E, D]
            fresh, held = tensor[0, :, n:n + S].float(), tensor[0, :, rows].float()
            diff += (fresh - held).square().sum(dim=(0, 2))
            norm += fresh.square().sum(dim=(0, 2))
    return (diff / norm.clamp_min(1e-30)).sqrt().cpu()


def _place_fresh(cache: DynamicCache, n: int, rows: torch.Tensor, *, keep_tail: bool) -> None:
    """After :func:`_masked_pass` appended ``S = len(rows)`` fresh slots and then a tail after the ``n`` old ones:
    the S go into place at ``rows``; the tail is kept after them (``keep_tail``) or dropped (a probe's)."""
    S = int(rows.numel())
    for layer in cache.layers:
        keys, values = layer.keys, layer.values  # [1, H, n + S + E, D], created by the forward's cat
        if S:
            keys[:, :, rows] = keys[:, :, n:n + S]
            values[:, :, rows] = values[:, :, n:n + S]
        if keep_tail:
            layer.keys = torch.cat([keys[:, :, :n], keys[:, :, n + S:]], dim=2) if S else keys
            layer.values = torch.cat([values[:, :, :n], values[:, :, n + S:]], dim=2) if S else values
        else:
            layer.keys, layer.values = keys[:, :, :n], values[:, :, :n]


@contextlib.contextmanager
def _eager(model: Any) -> Iterator[None]:
    """The model runs eager attention (which returns its weights) within the block."""
    with _ATTENTION_SWITCH:  # shared with the batched engine's switch to its own attention
        previous = model.config._attn_implementation
        if previous != "eager":
            model.set_attn_implementation("eager")
        try:
            yield
        finally:
            if previous != "eager":
                model.set_attn_implementation(previous)


def attention_to_cache(model: Any, cache: DynamicCache, token_ids: torch.Tensor, slot_positions: torch.Tensor,
                       query_positions: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """How strongly ``token_ids`` [1, Q], placed after ``cache`` at ``query_positions`` [Q],
    attend to each of the cache's N slots: ``[L, N]``, per layer the largest attention weight
    any head of any query gives the slot (0 for ``hidden`` slots, which are masked out,
    e.g. placeholders not yet computed). ``slot_positions`` [N] place the slots.

    One forward pass of the Q tokens through every layer (:func:`fill` reading with all of them, which also refuses
    sliding-window caches); the cache is left as it was.
    """
    n, q = cache_length(cache), int(token_ids.shape[-1])
    if token_ids.shape != (1, q) or query_positions.shape != (q,) or slot_positions.shape != (n,) or q == 0:
        raise PacketError(f"token_ids [1, Q>0], query_positions [Q] and slot_positions [{n}] expected, got "
                          f"{list(token_ids.shape)}, {list(query_positions.shape)}, {list(slot_positions.shape)}")
    filled = fill(model, cache, None, slot_positions, torch.zeros(0, dtype=torch.long), token_ids,
                  query_positions.to(slot_positions.device), keep_tail=False, hidden=hidden, reads=q)
    if filled.reads is None:
        raise ModelError(f"{type(model).__name__} does not return attention weights from its attention layers",
                         "choose recompute slots by K/V deviation: Recompute(select='kv-deviation')")
    return filled.reads


def recompute(model: Any, cache: DynamicCache, spec: ModelSpec, token_ids: torch.Tensor,
              slot_positions: torch.Tensor, selected: torch.Tensor) -> None:
    """Recompute the K/V of the ``selected`` cache slots in place, through all layers.

    ``token_ids`` [1, N] and ``slot_positions`` [N] describe every slot of ``cache``;
    ``selected`` [S] (sorted slot indices) are recomputed as fresh tokens at their
    positions. Each one attends causally (by position) to every slot that is not
    selected -- kept as it is, e.g. a spliced segment -- and to the fresh selected
    tokens before it; never to the stale values in selected slots. Recomputing every
    slot after a fresh prefix is a full prefill: the exact result. (:func:`fill` with no tail.)
    """
    _require_full_attention(spec, "selective recompute")
    n = cache_length(cache)
    if token_ids.shape != (1, n) or slot_positions.shape != (n,):
        raise PacketError(f"token_ids [1, {n}] and slot_positions [{n}] must describe every cache slot")
    fill(model, cache, token_ids, slot_positions, selected)


def _attention_module(layer: Any) -> Any:
    """A decoder layer's self-attention module (``self_attn`` in most families, ``attention`` in GPT-NeoX)."""
    for name in ("self_attn", "attention", "attn"):
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ModelError(f"cannot find the self-attention module of {type(layer).__name__}",
                     "choose recompute slots by K/V deviation: Recompute(select='kv-deviation')")


def decoder_layers(model: Any) -> Any:
    """The model's list of decoder layers."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def _require_full_attention(spec: ModelSpec, what: str) -> None:
    if spec.has_sliding_window:
        raise ModelError(f"{what} is not supported for models with sliding-window layers ({spec.model_type})",
                         "use prefix or text mode for this model")
