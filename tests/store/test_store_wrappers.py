"""Store wrappers and the store-fault policy, on real stores.

- :class:`~kvwire.store.forwarding.ForwardingStore` passes every call and property to the store it
  wraps; a wrapper subclasses it and overrides only what it changes (here: a store that counts puts).
- :mod:`kvwire.store.retrying` is the one policy for store faults: an agent process retries
  transient faults (:class:`RetryingStore`), a server puts a failing store aside (:class:`Breaker`).
  Faults are injected with a small failing subclass of the in-memory store, and with a real
  redis-server killed and started again.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from kvwire.errors import OverBudget, StoreAccessDenied, StoreError, StoreUnavailable, VersionConflict
from kvwire.store import FileStore, MemoryStore, open_store
from kvwire.store.forwarding import ForwardingStore
from kvwire.store.local import LocalPackets
from kvwire.store.metered import MeteredStore
from kvwire.store.retrying import (Backoff, Breaker, Retry, RetryingStore, StoreDown, is_answer, is_transient,
                                   retrying)

FAST = Retry(retries=3, backoff=Backoff(first_s=0.001, factor=2.0, max_s=0.004))


class Counting(ForwardingStore):
    """The smallest wrapper: it changes ``put`` and nothing else."""

    def __init__(self, store):
        super().__init__(store)
        self.puts = 0

    def put(self, key, data, *, expect_version=None):
        self.puts += 1
        return self.store.put(key, data, expect_version=expect_version)


class Failing(MemoryStore):
    """A memory store whose next ``fail`` calls raise ``error`` (a transient fault unless told otherwise)."""

    def __init__(self, budget=None) -> None:
        super().__init__(budget=budget)
        self.fail, self.calls = 0, 0
        self.error: StoreError = StoreUnavailable("cannot connect to redis at 127.0.0.1:1: connection refused")

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise self.error

    def get_versioned(self, key):
        self._maybe_fail()
        return super().get_versioned(key)

    def exists(self, key):
        self._maybe_fail()
        return super().exists(key)

    def put(self, key, data, *, expect_version=None):
        self._maybe_fail()
        return super().put(key, data, expect_version=expect_version)


@pytest.fixture(params=["memory", "file", "redis"])
def inner(request, tmp_path):
    """The same store contract behind each backend a wrapper may sit in front of."""
    if request.param == "memory":
        store = MemoryStore(budget=100)
    elif request.param == "file":
        store = FileStore(tmp_path / "store", budget=100)
    else:
        server = request.getfixturevalue("redis_server")
        store = open_store(server.url(f"budget=100&prefix=wrappers-{uuid.uuid4().hex[:8]}"))
    yield store
    store.close()


def test_a_forwarding_store_is_the_store_it_wraps_but_for_what_it_overrides(inner):
    store = Counting(inner)
    assert (store.url, store.budget, repr(store)) == (inner.url, 100, f"Counting({inner.url!r})")
    assert store.put("a/one", b"x" * 60) == 1 and store.put("a/one", b"y" * 60) == 2
    assert bytes(store.get("a/one")) == b"y" * 60 and bytes(store.get_versioned("a/one")[0]) == b"y" * 60
    assert store.get_versioned("a/one")[1] == 2 and store.exists("a/one") and store.used_bytes == 60
    with pytest.raises(VersionConflict):  # the inner store's answers come through as they are
        store.put("a/one", b"z", expect_version=1)
    store.put("a/two", b"w" * 60)  # over the budget of 100: the inner store evicts a/one
    assert store.keys("a/") == ["a/two"] and store.evictions == inner.evictions == 1
    assert store.delete("a/two") and not store.delete("a/two") and store.get("a/two") is None
    assert store.puts == 4  # the one call it changed
    with store:
        pass  # closing the wrapper closes the store it wraps


def test_metered_and_local_wrappers_change_only_their_own_calls():
    remote = MemoryStore()
    metered = MeteredStore(remote)
    metered.put("packets/a", b"x" * 10)
    assert metered.get("packets/a") == b"x" * 10 and metered.get_versioned("packets/missing") is None
    assert (metered.traffic.puts, metered.traffic.gets, metered.traffic.nbytes) == (1, 2, 20)
    assert metered.keys() == ["packets/a"] and metered.traffic.gets == 2  # not a timed call
    local = LocalPackets(metered, max_bytes=100)  # wrappers stack
    assert local.get("packets/a") == b"x" * 10 and local.get("packets/a") == b"x" * 10
    assert local.hits == 1 and metered.traffic.gets == 3  # the second read never left this process
    assert local.url == "memory://" and local.used_bytes == 10


def test_faults_are_told_apart_the_same_way_everywhere():
    assert is_transient(StoreUnavailable("timed out")) and not is_transient(StoreAccessDenied("wrong password"))
    assert is_answer(VersionConflict("k", 0, 1)) and is_answer(OverBudget("too big"))
    assert not is_answer(StoreUnavailable("timed out")) and not is_answer(StoreError("disk full"))


def test_an_agent_rides_out_transient_faults_and_is_told_when_they_last(caplog):
    failing = Failing()
    store = RetryingStore(failing, FAST)
    failing.fail = 2
    with caplog.at_level(logging.WARNING, logger="kvwire.store.retrying"):
        assert store.put("sessions/s/r0/handoff/0-A", b"turn") == 1
    assert store.retried == 2 and [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "store memory:// unreachable while publishing handoff sessions/s/r0/handoff/0-A"] * 2
    failing.fail = 10
    with pytest.raises(StoreUnavailable, match=r"unreachable while reading packet packets/p: gave up after 4 "
                                               r"attempts in .* connection refused"):
        store.get("packets/p")
    assert store.retried == 5


def test_an_agent_raises_permanent_faults_and_answers_at_once():
    failing = Failing(budget=10)
    store = RetryingStore(failing, FAST)
    failing.fail, failing.error = 5, StoreAccessDenied("redis refused the password")
    with pytest.raises(StoreAccessDenied, match="refused the password"):
        store.exists("k")
    assert failing.calls == 1 and failing.fail == 4  # one attempt, no retry
    failing.fail, failing.calls = 0, 0
    store.put("k", b"v", expect_version=0)
    with pytest.raises(VersionConflict):
        store.put("k", b"w", expect_version=0)
    with pytest.raises(OverBudget):
        store.put("big", b"x" * 11)
    with pytest.raises(StoreError, match="invalid store key"):  # checked before any attempt
        store.get("../etc")
    assert failing.calls == 3 and store.retried == 0


def test_a_retried_call_need_not_be_a_store_method():
    failing = Failing()
    failing.fail = 1
    retries: list[StoreUnavailable] = []
    assert retrying("memory://", "counting", FAST, lambda: failing.exists("k"), retries.append) is False
    assert len(retries) == 1 and "connection refused" in retries[0].message
    assert Retry(retries=2, backoff=Backoff(0.5, 2.0, 8.0)).window_s == 1.5


def test_a_server_puts_a_failing_store_aside_then_tries_it_again(caplog):
    failing, states = Failing(), []
    breaker = Breaker("memory://", lambda: failing, retry_s=0.0, on_state=states.append)
    assert breaker.call("reading", lambda store: store.put("k", b"v")) == 1 and breaker.state == "ok"
    failing.fail = 2
    with caplog.at_level(logging.WARNING, logger="kvwire.store.retrying"):
        for _ in range(2):
            with pytest.raises(StoreDown, match="looking up: cannot connect"):
                breaker.call("looking up", lambda store: store.exists("k"))
        assert breaker.state == "degraded" and breaker.used_bytes() == 1  # retry_s 0: tried again at once
    assert states == ["degraded", "degraded", "ok"] and breaker.state == "ok"
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == [
        "store memory:// unreachable while looking up", "store memory:// reachable again"]  # one warning a spell
    with pytest.raises(VersionConflict):  # an answer: the store is reachable, nothing degrades
        breaker.call("writing", lambda store: store.put("k", b"w", expect_version=0))
    assert breaker.state == "ok"


def test_a_put_aside_store_is_not_called_until_its_retry_time_has_passed():
    failing = Failing()
    breaker = Breaker("memory://", lambda: failing, retry_s=60.0)
    failing.fail = 1
    with pytest.raises(StoreDown):
        breaker.call("checking", lambda store: store.exists("k"))
    with pytest.raises(StoreDown, match="checking: cannot connect"):  # not tried: still put aside
        breaker.call("reading", lambda store: store.exists("k"))
    breaker.probe()
    assert failing.calls == 1 and breaker.used_bytes() is None and breaker.state == "degraded"


def test_both_sides_of_the_policy_over_a_real_redis_that_goes_away_and_comes_back(tmp_path):
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    url = server.url("connect_timeout=0.5&timeout=1")
    try:
        agent = RetryingStore(open_store(url), FAST)
        breaker = Breaker("that redis", lambda: open_store(url), retry_s=0.0)
        agent.put("sessions/s/k", b"v")
        assert breaker.call("reading", lambda store: store.get("sessions/s/k")) == b"v"
        server.kill()
        with pytest.raises(StoreUnavailable, match=r"while reading key sessions/s/k: gave up after 4 attempts"):
            agent.get("sessions/s/k")
        assert agent.retried == 3
        with pytest.raises(StoreDown, match="reading"):
            breaker.call("reading", lambda store: store.get("sessions/s/k"))
        assert breaker.state == "degraded"
        server.start()  # empty again: --save "" keeps nothing
        assert agent.get("sessions/s/k") is None
        assert breaker.call("reading", lambda store: store.exists("sessions/s/k")) is False and breaker.state == "ok"
        agent.close()
        breaker.close()
    finally:
        server.stop()
