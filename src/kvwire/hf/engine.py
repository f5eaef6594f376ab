"""The batched-decode engine: the one place that decodes batches.

Sequences (*rows*) join and leave between steps (continuous batching). Each row has its
own context, sampling, stopping rule and positions; rows that read the same context
(a received chain several agents share) attend to it once per step instead of holding a
copy each (shared-prefix attention, :mod:`.attention`). A server drives it step by step;
the graph runner calls :meth:`Engine.run` once per fan-out.

API::

    engine = Engine(model, max_batch=8, memory_budget=None, attention="cascade")
    shared = Prefix.from_cache(cache, ids[:n])           # or Prefix.from_packet(received.context)
    rid = engine.add(Request(ids, prefix=shared, max_new_tokens=32, sampling=Sampling(),
                             stop_ids=frozenset(), keep_logits=False, tag="critic"))
    while engine.busy:
        step = engine.step()                             # ONE forward pass: a prefill, a decode, or a
                                                         #  decode with a chunk of a long prefill ("mixed")
        step.tokens                                      # {row id: [tokens it produced this step]}
        step.finished                                    # [RowResult] of rows that left (eos, stop,
                                                         #  length, cancelled)
        step.prefill_s                                   # {row id: seconds of its prefill} (this step)
    engine.cancel(rid)                                   # frees the row at once; reported next step
    engine.finish(rid)                                   # the same, as a stop ("stop"): e.g. a stop string
    results = engine.run([Request(...), ...])            # one call: add all, step until done, in order
    engine.last_run_batch                                # most rows that run decoded in one step

    result.tokens, result.finish_reason                  # "eos" | "stop" | "length" | "cancelled"
    result.queued_s, result.prefill_s, result.ttft_s, result.decode_s, result.total_s
    result.cache(model)                                  # DynamicCache: prefix + own part (a copy)
    result.extract(spec, parent=received.head)           # == hf.extract(result.cache(model), ...),
                                                         #  without copying the shared prefix

A request's ``input_ids`` are its whole context; ``prefix`` (shared, a :class:`Prefix`)
or ``cache`` (private, a ``DynamicCache``) covers its first tokens, at positions 0..P-1.
At least one token must be left uncached: the row prefills that *suffix*, then decodes.
``first_position`` moves the suffix elsewhere (a spliced context whose positions jump).

Tensor layout: a row's *own part* -- its suffix and what it generated -- lives in a
:class:`~.attention.RowCache`, ``[rows, Hkv, capacity, D]`` per layer, written in place;
live rows are buffer rows ``0..n-1`` (a leaving row's slot is filled with the last row).
A row's own slots hold context tokens ``own_start..`` then its generated tokens except
the last (never fed back). With ``attention="cascade"`` (default) ``own_start`` is the
prefix length and the prefix is read from the caller's tensors, once per step per
prefix; ``attention="copy"`` copies the prefix into every row's own slots (own_start 0),
as batched decoding with a plain cache does -- kept for measurement.

Chunked prefill (``prefill_chunk``): a suffix longer than a chunk is prefilled a chunk a pass
while rows decode, each chunk riding in their decode step's pass -- one sequence of the
step's tokens and the chunk's, the linear layers computing them together, each part
attending to its own rows (:class:`.attention.Packed`; :mod:`.passes` runs every pass).
The running rows keep producing a token a step while a long prompt joins. With no row decoding, nothing
waits on a chunk: what is left of the prompt is prefilled in one pass (each extra pass costs a pass's fixed
cost of reading every weight: a 2,200-token prompt alone took 16 passes and 9.8 s in int8 on a 2-core EPYC,
one pass 7.7 s; BENCHMARKS section 13). On the CPU chunks
shrink as its context grows so that every pass costs what the first did (:func:`.passes.chunk_tokens`;
on an accelerator, where a pass costs about the same for any chunk, they keep their size).
``prefill_chunk="auto"`` picks the first chunk from the model's timings (:func:`.passes.auto_prefill_chunk`).

Exactness: every row's greedy tokens equal the same request decoded alone
(``hf.generate``), logits within float tolerance (tests/hf/test_engine.py, tiny models and
the default model), whatever rows join, leave or share its batch.

Kernels: every pass computes its linear layers with the product :mod:`.linears` picks for
its rows, as :func:`.generation.generate` does (four rows sharing a 1,700-token context:
63.5 -> 40.1 ms a step on a 2-core Xeon, 73.9 -> 37.2 on a 2-core AMD EPYC); where that
leaves the output layer to ``F.linear``, passes of several rows compute it in cache-sized
slices (:mod:`.head`).

Memory: ``memory_budget`` (bytes) bounds the engine's own buffers (shared prefixes belong
to their callers). A request that would push them past it waits until rows leave -- the
batch falls back to fewer rows, logged and counted in ``stats.deferred``; a request that
does not fit even alone raises :class:`~kvwire.errors.EngineError`. The buffers grow to the
longest live row's slots for every row and are dropped when the engine is idle; growing them while
rows decode pauses every row while the new pages are faulted in (a 3,000-token prompt joining four
streams: ~1 s on a 2-core VM). ``reserve_slots`` allocates ``max_batch`` rows of that many slots
when the engine starts and keeps them, as servers that preallocate their KV memory do. Models with
sliding-window layers (Gemma3) are refused (:class:`~kvwire.errors.ModelError`): decode
them one at a time with ``hf.generate``. Not thread-safe: one thread drives an engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, Literal

import torch

from ..errors import EngineError, ModelError, PacketError
from .attention import RowCache
from .cache import cache_length
from .generation import pick
from .loading import check_fits, config_spec, context_window, eos_token_ids, model_device, model_dtype
from .passes import (Pass, attention_reach, auto_prefill_chunk, chunk_tokens, decode_pass, forward, prefill_groups,
                     prefill_pass, probe)
from .rows import FinishReason, LiveRow, Prefix, Request, RowResult, Step, label

__all__ = ["Engine", "EngineStats", "FinishReason", "Prefix", "Request", "RowResult", "Step", "attention_reach",
           "auto_prefill_chunk", "check_prefill_chunk", "chunk_tokens", "generate_batch"]

log = logging.getLogger(__name__)

AttentionMode = Literal["cascade", "copy"]
_ROUND = 64  # own-buffer capacity grows in multiples of this many slots


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    max_batch: int = 0  # most rows decoded in one step
    deferred: int = 0  # admissions postponed by the memory budget

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Engine:
    """Decodes rows of ``model`` together; see the module docstring."""

    def __init__(self, model: Any, *, max_batch: int = 8, memory_budget: int | None = None,
                 attention: AttentionMode = "cascade", pad_id: int = 0,
                 prefill_chunk: int | Literal["auto"] | None = None, reserve_slots: int = 0) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if isinstance(reserve_slots, bool) or not isinstance(reserve_slots, int) or reserve_slots < 0:
            raise ValueError(f"reserve_slots must be a slot count >= 0 (0: no reservation), got {reserve_slots!r}")
        check_prefill_chunk(prefill_chunk)
        if attention not in ("cascade", "copy"):
            raise ValueError(f"attention must be 'cascade' or 'copy', got {attention!r}")
        self.model = model
        self.max_batch = max_batch
        self.memory_budget = memory_budget
        self.attention = attention
        self.pad_id = pad_id
        device, dtype = model_device(model), model_dtype(model)
        # later chunks shrink by the CPU's costs, where a token's attention over a long context costs as much as its
        # linear layers; on an accelerator a pass costs about the same for any chunk, so chunks keep their size
        self.attention_reach = attention_reach(model.config) if device.type == "cpu" else float("inf")
        spec = config_spec(model.config, dtype)
        if spec.has_sliding_window:
            raise ModelError(f"the batched engine does not support sliding-window layers ({spec.model_type})",
                             "decode this model's agents one at a time (hf.generate)")
        if prefill_chunk == "auto":  # timed on the model (~1 s on a 2-core CPU): only once it is not refused
            prefill_chunk = auto_prefill_chunk(model)
            log.debug("prefill chunk (auto, measured on this model here): %s",
                      "whole prefills" if prefill_chunk is None else f"{prefill_chunk} tokens first")
        self.prefill_chunk: int | None = prefill_chunk
        self.eos = eos_token_ids(model)
        self.vocab_size = spec.vocab_size
        self.device = device
        self.rows_cache = RowCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, device)
        self.stats = EngineStats()
        self._ids = count()
        self._pending: list[LiveRow] = []
        self._active: list[LiveRow] = []  # buffer row i holds _active[i]
        self._finished: list[RowResult] = []
        self._deferring = False
        self.last_run_batch = 0  # most rows one decode step of the last run() held (max_batch and the budget bound it)
        if reserve_slots:
            self._reserve(reserve_slots)
        else:
            self.rows_cache.grow(1, _ROUND, 0)
        probe(self.model, self.rows_cache)

    def _reserve(self, slots: int) -> None:
        """Allocate ``max_batch`` rows of ``slots`` (rounded up) now and keep them (``reserve_slots``), refused past
        the model's window or over the memory budget."""
        window = context_window(self.model)
        if window is not None and slots > window:
            raise EngineError(f"reserve_slots {slots:,} is past the model's context window of {window:,} tokens",
                              f"reserve at most {window:,} slots a row")
        capacity = _rounded(slots)
        need = self.rows_cache.nbytes_for(self.max_batch, capacity)
        if self.memory_budget is not None and need > self.memory_budget:
            raise EngineError(f"reserving {self.max_batch} rows of {capacity:,} slots needs {need:,} bytes, over the "
                              f"engine's memory budget of {self.memory_budget:,}",
                              "reserve fewer slots or rows, or raise the budget")
        self.rows_cache.reserve(self.max_batch, capacity)

    # -- the API a server drives ---------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Rows are waiting or decoding, or results are waiting to be reported."""
        return bool(self._pending or self._active or self._finished)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def active(self) -> int:
        return len(self._active)

    def add(self, request: Request) -> int:
        """Queue a request; it joins the batch at a coming step. Returns its row id."""
        row = self._row(request)
        self._pending.append(row)
        return row.id

    def cancel(self, row_id: int) -> bool:
        """End a row now (pending or decoding; e.g. its client went away). Its result (``cancelled``)
        comes with the next step; a row that was decoding keeps its K/V (``RowResult.extract`` works).
        Returns whether the row was still there."""
        return self._end(row_id, "cancelled")

    def finish(self, row_id: int) -> bool:
        """End a decoding row now as if it had produced a stop id (``finish_reason="stop"``), keeping its
        K/V -- for stops a caller detects itself, e.g. a stop *string* in the decoded text. Its result
        comes with the next step. A row still waiting ends without tokens. Returns whether it was there."""
        return self._end(row_id, "stop")

    def take_result(self, row_id: int) -> RowResult | None:
        """The result of a row that has ended (``cancel`` / ``finish``) now, instead of with the next
        step (which then no longer reports it); ``None`` if the engine holds no result for that row."""
        for index, result in enumerate(self._finished):
            if result.id == row_id:
                return self._finished.pop(index)
        return None

    @torch.inference_mode()
    def _end(self, row_id: int, reason: FinishReason) -> bool:
        for row in self._pending:
            if row.id == row_id:
                self._pending.remove(row)
                self._finished.append(self._result(row, reason, keep_kv=False))
                return True
        for index, row in enumerate(self._active):
            if row.id == row_id:
                self._leave(index, reason)
                return True
        return False

    @torch.inference_mode()
    def step(self) -> Step:
        """One forward pass: the prefill of the waiting rows that fit; else the running rows' decode step,
        packed with the next chunk of every long prompt being prefilled (``prefill_chunk``)."""
        start = time.perf_counter()
        admitted = self._admit()
        whole = [row for row in admitted if not self._chunked(row)]  # a long suffix starts with the next pass
        tokens: dict[int, list[int]] = {}
        prefill_s: dict[int, float] = {}
        chunking = [row for row in self._active if row.prefilling and row not in whole]
        decodable = len(self._active) - len(chunking) - len(whole)
        if whole:
            kind, batch = "prefill", len(whole)
            for group in prefill_groups(whole):
                self._isolated(self._prefill, group, tokens, "a prefill")
        elif chunking and decodable:
            # the running rows keep producing a token a step while a long prompt joins: one pass carries
            # their decode step and its next chunk (the weights are read once for both)
            kind, batch = "mixed", decodable
            self._mixed(chunking, tokens)
        elif chunking:  # nothing decodes, so nothing waits on a chunk: the rest of each prompt in one pass
            kind, batch = "prefill", len(chunking)
            for row in chunking:
                self._isolated(self._prefill_rest, [row], tokens, "a prefill")
        elif self._active:
            kind, batch = "decode", decodable
            self._isolated(self._decode_rows, list(self._active), tokens, "a decode step")
        else:
            kind, batch = "idle", 0
        if kind != "idle":
            prefill_s.update((row.id, row.prefill_s) for row in whole + chunking if not row.prefilling)
            self._sweep()  # only now: a leaving row's place is taken by the last row, whose pass is done
            self.stats.steps += 1
            self.stats.prefill_steps += kind != "decode"
        if kind in ("decode", "mixed"):
            self.stats.decode_steps += 1
            self.stats.decode_tokens += batch
            self.stats.decode_s += time.perf_counter() - start
            self.stats.max_batch = max(self.stats.max_batch, batch)
        if not self._active and not self._pending:
            self.rows_cache.release()  # an idle engine holds no buffers beyond its reservation
        finished, self._finished = self._finished, []
        return Step(kind, batch, tokens, finished, time.perf_counter() - start, prefill_s)

    def run(self, requests: Sequence[Request]) -> list[RowResult]:
        """Decode ``requests`` together (as many at a time as fit) and return their results in order."""
        if self.busy:
            raise EngineError("Engine.run needs an idle engine", "drive a busy engine with add/step instead")
        ids = [self.add(request) for request in requests]
        results: dict[int, RowResult] = {}
        self.last_run_batch = 0
        while self.busy:
            step = self.step()
            if step.kind == "idle" and self._pending and not self._active:
                raise EngineError(f"{len(self._pending)} request(s) cannot be admitted under the memory budget")
            if step.kind in ("decode", "mixed"):
                self.last_run_batch = max(self.last_run_batch, step.batch)
            for result in step.finished:
                results[result.id] = result
        return [results[i] for i in ids]

    # -- joining -------------------------------------------------------------------------------

    def _row(self, request: Request) -> LiveRow:
        context = [int(t) for t in request.input_ids]
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if request.prefix is not None and request.cache is not None:
            raise PacketError("give a request a shared prefix or a private cache, not both")
        prefix = request.prefix
        if request.cache is not None:  # a private prefix: read in place like a shared one, never copied
            prefix = Prefix.from_cache(request.cache, context[: cache_length(request.cache)])
        cached = prefix.length if prefix is not None else 0
        if cached >= len(context):
            raise PacketError(f"the prefix covers {cached} tokens but the context has {len(context)}",
                              "leave at least one context token uncached")
        if prefix is not None and tuple(context[:cached]) != prefix.token_ids:
            raise PacketError("the request's input_ids do not start with its prefix's token ids")
        if min(context) < 0 or max(context) >= self.vocab_size:
            raise PacketError(f"token ids must be in [0, {self.vocab_size})")
        own_start = cached if self.attention == "cascade" else 0
        sampling = request.sampling
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
        first = cached if request.first_position is None else request.first_position
        if first < cached:
            raise PacketError(f"first_position {first} would overlap the {cached} cached tokens")
        check_fits(self.model, first + len(context) - cached + request.max_new_tokens,
                   f"a context of {len(context):,} tokens"
                   + (f" (placed from position {first:,})" if first != cached else "")
                   + f" plus {request.max_new_tokens} new tokens")
        row = LiveRow(next(self._ids), request, prefix, context, cached, own_start, context[cached:], first,
                   self.eos if request.eos_ids is None else request.eos_ids, time.perf_counter(), generator)
        alone = self.rows_cache.nbytes_for(1, _rounded(row.capacity_needed))
        if self.memory_budget is not None and alone > self.memory_budget:
            raise EngineError(f"one row of {row.capacity_needed} slots needs {alone:,} bytes, over the engine's "
                              f"memory budget of {self.memory_budget:,}",
                              "raise the budget, share the context as a prefix, or lower max_new_tokens")
        return row

    def _admit(self) -> list[LiveRow]:
        """Move the waiting rows that fit (places, memory budget) into the batch; allocate their slots."""
        admitted: list[LiveRow] = []
        if not self._active and self._pending:
            self.rows_cache.release()  # nothing live: size the buffers afresh for what waits
        capacity = max([r.capacity_needed for r in self._active] or [0])
        for row in list(self._pending):
            live = len(self._active) + len(admitted)
            if live >= self.max_batch:
                break
            need_capacity = max(capacity, row.capacity_needed)
            rows, cap = self._allocation(live + 1, need_capacity)
            if self.memory_budget is not None and self.rows_cache.nbytes_for(rows, cap) > self.memory_budget:
                self.stats.deferred += 1
                if not self._deferring:
                    log.info("memory budget %s bytes: decoding %d rows at once, %d waiting (smaller batches)",
                             f"{self.memory_budget:,}", live, len(self._pending) - len(admitted))
                self._deferring = True
                break
            admitted.append(row)
            capacity = need_capacity
            self._pending.remove(row)
        else:
            self._deferring = False
        if admitted:
            admitted.sort(key=lambda r: (r.start_slot, len(r.suffix)))  # similar lengths prefill together
            live = len(self._active)
            rows, cap = self._allocation(live + len(admitted), capacity)
            self.rows_cache.grow(rows, cap, live)
            now = time.perf_counter()
            for row in admitted:
                row.admitted = now
                if row.prefix is not None and row.own_start == 0:  # copy mode: each row gets a copy of the prefix
                    self.rows_cache.write_row(len(self._active), list(row.prefix.keys), list(row.prefix.values))
                row.own_length = row.start_slot
                self._active.append(row)
        return admitted

    def _allocation(self, rows: int, capacity: int) -> tuple[int, int]:
        """Rows and slots the buffers would have for ``rows`` live rows of ``capacity`` slots (grown, never shrunk
        while rows live; doubled rows up to ``max_batch`` unless a budget is set)."""
        if self.memory_budget is None:
            rows = min(self.max_batch, max(rows, 2 * self.rows_cache.rows))
        return max(rows, self.rows_cache.rows), max(_rounded(capacity), self.rows_cache.capacity)

    # -- forward passes ------------------------------------------------------------------------

    def _chunked(self, row: LiveRow) -> bool:
        """Its suffix is prefilled a chunk a pass (longer than ``prefill_chunk``)."""
        return self.prefill_chunk is not None and len(row.suffix) > self.prefill_chunk

    def _chunk(self, row: LiveRow) -> int:
        """How many of ``row``'s suffix tokens its next prefill pass takes: all, or the next chunk."""
        if not self._chunked(row):
            return len(row.suffix)
        return chunk_tokens(self.prefill_chunk, row.cached + row.done, self.attention_reach)

    def _prefill(self, group: list[LiveRow], tokens: dict[int, list[int]]) -> None:
        """Prefill the rest of the suffixes of ``group`` (buffer rows in a block, at the same slot) in one
        forward pass -- or, with ``prefill_chunk``, the next chunk of each; a row whose suffix is then all
        prefilled produces its first token."""
        start = time.perf_counter()
        part, pieces = self._prefill_pass(group)
        (logits,) = self._forward([part])
        self._prefilled(group, pieces, logits, time.perf_counter() - start, tokens)

    def _prefill_rest(self, group: list[LiveRow], tokens: dict[int, list[int]]) -> None:
        """Prefill all that is left of the suffixes of ``group`` in one forward pass, chunks or not."""
        start = time.perf_counter()
        part, pieces = self._prefill_pass(group, rest=True)
        (logits,) = self._forward([part])
        self._prefilled(group, pieces, logits, time.perf_counter() - start, tokens)

    def _prefill_pass(self, group: list[LiveRow], rest: bool = False) -> tuple[Pass, list[list[int]]]:
        """The forward pass that prefills the next piece of each row of ``group`` (``rest``: all that is left),
        and the pieces."""
        pieces = [row.suffix[row.done:] if rest else row.suffix[row.done:row.done + self._chunk(row)]
                  for row in group]
        return prefill_pass(group, pieces, self._active.index(group[0]), self.pad_id), pieces

    def _prefilled(self, group: list[LiveRow], pieces: list[list[int]], logits: torch.Tensor, seconds: float,
                   tokens: dict[int, list[int]]) -> None:
        """Book a prefill pass's pieces; a row whose suffix is now all prefilled emits its first token."""
        last = torch.tensor([len(piece) for piece in pieces]) - 1
        picked = logits[torch.arange(len(group)), torch.searchsorted(torch.unique(last), last)]  # [b, V]
        for i, row in enumerate(group):
            row.prefill_s += seconds
            row.done += len(pieces[i])
            row.own_length = row.start_slot + row.done
            if not row.prefilling:  # its last piece: the logits of its last context token
                row.first_logits = picked[i].float().cpu()
                self._emit(row, picked[i], tokens)
                row.first_token_at = time.perf_counter()

    def _isolated(self, forward: Any, rows: list[LiveRow], tokens: dict[int, list[int]], what: str) -> None:
        """``forward(rows, tokens)``; if the pass raises, each row again alone, so that only the row whose
        own work fails leaves (``finish_reason="error"``) and the others go on with their tokens."""
        try:
            forward(rows, tokens)
            return
        except Exception as err:  # noqa: BLE001 -- one row's fault must not end the others
            if len(rows) == 1:
                rows[0].error = err
                log.warning("%s of row %s failed, it alone ends: %s", what, label(rows[0]), err)
                return
            log.warning("%s of %d rows failed (%s): retrying row by row to find the culprit", what, len(rows), err)
        for row in rows:
            try:
                forward([row], tokens)
            except Exception as err:  # noqa: BLE001
                row.error = err
                log.warning("%s of row %s failed alone too, it ends: %s", what, label(row), err)

    def _mixed(self, chunking: list[LiveRow], tokens: dict[int, list[int]]) -> None:
        """One packed pass: the decode step of every live row (``chunking`` ones ride along, their output
        dropped) and the next chunk of each ``chunking`` row, which overwrites the slot its ride wrote. If it
        raises, the same work runs apart, each part isolated, to find the culprit."""
        start = time.perf_counter()
        rows = list(self._active)
        try:
            step = self._decode_pass(rows)
            chunks = [self._prefill_pass([row]) for row in chunking]
            logits = self._forward([step] + [part for part, _ in chunks])
        except Exception as err:  # noqa: BLE001 -- one row's fault must not end the others
            log.warning("a decode step with %d prefill chunk(s) failed (%s): running them apart to find the "
                        "culprit", len(chunking), err)
            self._isolated(self._decode_rows, rows, tokens, "a decode step")
            for row in chunking:
                self._isolated(self._prefill, [row], tokens, "a prefill")
            return
        seconds = time.perf_counter() - start
        self._decoded(rows, logits[0][:, -1], tokens)
        for row, (_, pieces), row_logits in zip(chunking, chunks, logits[1:]):
            self._prefilled([row], pieces, row_logits, seconds, tokens)

    def _decode_rows(self, rows: list[LiveRow], tokens: dict[int, list[int]]) -> None:
        """One decode step of ``rows``: all live rows (buffer rows 0..n-1), or one of them alone."""
        if len(rows) == 1 and rows[0].prefilling:
            return
        (logits,) = self._forward([self._decode_pass(rows)])
        self._decoded(rows, logits[:, -1], tokens)

    def _decode_pass(self, rows: list[LiveRow]) -> Pass:
        """The decode step of ``rows`` (all live rows, or one of them) as a forward pass."""
        return decode_pass(rows, self._active.index(rows[0]) if len(rows) == 1 else 0, self.pad_id)

    def _decoded(self, rows: list[LiveRow], logits: torch.Tensor, tokens: dict[int, list[int]]) -> None:
        """Book a decode step: each row (but riders) takes its slot and emits its token from ``logits[i]``."""
        for i, row in enumerate(rows):
            if row.prefilling:
                continue
            row.own_length += 1
            row.steps += 1
            self._emit(row, logits[i], tokens)

    def _forward(self, parts: list[Pass]) -> list[torch.Tensor]:
        """Each part's logits ``[b, kept, V]`` from one forward pass (:func:`.passes.forward`)."""
        return forward(self.model, self.rows_cache, parts)

    # -- tokens and leaving --------------------------------------------------------------------

    def _emit(self, row: LiveRow, logits: torch.Tensor, tokens: dict[int, list[int]]) -> None:
        logits = logits.float()
        try:
            token = pick(logits, row.request.sampling, row.generator)
        except Exception as err:  # noqa: BLE001 -- its own sampling failed: it alone ends
            row.error = err
            log.warning("picking a token for row %s failed, it alone ends: %s", label(row), err)
            return
        if row.request.keep_logits:
            row.logits.append(logits.cpu())
        row.tokens.append(token)
        tokens.setdefault(row.id, []).append(token)

    def _sweep(self) -> None:
        """Let every row that is done leave the batch."""
        for index in range(len(self._active) - 1, -1, -1):
            row = self._active[index]
            reason: FinishReason | None = None
            if row.error is None and row.prefilling:
                continue  # a chunked prefill under way
            if row.error is not None or not row.tokens:
                reason = "error"
            elif (token := row.tokens[-1]) in row.eos:
                reason = "eos"
            elif token in row.request.stop_ids:
                reason = "stop"
            elif len(row.tokens) >= row.request.max_new_tokens:
                reason = "length"
            if reason is not None:
                self._leave(index, reason)

    def _leave(self, index: int, reason: FinishReason) -> None:
        row = self._active[index]
        self._finished.append(self._result(row, reason, keep_kv=reason != "error", buffer_row=index))
        last = len(self._active) - 1
        if index != last:  # keep live rows in buffer rows 0..n-1: the last one takes this place
            self.rows_cache.move_row(last, index, self._active[last].own_length)
            self._active[index] = self._active[last]
        self._active.pop()

    def _result(self, row: LiveRow, reason: FinishReason, keep_kv: bool, buffer_row: int = 0) -> RowResult:
        if keep_kv and row.own_length:
            keys, values = self.rows_cache.row_kv(buffer_row, row.own_length)
            return row.result(reason, tuple(keys), tuple(values))
        return row.result(reason, (), ())


def check_prefill_chunk(value: Any) -> None:
    """``ValueError`` unless ``value`` is a token count >= 1, ``"auto"`` or ``None`` (whole prefills)."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"prefill_chunk must be a token count >= 1, 'auto' (measured on the model) or None (whole "
                         f"prefills), got {value!r}")


def generate_batch(model: Any, requests: Sequence[Request], **engine_options: Any) -> list[RowResult]:
    """Decode ``requests`` together in a fresh :class:`Engine` (the graph runner's fan-out)."""
    return Engine(model, **engine_options).run(requests)


def _rounded(slots: int) -> int:
    return -(-slots // _ROUND) * _ROUND
