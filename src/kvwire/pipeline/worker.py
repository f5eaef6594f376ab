"""One agent of a pipeline in its own process: wait for the upstream handoff, take the turn, ride out store faults.

:class:`kvwire.pipeline.Pipeline` runs every agent in one process. ``kvwire agent``
runs one agent per process, on one host or several, and this module is what it
calls. The agents meet only in a shared store (``file:///dev/shm/NAME`` on one
host, ``redis://HOST:PORT/DB`` or ``redis+cluster://HOST:PORT,...`` across hosts)::

    A (round 0) --handoff--> B (round 0) --handoff--> C (round 0) --handoff--> A (round 1) ...

A :class:`Worker` takes agent ``index``'s turn in round ``r``: it finds its upstream
handoff key (:func:`upstream_of`: the previous agent in the same round; for the first
agent of round ``r > 0`` the last agent of round ``r - 1``; the first agent of round 0
has none), polls the store for it with exponential backoff (:func:`wait_for`), then
calls :meth:`kvwire.pipeline.agent.Agent.turn`, which reads the handoff, receives the cache,
generates and publishes its packet and handoff (compare-and-set: a turn is taken once).

Faults. Every store call goes through a :class:`RetryingStore`, which retries
:class:`~kvwire.errors.StoreUnavailable` and nothing else. A transient fault (the
server is down or restarting, a timeout, a cluster failing over) is logged with the
store, what the agent was doing and ``attempt k of n``, and retried after a backoff;
when the attempts run out it becomes one ``StoreUnavailable`` saying all of that.
Every other :class:`~kvwire.errors.StoreError` is raised at once, on the first
attempt: a permanent fault (:class:`~kvwire.errors.StoreAccessDenied`: a wrong
password, an ACL denial; :class:`~kvwire.errors.StoreConfigError`: a TLS certificate
that does not verify, a database the server lacks, a bad URL), a
:class:`~kvwire.errors.VersionConflict`, an :class:`~kvwire.errors.OverBudget` value.
``RetryingStore.retried`` counts the retries made. A put whose reply was lost although
the write landed is recognised on retry by its bytes, so this agent is not mistaken for
another writer.
Reading the upstream *packets* is retried the same way; if that still fails the agent
re-prefills from the handoff's token ids (event ``store-unreachable``) instead of giving
up. Nothing stored is ever half-written: every backend publishes a value atomically.

Mode ``auto``: a :class:`Worker` measures its own store's latency and bandwidth and its
own model's prefill speed once (:meth:`Worker.measure_costs`, about a second, the probes
of :mod:`kvwire.pipeline.cost`), unless its agent was given costs, and then decides for its own hop
whether to send its cache or let the next agent re-prefill the ids, as agents of an
in-process pipeline do. Each process decides with its own measurements.

Errors raised here, both in the :mod:`kvwire.errors` tree:

- :class:`~kvwire.errors.UpstreamTimeout` (a :class:`~kvwire.errors.KvwireError`): the upstream handoff
  did not appear within the timeout;
- :class:`~kvwire.errors.TurnTaken` (a :class:`~kvwire.errors.VersionConflict`): another process already
  took this agent's turn in this round of this session.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ..kv.chain import PACKETS
from .cost import CostModel, measure
from ..errors import (KvwireError, PipelineConfigError, StoreUnavailable, TurnTaken, UnknownStoreError,
                     UpstreamTimeout, VersionConflict)
from .handoff import handoff_key
from .spec import PipelineSpec
from .results import AgentResult
from ..store import Store, check_key, open_store
from ..store.base import Buffer
from ..store.redis_common import redact

if TYPE_CHECKING:  # the agent module loads transformers: a worker can reach its store and fail fast without it
    from .agent import Agent, Mode

log = logging.getLogger(__name__)

T = TypeVar("T")

WORKER_MODES: tuple[str, ...] = ("prefix", "splice", "text", "auto")  # auto: each process measures its own costs
_SESSION = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: the ``n``-th wait (from 0) is ``min(max_s, first_s * factor**n)`` seconds."""

    first_s: float = 0.25
    factor: float = 2.0
    max_s: float = 8.0

    def __post_init__(self) -> None:
        if not (self.first_s > 0 and self.factor >= 1 and self.max_s >= self.first_s):
            raise ValueError(f"bad backoff {self}: need first_s > 0, factor >= 1, max_s >= first_s")

    def delay(self, n: int) -> float:
        return min(self.max_s, self.first_s * self.factor ** min(n, 64))


@dataclass(frozen=True)
class Retry:
    """How a store call that failed with a transient fault is retried: ``retries`` more
    attempts, waiting ``backoff`` in between. The defaults (5, 0.25 s doubling) give the
    store about 8 s to come back."""

    retries: int = 5
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    @property
    def window_s(self) -> float:
        """The longest the waits between attempts add up to (each attempt's own time not counted)."""
        return sum(self.backoff.delay(n) for n in range(self.retries))


POLL = Backoff(first_s=0.02, factor=1.5, max_s=0.5)  # waiting for an upstream handoff: quick first, then calm


def retrying(url: str, doing: str, retry: Retry, call: Callable[[], T],
             on_retry: Callable[[StoreUnavailable], None] | None = None) -> T:
    """``call()``, retried per ``retry`` while it raises :class:`StoreUnavailable`.

    Each transient failure is logged (store ``url``, ``doing``, ``attempt k of n``, the
    wait) and passed to ``on_retry`` before the retry. After the last attempt one
    :class:`StoreUnavailable` names all of that and the last fault. Any other error,
    permanent faults included, is raised at once.
    """
    start = time.monotonic()
    attempt = 1
    while True:
        try:
            return call()
        except StoreUnavailable as err:
            if attempt >= retry.attempts:
                raise StoreUnavailable(
                    f"store {url} unreachable while {doing}: gave up after {retry.attempts} attempt"
                    f"{'s' if retry.attempts > 1 else ''} in {time.monotonic() - start:.1f} s: {err.message}",
                    err.hint or "check the store, then start the agent again",
                ) from err
            wait = retry.backoff.delay(attempt - 1)
            log.warning("store %s unreachable while %s (attempt %d of %d): %s - retrying in %.2g s",
                        url, doing, attempt, retry.attempts, err.message, wait)
            if on_retry is not None:
                on_retry(err)
            time.sleep(wait)
            attempt += 1


def _what(key: str) -> str:
    if key.startswith(PACKETS):
        return f"packet {key}"
    if "/handoff/" in key:
        return f"handoff {key}"
    return f"key {key}"


class RetryingStore(Store):
    """``store`` with every call retried on a transient fault (see the module docstring).

    ``retried`` counts the retries made (0 while every call succeeded, or failed permanently
    on its first attempt). Keys are checked before the first attempt, so a bad key fails at once. A put that
    raises :class:`VersionConflict` after an earlier attempt of it failed is checked
    against the store: if the key holds exactly these bytes at the version that put
    would have made, the earlier attempt landed and its version is returned.
    """

    def __init__(self, store: Store, retry: Retry | None = None) -> None:
        self.store = store
        self.retry = retry or Retry()
        self.retried = 0

    @property
    def url(self) -> str:  # type: ignore[override]
        return self.store.url

    @property
    def budget(self) -> int | None:  # type: ignore[override]
        return self.store.budget

    @property
    def evictions(self) -> int:  # type: ignore[override]
        return self.store.evictions

    def call(self, doing: str, call: Callable[[], T]) -> T:
        """``call()`` under this store's retry policy; ``doing`` names it in messages."""
        return retrying(self.url, doing, self.retry, call, self._count)

    def _count(self, _: StoreUnavailable) -> None:
        self.retried += 1

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        check_key(key)
        failed = False

        def put_once() -> int:
            nonlocal failed
            try:
                return self.store.put(key, data, expect_version=expect_version)
            except VersionConflict:
                if failed and expect_version is not None:
                    found = self.store.get_versioned(key)
                    if found is not None and found[1] == expect_version + 1 and bytes(found[0]) == bytes(data):
                        log.info("%s in %s was written by an attempt whose reply was lost", key, self.url)
                        return found[1]
                raise
            except StoreUnavailable:
                failed = True
                raise

        return self.call(f"publishing {_what(key)}", put_once)

    def get(self, key: str) -> bytes | memoryview | None:
        check_key(key)
        return self.call(f"reading {_what(key)}", lambda: self.store.get(key))

    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        check_key(key)
        return self.call(f"reading {_what(key)}", lambda: self.store.get_versioned(key))

    def exists(self, key: str) -> bool:
        check_key(key)
        return self.call(f"checking {_what(key)}", lambda: self.store.exists(key))

    def delete(self, key: str) -> bool:
        check_key(key)
        return self.call(f"deleting {_what(key)}", lambda: self.store.delete(key))

    def keys(self, prefix: str = "") -> list[str]:
        return self.call(f"listing keys {prefix}*", lambda: self.store.keys(prefix))

    @property
    def used_bytes(self) -> int:
        return self.call("reading the byte count", lambda: self.store.used_bytes)

    def close(self) -> None:
        self.store.close()


def connect(url: str, retry: Retry | None = None) -> RetryingStore:
    """Open the store at ``url`` for an agent in its own process, retrying while it is unreachable
    (a Redis server still starting, say); a permanent fault (a wrong password, a TLS certificate that
    does not verify) is raised at once. ``memory://`` is refused: no other process can reach it.
    The returned store's ``retried`` counts the retries made while connecting too."""
    retry = retry or Retry()
    if isinstance(url, str) and url.startswith("memory:"):
        raise UnknownStoreError(f"store {url} lives inside one process; agents in separate processes cannot "
                                "meet there", "use file:///dev/shm/NAME (one host) or redis://HOST:PORT/DB")
    retries: list[StoreUnavailable] = []
    store = retrying(redact(url) if isinstance(url, str) else repr(url), "connecting", retry,
                     lambda: open_store(url), retries.append)
    retrying_store = RetryingStore(store, retry)
    retrying_store.retried = len(retries)
    return retrying_store


# -- who waits for whom ----------------------------------------------------------------------------


def agent_index(spec: PipelineSpec, name: str) -> int:
    """The index of agent ``name`` in ``spec``; :class:`PipelineConfigError` listing the agents if none,
    or if the pipeline is a graph (``after``), which runs in one process (``kvwire run``)."""
    if not spec.graph.is_linear:
        raise PipelineConfigError(f"pipeline {spec.name!r} is a graph (its agents name what they read with "
                                  "'after'); kvwire agent runs chains of agents",
                                  "run graphs in one process with kvwire run")
    for index, agent in enumerate(spec.agents):
        if agent.name == name:
            return index
    raise PipelineConfigError(f"pipeline {spec.name!r} has no agent {name!r}",
                              f"its agents are {', '.join(a.name for a in spec.agents)}")


def upstream_of(spec: PipelineSpec, index: int, round: int) -> tuple[int, int] | None:
    """(agent index, round) whose handoff agent ``index`` reads in ``round``; ``None`` for the very first turn.

    With agents A, B, C: B in round 0 -> (0, 0) (A); A in round 1 -> (2, 0) (C of round 0);
    A in round 0 -> None.
    """
    if index > 0:
        return index - 1, round
    if round > 0:
        return len(spec.agents) - 1, round - 1
    return None


def upstream_key(spec: PipelineSpec, index: int, session: str, round: int) -> str | None:
    """The store key of the handoff agent ``index`` reads in ``round`` of ``session`` (see :func:`upstream_of`)."""
    upstream = upstream_of(spec, index, round)
    if upstream is None:
        return None
    up_index, up_round = upstream
    return handoff_key(session, up_index, spec.agents[up_index].name, up_round)


def resolve_mode(spec: PipelineSpec, mode: str | None) -> Mode:
    """``mode``, checked against ``spec``; ``None`` picks prefix (shared system prompt) or splice (private ones)."""
    if mode is None:
        return "prefix" if spec.shared_system else "splice"
    if mode not in WORKER_MODES:
        raise KvwireError(f"unknown mode {mode!r} for a worker", f"use one of {', '.join(WORKER_MODES)}")
    if mode in ("prefix", "auto") and not spec.shared_system:
        raise PipelineConfigError(f"pipeline {spec.name!r} gives agents private system prompts, so no "
                                  f"agent's context extends another's (mode {mode} sends prefix caches)",
                                  "use splice mode (or text)")
    return mode  # type: ignore[return-value]


def check_turn_free(store: Store, spec: PipelineSpec, index: int, session: str, round: int) -> str:
    """The key agent ``index`` will write in ``round``; :class:`TurnTaken` if it is already there.

    A cheap early check (before loading a model); the turn's own compare-and-set put
    is what guarantees a turn is taken once when two processes race.
    """
    if not isinstance(session, str) or not _SESSION.fullmatch(session):
        raise PipelineConfigError(f"session {session!r} cannot name store keys",
                                  "use 1-128 letters, digits, '.', '_' or '-', not starting with '.'")
    key = check_key(handoff_key(session, index, spec.agents[index].name, round))
    found = store.get_versioned(key)
    if found is not None:
        raise TurnTaken(key, found[1], store.url, spec.agents[index].name, round, session)
    return key


def wait_for(store: RetryingStore, key: str, timeout_s: float, *, poll: Backoff = POLL,
             upstream: str = "the upstream agent") -> float:
    """Poll ``store`` until ``key`` exists; return the seconds waited.

    Polls back off from ``poll.first_s`` to ``poll.max_s``; store faults are retried by
    ``store``. Raises :class:`UpstreamTimeout` naming the key, the store and the timeout.
    """
    check_key(key)
    start = time.monotonic()
    deadline = start + timeout_s
    polls = 0
    log.info("waiting for %s in %s (timeout %g s)", key, store.url, timeout_s)
    while not store.call(f"waiting for the upstream handoff {key}", lambda: store.store.exists(key)):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeout(f"{key} did not appear in {store.url} within {timeout_s:g} s",
                                  f"start {upstream} with the same --session and --store, or raise --timeout")
        time.sleep(min(poll.delay(polls), remaining))
        polls += 1
    return time.monotonic() - start


# -- the worker ------------------------------------------------------------------------------------


@dataclass
class TurnReport:
    """One turn taken by a :class:`Worker`: the agent's result and where it met the others."""

    result: AgentResult
    session: str
    store: str
    upstream: str | None  # the handoff key read (None for the first turn)
    handoff: str  # the handoff key written
    waited_s: float  # spent waiting for the upstream handoff (not part of the turn's total_s)
    store_retries: int = 0  # retries of transient store faults by this process so far (RetryingStore.retried)
    costs: dict[str, Any] | None = None  # mode auto: the costs this process decided with (CostModel.to_json)

    def to_json(self) -> dict[str, Any]:
        """The agent's result (:meth:`AgentResult.to_json`) with the session, keys, wait, retries and output ids."""
        return {**self.result.to_json(), "session": self.session, "store": self.store, "upstream": self.upstream,
                "handoff": self.handoff, "waited_s": self.waited_s, "store_retries": self.store_retries,
                "costs": self.costs, "output_ids": self.result.output_ids}


class Worker:
    """Takes ``agent``'s turns, each once its upstream handoff is in ``store``."""

    def __init__(self, agent: Agent, store: RetryingStore, *, timeout_s: float = 600.0, poll: Backoff = POLL) -> None:
        if agent.store is not store:
            raise ValueError("the agent must use the worker's RetryingStore, so its turns ride out faults too")
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.agent, self.store, self.timeout_s, self.poll = agent, store, timeout_s, poll

    def take_turn(self, mode: Mode, session: str, round: int = 0) -> TurnReport:
        """Wait for the upstream handoff of ``round``, then take the turn."""
        spec, index = self.agent.spec, self.agent.index
        up_key = upstream_key(spec, index, session, round)
        own_key = check_key(handoff_key(session, index, self.agent.name, round))
        waited = 0.0
        if up_key is not None:
            up_index, up_round = upstream_of(spec, index, round)  # type: ignore[misc]
            waited = wait_for(self.store, up_key, self.timeout_s, poll=self.poll,
                              upstream=f"agent {spec.agents[up_index].name} for round {up_round}")
        try:
            result, key, _ = self.agent.turn(mode, session, up_key, round=round)
        except VersionConflict as err:
            if err.key != own_key:
                raise
            raise TurnTaken(own_key, err.actual, self.store.url, self.agent.name, round, session) from None
        log.info("%s took its turn in round %d: %d context tokens, %d from cache", self.agent.name, round,
                 result.context_tokens, result.cached_tokens)
        costs = self.agent.cost.to_json() if mode == "auto" and self.agent.cost is not None else None
        return TurnReport(result, session, self.store.url, up_key, key, waited, self.store.retried, costs)

    def measure_costs(self, force: bool = False) -> CostModel:
        """This process's own costs for mode ``auto`` (its store's latency and bandwidth, its model's
        prefill speed: about a second), measured once; an agent created with ``cost=`` keeps that one."""
        if force or self.agent.cost is None:
            start = time.perf_counter()
            agent = self.agent
            agent.cost = measure(self.store, agent.model, agent.cache_spec.kv_bytes(1), spec=agent.cache_spec,
                                 options=agent.codec_options)
            even = agent.cost.break_even_tokens()
            log.info("%s measured its costs in %.1f s: store %s %.2f ms, put %.0f MB/s, get %.0f MB/s, prefill "
                     "%.0f tokens/s; a cache pays off from %s upstream tokens", agent.name,
                     time.perf_counter() - start, self.store.url, agent.cost.store.latency_s * 1000,
                     agent.cost.store.put_rate / 1e6, agent.cost.store.get_rate / 1e6, agent.cost.model.prefill_rate,
                     even if even is not None else "no number of")
        return self.agent.cost

    def run(self, mode: Mode, session: str, first_round: int = 0, rounds: int = 1) -> Iterator[TurnReport]:
        """Take the turns of rounds ``first_round .. first_round + rounds - 1``, yielding each as it is done.

        Mode ``auto`` first measures this process's costs (:meth:`measure_costs`), unless the agent has them;
        each turn then decides for its own hop whether the cache is worth sending (``result.decision``).
        """
        if rounds < 1 or first_round < 0:
            raise KvwireError(f"need rounds >= 1 and a first round >= 0, got rounds={rounds}, round={first_round}")
        if mode == "auto":
            resolve_mode(self.agent.spec, mode)
            check_turn_free(self.store, self.agent.spec, self.agent.index, session, first_round)  # before probing
            self.measure_costs()
        for round in range(first_round, first_round + rounds):
            check_turn_free(self.store, self.agent.spec, self.agent.index, session, round)
            yield self.take_turn(mode, session, round)
