"""The packet: one agent's KV-cache for a run of tokens, plus what is needed to trust it.

Layout (the only place it is defined; everything else converts at the edges)::

    keys[l], values[l]   Tensor [B, H_kv, T_l, D]   batch, KV heads, tokens, head_dim
                         (transformers' own DynamicLayer layout, so hf.py copies nothing)
                         T_l == T for full-attention layers;
                         T_l == min(T, sliding_window - 1) for sliding layers: the *last* T_l
                         tokens of the segment, which is all such a layer ever attends to
    token_ids            LongTensor  [B, T]          the tokens whose K/V these are
    mask                 uint8       [B, T]          1 = real token, 0 = padding
    start                int                         absolute position of the first real token
    positions()          LongTensor  [B, T]          start + number of real tokens before each one:
                                                     padding takes no position (left- or right-padded
                                                     batches keep each row's positions as if run alone)
    rotary               "applied" | "stripped"      keys rotated at positions(), or position-free
    attention            "causal" | "segment"        causal: computed over exactly its parent chain;
                                                     segment: computed inside another context (its
                                                     producer's) and exchanged on its own, for splicing

Partial-layer packets (``layers`` set; see :mod:`kvwire.wire.layers`) carry K/V for some layers only::

    layers               tuple[int, ...]             the layers keys[i] / values[i] belong to (ascending);
                                                     None (the usual case) means every layer, in order
    hidden[l]            Tensor [B, T, H]            for each layer l starting a run of layers *not*
                                                     carried: the hidden state entering layer l (the
                                                     receiver computes that run itself from it)

A packet either starts a context (``parent is None``, usually ``start == 0``) or
continues one: it then holds only the tokens appended since its parent and names
the parent by :attr:`Packet.id`, a prefix-chained hash like the block hashes of
paged KV stores: ``id = H(parent.id, fingerprint, start, token_ids, mask)``, so an
id names the whole context up to the packet's last token. ``parent_checksum`` pins
the exact parent bytes as well. :func:`join` assembles a chain into one packet.

:meth:`Packet.validate` is the shape contract; the codec calls it on every decode
and the HF module on every inject.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

import blake3
import torch

from ..errors import ChainError, PacketError
from .spec import ModelSpec

Attention = Literal["causal", "segment"]
Rotary = Literal["applied", "stripped"]


@dataclass(eq=False)
class Packet:
    """Per-layer K/V for ``token_ids`` plus provenance. See the module docstring for the layout."""

    spec: ModelSpec
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor  # int64 [B, T]
    mask: torch.Tensor  # uint8 [B, T]
    start: int = 0
    attention: Attention = "causal"  # the visibility rule the cache was computed under
    rotary: Rotary = "applied"  # keys carry RoPE at positions(), or were stripped of it
    parent: str | None = None  # id of the packet this one continues
    parent_checksum: str | None = None  # checksum of that parent's bytes
    producer: str = ""  # agent that computed it
    session: str = ""
    round: int = 0
    version: int = 1
    created_at: float = field(default_factory=time.time)
    checksum: str | None = None  # blake3 of the encoded bytes; set by the codec
    layers: tuple[int, ...] | None = None  # partial-layer packet: the layers keys/values hold (None: all)
    hidden: Mapping[int, torch.Tensor] | None = None  # partial-layer packet: hidden state entering layer l

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def length(self) -> int:
        """Number of token positions the packet covers (T)."""
        return int(self.token_ids.shape[1])

    @property
    def end(self) -> int:
        """Absolute position just after the last token."""
        return self.start + self.length

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (what ``kvwire size`` predicts), plus any hidden states of a partial packet."""
        hidden = tuple(self.hidden.values()) if self.hidden else ()
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *hidden))

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """The layers ``keys`` / ``values`` belong to: all of them unless this is a partial-layer packet."""
        return tuple(range(self.spec.num_layers)) if self.layers is None else self.layers

    @property
    def is_partial(self) -> bool:
        return self.layers is not None

    @cached_property
    def id(self) -> str:
        """Prefix-chained content hash naming this packet's whole context (see module docstring)."""
        hasher = blake3.blake3(b"kvwire-chain-v1\0")
        hasher.update(f"{self.parent or ''}\0{self.spec.fingerprint}\0{self.start}\0{self.attention}\0{self.rotary}\0"
                      .encode())
        hasher.update(f"{tuple(self.token_ids.shape)}\0".encode())
        if self.layers is not None:  # a partial packet never shares an id with the full one
            hasher.update(f"partial\0{list(self.layers)}\0{sorted(self.hidden or ())}\0".encode())
        for tensor in (self.token_ids.to(torch.int64), self.mask.to(torch.uint8)):
            hasher.update(tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        return hasher.hexdigest()

    # -- the shape contract --------------------------------------------------------------------

    def validate(self) -> Packet:
        """Check every field against the spec; raise :class:`PacketError` naming expected vs got."""
        spec = self.spec
        _check(isinstance(self.token_ids, torch.Tensor) and self.token_ids.dtype == torch.int64
               and self.token_ids.dim() == 2,
               "token_ids must be an int64 tensor [B, T]", _describe(self.token_ids))
        B, T = self.token_ids.shape
        _check(B >= 1, "batch size must be >= 1", f"B={B}")
        _check(isinstance(self.mask, torch.Tensor) and self.mask.dtype == torch.uint8
               and tuple(self.mask.shape) == (B, T),
               f"mask must be a uint8 tensor [B, T]=[{B}, {T}]", _describe(self.mask))
        if T:
            _check(bool(((self.mask == 0) | (self.mask == 1)).all()), "mask values in {0, 1}", "other values")
            lo, hi = int(self.token_ids.min()), int(self.token_ids.max())
            _check(0 <= lo and hi < spec.vocab_size, f"token ids in [0, {spec.vocab_size})", f"[{lo}, {hi}]")
        _check(isinstance(self.start, int) and self.start >= 0, "start >= 0", repr(self.start))
        _check(self.attention in ("causal", "segment"), "attention 'causal' or 'segment'", repr(self.attention))
        _check(self.rotary in ("applied", "stripped"), "rotary 'applied' or 'stripped'", repr(self.rotary))
        _check(isinstance(self.round, int) and self.round >= 0, "round >= 0", repr(self.round))
        _check(isinstance(self.version, int) and self.version >= 1, "version >= 1", repr(self.version))
        _check((self.parent is None) == (self.parent_checksum is None),
               "parent and parent_checksum both set or both unset",
               f"parent={self.parent!r}, parent_checksum={self.parent_checksum!r}")
        layers = self.layer_indices
        _check(len(self.keys) == len(layers) and len(self.values) == len(layers),
               f"{len(layers)} layers of keys and values", f"{len(self.keys)} keys, {len(self.values)} values")
        device = self.token_ids.device
        if self.layers is not None or self.hidden is not None:
            _validate_partial(self, B, T)
        for layer, k, v in zip(layers, self.keys, self.values):
            want = (B, spec.num_kv_heads, spec.kept_tokens(layer, T), spec.head_dim)
            for name, t in (("keys", k), ("values", v)):
                _check(isinstance(t, torch.Tensor) and t.dtype == spec.torch_dtype and tuple(t.shape) == want,
                       f"layer {layer} {name} [B, H_kv, T, D]={list(want)} {spec.dtype}", _describe(t))
                _check(t.device == device, f"layer {layer} {name} on {device}", str(t.device))
        return self

    def positions(self) -> torch.Tensor:
        """Absolute position of every token, [B, T]: padding takes no position.

        Example (start=10): mask [[0, 0, 1, 1], [1, 1, 1, 1]] -> [[10, 10, 10, 11], [10, 11, 12, 13]].
        """
        counted = torch.cumsum(self.mask.to(torch.int64), dim=1) - 1
        return self.start + counted.clamp(min=0)

    # -- views ---------------------------------------------------------------------------------

    def with_provenance(self, **changes: Any) -> Packet:
        """A copy sharing the tensors, with metadata fields replaced (checksum cleared)."""
        return replace(self, checksum=None, **changes)

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def to(self, device: str | torch.device) -> Packet:
        """The packet with every tensor on ``device`` (the same packet if already there).

        Moving K/V between an accelerator and the CPU is a copy of ``nbytes``; kvwire
        never does it implicitly: the codec refuses non-CPU tensors, and the pipeline
        moves packets with this method and counts the bytes it moved.
        """
        device = torch.device(device)
        if self.device == device:
            return self
        return replace(self, keys=tuple(k.to(device) for k in self.keys),
                       values=tuple(v.to(device) for v in self.values),
                       token_ids=self.token_ids.to(device), mask=self.mask.to(device),
                       hidden={i: h.to(device) for i, h in self.hidden.items()} if self.hidden is not None else None)

    def describe(self) -> dict[str, Any]:
        """Metadata and shapes as plain JSON (what ``kvwire inspect`` prints)."""
        return {
            "id": self.id,
            "checksum": self.checksum,
            "parent": self.parent,
            "producer": self.producer,
            "session": self.session,
            "round": self.round,
            "version": self.version,
            "created_at": self.created_at,
            "start": self.start,
            "length": self.length,
            "batch_size": self.batch_size,
            "attention": self.attention,
            "rotary": self.rotary,
            "padding_tokens": int((self.mask == 0).sum()),
            "kv_bytes": self.nbytes,
            "layer_shapes": sorted({str(list(k.shape)) for k in self.keys}),
            "spec": self.spec.to_json(),
            **({"partial": {"layers": list(self.layers), "hidden_layers": sorted(self.hidden or {}),
                            "hidden_size": next(iter(self.hidden.values())).shape[2] if self.hidden else None}}
               if self.layers is not None else {}),
        }


def join(chain: Sequence[Packet]) -> Packet:
    """Assemble a contiguous chain (root first) into one packet covering all its tokens.

    Every link must name its predecessor (``parent == prev.id`` and
    ``parent_checksum == prev.checksum``), start where it ends, and come from the same
    model and batch; otherwise :class:`ChainError`. Sliding layers keep only their
    last ``sliding_window - 1`` tokens, exactly as a cache that saw the whole context.
    """
    check_chain(chain)
    first = chain[0]
    if len(chain) == 1:
        return first
    spec = first.spec
    total = sum(p.length for p in chain)
    keys, values = [], []
    for layer in range(spec.num_layers):
        kept = spec.kept_tokens(layer, total)
        # [B, H, sum(T_l), D] -> keep the last `kept` tokens (a no-op for full layers)
        keys.append(torch.cat([p.keys[layer] for p in chain], dim=2)[:, :, -kept:, :] if kept else
                    first.keys[layer][:, :, :0, :])
        values.append(torch.cat([p.values[layer] for p in chain], dim=2)[:, :, -kept:, :] if kept else
                      first.values[layer][:, :, :0, :])
    last = chain[-1]
    return Packet(
        spec=spec,
        keys=tuple(keys),
        values=tuple(values),
        token_ids=torch.cat([p.token_ids for p in chain], dim=1),
        mask=torch.cat([p.mask for p in chain], dim=1),
        start=first.start,
        attention=first.attention,
        rotary=first.rotary,
        parent=first.parent,
        parent_checksum=first.parent_checksum,
        producer=last.producer,
        session=last.session,
        round=last.round,
        version=last.version,
        created_at=last.created_at,
    )


def check_chain(chain: Sequence[Packet]) -> None:
    """:class:`ChainError` unless ``chain`` (root first) is one contiguous chain: not empty, every link naming its
    predecessor and starting where it ends, from one model and batch (what :func:`join` checks before copying)."""
    if not chain:
        raise ChainError("cannot join an empty chain")
    if any(p.is_partial for p in chain) and len(chain) > 1:
        raise ChainError("partial-layer packets are standalone prefixes, not chain links",
                         "send the whole context as one partial packet (kvwire.hf.partial.send)")
    for prev, link in zip(chain, chain[1:]):
        _check_link(prev, link)


def _check_link(prev: Packet, link: Packet) -> None:
    """:class:`ChainError` unless ``link`` continues ``prev``: names it (id and bytes), starts where it ends,
    and shares its attention, rotary state, batch size and model."""
    if link.parent != prev.id:
        raise ChainError(f"packet {link.id[:12]} names parent {str(link.parent)[:12]}, but follows {prev.id[:12]}")
    if link.parent_checksum != prev.checksum:
        raise ChainError(
            f"packet {link.id[:12]} expects parent bytes {str(link.parent_checksum)[:12]}, "
            f"got {str(prev.checksum)[:12]}",
            "the parent was replaced after its child was made; rebuild the context",
        )
    if link.start != prev.end:
        raise ChainError(f"packet {link.id[:12]} starts at {link.start}, but its parent ends at {prev.end}")
    if (link.attention, link.rotary) != (prev.attention, prev.rotary):
        raise ChainError(f"packet {link.id[:12]} is {link.attention}/{link.rotary}, its parent "
                         f"{prev.attention}/{prev.rotary}: a chain is uniform")
    if link.batch_size != prev.batch_size:
        raise ChainError(f"batch size changes along the chain: {prev.batch_size} -> {link.batch_size}")
    prev.spec.check_same_model(link.spec, what=f"packet {link.id[:12]} in the chain")


def _validate_partial(packet: Packet, B: int, T: int) -> None:
    """A partial-layer packet: valid layers, one hidden state per run of missing layers, a standalone prefix."""
    from .layers import LayerPlan  # partial.py builds on this module

    spec = packet.spec
    _check(packet.layers is not None and packet.hidden is not None,
           "a partial-layer packet to set both layers and hidden", f"layers={packet.layers!r}, hidden set: "
           f"{packet.hidden is not None}")
    layers = packet.layers
    _check(isinstance(layers, tuple) and all(type(i) is int for i in layers)
           and all(0 <= i < spec.num_layers for i in layers) and list(layers) == sorted(set(layers))
           and len(layers) < spec.num_layers,
           f"partial layers: ascending, unique, fewer than all, in [0, {spec.num_layers})", repr(layers))
    _check(packet.start == 0 and packet.parent is None and packet.attention == "causal" and packet.rotary == "applied",
           "a partial-layer packet to be a standalone causal prefix (start 0, no parent, RoPE applied)",
           f"start={packet.start}, parent={packet.parent!r}, {packet.attention}/{packet.rotary}")
    plan = LayerPlan(spec.num_layers, layers)
    hidden = packet.hidden
    _check(isinstance(hidden, Mapping) and sorted(hidden) == list(plan.hidden_layers),
           f"hidden states entering layers {list(plan.hidden_layers)}",
           f"{sorted(hidden) if isinstance(hidden, Mapping) else type(hidden).__name__}")
    sizes = set()
    for layer, h in hidden.items():
        ok = isinstance(h, torch.Tensor) and h.dim() == 3 and tuple(h.shape[:2]) == (B, T) and h.shape[2] > 0
        _check(ok and h.dtype == spec.torch_dtype and h.device == packet.token_ids.device,
               f"hidden state entering layer {layer}: [B, T, H]=[{B}, {T}, H] {spec.dtype} "
               f"on {packet.token_ids.device}",
               _describe(h))
        sizes.add(int(h.shape[2]))
    _check(len(sizes) == 1, "one hidden size for every hidden state", str(sorted(sizes)))


def _check(ok: bool, expected: str, got: str) -> None:
    if not ok:
        raise PacketError(f"invalid packet: expected {expected}, got {got}")


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"
    return type(t).__name__
