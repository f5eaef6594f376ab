"""The scheduler's one view of the model: sequences decoded together (:class:`Decoder`).

Sequences (*rows*) join and leave between steps. A row starts from an exact prefix
received from the store (a :class:`~kvwire.wire.packet.Packet`; rows holding the same
packet object read the same prefix) or from a private cache (a spliced context),
prefills the rest of its ids, then decodes with its own sampling until an eos id,
its token limit, or the scheduler ends it (a stop string: :meth:`Decoder.finish`; a
client gone: :meth:`Decoder.cancel`). A finished row hands back its K/V
(:class:`Kv`) for publishing.

:class:`Batched` is the batched-decode engine of ``kvwire/hf`` (:class:`kvwire.hf.Engine`:
continuous batching, shared-prefix attention) behind this interface; rows holding the
same context packet share one :class:`kvwire.hf.Prefix`, read once per step for all of
them. :class:`OneByOne` decodes every row on its own (a forward per row per step), for
models the engine refuses (sliding-window layers).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from .. import hf
from ..errors import ModelError
from ..hf.generation import pick
from ..wire.packet import Packet
from ..wire.spec import ModelSpec

log = logging.getLogger(__name__)

FinishReason = Literal["eos", "length", "stop", "cancelled", "error"]  # error: the row's own work raised


@dataclass
class Row:
    """One sequence to decode; ``context`` or ``cache`` covers the first ids (or neither)."""

    ids: list[int]
    context: Packet | None = None  # an exact prefix from the store (shared by rows holding the same object)
    cache: Any | None = None  # a private DynamicCache (a spliced context)
    max_new_tokens: int = 32
    sampling: hf.Sampling = field(default_factory=hf.Sampling)
    eos_ids: frozenset[int] = frozenset()  # end the row (the eos token is its last)


class Kv(Protocol):
    """A finished row's K/V: the context and every generated token but the last."""

    def extract(self, spec: ModelSpec, *, parent: Packet | None = None, start: int | None = None,
                **provenance: Any) -> Packet:
        """As :func:`kvwire.hf.extract` on the row's cache."""

    @property
    def length(self) -> int: ...


@dataclass
class Finished:
    reason: FinishReason
    kv: Kv | None  # None for a cancelled or failed row
    error: BaseException | None = None  # reason "error": what the row's own work raised (the others went on)


class Decoder(Protocol):
    def add(self, key: Hashable, row: Row) -> None:
        """Queue a row; it is prefilled at a coming step."""

    def step(self) -> tuple[dict[Hashable, list[int]], dict[Hashable, Finished]]:
        """One forward pass: the tokens each row produced, and the rows that ended (eos, their limit, or
        ``error``: a row whose own work raised ends alone, the others keep their tokens)."""

    def finish(self, key: Hashable) -> Kv | None:
        """End a row now, keeping its K/V (the scheduler found a stop string)."""

    def cancel(self, key: Hashable) -> None:
        """End a row now and drop it (its client went away)."""


@dataclass
class CacheKv:
    """:class:`Kv` of a plain ``DynamicCache`` covering ``ids``."""

    cache: Any
    ids: list[int]

    @property
    def length(self) -> int:
        return hf.cache_length(self.cache)

    def extract(self, spec: ModelSpec, *, parent: Packet | None = None, start: int | None = None,
                **provenance: Any) -> Packet:
        covered = torch.tensor([self.ids[:self.length]])
        return hf.extract(self.cache, spec, covered, parent=parent, start=start, **provenance)


@dataclass
class _State:
    row: Row
    cache: Any
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class OneByOne:
    """Each step prefills one waiting row, or decodes every row with a forward of its own. ``why``: why not batched
    (said in ``GET /health``'s ``decoding``)."""

    def __init__(self, model: Any, why: str = "") -> None:
        self.model = model
        self.why = why
        self.waiting: dict[Hashable, Row] = {}
        self.rows: dict[Hashable, _State] = {}

    def add(self, key: Hashable, row: Row) -> None:
        self.waiting[key] = row

    @torch.inference_mode()
    def step(self) -> tuple[dict[Hashable, list[int]], dict[Hashable, Finished]]:
        produced: dict[Hashable, list[int]] = {}
        finished: dict[Hashable, Finished] = {}
        if self.waiting:
            key = next(iter(self.waiting))
            try:
                produced[key] = [self._prefill(key, self.waiting.pop(key))]
            except Exception as err:  # noqa: BLE001 -- its own work: it alone ends
                self.rows.pop(key, None)
                finished[key] = Finished("error", None, err)
        else:
            for key, state in list(self.rows.items()):
                try:
                    with hf.fast_linears(self.model, 1, 1):
                        out = self.model(input_ids=torch.tensor([[state.tokens[-1]]]), past_key_values=state.cache,
                                         use_cache=True)
                    produced[key] = [self._pick(state, out.logits[0, -1])]
                except Exception as err:  # noqa: BLE001
                    del self.rows[key]
                    finished[key] = Finished("error", None, err)
        for key in produced:
            state = self.rows[key]
            reason = "eos" if state.tokens[-1] in state.row.eos_ids else \
                "length" if len(state.tokens) >= state.row.max_new_tokens else None
            if reason:
                finished[key] = Finished(reason, self._kv(self.rows.pop(key)))
        return produced, finished

    def _prefill(self, key: Hashable, row: Row) -> int:
        cache = row.cache if row.cache is not None else (
            hf.build_cache(row.context, self.model) if row.context is not None else hf.new_cache(self.model))
        suffix = row.ids[hf.cache_length(cache):]
        with hf.fast_linears(self.model, len(suffix), 1):
            out = self.model(input_ids=torch.tensor([suffix]), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        sampling = row.sampling
        state = _State(row, cache, generator=torch.Generator().manual_seed(sampling.seed)
                       if sampling.temperature > 0 else None)
        token = self._pick(state, out.logits[0, -1])
        self.rows[key] = state
        return token

    def finish(self, key: Hashable) -> Kv | None:
        state = self.rows.pop(key, None)
        return None if state is None else self._kv(state)

    def cancel(self, key: Hashable) -> None:
        self.waiting.pop(key, None)
        self.rows.pop(key, None)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.rows)

    @staticmethod
    def _kv(state: _State) -> CacheKv:
        return CacheKv(state.cache, state.row.ids + state.tokens)

    @staticmethod
    def _pick(state: _State, logits: torch.Tensor) -> int:
        token = pick(logits, state.row.sampling, state.generator)  # as the engine and hf.generate pick
        state.tokens.append(token)
        return token


@dataclass
class RowKv:
    """:class:`Kv` of an engine row's result (its shared prefix is not copied until extracted)."""

    result: hf.RowResult

    @property
    def length(self) -> int:
        return len(self.result.covered_ids)

    def extract(self, spec: ModelSpec, *, parent: Packet | None = None, start: int | None = None,
                **provenance: Any) -> Packet:
        return self.result.extract(spec, parent=parent, start=start, **provenance)


class Batched:
    """:class:`kvwire.hf.Engine` as a :class:`Decoder`: continuous batching with shared-prefix attention.

    A row that ends early on a stop string (:meth:`finish`) keeps its K/V, like one that
    produced eos: the engine ends it as a stop and hands its result back at once.
    """

    def __init__(self, model: Any, max_batch: int, memory_budget: int | None = None,
                 prefill_chunk: int | str | None = None, reserve_slots: int = 0) -> None:
        self.engine = hf.Engine(model, max_batch=max_batch, memory_budget=memory_budget, prefill_chunk=prefill_chunk,
                                reserve_slots=reserve_slots)
        self.rows: dict[Hashable, int] = {}  # key -> engine row id, while the row is the scheduler's
        self.keys: dict[int, Hashable] = {}  # engine row id -> key, until the engine reports the row ended
        self._prefixes: weakref.WeakKeyDictionary[Packet, hf.Prefix] = weakref.WeakKeyDictionary()

    def add(self, key: Hashable, row: Row) -> None:
        prefix = None
        if row.context is not None:  # one Prefix per context object: rows that found the same one share it
            prefix = self._prefixes.get(row.context)
            if prefix is None:
                prefix = self._prefixes[row.context] = hf.Prefix.from_packet(row.context)
        rid = self.engine.add(hf.Request(row.ids, prefix=prefix, cache=row.cache, max_new_tokens=row.max_new_tokens,
                                         sampling=row.sampling, eos_ids=row.eos_ids, tag=key))
        self.rows[key], self.keys[rid] = rid, key

    def step(self) -> tuple[dict[Hashable, list[int]], dict[Hashable, Finished]]:
        step = self.engine.step()
        produced = {self.keys[rid]: tokens for rid, tokens in step.tokens.items() if rid in self.keys}
        finished: dict[Hashable, Finished] = {}
        for result in step.finished:
            key = self.keys.pop(result.id, None)
            if key is None or self.rows.get(key) != result.id:
                continue  # a row the scheduler already let go of (cancelled)
            del self.rows[key]
            reason: FinishReason = result.finish_reason if result.finish_reason in ("length", "cancelled", "error") \
                else "eos"
            finished[key] = Finished(reason, RowKv(result) if reason in ("eos", "length") else None, result.error)
        return produced, finished

    def finish(self, key: Hashable) -> Kv | None:
        rid = self.rows.pop(key, None)
        if rid is None:
            return None
        self.keys.pop(rid, None)
        self.engine.finish(rid)  # ends the row as a stop, keeping its K/V
        result = self.engine.take_result(rid)
        return RowKv(result) if result is not None and result.tokens else None  # a row still waiting has none

    def cancel(self, key: Hashable) -> None:
        rid = self.rows.pop(key, None)
        if rid is not None:
            self.engine.cancel(rid)  # its "cancelled" result comes with the next step and is dropped there

    def __len__(self) -> int:
        return len(self.rows)


def decoder_for(model: Any, max_batch: int, prefill_chunk: int | str | None = None, reserve_slots: int = 0) -> Decoder:
    """The batched engine (a long prompt prefilled ``prefill_chunk`` tokens a step, between the decode steps
    of the running rows; ``reserve_slots``: its buffers allocated at start), or :class:`OneByOne` for a model
    the engine refuses (said in a log line)."""
    try:
        return Batched(model, max_batch, prefill_chunk=prefill_chunk, reserve_slots=reserve_slots)
    except ModelError as err:
        log.warning("decoding one request at a time: %s", err)
        return OneByOne(model, str(err))
