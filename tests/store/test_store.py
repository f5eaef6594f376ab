"""One contract for every store backend (memory, file, a real Redis, a real Redis Cluster of three masters),
plus what is specific to each (the cluster's own tests are in test_cluster.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from kvwire import FileStore, MemoryStore, StoreError, UnknownStoreError, open_store
from kvwire.errors import VersionConflict

SHM = Path("/dev/shm")
BACKENDS = ["memory", "memory-named", "file", "file-shm", "redis", "cluster"]


class Backend:
    """Opens stores of one backend; every open of one Backend reaches the same data, except
    for the private ``memory://`` (``shared`` is False there)."""

    def __init__(self, kind: str, tmp: Path, request) -> None:
        uid = uuid.uuid4().hex[:8]
        self.kind, self.shared, self.opened, self.cleanup = kind, kind != "memory", [], []
        if kind == "memory":
            self.url = "memory://"
        elif kind == "memory-named":
            self.url = f"memory://contract-{uid}"
        elif kind == "file":
            self.url = f"file://{tmp}/store"
        elif kind == "file-shm":
            if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
                pytest.skip("/dev/shm is not writable here")
            self.url = f"file:///dev/shm/kvwire-test-{uid}"
            self.cleanup.append(lambda: shutil.rmtree(f"/dev/shm/kvwire-test-{uid}", ignore_errors=True))
        elif kind == "redis":
            server = request.getfixturevalue("redis_server")
            self.url = server.url(f"prefix=test-{uid}")
        else:
            cluster = request.getfixturevalue("redis_cluster")
            self.url = cluster.url(f"prefix=test-{uid}")

    def open(self, query: str = ""):
        url = self.url + (("&" if "?" in self.url else "?") + query if query else "")
        store = open_store(url)
        self.opened.append(store)
        return store

    def close(self) -> None:
        for store in self.opened:
            for key in store.keys():
                store.delete(key)
            store.close()
        for step in self.cleanup:
            step()


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    b = Backend(request.param, tmp_path, request)
    yield b
    b.close()


@pytest.fixture
def store(backend):
    return backend.open()


def test_contract_put_get_exists_delete_keys(store):
    assert store.get("packets/a") is None and not store.exists("packets/a")
    store.put("packets/a", b"alpha")
    store.put("packets/b", bytearray(b"beta"))
    store.put("sessions/s1/handoff/0-x", memoryview(b"{}"))
    assert bytes(store.get("packets/a")) == b"alpha" and bytes(store.get("packets/b")) == b"beta"
    assert store.exists("packets/a")
    assert store.keys("packets/") == ["packets/a", "packets/b"]
    assert store.keys() == ["packets/a", "packets/b", "sessions/s1/handoff/0-x"]
    store.put("packets/a", b"overwritten")
    assert bytes(store.get("packets/a")) == b"overwritten"
    assert store.delete("packets/a") and not store.delete("packets/a")
    assert store.get("packets/a") is None


def test_contract_large_and_empty_values(store):
    big = os.urandom(8 << 20)
    store.put("big", big)
    assert bytes(store.get("big")) == big
    store.put("empty", b"")
    assert bytes(store.get("empty")) == b""


def test_contract_values_are_isolated_from_the_callers_buffer(store):
    data = bytearray(b"original")
    store.put("k", data)
    data[:] = b"mutated!"
    assert bytes(store.get("k")) == b"original"


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../escape", "a/../../b", "a/./b", "sp ace", "a\\b",
                                 "nul\0", "x" * 600,
                                 ".hidden", "a/.kvwire/b"])
def test_contract_bad_keys_are_refused(store, key):
    with pytest.raises(StoreError):
        store.put(key, b"x")
    with pytest.raises(StoreError):
        store.get(key)


def test_contract_readers_never_see_a_partial_value(store):
    """A reader racing a writer sees one whole value or the other, never a mix."""
    a, b = b"A" * (4 << 20), b"B" * (4 << 20)
    store.put("race", a)
    stop = threading.Event()
    seen, bad = set(), []

    def read():
        while not stop.is_set():
            value = bytes(store.get("race"))
            seen.add(value[:1])
            if value not in (a, b):
                bad.append(len(value))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(20):
        store.put("race", b if i % 2 == 0 else a)
    stop.set()
    reader.join()
    assert not bad


# -- versions and compare-and-set ---------------------------------------------------------------


def test_contract_versions_count_puts_and_restart_after_delete(store):
    assert store.get_versioned("k") is None
    assert store.put("k", b"one") == 1
    assert store.put("k", b"two") == 2
    value, version = store.get_versioned("k")
    assert (bytes(value), version) == (b"two", 2)
    assert store.put("k", b"three", expect_version=2) == 3
    assert store.delete("k") and store.get_versioned("k") is None
    assert store.put("k", b"again", expect_version=0) == 1  # 0: only if absent
    store.put("empty", b"")
    assert [bytes(v) for v in store.get_versioned("empty")[:1]] == [b""]


def test_contract_a_stale_writer_is_rejected_and_changes_nothing(store):
    store.put("k", b"first")
    with pytest.raises(VersionConflict, match="at version 1, the writer expected version 0") as caught:
        store.put("k", b"create-only", expect_version=0)
    assert (caught.value.key, caught.value.expected, caught.value.actual) == ("k", 0, 1)
    assert isinstance(caught.value, StoreError)
    store.put("k", b"second")
    with pytest.raises(VersionConflict, match="get_versioned"):
        store.put("k", b"stale", expect_version=1)
    with pytest.raises(VersionConflict, match="is absent"):
        store.put("missing", b"x", expect_version=3)
    value, version = store.get_versioned("k")
    assert (bytes(value), version) == (b"second", 2)
    assert store.get("missing") is None and store.keys() == ["k"]


@pytest.mark.parametrize("bad", [-1, 1.0, "1", True])
def test_contract_expect_version_must_be_a_count(store, bad):
    with pytest.raises(StoreError, match="expect_version"):
        store.put("k", b"x", expect_version=bad)


def test_contract_racing_writers_with_the_same_version_exactly_one_wins(backend):
    """Eight writers read version 1 and all put with expect_version=1 at once: one wins, seven are told."""
    writers = 8
    first = backend.open()
    first.put("race/k", b"base")
    stores = [backend.open() for _ in range(writers)] if backend.shared else [first] * writers
    barrier = threading.Barrier(writers)
    won, lost = [], []

    def write(i: int) -> None:
        barrier.wait()
        try:
            won.append((i, stores[i].put("race/k", f"writer-{i}".encode() * 1000, expect_version=1)))
        except VersionConflict as err:
            lost.append(err.actual)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == writers - 1 and set(lost) == {2}
    (winner, version), = won
    value, stored_version = first.get_versioned("race/k")
    assert version == stored_version == 2 and bytes(value) == f"writer-{winner}".encode() * 1000


# -- byte budget and least-recently-used eviction ---------------------------------------------------


def test_contract_budget_evicts_least_recently_used(backend):
    store = backend.open("budget=100")
    assert store.budget == 100 and store.used_bytes == 0 and store.evictions == 0
    store.put("a", b"a" * 40)
    store.put("b", b"b" * 40)
    assert store.used_bytes == 80
    assert bytes(store.get("a")) == b"a" * 40  # a is now used more recently than b
    store.put("c", b"c" * 40)  # 120 > 100: b goes
    assert store.keys() == ["a", "c"] and store.evictions == 1 and store.used_bytes == 80
    store.get_versioned("a")
    store.put("c", b"C" * 60)  # replacing c frees its 40 bytes first: 40 + 60 fits, nothing evicted
    assert store.keys() == ["a", "c"] and store.evictions == 1 and store.used_bytes == 100
    store.put("d", b"d" * 30)  # a was read before c was put again: a is the least recently used
    assert store.keys() == ["c", "d"] and store.evictions == 2 and store.used_bytes == 90
    assert bytes(store.get("c")) == b"C" * 60 and bytes(store.get("d")) == b"d" * 30


def test_contract_budget_evicts_as_many_keys_as_needed_and_never_a_partial_value(backend):
    store = backend.open("budget=1KiB")
    assert store.budget == 1024
    for i in range(10):
        store.put(f"small/{i}", bytes([i]) * 100)
    store.put("big", b"x" * 1000)  # needs all ten small ones gone
    assert store.keys() == ["big"] and store.evictions == 10 and store.used_bytes == 1000
    for i in range(10):
        assert store.get(f"small/{i}") is None and store.get_versioned(f"small/{i}") is None


def test_contract_a_value_larger_than_the_budget_is_refused_and_stores_nothing(backend):
    store = backend.open("budget=64")
    store.put("k", b"kept")
    with pytest.raises(StoreError, match=r"'huge' is 65 bytes, more than the whole budget of 64 bytes"):
        store.put("huge", b"h" * 65)
    with pytest.raises(StoreError, match=r"is 65 bytes"):
        store.put("k", b"h" * 65)
    assert store.keys() == ["k"] and bytes(store.get("k")) == b"kept" and store.used_bytes == 4
    assert store.evictions == 0


def test_contract_a_conflicting_put_evicts_nothing(backend):
    store = backend.open("budget=100")
    store.put("a", b"a" * 60)
    store.put("b", b"b" * 30)
    with pytest.raises(VersionConflict):
        store.put("b", b"b" * 80, expect_version=7)
    assert store.keys() == ["a", "b"] and store.evictions == 0 and store.used_bytes == 90


def test_contract_used_bytes_without_a_budget(store):
    assert store.budget is None
    store.put("a", b"12345")
    store.put("b", b"123")
    store.put("a", b"1")
    assert store.used_bytes == 4
    store.delete("b")
    assert store.used_bytes == 1 and store.evictions == 0


@pytest.mark.parametrize("text, size", [("4096", 4096), ("64MiB", 64 << 20), ("1kb", 1000), ("2 GiB", 2 << 30),
                                        ("7B", 7), ("3GB", 3 * 10**9)])
def test_budget_sizes_in_urls(text, size, tmp_path):
    assert open_store(f"memory://?budget={text}").budget == size
    assert open_store(f"file://{tmp_path}/b?budget={text}").budget == size
    assert MemoryStore(budget=text).budget == size and FileStore(tmp_path / "c", budget=size).budget == size


@pytest.mark.parametrize("url, message", [
    ("memory://?budget=lots", "not a byte count"),
    ("memory://?budget=0", "at least one byte"),
    ("memory://?budget=12XB", "not a byte count"),
    ("memory://?size=1", "unknown parameter 'size'"),
    ("memory://?budget=1&budget=2", "twice"),
])
def test_bad_budgets_are_refused(url, message):
    with pytest.raises(StoreError, match=message):
        open_store(url)


def test_file_store_is_shared_between_processes(tmp_path):
    url = f"file://{tmp_path}/shared"
    code = f"from kvwire import open_store; open_store({url!r}).put('from/child', b'hello from another process')"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert bytes(open_store(url).get("from/child")) == b"hello from another process"


def test_file_store_compare_and_set_holds_across_processes(tmp_path):
    """Three processes put with expect_version=1 at the same moment: the flock lets exactly one win."""
    url = f"file://{tmp_path}/cas"
    open_store(url).put("k", b"base")
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "from kvwire import open_store\n"
        "from kvwire.errors import VersionConflict\n"
        "store = open_store(sys.argv[1])\n"
        "while not os.path.exists(sys.argv[2]):\n"
        "    time.sleep(0.001)\n"
        "try:\n"
        "    print('won', store.put('k', sys.argv[3].encode() * 100000, expect_version=1))\n"
        "except VersionConflict as err:\n"
        "    print('lost', err.actual)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(go), f"w{i}"], stdout=subprocess.PIPE, text=True)
             for i in range(3)]
    go.touch()
    outputs = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outputs == ["lost 2", "lost 2", "won 2"]
    value, version = open_store(url).get_versioned("k")
    assert version == 2 and bytes(value)[:2] in (b"w0", b"w1", b"w2")


def test_file_store_bookkeeping_stays_out_of_keys_and_old_values_count_as_version_1(tmp_path):
    s = FileStore(tmp_path / "s")
    s.put("packets/a", b"x")
    (tmp_path / "s" / "packets" / ".a.123.tmp").write_bytes(b"a dead writer's leftover")
    (tmp_path / "s" / "legacy").write_bytes(b"written before versions existed")
    assert s.keys() == ["legacy", "packets/a"] and s.used_bytes == 1 + 31
    assert s.get_versioned("legacy")[1] == 1 and s.put("legacy", b"new", expect_version=1) == 2


def test_file_store_leaves_no_partial_file_when_a_write_fails(tmp_path, monkeypatch):
    s = FileStore(tmp_path / "s")
    s.put("k", b"old")

    real_replace = os.replace

    def disk_full(src, dst):  # the version record lands, then renaming the value fails
        if Path(dst) == tmp_path / "s" / "k":
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr("kvwire.store.file.os.replace", disk_full)
        with pytest.raises(StoreError, match="cannot write .*No space left"):
            s.put("k", b"new")
    value, version = s.get_versioned("k")
    assert bytes(value) == b"old" and version == 2  # the version moved on (a stale writer stays rejected)
    assert s.put("k", b"new", expect_version=2) == 3
    s.put("k", b"old")

    class Boom(Exception):
        pass

    def chunks():
        yield b"new-but-"
        raise Boom

    from kvwire.wire import codec

    with pytest.raises(Boom):
        codec.atomic_write(tmp_path / "s" / "k", chunks())
    assert bytes(s.get("k")) == b"old"
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [".kvwire", "k"]  # no temp file left behind


def test_named_memory_stores_share_within_a_process():
    one, two = open_store("memory://team-x"), open_store("memory://team-x")
    one.put("k", b"v")
    assert two.get("k") == b"v"
    assert open_store("memory://").get("k") is None  # a bare memory:// is private


@pytest.mark.parametrize("url, message", [
    ("redis+bogus://x", "unknown store URL"),
    ("s3://bucket/x", "unknown store URL"),
    ("file://otherhost/dir", "names host"),
    ("memory://a/b", "bad memory store URL"),
    ("", "non-empty"),
])
def test_unknown_urls_are_refused(url, message):
    with pytest.raises(UnknownStoreError, match=message):
        open_store(url)


def test_unwritable_directory_is_a_store_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create"):
        FileStore(tmp_path / "file" / "sub")


def test_memory_store_is_the_default():
    assert isinstance(open_store(), MemoryStore)


# -- Redis: a real redis-server, started by the tests ------------------------------------------------


def _chunk_keys(server, prefix: str) -> list[bytes]:
    client = server.raw()
    try:
        return sorted(client.scan_iter(match=f"{prefix}:c:*", count=1000))
    finally:
        client.close()


def test_redis_large_values_are_split_into_chunks_and_swapped_whole(redis_server):
    from kvwire.store import RedisStore

    prefix = f"chunks-{uuid.uuid4().hex[:8]}"
    store = RedisStore(redis_server.url(f"prefix={prefix}"), chunk_size=1000)
    big = os.urandom(10_007)
    assert store.put("packets/big", big) == 1
    assert len(_chunk_keys(redis_server, prefix)) == 11
    assert store.get_versioned("packets/big") == (big, 1)
    with pytest.raises(VersionConflict, match="at version 1"):  # refused before any chunk is uploaded
        store.put("packets/big", big[::-1], expect_version=0)
    assert len(_chunk_keys(redis_server, prefix)) == 11
    assert store.put("packets/big", b"small") == 2
    assert len(_chunk_keys(redis_server, prefix)) == 1  # the old generation's chunks are gone
    assert store.get("packets/big") == b"small" and store.used_bytes == 5
    store.put("packets/empty", b"")
    assert store.get("packets/empty") == b"" and store.keys() == ["packets/big", "packets/empty"]
    store.delete("packets/big")
    assert _chunk_keys(redis_server, prefix) == [] and store.used_bytes == 0
    store.close()


def test_redis_readers_never_see_a_mix_of_chunk_generations(redis_server):
    prefix = f"mix-{uuid.uuid4().hex[:8]}"
    writer = open_store(redis_server.url(f"prefix={prefix}&chunk_size=64KiB"))
    reader = open_store(redis_server.url(f"prefix={prefix}"))
    values = [bytes([i]) * (1 << 20) for i in range(4)]  # 16 chunks each
    writer.put("k", values[0])
    stop, bad = threading.Event(), []

    def read():
        while not stop.is_set():
            value, version = reader.get_versioned("k")
            if value != values[(version - 1) % 4]:
                bad.append(version)

    thread = threading.Thread(target=read)
    thread.start()
    for i in range(1, 24):
        writer.put("k", values[i % 4])
    stop.set()
    thread.join()
    assert not bad


def test_redis_server_down_at_start_says_what_to_do():
    from tests.support.redis_server import free_port, require_redis_server

    require_redis_server()
    port = free_port()
    with pytest.raises(StoreError, match=rf"cannot connect to redis at 127\.0\.0\.1:{port}: connection refused "
                                         r"- is redis-server running\?"):
        open_store(f"redis://127.0.0.1:{port}/0?connect_timeout=2")


def test_redis_wrong_or_missing_password(tmp_path, monkeypatch):
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "auth", password="s3cret-pass").start()
    try:
        monkeypatch.delenv("KVWIRE_REDIS_PASSWORD", raising=False)
        with pytest.raises(StoreError, match="refused the password for user 'default'") as caught:
            open_store(server.url(password="wrong"))
        assert "wrong" not in str(caught.value)  # the password never appears in a message
        with pytest.raises(StoreError, match="requires a password and none was given"):
            open_store(server.url(password=""))
        with pytest.raises(StoreError, match="refused the password for user 'nobody'"):
            open_store(f"redis://nobody:s3cret-pass@127.0.0.1:{server.port}/0")
        store = open_store(server.url())
        assert store.put("k", b"v") == 1 and "s3cret" not in store.url and "s3cret" not in repr(store)
        monkeypatch.setenv("KVWIRE_REDIS_PASSWORD", "s3cret-pass")
        assert open_store(f"redis://127.0.0.1:{server.port}/0").get("k") == b"v"
    finally:
        server.stop()


def test_redis_acl_user_limited_to_the_stores_prefix(tmp_path):
    """The ACL line documented for multi-host setups is enough for kvwire, and nothing more."""
    from tests.support.redis_server import RedisServer

    acl = ("--user", "kvwire", "on", ">acl-pass", "~kvwire:*", "+@read", "+@write", "+@keyspace", "+@scripting",
           "+@connection", "-@dangerous")
    server = RedisServer(tmp_path / "acl", extra=acl).start()
    try:
        store = open_store(f"redis://kvwire:acl-pass@127.0.0.1:{server.port}/0?budget=100&chunk_size=16")
        assert store.put("a", b"x" * 60) == 1 and store.put("b", b"y" * 60) == 1 and store.keys() == ["b"]
        assert store.get_versioned("b") == (b"y" * 60, 1) and store.delete("b") and store.used_bytes == 0
        other = open_store(f"redis://kvwire:acl-pass@127.0.0.1:{server.port}/0?prefix=elsewhere")
        with pytest.raises(StoreError, match=r"user 'kvwire' .* may not store 'a'.*grant it ~elsewhere:\*"):
            other.put("a", b"x")
    finally:
        server.stop()


def test_redis_killed_mid_run_then_restarted_keeps_every_acknowledged_value(tmp_path):
    """kill -9 while a writer publishes chunked values: the next operation raises StoreError;
    after a restart (appendonly, appendfsync always) every value is whole and matches its version."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "durable", durable=True).start()
    try:
        url = server.url("chunk_size=16KiB&timeout=5")
        store = open_store(url)
        kept = os.urandom(100_000)
        store.put("kept", kept)

        def value(version: int) -> bytes:
            return bytes([version % 256]) * (200_000 + version)

        acknowledged, errors, started = [], [], threading.Event()

        def write() -> None:
            for version in range(1, 10_000):
                try:
                    acknowledged.append(store.put("busy", value(version), expect_version=version - 1))
                except StoreError as err:
                    errors.append(err)
                    return
                if version == 5:
                    started.set()

        thread = threading.Thread(target=write)
        thread.start()
        assert started.wait(60)
        server.kill()
        thread.join(60)
        assert len(acknowledged) >= 5 and errors and "cannot connect to redis" in str(errors[0])
        with pytest.raises(StoreError, match=r"connection refused - is redis-server running\?"):
            store.get("kept")

        server.start()  # same port and directory: replays the append-only file
        assert store.get("kept") == kept  # the old store object reconnects by itself
        got, version = store.get_versioned("busy")
        assert version in (acknowledged[-1], acknowledged[-1] + 1)  # the last put may have landed unacknowledged
        assert got == value(version)
        assert open_store(url).keys() == ["busy", "kept"]
        store.close()
    finally:
        server.stop()


def test_redis_a_writer_that_dies_before_publishing_leaves_nothing_visible(redis_server, monkeypatch):
    from kvwire.store import RedisStore

    prefix = f"dies-{uuid.uuid4().hex[:8]}"
    store = RedisStore(redis_server.url(f"prefix={prefix}"), chunk_size=100)
    store.put("k", b"old" * 100)

    class Killed(Exception):
        pass

    def die(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(store, "_commit", die)
    with pytest.raises(Killed):
        store.put("k", b"new" * 100)
    with pytest.raises(Killed):
        store.put("other", b"x" * 1000)
    monkeypatch.undo()
    assert store.get_versioned("k") == (b"old" * 100, 1) and store.keys() == ["k"] and store.used_bytes == 300
    client = redis_server.raw()
    staged = [name for name in _chunk_keys(redis_server, prefix) if client.pttl(name) > 0]
    client.close()
    assert len(staged) == 3 + 10  # the dead writers' chunks, left to expire (one hour)


def test_redis_tls_with_a_self_signed_ca(tmp_path):
    from tests.support.redis_server import RedisServer, make_tls_files, require_redis_server

    require_redis_server()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a certificate")
    tls = make_tls_files(tmp_path / "tls")
    server = RedisServer(tmp_path / "tls-server", tls=tls).start()
    try:
        store = open_store(server.url("chunk_size=1KiB"))
        data = os.urandom(5000)
        assert store.put("k", data) == 1 and store.get_versioned("k") == (data, 1)
        store.close()
        with pytest.raises(StoreError, match="TLS with redis at 127.0.0.1:.*ssl_ca_certs"):
            open_store(f"rediss://127.0.0.1:{server.port}/0?connect_timeout=5")  # the system CAs do not know it
        with pytest.raises(StoreError, match="cannot connect|TLS"):
            open_store(f"redis://127.0.0.1:{server.port}/0?timeout=2&connect_timeout=2")  # plain text to a TLS port
    finally:
        server.stop()


def test_redis_budget_is_shared_by_every_store_object_on_the_server(redis_server):
    prefix = f"shared-budget-{uuid.uuid4().hex[:8]}"
    one = open_store(redis_server.url(f"prefix={prefix}&budget=100"))
    two = open_store(redis_server.url(f"prefix={prefix}&budget=100"))
    one.put("a", b"a" * 50)
    two.put("b", b"b" * 50)
    assert one.get("a") == b"a" * 50  # b is now the least recently used, whoever wrote it
    two.put("c", b"c" * 50)
    assert one.keys() == ["a", "c"] and two.evictions == 1 and one.used_bytes == 100


def test_redis_urls_are_parsed_without_connecting():
    from kvwire.store.redis import DEFAULT_CHUNK_SIZE, RedisConfig, parse_redis_url, redact

    assert parse_redis_url("redis://", environ={}) == RedisConfig()
    config = parse_redis_url("rediss://alice:p%40ss@cache.internal:7000/3?budget=1GiB&prefix=team-a&"
                             "chunk_size=64MiB&connect_timeout=2.5&timeout=60&ssl_ca_certs=/etc/ca.pem"
                             "&ssl_cert_reqs=required", environ={})
    assert config == RedisConfig(host="cache.internal", port=7000, db=3, username="alice", password="p@ss",
                                 tls=True, prefix="team-a", budget=1 << 30, chunk_size=64 << 20,
                                 connect_timeout=2.5, timeout=60.0, ssl_ca_certs="/etc/ca.pem")
    assert parse_redis_url("redis://:pw@[::1]:6380", environ={}).address == "[::1]:6380"
    assert parse_redis_url("redis://h", environ={"KVWIRE_REDIS_PASSWORD": "from-env"}).password == "from-env"
    assert parse_redis_url("redis://:in-url@h", environ={"KVWIRE_REDIS_PASSWORD": "x"}).password == "in-url"
    assert parse_redis_url("redis://h/0", environ={}).chunk_size == DEFAULT_CHUNK_SIZE
    assert redact("redis://alice:secret@h:1/0?budget=1") == "redis://alice:***@h:1/0?budget=1"
    assert redact("rediss://:secret@h") == "rediss://:***@h" and redact("redis://h") == "redis://h"


@pytest.mark.parametrize("url, message", [
    ("redis://h:99999/0", "bad port"),
    ("redis://h/zero", "names database 'zero'"),
    ("redis://h/0?ssl_ca_certs=/x", "without TLS"),
    ("redis://h/0?prefix=a:b", "prefix"),
    ("redis://h/0?chunk_size=1GiB", "chunk_size must be between"),
    ("redis://h/0?timeout=-1", "positive number of seconds"),
    ("redis://h/0?timeout=soon", "number of seconds"),
    ("redis://h/0?budget=0", "at least one byte"),
    ("redis://h/0?db=1", "unknown parameter 'db'"),
    ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
    ("redis://:hunter2@h/0#frag", "fragment"),
])
def test_redis_bad_urls_are_refused_before_connecting(url, message):
    from kvwire.store.redis import parse_redis_url

    with pytest.raises(StoreError, match=message) as caught:
        parse_redis_url(url, environ={})
    assert "hunter2" not in str(caught.value)
