"""Mode auto's store estimate: a probe bounded in time and bytes, shared through the store, refined by real traffic.

The link is emulated by :class:`Link`, a store wrapper that sleeps as a link of a given latency
and rate would; everything else is the real store (memory, file, Redis with an ACL).
"""

from __future__ import annotations

import json
from dataclasses import replace
import logging
import threading
import time

import pytest

from kvwire.pipeline import probe
from kvwire.pipeline.cost import CostModel, ModelCost, ProbeCost, StoreCost
from kvwire.store import open_store
from kvwire.store.forwarding import ForwardingStore
from kvwire.store.metered import Traffic


class Link(ForwardingStore):
    """``store`` behind a link: each put and get takes ``latency_s / 2`` plus its bytes at ``rate``."""

    def __init__(self, store, rate: float, latency_s: float = 2e-3, burst: int = 0) -> None:
        super().__init__(store)
        self.rate, self.latency_s, self.burst = rate, latency_s, burst
        self.tokens, self.refilled = float(burst), time.perf_counter()  # a token bucket, as tc's tbf shapes
        self.moved = 0
        self.busy: list[tuple[float, float]] = []  # (start, end) of each probe-sized transfer

    def _wait(self, nbytes: int) -> None:
        start = time.perf_counter()
        self.tokens = min(self.burst, self.tokens + (start - self.refilled) * self.rate)
        free = min(self.tokens, nbytes)  # what fits in the bucket passes at once
        self.tokens -= free
        time.sleep(self.latency_s / 2 + (nbytes - free) / self.rate)
        self.refilled = time.perf_counter()
        self.moved += nbytes
        if nbytes >= probe.SIZES[0]:
            self.busy.append((start, time.perf_counter()))

    def put(self, key, data, *, expect_version=None):
        self._wait(memoryview(data).nbytes)
        return self.store.put(key, data, expect_version=expect_version)

    def get_versioned(self, key):
        found = self.store.get_versioned(key)
        self._wait(len(found[0]) if found is not None else 0)
        return found

    def get(self, key):
        found = self.get_versioned(key)
        return None if found is None else found[0]


MODEL = ModelCost(prefill_rate=1500.0, codec_rate=2e9, bytes_per_token=46_080)


def test_the_probe_measures_a_slow_link_within_its_budget_and_moves_a_few_megabytes():
    link = Link(open_store("memory://"), rate=12.5e6, latency_s=4e-3)  # 100 Mbit, 4 ms
    cost, spent = probe.probe_store_bounded(link, budget_s=0.3)
    assert spent.source == "probe" and spent.rounds >= 2
    assert spent.seconds < 0.3 + 0.25  # the budget, and at most the round that was predicted to fit
    assert spent.bytes == link.moved and spent.bytes < 4e6  # the old probe moved 96 MiB
    assert cost.put_rate == pytest.approx(12.5e6, rel=0.3) and cost.get_rate == cost.put_rate
    assert cost.latency_s == pytest.approx(4e-3, rel=0.5)
    assert link.keys(probe.PREFIX) == []  # nothing left behind


def test_a_shapers_burst_does_not_pass_for_the_links_rate():
    """tc's tbf lets a 512 KiB burst through at once, which a small round alone would take for the link's
    speed. The marginal rate between the rounds, and the slower direction, discount what the burst carried."""
    link = Link(open_store("memory://"), rate=1.25e6, latency_s=2e-3, burst=512 << 10)  # 10 Mbit
    cost, spent = probe.probe_store_bounded(link, budget_s=0.3)
    assert cost.put_rate < 2.5e6 and cost.get_rate < 2.5e6  # within 2x of 1.25 MB/s, not the burst's speed
    assert spent.bytes < 3e6 and spent.seconds < 3.0


def test_on_a_fast_store_the_probe_moves_its_two_rounds_and_no_more():
    store = open_store("memory://")
    cost, spent = probe.probe_store_bounded(store, budget_s=5.0)
    assert spent.rounds == len(probe.SIZES) and spent.bytes <= 2 * sum(probe.SIZES) + 1024 < 1.5e6
    assert cost.put_rate > 50e6 and cost.get_rate == cost.put_rate


def test_agents_on_one_host_reuse_a_published_result_and_another_host_measures_its_own():
    link = Link(open_store("memory://"), rate=50e6)
    first = probe.store_costs(link, host="h1")
    moved = link.moved
    again = probe.store_costs(link, host="h1")
    assert first[1].source == "probe" and again[1].source == "shared" and again[1].bytes == 0
    assert link.moved - moved < 10_000  # reading the result, not probing
    assert again[0].put_rate == pytest.approx(first[0].put_rate) and again[0].latency_s == first[0].latency_s
    other = probe.store_costs(link, host="h2")
    assert other[1].source == "probe"
    assert sorted(k.rsplit("/", 1)[1] for k in link.keys(probe.PREFIX)) == ["h1", "h2"]  # no lock left


@pytest.mark.parametrize("stored", [
    b"not json",
    b'["a list"]',
    json.dumps({"format": 99}).encode(),
    "expired",
    "another store",
    "from the future",
    "zero rate",
])
def test_a_stored_result_that_is_malformed_foreign_or_expired_is_measured_again(stored):
    store = open_store("memory://")
    url, host = store.url, "h1"
    good = StoreCost.from_rates(1e-3, 1e6, 1e6, url)
    made = {"expired": probe.encode_result(good, ProbeCost("probe"), url, host, ttl_s=10, now=time.time() - 11),
            "another store": probe.encode_result(good, ProbeCost("probe"), "redis://elsewhere:6379/0", host),
            "from the future": probe.encode_result(good, ProbeCost("probe"), url, host, now=time.time() + 3600),
            "zero rate": probe.encode_result(good, ProbeCost("probe"), url, host).replace(b'"put_rate": 1000000.0',
                                                                                        b'"put_rate": 0')}
    store.put(probe.result_key(url, host), made.get(stored, stored))
    cost, spent = probe.store_costs(store, host=host)
    assert spent.source == "probe" and cost.put_rate > 1e7  # measured, not the stored 1 MB/s
    assert probe.read_shared(store, url, host) is not None  # and the bad value replaced by a good one


def test_concurrent_probes_of_one_store_take_turns():
    link = Link(open_store("memory://"), rate=25e6)
    results = {}

    def agent(host):
        results[host] = probe.store_costs(link, host=host, budget_s=0.2)

    threads = [threading.Thread(target=agent, args=(f"h{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r[1].source for r in results.values()} == {"probe"}
    spans = sorted(link.busy)
    # every probe-sized transfer ends before the next begins: no two probes shared the link
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
    assert sum(r[1].waited_s > 0.05 for r in results.values()) >= 2  # two of the three waited their turn


def test_the_agents_of_one_host_started_together_probe_once():
    link = Link(open_store("memory://"), rate=25e6)
    found = []
    threads = [threading.Thread(target=lambda: found.append(probe.store_costs(link, host="h1", budget_s=0.2)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(f[1].source for f in found) == ["probe", "shared", "shared"]


def test_a_lock_left_by_a_dead_prober_is_taken_over_once_expired():
    store = open_store("memory://")
    store.put(probe.lock_key(store.url), json.dumps({"holder": "dead", "expires_at": time.time() - 1}).encode())
    cost, spent = probe.store_costs(store, host="h1", wait_s=5.0)
    assert spent.source == "probe" and spent.waited_s < 1.0
    assert not store.exists(probe.lock_key(store.url))


def test_a_lock_that_never_clears_delays_the_probe_only_up_to_the_wait():
    store = open_store("memory://")
    store.put(probe.lock_key(store.url), json.dumps({"holder": "slow", "expires_at": time.time() + 60}).encode())
    start = time.perf_counter()
    _, spent = probe.store_costs(store, host="h1", wait_s=0.3)
    assert spent.source == "probe" and 0.3 <= time.perf_counter() - start < 3.0


def test_no_probe_where_a_cache_cannot_win_on_any_link():
    store = open_store("memory://")
    slow_codec = ModelCost(prefill_rate=20_000.0, codec_rate=1e6, bytes_per_token=46_080)  # codec >> prefill
    assert not probe.cache_can_win(slow_codec) and probe.cache_can_win(MODEL)
    cost = probe.auto_costs(store, slow_codec)
    assert cost.probe.source == "skipped" and store.keys() == []  # not a byte sent
    decision = cost.decide(3000, 1000, 2)
    assert decision.choice == "ids" and "skipped" in decision.reason
    assert probe.refine(cost, Traffic(get_s=0.01, get_bytes=10 << 20, gets=1)) is cost


def test_real_traffic_replaces_the_probes_rates():
    measured = CostModel(StoreCost.from_rates(2e-3, 100e6, 100e6), MODEL, ProbeCost("probe", 1 << 20, 0.1, 3))
    small = Traffic(get_s=0.01, get_bytes=1000, gets=1)
    assert probe.refine(measured, small) is measured  # too few bytes to say anything
    big = Traffic(put_s=1.001, put_bytes=10_000_000, puts=1, get_s=0.502, get_bytes=20_000_000, gets=2)
    refined = probe.refine(measured, big)
    assert refined.store.put_rate == pytest.approx(10e6, rel=1e-3)
    assert refined.store.get_rate == pytest.approx(40e6, rel=1e-3)
    assert refined.probe.source == "passive" and refined.probe.basis == "probe"
    assert "passive (first: probe)" in refined.decide(2000, 500, 2).reason
    given = CostModel(measured.store, MODEL)  # costs a caller chose (no ProbeCost) are not second-guessed
    assert probe.refine(given, big) is given


def test_a_turns_own_prefill_replaces_the_probed_prefill_rate():
    measured = CostModel(StoreCost.from_rates(2e-3, 125e6, 125e6), MODEL, ProbeCost("probe", 1 << 20, 0.1, 3))
    slow = replace(measured, model=replace(MODEL, prefill_rate=300.0))  # probed while other agents loaded
    assert slow.decide(2000, 2000, 1).choice == "cache"  # 2000 tokens at 300/s: 6.7 s of re-prefill
    faster = probe.refine_prefill(slow, 2000, 1.25)  # the turn prefilled 2000 tokens in 1.25 s
    assert faster.model.prefill_rate == pytest.approx(1600.0) and faster.decide(2000, 2000, 1).choice == "ids"
    assert probe.refine_prefill(slow, 10, 0.01) is slow  # too few tokens to say
    given = CostModel(slow.store, slow.model)
    assert probe.refine_prefill(given, 2000, 1.25) is given
    skipped = CostModel(probe.NO_LINK, MODEL, ProbeCost("skipped"))
    assert probe.refine_prefill(skipped, 2000, 1.25) is skipped  # the store was never measured


def test_a_decision_reports_what_its_estimate_cost():
    cost = CostModel(StoreCost.from_rates(1e-3, 1e9, 1e9), MODEL, ProbeCost("probe", 2_700_000, 0.18, 3))
    decision = cost.decide(2000, 500, 2)
    assert decision.to_json()["probe"]["bytes"] == 2_700_000
    assert "probe: 2.7 MB in 180 ms, 3 rounds" in decision.reason
    assert cost.to_json()["probe"]["source"] == "probe"
    assert CostModel.from_json(cost.to_json(), "costs.json").probe is None  # a file's costs are given ones


def test_host_id_names_the_address_that_reaches_the_store():
    assert probe.host_id("redis://127.0.0.1:6379/0").endswith("_127.0.0.1")
    assert probe.host_id("file:///dev/shm/x").endswith("_local")
    assert probe.host_id("redis+cluster://u:pw@127.0.0.1:7000,127.0.0.1:7001/0").endswith("_127.0.0.1")
    assert probe.host_id("redis://[::1]:6379/0") and probe.host_id("redis://localhost/0")
    assert probe.host_id("redis://203.0.113.9:6379/0")  # any routable form gives a key segment
    from kvwire.store import check_key
    check_key(probe.result_key("redis://127.0.0.1:6379/0", probe.host_id("redis://127.0.0.1:6379/0")))


def test_a_store_that_refuses_the_probes_keys_falls_back_to_a_prior_and_names_the_permission(tmp_path, caplog):
    from tests.support.redis_server import RedisServer, require_redis_server

    require_redis_server()
    patterns = [f"~kvwire:{kind}:{space}/*" for kind in "mc" for space in ("sessions", "packets")]
    acl = ("--user", "agent", "on", ">agent-pass", *patterns, "~kvwire:used", "~kvwire:lru", "~kvwire:clock",
           "+@read", "+@write", "+@keyspace", "+@scripting", "+@connection", "-@dangerous")
    server = RedisServer(tmp_path / "acl", extra=acl).start()
    try:
        store = open_store(f"redis://agent:agent-pass@127.0.0.1:{server.port}/0")
        store.put("sessions/s/r0/handoff/0-a", b"allowed")  # the agent's own keys work
        with caplog.at_level(logging.WARNING, logger="kvwire.pipeline.probe"):
            cost, spent = probe.store_costs(store)
        assert spent.source == "prior" and cost.put_rate == probe.PRIOR.put_rate
        assert f"{probe.PREFIX}/*" in caplog.text and "grant" in caplog.text and "may not read" in caplog.text
        assert "agent-pass" not in caplog.text
        traffic = Traffic(get_s=0.2, get_bytes=4_000_000, gets=1)
        assert probe.refine(CostModel(cost, MODEL, spent), traffic).store.get_rate == pytest.approx(20e6, rel=0.05)
    finally:
        server.stop()
