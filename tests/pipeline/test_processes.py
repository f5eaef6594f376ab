"""Agents as separate processes (``kvwire agent``) that meet only in a store, on loopback.

Three processes run the three agents of a short pipeline, through a real
redis-server and through ``file:///dev/shm``: the downstream ones wait for their
upstream handoff, use its cache, and produce exactly what one in-process
:class:`~kvwire.pipeline.Pipeline` produces. With ``--mode auto`` (here through a
real Redis Cluster) each process probes its own store and model and decides for its
own hop whether to send its cache. Faults: Redis killed (kill -9) while an
agent waits and restarted from its append-only file (the agent retries, then
finishes; nothing stored is lost), Redis that never comes back or is down from the
start (one clear ``error:`` line within the retry budget), and a second process
taking a turn already taken (a version conflict).

Agent processes run with one thread each: several share this machine's cores.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvwire
from kvwire import PipelineSpec, StoreError, StoreUnavailable, VersionConflict, open_store
from kvwire.wire import codec
from kvwire.pipeline.agent import Agent
from kvwire.store import MemoryStore
from kvwire.pipeline.worker import (Backoff, Retry, RetryingStore, TurnTaken, UpstreamTimeout, Worker, connect,
                           upstream_key, wait_for)

TRIO = """
name = "trio"
system = "You are one of three agents taking turns. Answer in one short sentence."
input_text = "def mean(xs): return sum(xs) / len(xs)"
max_new_tokens = 6

[[agents]]
name = "A"
instruction = "Name one bug in the code."

[[agents]]
name = "B"
instruction = "Suggest a fix."

[[agents]]
name = "C"
instruction = "Check the fix."
"""
SRC = Path(kvwire.__file__).resolve().parent.parent  # the sources this test imports; the processes use the same
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
FAST = Retry(3, Backoff(0.001, 2.0, 0.01))


# -- helpers -----------------------------------------------------------------------------------------


@dataclass
class Proc:
    """One ``kvwire agent`` process; stdout and stderr go to files, read while it runs."""

    name: str
    popen: subprocess.Popen
    out: Path
    err: Path

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def finish(self, timeout: float = 180) -> int:
        return self.popen.wait(timeout)

    def results(self) -> list[dict]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.startswith("{")]


@pytest.fixture
def agents(tmp_path):
    """Start ``kvwire agent`` processes; any still running at the end is killed."""
    started: list[Proc] = []

    def start(pipeline: Path, name: str, session: str, url: str, *args: str) -> Proc:
        out, err = tmp_path / f"{name}-{len(started)}.out", tmp_path / f"{name}-{len(started)}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            popen = subprocess.Popen([sys.executable, "-m", "kvwire", "agent", str(pipeline), "--name", name,
                                      "--session", session, "--store", url, "--json", *args],
                                     stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=ENV)
        proc = Proc(name, popen, out, err)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait()


def until(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll ``condition`` until it holds (a readiness check, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def says(proc: Proc, *fragments: str) -> Callable[[], bool]:
    return lambda: all(f in " ".join(proc.stderr().split()) for f in fragments)


def one_error_line(proc: Proc) -> str:
    lines = [line for line in proc.stderr().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr(), proc.stderr()
    return lines[0]


def check_finished(procs: list[Proc], reference: dict[str, list[int]]) -> dict[str, dict]:
    """Every process exited 0; B and C used the cache; every output equals the in-process run's."""
    results = {}
    for proc in procs:
        assert proc.finish() == 0, proc.stderr()
        [results[proc.name]] = proc.results()
    assert results["A"]["cached_tokens"] == 0
    for name in ("B", "C"):
        assert results[name]["cached_tokens"] > 0 and not results[name]["events"], results[name]
    assert {name: r["output_ids"] for name, r in results.items()} == reference
    return results


@pytest.fixture(scope="module")
def trio(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pipeline") / "trio.toml"
    path.write_text(TRIO)
    return path


@pytest.fixture(scope="module")
def reference(real_model, trio) -> dict[str, list[int]]:
    """Each agent's output ids from one in-process prefix run (one thread, as the agent processes)."""
    from kvwire.pipeline.linear import Pipeline

    model, tokenizer, spec = real_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = Pipeline(model, tokenizer, PipelineSpec.from_toml(trio), model_spec=spec).run("prefix")
    finally:
        torch.set_num_threads(threads)
    return {agent.agent: agent.output_ids for agent in result.agents}


@pytest.fixture
def shm_url():
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    root = Path("/dev/shm") / f"kvwire-test-{uuid.uuid4().hex[:8]}"
    yield f"file://{root}"
    shutil.rmtree(root, ignore_errors=True)


# -- the library, in-process -------------------------------------------------------------------------


def test_upstream_keys_follow_the_rounds(trio):
    spec = PipelineSpec.from_toml(trio)
    assert upstream_key(spec, 0, "s", 0) is None  # the very first turn waits for nothing
    assert upstream_key(spec, 1, "s", 0) == "sessions/s/r0/handoff/0-A"
    assert upstream_key(spec, 0, "s", 1) == "sessions/s/r0/handoff/2-C"  # A of round 1 reads C of round 0
    assert upstream_key(spec, 2, "s", 3) == "sessions/s/r3/handoff/1-B"


def test_modes_a_worker_takes(trio):
    from dataclasses import replace

    from kvwire import KvwireError, PipelineConfigError
    from kvwire.pipeline.worker import resolve_mode

    shared = PipelineSpec.from_toml(trio)
    private = replace(shared, agents=tuple(replace(a, system=f"You are {a.name}.") for a in shared.agents))
    assert resolve_mode(shared, None) == "prefix" and resolve_mode(private, None) == "splice"
    assert resolve_mode(shared, "text") == "text" and resolve_mode(shared, "auto") == "auto"
    for mode in ("prefix", "auto"):
        with pytest.raises(PipelineConfigError, match="use splice mode"):
            resolve_mode(private, mode)
    with pytest.raises(KvwireError, match="unknown mode 'compare' for a worker"):
        resolve_mode(shared, "compare")


class Flaky(MemoryStore):
    """A memory store whose next ``fail`` calls raise as an unreachable server would;
    with ``lose_reply`` a put stores its value and then fails (the reply was lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail, self.calls, self.lose_reply = 0, 0, False

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise StoreUnavailable("cannot connect to redis at 127.0.0.1:1: connection refused - is redis-server "
                                   "running?")

    def exists(self, key):
        self._maybe_fail()
        return super().exists(key)

    def get_versioned(self, key):
        self._maybe_fail()
        return super().get_versioned(key)

    def put(self, key, data, *, expect_version=None):
        self._maybe_fail()
        version = super().put(key, data, expect_version=expect_version)
        if self.lose_reply:
            self.lose_reply = False
            raise StoreUnavailable("redis at 127.0.0.1:1 did not answer within 30 s while trying to store")
        return version


def test_store_faults_are_retried_then_reported_clearly(caplog):
    flaky = Flaky()
    store = RetryingStore(flaky, FAST)
    key = "sessions/s/r0/handoff/0-A"
    flaky.fail = 2
    with caplog.at_level(logging.WARNING, logger="kvwire.store.retrying"):
        assert store.get(key) is None
    assert [r.getMessage().partition("):")[0] for r in caplog.records] == [
        f"store memory:// unreachable while reading handoff {key} (attempt {k} of 4" for k in (1, 2)]
    flaky.fail = 10
    with pytest.raises(StoreError, match=rf"store memory:// unreachable while publishing handoff {key}: gave up "
                                         r"after 4 attempts in .* connection refused"):
        store.put(key, b"x")
    flaky.fail, flaky.calls = 0, 0
    store.put(key, b"mine", expect_version=0)
    with pytest.raises(VersionConflict):  # another writer: never retried
        store.put(key, b"theirs", expect_version=0)
    assert flaky.calls == 2


def test_a_put_whose_reply_was_lost_is_not_taken_for_another_writer():
    flaky = Flaky()
    store = RetryingStore(flaky, FAST)
    flaky.lose_reply = True
    assert store.put("sessions/s/r0/handoff/0-A", b"turn", expect_version=0) == 1
    assert flaky.get("sessions/s/r0/handoff/0-A") == b"turn"


def test_waiting_polls_until_the_handoff_appears_or_times_out():
    flaky = Flaky()
    store = RetryingStore(flaky, FAST)
    key = "sessions/s/r0/handoff/0-A"
    with pytest.raises(UpstreamTimeout, match=rf"{key} did not appear in memory:// within 0.05 s \(start agent A"):
        wait_for(store, key, 0.05, upstream="agent A")
    polls = flaky.calls
    assert 2 <= polls < 20  # backing off from 20 ms: a few polls, not a busy loop
    flaky.put(key, b"here")
    flaky.fail = 2  # the store hiccups, then answers
    assert wait_for(store, key, 5) < 1


def test_memory_stores_cannot_join_processes():
    with pytest.raises(StoreError, match="lives inside one process"):
        connect("memory://team")


def test_a_namespace_keeps_a_runs_keys_apart_in_a_shared_store(tiny_tokenizer, trio, tmp_path):
    """Two teams on one store: team b's B never sees team a's handoff, and every key of a run lies under
    ns/NAME/ (kvwire agent --namespace)."""
    from tests.support import tiny

    spec = PipelineSpec.from_toml(trio)
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    url = f"file://{tmp_path}/shared"
    team_a, team_b = connect(url, FAST, namespace="team-a"), connect(url, FAST, namespace="team-b")
    Worker(Agent(spec, 0, model, tiny_tokenizer, team_a), team_a).take_turn("prefix", "s", 0)
    waiting = Worker(Agent(spec, 1, model, tiny_tokenizer, team_b), team_b, timeout_s=0.1)
    with pytest.raises(UpstreamTimeout):  # the same session name, another namespace: nothing to read
        waiting.take_turn("prefix", "s", 0)
    everything = open_store(url).keys()
    assert everything and all(k.startswith("ns/team-a/") for k in everything)
    assert team_a.keys("sessions/") == ["sessions/s/r0/handoff/0-A"] and team_b.keys() == []
    for bad in ("a/b", ".hidden", ""):
        with pytest.raises(kvwire.errors.PipelineConfigError, match="namespace"):
            connect(url, FAST, namespace=bad)


def test_a_raced_turn_is_refused_with_a_version_conflict(tiny_tokenizer, trio):
    """Two processes past the early check: the turn's compare-and-set lets exactly one publish."""
    from tests.support import tiny

    spec = PipelineSpec.from_toml(trio)
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    store = RetryingStore(MemoryStore(), FAST)
    Agent(spec, 0, model, tiny_tokenizer, store).turn("prefix", "s", None)  # the winner
    loser = Worker(Agent(spec, 0, model, tiny_tokenizer, store), store)
    with pytest.raises(TurnTaken, match=r"agent A's turn in round 0 of session 's' is already taken: "
                                        r"sessions/s/r0/handoff/0-A is in memory:// at version 1 \(version conflict"):
        loser.take_turn("prefix", "s", 0)
    with pytest.raises(VersionConflict, match="already taken"):  # the early check, before any generation
        next(loser.run("prefix", "s"))
    assert store.get("sessions/s/r0/handoff/0-A") is not None and len(store.keys("packets/")) == 1


def test_workers_take_turns_across_rounds_like_one_pipeline(tiny_tokenizer, trio):
    """Three workers (threads here, processes in production) over one store, two rounds:
    A of round 1 waits for C of round 0, and every turn equals the in-process pipeline's."""
    from tests.support import tiny
    from concurrent.futures import ThreadPoolExecutor

    from kvwire.pipeline.linear import Pipeline

    spec = PipelineSpec.from_toml(trio)
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    shared = MemoryStore()

    def run(index: int) -> list:
        store = RetryingStore(shared, FAST)
        worker = Worker(Agent(spec, index, model, tiny_tokenizer, store), store, poll=Backoff(0.001, 2.0, 0.02))
        return list(worker.run("prefix", "s", rounds=2))

    with ThreadPoolExecutor(3) as pool:
        reports = [report for turns in pool.map(run, (2, 1, 0)) for report in turns]
    reports.sort(key=lambda r: (r.result.round, r.result.agent))
    expected = Pipeline(model, tiny_tokenizer, spec).run("prefix", rounds=2)
    assert [(r.result.round, r.result.agent, r.result.output_ids) for r in reports] == [
        (t.round, t.agent, t.output_ids) for t in expected.agents]
    assert [r.upstream for r in reports][:4] == [None, "sessions/s/r0/handoff/0-A", "sessions/s/r0/handoff/1-B",
                                                 "sessions/s/r0/handoff/2-C"]
    assert all(r.result.cached_tokens > 0 for r in reports[1:])


def test_auto_workers_measure_their_own_costs_and_decide_per_hop(tiny_tokenizer, trio):
    """Mode auto in workers: A is told its link is slow (it sends ids); B and C measure their store beside their
    models' loading (:class:`~kvwire.pipeline.rates.Background`, as ``kvwire agent`` starts it), their model on
    their own turns, and decide for their own hop; the outputs equal prefix mode's."""
    from tests.support import tiny
    from concurrent.futures import ThreadPoolExecutor

    from kvwire import hf
    from kvwire.pipeline import rates
    from kvwire.pipeline.cost import CostModel, ModelCost, StoreCost
    from kvwire.pipeline.linear import Pipeline

    spec = PipelineSpec.from_toml(trio)
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    shared = MemoryStore()
    slow_link = CostModel(StoreCost(latency_s=0.05, bandwidth=1e6), ModelCost(500.0, 1e9, 46080))
    stores = [RetryingStore(shared, FAST) for _ in range(3)]
    beside = {i: rates.Background(stores[i], hf.model_spec(model)) for i in (1, 2)}  # the "loading" is done here
    assert all(b.wait(30) for b in beside.values())

    def run(index: int) -> list:
        agent = Agent(spec, index, model, tiny_tokenizer, stores[index], cost=slow_link if index == 0 else None)
        worker = Worker(agent, stores[index], poll=Backoff(0.001, 2.0, 0.02), background=beside.get(index))
        return list(worker.run("auto", "s"))

    with ThreadPoolExecutor(3) as pool:
        a, b, c = (turns[0] for turns in pool.map(run, (0, 1, 2)))
    assert a.result.decision.startswith("ids") and a.costs["store"]["latency_s"] == 0.05
    assert b.result.cached_tokens == 0  # A sent no cache: B re-prefilled its ids
    assert b.costs["store"]["url"] == "memory://" and b.costs["model"]["prefill_rate"] > 0  # B measured its own
    assert b.result.decision.startswith(("cache", "ids"))
    # B's prefill rate is its own turn's (it re-prefilled A's ids), the codec's was measured beside the loading
    assert b.costs["sources"]["prefill"].startswith(("measured", "contended")), b.costs["sources"]
    assert b.costs["sources"]["codec"] == "measured beside the model's loading"
    assert "prefill: " in b.result.decision and "codec: " in b.result.decision  # the decision names its figures
    assert (c.result.cached_tokens > 0) == b.result.decision.startswith("cache")
    # B and C share a host: one probed the store (a few rounds, bounded), the other read its published result
    probes = sorted(r.costs["probe"]["basis"] or r.costs["probe"]["source"] for r in (b, c))  # then refined
    assert probes == ["probe", "shared"], probes
    assert max(r.costs["probe"]["seconds"] for r in (b, c)) < 2.0  # its 0.3 s budget, give or take a round
    assert "probe" not in a.costs  # costs given to it are not measured
    expected = Pipeline(model, tiny_tokenizer, spec).run("prefix")
    assert [r.result.output_ids for r in (a, b, c)] == [t.output_ids for t in expected.agents]


# -- processes ---------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_three_agent_processes_through_redis_and_dev_shm(agents, trio, reference, shm_url, redis_server):
    """Both trios run at once (six processes, so the cores stay busy while agents wait)."""
    urls = {"redis": redis_server.url(f"prefix=proc-{uuid.uuid4().hex[:8]}"), "file": shm_url}
    procs = {kind: [agents(trio, name, f"s-{kind}", url) for name in ("C", "B", "A")]  # downstream first: they wait
             for kind, url in urls.items()}
    a = procs["redis"][-1]
    assert a.finish() == 0, a.stderr()
    # a second process for a turn already taken: one clear error, nothing overwritten
    store = open_store(urls["redis"])
    handoff = "sessions/s-redis/r0/handoff/0-A"
    before = bytes(store.get(handoff))
    again = agents(trio, "A", "s-redis", urls["redis"])
    assert again.finish() == 1
    line = one_error_line(again)
    assert "agent A's turn in round 0 of session 's-redis' is already taken" in line, line
    assert "version conflict" in line and "new --session" in line, line
    for kind, url in urls.items():
        results = check_finished(procs[kind], reference)
        assert results["B"]["upstream"] == results["A"]["handoff"] == f"sessions/s-{kind}/r0/handoff/0-A"
        assert results["C"]["upstream"] == results["B"]["handoff"]
        assert results["C"]["waited_s"] > 0 and all(r["store"] == url for r in results.values())
    assert bytes(store.get(handoff)) == before
    store.close()


PRIVATE_DUO = """
name = "duo"
input_text = "def mean(xs): return sum(xs) / len(xs)"
max_new_tokens = 4

[[agents]]
name = "A"
system = "You find bugs."
instruction = "Name one bug in the code."

[[agents]]
name = "B"
system = "You fix bugs."
instruction = "Suggest a fix."
"""


def test_splice_agents_choose_when_to_splice(agents, tiny_folder, tmp_path):
    """Private system prompts: B places A's turn inside its own context. Its four tokens are cheaper to
    prefill than to splice, so by default B prefills them exactly; ``--splice-when always`` splices.
    The flag means nothing in other modes and is refused before any model loads."""
    pipeline = tmp_path / "duo.toml"
    pipeline.write_text(PRIVATE_DUO)
    url = f"file://{tmp_path / 'store'}"
    model = ("--model", str(tiny_folder))
    decisions = {}
    for when in ("cheaper", "always"):
        a = agents(pipeline, "A", when, url, *model)
        b = agents(pipeline, "B", when, url, *model, *(("--splice-when", "always") if when == "always" else ()))
        assert a.finish() == 0 and b.finish() == 0, a.stderr() + b.stderr()
        (result,) = b.results()
        assert result["mode"] == "splice" and result["upstream"] == f"sessions/{when}/r0/handoff/0-A"
        decisions[when] = result["decision"]
    assert decisions["cheaper"].startswith("splice: prefilled the upstream turns exactly"), decisions
    assert decisions["always"].startswith("splice: spliced 1 upstream turn(s)"), decisions
    from tests.support import cli  # usage errors: the command line in this process (tests/support/cli.py)

    agent = ("agent", str(pipeline), "--name", "B", "--store", url, "--json")
    refused = cli.run(*agent, "--session", "x", "--mode", "text", "--splice-when", "always")
    assert refused.returncode == 2 and "--splice-when is for splice mode; this agent runs text mode" in refused.stderr
    budget = cli.run(*agent, "--session", "y", "--mode", "text", "--probe-budget", "1")  # a probe only auto makes
    assert budget.returncode == 2 and "--probe-budget is for --mode auto" in budget.stderr


@pytest.mark.slow  # ~30 s; Redis lost and back under one client: tests/store/test_store_faults.py
@pytest.mark.real_model
def test_redis_killed_while_an_agent_waits_then_restarted(agents, trio, reference, tmp_path):
    """kill -9 while C waits for B; Redis restarts from its append-only file inside C's retry window:
    C retries, then finishes with B's cache, and A's handoff and packet survive byte for byte."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "durable", durable=True).start()
    try:
        url = server.url()
        a = agents(trio, "A", "s", url)
        assert a.finish() == 0, a.stderr()
        store = open_store(url)
        stored = {key: bytes(store.get(key)) for key in store.keys()}
        assert len(stored) == 2  # A's handoff and its packet
        c = agents(trio, "C", "s", url)
        until(says(c, "waiting for sessions/s/r0/handoff/1-B"), "C to wait for B")
        server.kill()
        until(says(c, f"store {url} unreachable while waiting for the upstream handoff "
                      "sessions/s/r0/handoff/1-B (attempt 1 of 6)"), "C to report the store unreachable")
        server.start()  # same port and directory: replays the append-only file
        assert {key: bytes(store.get(key)) for key in store.keys()} == stored
        codec.decode(stored[next(k for k in stored if k.startswith("packets/"))])  # whole and verified
        b = agents(trio, "B", "s", url)
        assert c.finish() == 0, c.stderr()
        results = check_finished([a, b, c], reference)
        assert results["C"]["store_retries"] >= 1 and results["A"]["store_retries"] == 0  # a transient fault
        store.close()
    finally:
        server.stop()


@pytest.mark.real_model
def test_redis_that_never_comes_back_ends_the_agent_with_one_error(agents, trio, tmp_path):
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "gone").start()
    try:
        url = server.url()
        b = agents(trio, "B", "s", url, "--retries", "2")
        until(says(b, "waiting for sessions/s/r0/handoff/0-A"), "B to wait for A")
        server.kill()
        assert b.finish(timeout=60) == 1  # gives up within its retry window, not after a wait for A
    finally:
        server.stop()
    line = one_error_line(b)
    assert (f"store {url} unreachable while waiting for the upstream handoff sessions/s/r0/handoff/0-A: "
            "gave up after 3 attempts") in line and "connection refused" in line, line
    assert says(b, "(attempt 1 of 3)", "(attempt 2 of 3)")()


def test_redis_down_at_start_is_retried_then_reported(agents, trio):
    from tests.support.redis_server import free_port, require_redis_server

    require_redis_server()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proc = agents(trio, "A", "s", url, "--retries", "1")
    assert proc.finish(timeout=60) == 1
    line = one_error_line(proc)
    assert f"store {url} unreachable while connecting: gave up after 2 attempts" in line, line
    assert "is redis-server running?" in line and says(proc, "(attempt 1 of 2)")()


@pytest.mark.slow  # ~25 s; the cluster store itself: tests/store/test_cluster.py
@pytest.mark.real_model
def test_auto_agent_processes_over_a_redis_cluster(agents, trio, reference, redis_cluster, tmp_path):
    """``--mode auto``, one agent per process, through a Redis Cluster of three masters. A is given a slow
    link's costs (``--costs``, as saved by ``kvwire probe --json``) and sends ids; B and C probe their own
    store and model at start and decide for their own hop. The outputs equal prefix mode's in one process."""
    from kvwire.pipeline.cost import CostModel, ModelCost, StoreCost

    url = redis_cluster.url(f"prefix=auto-{uuid.uuid4().hex[:8]}")
    slow = tmp_path / "slow-link.json"
    slow.write_text(json.dumps(CostModel(StoreCost(0.05, 1e6, "a slow link"), ModelCost(500.0, 1e9, 46080))
                               .to_json()))
    procs = [agents(trio, "C", "s", url, "--mode", "auto"), agents(trio, "B", "s", url, "--mode", "auto"),
             agents(trio, "A", "s", url, "--mode", "auto", "--costs", str(slow))]
    results = {}
    for proc in procs:
        assert proc.finish() == 0, proc.stderr()
        [results[proc.name]] = proc.results()
    assert {name: r["output_ids"] for name, r in results.items()} == reference
    assert all(r["mode"] == "auto" and r["store"] == url for r in results.values())
    a, b, c = results["A"], results["B"], results["C"]
    assert a["decision"].startswith("ids: sending the cache") and a["packet_bytes"] == 0
    assert a["costs"]["store"]["url"] == "a slow link"
    assert b["cached_tokens"] == 0 and not b["events"]  # nothing was sent: B re-prefilled A's ids, by design
    for proc, r in zip(procs[:2], (c, b)):
        assert r["costs"]["store"]["url"] == url and r["costs"]["model"]["prefill_rate"] > 0
        assert says(proc, "beside the model's loading")()  # nothing measured before the turn
        assert r["costs"]["sources"]["codec"] == "measured beside the model's loading", r["costs"]
    # one host: the second agent to get there read the first's published probe instead of probing again
    first = sorted(r["costs"]["probe"]["basis"] or r["costs"]["probe"]["source"] for r in (b, c))
    assert first == ["probe", "shared"], first  # (then refined by the turn's real transfers: "passive")
    assert max(r["costs"]["probe"]["seconds"] for r in (b, c)) < 2.0  # its 0.3 s budget, give or take a round
    assert (c["cached_tokens"] > 0) == b["decision"].startswith("cache"), (b["decision"], c["cached_tokens"])
