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

Faults. Every store call goes through a :class:`~kvwire.store.retrying.RetryingStore`
(:mod:`kvwire.store.retrying`: the one store-fault policy, the server's too), which retries
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

Mode ``auto``: a :class:`Worker` measures nothing before a turn (:mod:`kvwire.pipeline.rates`). Each
turn's own prefill measures the model (recognised as contended when the process got less than its
threads' CPU time, and then never the host's figure); the store's latency and rates come from
:mod:`kvwire.pipeline.probe` -- another agent's result on the same host if the store holds a fresh one,
else a probe bounded in time (300 ms by default), serialized with the other agents' probes -- and the
codec's from a thread started beside the model's loading (:class:`~kvwire.pipeline.rates.Background`);
clean rates are shared with the host's other agents through the store; what is not known yet comes
from priors, and every decision says which figure came from where. Each turn's real packet traffic
refines the store's estimate (passive measurement) before the turn decides for its own hop whether to
send its cache or let the next agent re-prefill the ids. An agent given costs (``--costs``) keeps them;
:meth:`Worker.measure_costs` still measures everything at once, for a caller that wants that.

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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cost import CostModel, probe_model
from . import probe as probing
from . import rates
from ..errors import (KvwireError, PipelineConfigError, StoreUnavailable, TurnTaken, UnknownStoreError,
                     UpstreamTimeout, VersionConflict)
from .handoff import handoff_key
from .spec import PipelineSpec
from .results import AgentResult
from ..store import Store, check_key, open_store
from ..store.redis_common import redact
from ..store.scoped import scoped
from ..store.retrying import Backoff, Retry, RetryingStore, retrying  # the policy's home; importable here too

if TYPE_CHECKING:  # the agent module loads transformers: a worker can reach its store and fail fast without it
    from .agent import Agent, Mode

log = logging.getLogger(__name__)

WORKER_MODES: tuple[str, ...] = ("prefix", "splice", "text", "auto")  # auto: each process measures its own costs
_SESSION = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


POLL = Backoff(first_s=0.02, factor=1.5, max_s=0.5)  # waiting for an upstream handoff: quick first, then calm


def connect(url: str, retry: Retry | None = None, namespace: str | None = None) -> RetryingStore:
    """Open the store at ``url`` for an agent in its own process, retrying while it is unreachable
    (a Redis server still starting, say); a permanent fault (a wrong password, a TLS certificate that
    does not verify) is raised at once. ``memory://`` is refused: no other process can reach it.
    The returned store's ``retried`` counts the retries made while connecting too. With ``namespace``,
    every key lives under ``ns/NAMESPACE/`` (:class:`~kvwire.store.scoped.ScopedStore`): agents of
    other namespaces sharing the store never see this run's caches or handoffs."""
    if namespace is not None:
        try:
            check_key(namespace)
        except KvwireError:
            raise PipelineConfigError(f"namespace {namespace!r} cannot name store keys",
                                      "use letters, digits, '.', '_' or '-', not starting with '.'") from None
        if "/" in namespace:
            raise PipelineConfigError(f"namespace {namespace!r} has a '/'", "give one name, without '/'")
    retry = retry or Retry()
    if isinstance(url, str) and url.startswith("memory:"):
        raise UnknownStoreError(f"store {url} lives inside one process; agents in separate processes cannot "
                                "meet there", "use file:///dev/shm/NAME (one host) or redis://HOST:PORT/DB")
    retries: list[StoreUnavailable] = []
    store = retrying(redact(url) if isinstance(url, str) else repr(url), "connecting", retry,
                     lambda: open_store(url), retries.append)
    retrying_store = RetryingStore(scoped(store, namespace), retry)
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

    def __init__(self, agent: Agent, store: RetryingStore, *, timeout_s: float = 600.0, poll: Backoff = POLL,
                 background: rates.Background | None = None) -> None:
        if agent.store is not store:
            raise ValueError("the agent must use the worker's RetryingStore, so its turns ride out faults too")
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.agent, self.store, self.timeout_s, self.poll = agent, store, timeout_s, poll
        self._published: Any = None  # the last store estimate this worker published (mode auto)
        # mode auto: the store's and the codec's costs, measured beside the model's loading (kvwire agent starts it
        # before it loads the model); without one, the worker starts one of the store alone when its turns begin
        self.background = background

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
        if mode == "auto":
            self._learn(result)
        costs = self.agent.cost.to_json() if mode == "auto" and self.agent.cost is not None else None
        return TurnReport(result, session, self.store.url, up_key, key, waited, self.store.retried, costs)

    def measure_costs(self, force: bool = False, budget_s: float = probing.BUDGET_S) -> CostModel:
        """This process's own costs for mode ``auto``, measured once; an agent created with ``cost=`` keeps
        that one. The model's prefill and codec are measured here (local, no traffic); the store's come
        from :func:`kvwire.pipeline.probe.auto_costs`: another agent's result on this host if the store
        has one, else a probe bounded by ``budget_s`` and serialized with the other agents' probes --
        or nothing at all where a cache cannot beat re-prefilling on any link."""
        if force or self.agent.cost is None:
            start = time.perf_counter()
            agent = self.agent
            model = probe_model(agent.model, agent.cache_spec.kv_bytes(1), spec=agent.cache_spec,
                                options=agent.codec_options)
            agent.cost = probing.auto_costs(self.store, model, budget_s=budget_s)
            even = agent.cost.break_even_tokens()
            log.info("%s measured its costs in %.1f s: store %s %.2f ms, put %.0f MB/s, get %.0f MB/s (%s), prefill "
                     "%.0f tokens/s; a cache pays off from %s upstream tokens", agent.name,
                     time.perf_counter() - start, self.store.url, agent.cost.store.latency_s * 1000,
                     agent.cost.store.put_rate / 1e6, agent.cost.store.get_rate / 1e6,
                     agent.cost.probe.describe() if agent.cost.probe else "given", agent.cost.model.prefill_rate,
                     even if even is not None else "no number of")
        return self.agent.cost

    def estimate(self, budget_s: float = probing.BUDGET_S) -> rates.Estimator:
        """Mode ``auto`` without measuring anything before a turn: the agent's
        :class:`~kvwire.pipeline.rates.Estimator`, which assembles each decision's costs from the turns' own
        prefills, the host's shared rates, the :attr:`background` measurement (started here, of the store
        alone, if there is none) and priors."""
        agent = self.agent
        if agent.estimator is None:
            if self.background is None:
                self.background = rates.Background(self.store, None, agent.codec_options, budget_s=budget_s)
            import kvwire.hf as hf

            agent.estimator = rates.Estimator(self.store, agent.cache_spec, background=self.background,
                                              device=str(hf.model_device(agent.model)))
        return agent.estimator

    def _learn(self, result: AgentResult) -> None:
        """Refine this process's store estimate with the turn's real packet traffic (the receive was
        already used for the turn's own decision), and publish it for the agents on this host, with
        the model's clean rates (:meth:`kvwire.pipeline.rates.Estimator.publish`)."""
        if self.agent.estimator is not None:
            self.agent.estimator.publish()
        if self.agent.cost is None:
            return
        cost = self.agent.cost = probing.refine(self.agent.cost, result.traffic)
        if cost.probe is not None and cost.probe.source == "passive" and cost.probe.host \
                and cost.store != self._published:
            if probing.publish(self.store, cost.store, cost.probe, self.store.url, cost.probe.host):
                self._published = cost.store

    def run(self, mode: Mode, session: str, first_round: int = 0, rounds: int = 1) -> Iterator[TurnReport]:
        """Take the turns of rounds ``first_round .. first_round + rounds - 1``, yielding each as it is done.

        Mode ``auto`` measures nothing before the first turn: unless the agent has costs, each turn decides for its
        own hop whether the cache is worth sending (``result.decision``) with the figures known by then
        (:meth:`estimate`).
        """
        if rounds < 1 or first_round < 0:
            raise KvwireError(f"need rounds >= 1 and a first round >= 0, got rounds={rounds}, round={first_round}")
        if mode == "auto":
            resolve_mode(self.agent.spec, mode)
            check_turn_free(self.store, self.agent.spec, self.agent.index, session, first_round)  # before probing
            if self.agent.cost is None:
                self.estimate()
        for round in range(first_round, first_round + rounds):
            check_turn_free(self.store, self.agent.spec, self.agent.index, session, round)
            yield self.take_turn(mode, session, round)
