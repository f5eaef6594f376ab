"""Redis Cluster (``redis+cluster://``): what is specific to it, on real clusters of three masters.

The store contract itself runs over the session's cluster in test_store.py. Here:
where things live (a value in one slot, the budget's bookkeeping in one metadata
slot, values spread over the masters), the byte budget and LRU across masters,
writers that die holding a lock, URLs, and masters killed mid-run.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, defaultdict

import pytest

from kvwire import StoreConfigError, StoreError, StoreUnavailable, UnknownStoreError, open_store
from kvwire.store.cluster import RedisClusterStore
from kvwire.store.redis_common import RedisConfig, parse_redis_url


def _prefix() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


def _slot(cluster, name: str) -> int:
    client = cluster.nodes[0].raw()
    try:
        return int(client.execute_command("CLUSTER", "KEYSLOT", name))
    finally:
        client.close()


def _raw_keys(cluster, pattern: str) -> list[str]:
    names = []
    for node in cluster.nodes:
        client = node.raw()
        try:
            names += [name.decode() for name in client.scan_iter(match=pattern, count=1000)]
        finally:
            client.close()
    return sorted(names)


class Killed(Exception):
    """Stands for a writer process that dies at this point."""


# -- URLs -------------------------------------------------------------------------------------------


def test_cluster_urls_are_parsed_without_connecting():
    config = parse_redis_url("rediss+cluster://alice:p%40ss@a.internal:7000,b.internal:7001,[::1]:7002/0?budget=1GiB"
                             "&prefix=team&ssl_ca_certs=/etc/ca.pem", environ={})
    assert config == RedisConfig(host="a.internal", port=7000, db=0, username="alice", password="p@ss", tls=True,
                                 prefix="team", budget=1 << 30, ssl_ca_certs="/etc/ca.pem", cluster=True,
                                 nodes=(("a.internal", 7000), ("b.internal", 7001), ("::1", 7002)))
    assert config.address == "a.internal:7000,b.internal:7001,[::1]:7002"
    assert parse_redis_url("redis+cluster://h", environ={}).nodes == (("h", 6379),)


@pytest.mark.parametrize("url, message", [
    ("redis+cluster://h:7000/3", "has only database 0"),
    ("redis+cluster://h:7000,,h:7001", "empty host"),
    ("redis+cluster://h:7000,h:99999", "bad port"),
    ("redis://a:7000,b:7001/0", "several servers.*redis\\+cluster://"),
    ("redis+cluster://h/0?ssl_ca_certs=/x", "without TLS"),
    ("redis+cluster://h/0?lease=1", "unknown parameter 'lease'"),
])
def test_bad_cluster_urls_are_refused_before_connecting(url, message):
    with pytest.raises(UnknownStoreError, match=message) as caught:
        open_store(url)
    assert isinstance(caught.value, StoreConfigError)  # permanent: never retried


def test_a_cluster_url_for_a_single_server_and_the_reverse_fail_at_once(redis_server, redis_cluster):
    with pytest.raises(StoreConfigError, match=r"is not a Redis Cluster node.*redis://127\.0\.0\.1:\d+/0"):
        open_store(f"redis+cluster://127.0.0.1:{redis_server.port}/0")
    node = redis_cluster.nodes[0]
    with pytest.raises(StoreConfigError, match=rf"127\.0\.0\.1:{node.port} is a Redis Cluster node.*redis\+cluster://"):
        open_store(f"redis://127.0.0.1:{node.port}/0")


# -- where things live ------------------------------------------------------------------------------


def test_a_value_lives_in_one_slot_and_values_spread_over_the_masters(redis_cluster):
    prefix = _prefix()
    store = open_store(redis_cluster.url(f"prefix={prefix}&chunk_size=1KiB"))
    keys = [f"packets/{i:02d}" for i in range(24)]
    for key in keys:
        store.put(key, bytes(range(256)) * 20)  # 5 chunks each
    for key in keys[:3]:  # manifest and every chunk of a value: one slot, so one atomic publish
        names = _raw_keys(redis_cluster, f"{prefix}:{{{prefix}:{key}}}:*")
        assert len(names) == 1 + 5 and len({_slot(redis_cluster, name) for name in names}) == 1
    masters = Counter(redis_cluster.node_of(f"{prefix}:{{{prefix}:{key}}}:m").port for key in keys)
    assert len(masters) == 3, masters  # 24 keys over 3 masters: each holds some
    meta = [name for name in _raw_keys(redis_cluster, f"{prefix}:{{{prefix}}}:*")]
    assert {name.rsplit(":", 1)[1] for name in meta} >= {"entry", "lru", "used", "clock"}
    assert len({_slot(redis_cluster, name) for name in meta}) == 1  # the budget's bookkeeping: one slot
    assert store.used_bytes == 24 * 5120 and store.keys("packets/") == keys
    for key in keys:
        store.delete(key)
    assert _raw_keys(redis_cluster, f"{prefix}:{{{prefix}:*") == [] and store.used_bytes == 0


def test_the_budget_and_lru_span_every_master(redis_cluster):
    """Two store objects, keys on all three masters: a put on one master evicts the globally least
    recently used key, wherever it lives; the bytes never exceed the budget."""
    prefix = _prefix()
    one = open_store(redis_cluster.url(f"prefix={prefix}&budget=1000"))
    two = open_store(redis_cluster.url(f"prefix={prefix}&budget=1000"))
    keys = [f"k{i}" for i in range(10)]
    for i, key in enumerate(keys):
        (one if i % 2 else two).put(key, bytes([i]) * 100)
    assert one.used_bytes == 1000 and one.evictions == two.evictions == 0
    for key in keys[::-1][:5]:  # k9..k5 used again: k0..k4 are now the least recently used, oldest first
        assert two.get(key) is not None
    home = {key: redis_cluster.node_of(f"{prefix}:{{{prefix}:{key}}}:m").port for key in keys + ["new"]}
    one.put("new", b"n" * 250)  # needs 250 bytes: k0, k1 and k2 go, wherever they live
    assert one.keys() == sorted(["new"] + keys[3:]) and one.evictions == 3 and one.used_bytes == 950
    assert {home[k] for k in keys[:3]} - {home["new"]}, "no victim on another master than the new key"
    two.put("k5", b"5" * 150)  # replacing k5 frees its 100 bytes first: 950 + 50 fits, nothing evicted
    assert two.evictions == 0 and two.used_bytes == 1000
    two.put("k6", b"6" * 200)  # 100 more than k6 had: the least recently used, k3, goes
    assert two.keys() == sorted(["new", "k4", "k5", "k6", "k7", "k8", "k9"]) and two.used_bytes == 1000
    assert two.evictions == 1 and bytes(one.get("k5")) == b"5" * 150


def test_a_writer_that_dies_holding_a_lock_is_fenced_after_its_lease(redis_cluster, monkeypatch):
    """A writer dies between taking the key's lock and publishing: the next writer of that key waits for the
    lease, fences the dead one (its late publish fails) and goes on; the bytes it reserved are released."""
    prefix = _prefix()
    url = redis_cluster.url(f"prefix={prefix}&budget=10000")
    dead, alive = RedisClusterStore(url), RedisClusterStore(url)
    dead.lease_ms = alive.lease_ms = 300
    dead.put("k", b"old" * 100)
    staged = {}
    real_publish = RedisClusterStore._publish

    def die(self, key, gen, chunks, size, expect, old_gen, old_n):
        staged.update(gen=gen, chunks=chunks, size=size, old_gen=old_gen, old_n=old_n)
        raise Killed

    monkeypatch.setattr(RedisClusterStore, "_publish", die)
    with pytest.raises(Killed):
        dead.put("k", b"new" * 1000)
    monkeypatch.setattr(RedisClusterStore, "_publish", real_publish)
    assert alive.get_versioned("k") == (b"old" * 100, 1)  # nothing published
    assert alive.put("k", b"third" * 10) == 2  # waited out the lease, fenced the dead writer
    status, _ = real_publish(dead, "k", staged["gen"], staged["chunks"], staged["size"], None, staged["old_gen"],
                             staged["old_n"])
    assert status == "fenced"  # the dead writer's late publish cannot land any more
    assert alive.get_versioned("k") == (b"third" * 10, 2) and alive.used_bytes == 50
    client = redis_cluster.node_of(f"{prefix}:{{{prefix}}}:held").raw()
    try:
        assert int(client.get(f"{prefix}:{{{prefix}}}:held") or 0) == 0  # its 2700 reserved bytes are free
        assert client.hlen(f"{prefix}:{{{prefix}}}:lock") == 0
    finally:
        client.close()


def test_a_writer_that_dies_after_publishing_is_recorded_by_the_next_one(redis_cluster, monkeypatch):
    """Published, then dead before recording it: the next put (of any key) settles the expired lock from
    what the key's slot holds, so the byte count matches the values again."""
    prefix = _prefix()
    url = redis_cluster.url(f"prefix={prefix}")
    dead, alive = RedisClusterStore(url), RedisClusterStore(url)
    dead.lease_ms = alive.lease_ms = 300
    real_finish = dead._finish

    def die(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(dead, "_finish", die)
    with pytest.raises(Killed):
        dead.put("a", b"a" * 700)
    monkeypatch.setattr(dead, "_finish", real_finish)
    assert alive.get_versioned("a") == (b"a" * 700, 1)  # published whole
    assert alive.used_bytes == 0  # not recorded yet
    deadline = time.monotonic() + 30
    while True:  # any put after the lease settles it
        alive.put("b", b"b")
        if alive.used_bytes == 701:
            break
        assert time.monotonic() < deadline, "the expired lock was never settled"
        time.sleep(0.05)
    assert alive.keys() == ["a", "b"] and alive.get_versioned("a") == (b"a" * 700, 1)
    alive.put("a", b"A" * 10)  # and the key is usable again
    assert alive.used_bytes == 11


# -- a master killed mid-run ------------------------------------------------------------------------


def _value(key: str, n: int) -> bytes:
    """Write number n of key: self-describing (a reader can tell a whole value from a mix), 20 KB."""
    head = f"{key}#{n}#".encode()
    return (head * (20_000 // len(head) + 1))[:20_000]


def _whole(value: bytes) -> bool:
    key, n, _ = bytes(value).split(b"#", 2)
    return bytes(value) == _value(key.decode(), int(n))


def test_a_master_killed_mid_run(tmp_path):
    """Kill -9 one master (not the metadata's) while a writer and a reader run: no partial value is ever read;
    operations on its slots fail with StoreUnavailable, those on live masters go on; a put that needs an
    eviction skips the unreachable keys. Then the metadata's master dies: puts fail with StoreUnavailable,
    reads still work. Restarted (append-only files), nothing acknowledged is lost and the byte count is exact."""
    from tests.support.redis_server import RedisClusterNodes

    cluster = RedisClusterNodes(tmp_path / "cluster", durable=True).start()
    try:
        prefix = "kill"
        url = cluster.url(f"prefix={prefix}&chunk_size=4KiB&timeout=5&connect_timeout=2")
        store = open_store(url)
        store.lease_ms = 1000
        keys = [f"packets/p{i:02d}" for i in range(18)]
        home = {key: cluster.node_of(f"{prefix}:{{{prefix}:{key}}}:m") for key in keys}
        meta = cluster.node_of(f"{prefix}:{{{prefix}}}:used")
        victim = max((node for node in cluster.nodes if node is not meta),
                     key=lambda node: sum(home[k] is node for k in keys))
        doomed = {key for key in keys if home[key] is victim}
        live = [key for key in keys if key not in doomed]
        assert doomed and live
        written = {key: 0 for key in keys}  # last acknowledged write number
        tried = dict(written)  # last attempted (it may have landed without an acknowledgement)
        for key in keys:
            store.put(key, _value(key, 0))
        outcomes: dict[tuple[str, bool, bool], Counter] = defaultdict(Counter)
        unexpected: list[BaseException] = []
        messages: set[str] = set()
        stop, killed = threading.Event(), threading.Event()

        def run(op: str) -> None:
            i = 0
            while not stop.is_set():
                key = keys[i % len(keys)]
                i += 1
                after = killed.is_set()
                try:
                    if op == "put":
                        tried[key] += 1
                        store.put(key, _value(key, tried[key]))
                        written[key] = tried[key]
                    else:
                        value = store.get(key)
                        if value is None or not _whole(value):
                            unexpected.append(AssertionError(f"{key}: {None if value is None else bytes(value[:40])}"))
                    outcomes[(op, key in doomed, after)]["ok"] += 1
                except StoreUnavailable as err:
                    outcomes[(op, key in doomed, after)]["unavailable"] += 1
                    messages.add(err.message)
                except BaseException as err:  # noqa: BLE001 - collected and reported below
                    unexpected.append(err)

        threads = [threading.Thread(target=run, args=(op,)) for op in ("put", "get")]
        for thread in threads:
            thread.start()

        def enough(after: bool) -> bool:
            return all(outcomes[(op, d, after)].total() >= 2 * len(keys) for op in ("put", "get") for d in (0, 1))

        _until(lambda: enough(False) or unexpected, "operations before the kill")
        victim.kill()
        killed.set()
        _until(lambda: enough(True) or unexpected, "operations after the kill")
        stop.set()
        for thread in threads:
            thread.join()
        assert not unexpected, unexpected[:3]
        for message in messages:  # what a user sees: the cluster, and the node that does not answer
            assert message.startswith("cannot connect to redis cluster at 127.0.0.1:") and \
                f"connecting to 127.0.0.1:{victim.port}" in message, message
        for op in ("put", "get"):
            assert outcomes[(op, True, True)]["unavailable"] > 0, outcomes  # the dead master's slots fail...
            assert outcomes[(op, False, True)] == Counter(ok=outcomes[(op, False, True)]["ok"]), outcomes  # ...alone

        # a put that must evict: the least recently used keys are the dead master's, so it skips them
        for key in live:
            store.get(key)
        used = store.used_bytes
        tight = open_store(url + f"&budget={used}")
        fresh = next(f"packets/new{i}" for i in range(100)
                     if cluster.node_of(f"{prefix}:{{{prefix}:packets/new{i}}}:m") is not victim)
        tight.put(fresh, _value(fresh, 0))
        assert tight.evictions == 1 and tight.used_bytes <= used
        evicted = [key for key in live if not tight.exists(key)]
        assert len(evicted) == 1 and evicted[0] == live[0]  # the least recently used reachable key
        live.remove(evicted[0])

        victim.start()  # same port, directory and node id: replays its append-only file
        cluster.wait_ok()
        for key in doomed:  # nothing acknowledged is lost: the last acknowledged value or a later attempt -- the one
            # in flight at the kill may have landed unacknowledged, and the attempts refused after it counted up `tried`
            attempts = range(written[key], tried[key] + 1)
            assert bytes(store.get(key)) in {_value(key, n) for n in attempts}, (key, written[key], tried[key])

        meta.kill()
        reader = open_store(url)  # a new client finds the cluster through any live startup node
        other = next(key for key in live if home[key] is not meta)
        with pytest.raises(StoreUnavailable):
            store.put(other, b"x")
        assert _whole(reader.get(other))  # reads do not need the metadata's master
        meta.start()
        cluster.wait_ok()

        expected = {key: bytes(store.get(key)) for key in doomed | set(live) | {fresh}}
        assert store.keys() == sorted(expected)
        deadline = time.monotonic() + 30  # locks left by puts that failed mid-way are settled once they expire
        while store.used_bytes != sum(map(len, expected.values())):
            assert time.monotonic() < deadline, (store.used_bytes, sum(map(len, expected.values())))
            store.put("sync", b"")
            expected["sync"] = b""
            time.sleep(0.05)
    finally:
        cluster.stop()


def _until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


def test_store_error_classes_for_the_cluster():
    """Messages of the cluster name it by its startup nodes; a dead startup list is transient."""
    from tests.support.redis_server import free_port, require_redis_server

    require_redis_server()
    port = free_port()
    with pytest.raises(StoreUnavailable, match=rf"cannot connect to redis cluster at 127\.0\.0\.1:{port}"):
        open_store(f"redis+cluster://127.0.0.1:{port}/0?connect_timeout=1")
    assert issubclass(StoreUnavailable, StoreError)
