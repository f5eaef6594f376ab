"""Continuous batching: requests join and leave the batch between decode steps.

A request's lifetime, stage by stage, on the thread each stage belongs to::

    submit (caller)  --queue-->  find (I/O thread: store lookups)  --ready-->
    admit (model thread: splice, prefill, join the batch)  -->  decode steps, shared with every running
    request (model thread)  -->  finish: leave the batch  -->  publish (I/O thread)  -->  Done

The model thread is the only one that runs the model; the I/O thread is the only one
that touches the store (lookups and publishes in arrival order, so a request sent
after another one's answer always finds what that one published). Callers (the
HTTP layer) are never blocked: they submit a :class:`Job` with a ``sink`` and get
:class:`Text`, then one :class:`Done` or :class:`Failed`, delivered through it
from these threads.

Admission is bounded: ``max_batch`` sequences decode together and ``max_queue``
more may wait; :meth:`Scheduler.submit` raises :class:`~kvwire.errors.QueueFull`
beyond that. :meth:`Scheduler.cancel` (a client gone) takes a request out of the
batch before the next decode step, or out of the queue, and frees its slot.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import hf
from ..errors import QueueFull, ServerUnavailable
from .config import ServeConfig
from .generator import Decoder, Kv, Row
from .metrics import Metrics
from .prompt import MessageSpan
from .reuse import Found, Prepared, Reuse

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Params:
    """A validated request, as token ids and limits."""

    messages: list[dict[str, str]]
    ids: list[int]
    max_tokens: int
    sampling: hf.Sampling
    stops: tuple[str, ...] = ()
    ignore_eos: bool = False
    namespace: str = ""  # whose caches it may read and writes (kvwire.serve.tenancy): "" is the store's root


@dataclass(frozen=True)
class Text:
    """New text of the completion (never a partial stop string or a partial UTF-8 character)."""

    text: str


@dataclass(frozen=True)
class Served:
    """Where the prompt's K/V came from (see :class:`kvwire.serve.schemas.KvwireUsage`)."""

    prefix_tokens: int = 0
    spliced_tokens: int = 0
    recomputed_tokens: int = 0
    prefilled_tokens: int = 0  # computed for this request: the prompt less the cached tokens
    rebuilds: tuple[str, ...] = ()
    store: str = "ok"
    splice: str = ""  # earlier completions found in the messages: spliced or prefilled, and why
    staleness: tuple[float | None, ...] = ()  # per spliced segment: how far its recomputed share's K/V moved
    guarded_tokens: int = 0  # spliced tokens the fidelity guard recomputed

    @property
    def cached_tokens(self) -> int:
        return self.prefix_tokens + self.spliced_tokens


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (eos or a stop string) or "length"
    content: str
    prompt_tokens: int
    completion_tokens: int
    served: Served
    ttft_s: float
    total_s: float


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Text | Done | Failed


@dataclass(eq=False)
class Job:
    """One request inside the scheduler."""

    id: str
    params: Params
    sink: Callable[[Event], None]
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    found: Found | None = None
    prepared: Prepared | None = None
    prompt_ids: list[int] = field(default_factory=list)  # the ids decoded from (spliced requests: piecewise)
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the completion so far (stop strings cut)
    sent: int = 0  # characters of text already delivered
    first_token_at: float | None = None
    completion: tuple[list[int], str] | None = None  # (content ids, text) once finished, unless a stop string cut it
    prefill_s: float = 0.0  # the step in which its prompt was prefilled
    inputs: list[MessageSpan] = field(default_factory=list)  # --splice: its user messages, published as segments


class Scheduler:
    """Runs :class:`Job` s on a :class:`Decoder` (model thread) with a :class:`Reuse` (I/O thread)."""

    def __init__(self, config: ServeConfig, tokenizer: Any, eos_ids: frozenset[int], decoder: Decoder,
                 reuse: Reuse, metrics: Metrics, lookup: Callable[[Job], None]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.decoder = decoder
        self.reuse = reuse
        self.metrics = metrics
        self.lookup = lookup  # I/O thread: sets job.prompt_ids and job.found
        self._lock = threading.Condition()
        self._ready: collections.deque[Job] = collections.deque()
        self._running: dict[str, Job] = {}
        self._in_flight = 0  # submitted and not yet finished, failed or cancelled
        self._io: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._stopping = False
        self._aborted: str | None = None  # set by abort(): new requests are refused with this reason
        self._draining: float | None = None  # set by drain(): the grace period's end (monotonic); new ones 503
        self._seconds_per_token: float | None = None  # measured prefill speed, for "prefill seconds saved"
        self._ids = itertools.count()
        self._threads = [threading.Thread(target=self._model_loop, name="kvwire-model", daemon=True),
                         threading.Thread(target=self._io_loop, name="kvwire-io", daemon=True)]

    def start(self) -> Scheduler:
        for thread in self._threads:
            thread.start()
        return self

    # -- the caller's side -------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return max(0, self._in_flight - len(self._running))

    def submit(self, params: Params, sink: Callable[[Event], None]) -> Job:
        """Queue a request; :class:`QueueFull` if every slot and queue place is taken."""
        with self._lock:
            if self._draining is not None:
                raise ServerUnavailable("the server is shutting down and finishing the requests it has",
                                        "retry on another server, or after Retry-After seconds",
                                        retry_after_s=max(1, int(self._draining - time.monotonic()) + 1))
            if self._stopping or self._aborted or not self._threads[0].is_alive():
                raise ServerUnavailable(self._aborted or "the server is shutting down", "retry on another server")
            capacity = self.config.max_batch + self.config.max_queue
            if self._in_flight >= capacity:
                raise QueueFull(f"{self._in_flight} requests in flight, the limit is {capacity} "
                                f"({self.config.max_batch} decoding, {self.config.max_queue} waiting)",
                                "retry after the Retry-After seconds", retry_after_s=self._retry_after())
            self._in_flight += 1
            job = Job(f"chatcmpl-{next(self._ids)}-{time.time_ns() % 10**9:09d}", params, sink)
            self._gauges()
        self._io.put(lambda: self._find(job))
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job wherever it is; its slot is free before the next step."""
        with self._lock:
            if job.cancelled:
                return
            job.cancelled = True
            self._lock.notify_all()

    @property
    def draining(self) -> bool:
        """Whether a shutdown began: new requests are refused (503) while the running ones finish."""
        return self._draining is not None

    def drain(self, grace_s: float) -> bool:
        """Refuse new requests (503 with Retry-After) and wait up to ``grace_s`` for those in flight to
        finish; the ones still running then are ended with an error (:meth:`abort`). Returns whether all
        finished in time. For a shutdown (SIGTERM)."""
        deadline = time.monotonic() + grace_s
        with self._lock:
            self._draining = deadline
            while self._in_flight and time.monotonic() < deadline:
                self._lock.wait(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
            done = self._in_flight == 0
        if not done:
            log.warning("the shutdown grace of %g s is over: ending %d request(s) still running", grace_s,
                        self.abort("the server is shutting down"))
        return done

    def abort(self, reason: str) -> int:
        """End every request waiting or decoding now with :class:`ServerUnavailable` (``reason``), so that
        a stream's client reads why it ended; refuse new ones. For a shutdown whose grace period is running
        out. Returns how many requests were ended."""
        with self._lock:
            self._aborted = reason
            jobs = [job for job in list(self._ready) + list(self._running.values()) if not job.cancelled]
            for job in jobs:
                job.cancelled = True  # the model loop drops it before its next step and frees its slot
            self._lock.notify_all()
        for job in jobs:
            self._emit(job, Failed(self._unavailable()))
        return len(jobs)

    def _unavailable(self) -> ServerUnavailable:
        return ServerUnavailable(self._aborted or "the server is shutting down",
                                 "retry on another server, or once it is back")

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._io.put(None)
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=30)
        for job in list(self._ready) + list(self._running.values()):
            self._emit(job, Failed(ServerUnavailable("the server shut down before the request finished")))

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free: the remaining tokens of the running request closest to finishing,
        at ~10 tokens/s (1..60)."""
        remaining = [j.params.max_tokens - len(j.tokens) for j in self._running.values()]
        return max(1, min(60, min(remaining, default=10) // 10))

    def _gauges(self) -> None:
        self.metrics.running.set(len(self._running))
        self.metrics.waiting.set(self.waiting)

    def _release(self, job: Job) -> None:
        with self._lock:
            self._running.pop(job.id, None)
            self._in_flight -= 1
            self._gauges()
            self._lock.notify_all()  # a drain waits for the last one

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    # -- I/O thread --------------------------------------------------------------------------------

    def _io_loop(self) -> None:
        while (task := self._io.get()) is not None:
            try:
                on_a_passing_thread(task)  # its torch work leaves no OpenMP pool behind
            except Exception:  # a bug in one task must not stop lookups and publishes for everyone
                log.exception("I/O task failed")

    def _find(self, job: Job) -> None:
        if job.cancelled:
            self._cancelled(job)
            return
        try:
            self.lookup(job)
        except Exception as err:
            log.exception("looking up %s failed", job.id)
            self._fail(job, err)
            return
        with self._lock:
            aborted = self._aborted is not None
            if not aborted:
                self._ready.append(job)
                self._lock.notify_all()
        if aborted:  # it was being looked up when abort() ran
            self._fail(job, self._unavailable())

    def _publish(self, job: Job, kv: Kv | None, done: Done) -> None:
        try:
            if kv is not None and job.found is not None and job.prepared is not None:
                self.reuse.publish(kv, job.prompt_ids, job.tokens, job.found, job.prepared, job.completion,
                                   namespace=job.params.namespace, inputs=job.inputs)
        except Exception:  # publishing is best effort: the answer stands
            log.exception("publishing %s failed", job.id)
        self._release(job)
        self._emit(job, done)

    # -- model thread ------------------------------------------------------------------------------

    def _model_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._ready and not self._running:
                    self._lock.wait()
                if self._stopping:
                    return
                cancelled = [j for j in self._running.values() if j.cancelled]
                dropped = [j for j in self._ready if j.cancelled]
                for job in dropped:
                    self._ready.remove(job)
                admit = []
                while self._ready and len(self._running) - len(cancelled) + len(admit) < self.config.max_batch:
                    admit.append(self._ready.popleft())
            for job in cancelled:
                self.decoder.cancel(job.id)
                self._cancelled(job)
            for job in dropped:
                self._cancelled(job)
            for job in admit:
                if job.cancelled:
                    self._cancelled(job)
                else:
                    self._admit(job)
            if self._running:
                self._step()

    def _admit(self, job: Job) -> None:
        """Build the job's starting cache (splicing runs the model) and queue it in the decoder."""
        try:
            job.prepared = prepared = self.reuse.prepare(job.found, job.prompt_ids)
            params = job.params
            self.decoder.add(job.id, Row(job.prompt_ids, prepared.context, prepared.cache, params.max_tokens,
                                         params.sampling, frozenset() if params.ignore_eos else self.eos_ids))
        except Exception as err:
            log.exception("preparing %s failed", job.id)
            self.decoder.cancel(job.id)
            self._fail(job, err)
            return
        with self._lock:
            self._running[job.id] = job
            self._gauges()

    def _step(self) -> None:
        self.metrics.batch.observe(len(self._running))
        start = time.perf_counter()
        try:
            produced, finished = self.decoder.step()  # a row whose own work raises ends alone ("error")
        except Exception as err:  # a fault outside any one row: the batch is in an unknown state, start afresh
            log.exception("a decode step failed")
            for job in list(self._running.values()):
                self.decoder.cancel(job.id)
                self._fail(job, err)
            return
        for key in {**produced, **finished}:
            job = self._running.get(key)
            if job is None or job.cancelled:
                continue
            end = finished.get(key)
            if end is not None and end.reason == "error":  # its own work failed; the others go on
                log.error("request %s failed alone: %r", job.id, end.error)
                self._fail(job, end.error or RuntimeError("the request's decoding failed"))
                continue
            cut = False
            if job.first_token_at is None and produced.get(key):
                job.prefill_s = time.perf_counter() - start  # the forward pass its prefill was part of
            for token in produced.get(key, []):
                cut = self._token(job, token, final=end is not None)
                if cut:
                    break
            if cut:
                self._finish(job, "stop", end.kv if end is not None else self.decoder.finish(key))
            elif end is not None:
                self._finish(job, "length" if end.reason == "length" else "stop", end.kv)

    def _token(self, job: Job, token: int, *, final: bool) -> bool:
        """Take one generated token and deliver new text; True if a stop string ends the job here."""
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.ttft.observe(now - job.arrival)
            self._measure_prefill(job)
        job.tokens.append(token)
        eos = token in self.eos_ids and not job.params.ignore_eos
        text = self.tokenizer.decode(job.tokens[:-1] if eos else job.tokens, skip_special_tokens=True)
        stops = job.params.stops
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text, final = text[:cut], True
        elif final:  # the text is exactly these ids (a stop string would cut it mid-token)
            ids = job.tokens[:-1] if eos else list(job.tokens)
            if text.endswith("\ufffd"):  # cut inside a character (max_tokens): end at the last whole one
                ids, text = hf.whole_characters(self.tokenizer, ids, text)
            job.completion = (ids, text)
        job.text = text
        # hold back what could still become a stop string, and an incomplete UTF-8 character
        safe = len(text) if final else len(text) - max((len(s) - 1 for s in stops), default=0)
        if not final and text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe > job.sent:
            self._emit(job, Text(text[job.sent:safe]))
            job.sent = safe
        return cut >= 0

    def _measure_prefill(self, job: Job) -> None:
        """Seconds per prefilled token, for the "prefill seconds saved" estimate (a moving average)."""
        prefilled = len(job.prompt_ids) - job.prepared.prefix - job.prepared.spliced
        if prefilled >= 16:
            rate = job.prefill_s / prefilled
            self._seconds_per_token = rate if self._seconds_per_token is None else \
                0.8 * self._seconds_per_token + 0.2 * rate

    def _finish(self, job: Job, reason: str, kv: Kv | None) -> None:
        with self._lock:
            self._running.pop(job.id, None)  # out of the batch now; its place counts until published
            self._gauges()
        now = time.perf_counter()
        prepared, found = job.prepared, job.found
        served = Served(prepared.prefix, prepared.spliced, prepared.recomputed,
                        len(job.prompt_ids) - prepared.prefix - prepared.spliced,
                        tuple(found.events), found.store, prepared.splice, prepared.staleness, prepared.guarded)
        done = Done(reason, job.text, len(job.prompt_ids), len(job.tokens), served,
                    (job.first_token_at or now) - job.arrival, now - job.arrival)
        m = self.metrics
        m.prompt_tokens.inc(done.prompt_tokens)
        m.generation_tokens.inc(done.completion_tokens)
        m.success.labels(finished_reason=reason).inc()
        m.e2e.observe(done.total_s)
        m.cached.inc(served.cached_tokens)
        m.spliced.inc(served.spliced_tokens)
        m.recomputed.inc(served.recomputed_tokens)
        if self._seconds_per_token is not None:
            m.saved.inc(served.cached_tokens * self._seconds_per_token)
        if self.config.reuse:
            self._io.put(lambda: self._publish(job, kv, done))
        else:
            self._release(job)
            self._emit(job, done)

    def _cancelled(self, job: Job) -> None:
        self.metrics.cancelled.inc()
        self._release(job)

    def _fail(self, job: Job, error: BaseException) -> None:
        self._release(job)
        self._emit(job, Failed(error))


def on_a_passing_thread(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` on a thread that ends with it, its result or exception handed back.

    Why: OpenMP gives each thread that runs parallel torch work a pool of worker threads for
    as long as that thread lives. Loading the model on the main thread, or slicing and
    encoding K/V on the I/O thread, would leave such pools beside the model thread's own;
    with more OpenMP threads than cores, libgomp stops its workers spinning and every op of
    every decode step pays a wake-up -- measured here: one request decoded at 14 tokens/s
    instead of 22 on 2 cores. Work done on a thread that ends takes its pool with it; so
    the model is loaded, and every I/O task runs, on a passing thread (~0.1 ms each).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call(*args)
        except BaseException as error:  # noqa: BLE001 -- re-raised on the caller's thread
            box["error"] = error

    thread = threading.Thread(target=run, name="kvwire-passing")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
