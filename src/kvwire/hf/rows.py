"""What flows in and out of the batched-decode engine (:mod:`.engine`): the shared
:class:`Prefix` rows read, a :class:`Request`, a finished row's :class:`RowResult` (its
tokens, timings and K/V, which can be published as a packet), and what one
:class:`Step` did; and :class:`LiveRow`, a request's state while the engine holds it.

Layouts: prefix and own K/V are transformers' ``[B, Hkv, T, D]`` per layer with ``B == 1``;
a row's K/V cover ``context_ids + tokens[:-1]`` (the last token is never fed back), the
prefix part (positions ``0..own_start-1``) in :attr:`RowResult.prefix` and the rest in
:attr:`RowResult.own_keys` / ``own_values``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from ..errors import PacketError
from ..wire.packet import Packet
from ..wire.spec import ModelSpec
from .cache import cache_length, new_cache, packet_start
from .generation import Sampling

FinishReason = Literal["eos", "stop", "length", "cancelled", "error"]  # error: this row's own work raised


@dataclass(frozen=True, eq=False)
class Prefix:
    """A context rows share: per-layer K/V ``[1, Hkv, P, D]`` rotated at positions 0..P-1, and its ids.

    Never copied by the engine; rows holding it keep it alive. Compared by identity: rows
    share a prefix when they hold the same object.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    token_ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_cache(cls, cache: DynamicCache, token_ids: Sequence[int]) -> Prefix:
        """The K/V a ``DynamicCache`` holds (one row, full-attention layers) for ``token_ids``."""
        ids = tuple(int(t) for t in token_ids)
        if cache_length(cache) != len(ids):
            raise PacketError(f"the cache holds {cache_length(cache)} tokens, the prefix ids {len(ids)}")
        keys = tuple(layer.keys for layer in cache.layers)
        values = tuple(layer.values for layer in cache.layers)
        return cls(keys, values, ids)._checked()

    @classmethod
    def from_packet(cls, packet: Packet) -> Prefix:
        """A packet that starts a context (position 0, one unpadded row, keys rotated in place)."""
        packet.validate()
        if packet.start != 0 or packet.rotary != "applied":
            raise PacketError(f"a shared prefix starts at position 0 with keys in place; packet {packet.id[:12]} "
                              f"starts at {packet.start} ({packet.rotary})", "assemble the chain first")
        if packet.batch_size != 1 or bool((packet.mask == 0).any()):
            raise PacketError("a shared prefix is one unpadded row")
        return cls(tuple(packet.keys), tuple(packet.values), tuple(packet.token_ids[0].tolist()))._checked()

    def _checked(self) -> Prefix:
        for index, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != self.length or k.shape != v.shape:
                raise PacketError(f"prefix layer {index}: keys/values must be [1, Hkv, {self.length}, D], got "
                                  f"{list(k.shape)} / {list(v.shape)}",
                                  "sliding-window layers cannot be shared prefixes")
        return self


@dataclass
class Request:
    """One sequence to decode. ``input_ids`` is the whole context; ``prefix`` (shared) or ``cache``
    (private) covers its first tokens."""

    input_ids: Sequence[int]
    prefix: Prefix | None = None
    cache: DynamicCache | None = None
    max_new_tokens: int = 32
    sampling: Sampling = field(default_factory=Sampling)
    eos_ids: frozenset[int] | None = None  # None: the model's
    stop_ids: frozenset[int] = frozenset()  # further ids that end the row (kept in its output, like eos)
    first_position: int | None = None  # position of the first uncached token; None: the cached length
    keep_logits: bool = False  # keep every step's logits (fp32 [n, V]) for fidelity measurements
    tag: Any = None  # the caller's label, returned in the result


@dataclass
class RowResult:
    """A finished row. Times in seconds from ``perf_counter``; ``ttft_s`` counts from :meth:`Engine.add`."""

    id: int
    tag: Any
    tokens: list[int]
    finish_reason: FinishReason
    context_ids: list[int]
    cached: int  # context tokens read from the prefix / cache
    prefilled: int  # context tokens computed by this row's prefill
    queued_s: float  # add -> admitted (waiting for a place in the batch or the memory budget)
    prefill_s: float  # the prefill forward this row was part of
    ttft_s: float  # add -> first token
    decode_s: float  # first token -> finished (steps shared with the rest of the batch)
    total_s: float
    steps: int  # decode steps taken
    first_logits: torch.Tensor | None = field(repr=False, default=None)  # fp32 [V]
    step_logits: torch.Tensor | None = field(repr=False, default=None)  # fp32 [n, V] if kept
    prefix: Prefix | None = field(repr=False, default=None)  # read by cascade attention (not copied)
    own_start: int = 0  # context index where own_keys begin (the prefix length, or 0 in copy mode)
    own_keys: tuple[torch.Tensor, ...] = field(repr=False, default=())  # per layer [1, Hkv, n, D]
    own_values: tuple[torch.Tensor, ...] = field(repr=False, default=())
    first_position: int = 0
    error: BaseException | None = field(repr=False, default=None)  # finish_reason "error": what this row raised

    @property
    def covered_ids(self) -> list[int]:
        """The ids the row's K/V cover: context + tokens[:-1]."""
        return (self.context_ids + self.tokens[:-1])[: self.own_start + self._own_length]

    @property
    def _own_length(self) -> int:
        return int(self.own_keys[0].shape[-2]) if self.own_keys else 0

    def cache(self, model: Any) -> DynamicCache:
        """A fresh ``DynamicCache`` of prefix + own part (a copy), covering :attr:`covered_ids`."""
        if self.first_position != self.cached:
            raise PacketError(f"this row's suffix sits at position {self.first_position}, not {self.cached}: "
                              "its cache is not a prefix cache")
        cache = new_cache(model)
        for index in range(len(self.own_keys)):
            if self.prefix is not None:
                keys = torch.cat([self.prefix.keys[index], self.own_keys[index]], dim=-2)
                values = torch.cat([self.prefix.values[index], self.own_values[index]], dim=-2)
            else:
                keys, values = self.own_keys[index], self.own_values[index]
            cache.update(keys, values, index)
        return cache

    def extract(self, spec: ModelSpec, *, parent: Packet | None = None, start: int | None = None,
                **provenance: Any) -> Packet:
        """The packet ``hf.extract(self.cache(model), spec, covered ids, parent=..., start=...)`` would
        give, built without copying the shared prefix when the packet starts inside the own part."""
        device = self.own_keys[0].device if self.own_keys else torch.device("cpu")  # a packet lives with its K/V
        ids = torch.tensor([self.covered_ids], dtype=torch.int64, device=device)
        n = ids.shape[1]
        start, segment_only = packet_start(ids, parent, start, "the row")
        keys, values = [], []
        for index in range(len(self.own_keys)):
            k, v = self.own_keys[index], self.own_values[index]
            if start < self.own_start:  # the packet reaches into the shared prefix: that part is copied
                k = torch.cat([self.prefix.keys[index][:, :, start:], k], dim=-2)
                v = torch.cat([self.prefix.values[index][:, :, start:], v], dim=-2)
            else:
                k, v = k[:, :, start - self.own_start:], v[:, :, start - self.own_start:]
            keys.append(k)
            values.append(v)
        return Packet(spec=spec, keys=tuple(keys), values=tuple(values), token_ids=ids[:, start:],
                      mask=torch.ones(1, n - start, dtype=torch.uint8, device=device), start=start,
                      attention="segment" if segment_only else "causal",
                      parent=parent.id if parent is not None else None,
                      parent_checksum=parent.checksum if parent is not None else None, **provenance).validate()


@dataclass
class Step:
    """What one :meth:`Engine.step` did: one forward pass (``kind``) over ``batch`` rows. A ``"mixed"`` pass
    is the running rows' decode step (``batch`` of them) packed with a chunk of a long prompt's prefill."""

    kind: Literal["prefill", "decode", "mixed", "idle"]
    batch: int
    tokens: dict[int, list[int]]  # row id -> tokens it produced in this step
    finished: list[RowResult]
    seconds: float
    prefill_s: dict[int, float] = field(default_factory=dict)  # row id -> its prefill forward, if in this step


@dataclass(eq=False)
class LiveRow:
    """A request while the engine holds it: its context, where its slots start, what it has done so far."""


    id: int
    request: Request
    prefix: Prefix | None  # the request's shared prefix, or its private cache as one
    context: list[int]
    cached: int
    own_start: int  # context index of own slot 0
    suffix: list[int]  # context[cached:]
    first_position: int
    eos: frozenset[int]
    added: float
    generator: torch.Generator | None
    admitted: float = 0.0
    prefill_s: float = 0.0
    first_token_at: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    own_length: int = 0  # own slots written
    steps: int = 0
    done: int = 0  # suffix tokens prefilled so far (less than all only mid-way through a chunked prefill)
    error: BaseException | None = None  # this row's own work raised: it leaves with finish_reason "error"

    @property
    def start_slot(self) -> int:
        """Own slot where the suffix begins."""
        return self.cached - self.own_start

    @property
    def capacity_needed(self) -> int:
        return self.start_slot + len(self.suffix) + self.request.max_new_tokens

    @property
    def prefilling(self) -> bool:
        """Its suffix is not all prefilled yet: it has no token to decode from."""
        return self.done < len(self.suffix)

    def result(self, reason: FinishReason, own_keys: tuple[torch.Tensor, ...],
               own_values: tuple[torch.Tensor, ...]) -> RowResult:
        """What it leaves with: its tokens, timings, and the K/V of its own slots (empty when not kept)."""
        now = time.perf_counter()
        admitted = self.admitted or now
        first = self.first_token_at or now
        return RowResult(
            id=self.id, tag=self.request.tag, tokens=list(self.tokens), finish_reason=reason,
            context_ids=self.context, cached=self.cached, prefilled=len(self.suffix) if self.tokens else 0,
            queued_s=admitted - self.added, prefill_s=self.prefill_s,
            ttft_s=(first - self.added) if self.tokens else 0.0, decode_s=(now - first) if self.tokens else 0.0,
            total_s=now - self.added, steps=self.steps, first_logits=self.first_logits,
            step_logits=torch.stack(self.logits) if self.logits else None,
            prefix=self.prefix if self.own_start > 0 else None, own_start=self.own_start, own_keys=own_keys,
            own_values=own_values, first_position=self.first_position, error=self.error)


def label(row: LiveRow) -> str:
    """A row as a log line names it: its tag when that is short text (a request id, an agent's name), else the
    name its tag carries, else the row's number -- never a repr that dumps a whole turn, caches and all."""
    tag = row.request.tag
    if isinstance(tag, (str, int)) and len(str(tag)) <= 80:
        return str(tag)
    name = getattr(tag, "name", None) or getattr(getattr(tag, "agent", None), "name", None)
    return str(name) if isinstance(name, str) else f"#{row.id}"
