"""One contract for every store backend, plus what is specific to each."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from kvwire import FileStore, MemoryStore, StoreError, UnknownStoreError, open_store

SHM = Path("/dev/shm")


def _urls():
    yield "memory://"
    yield "memory://shared-contract"
    yield "file://{tmp}/store"
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        yield "file:///dev/shm/kvwire-test-{uid}"


@pytest.fixture(params=list(_urls()))
def store(request, tmp_path):
    url = request.param.format(tmp=tmp_path, uid=uuid.uuid4().hex[:8])
    s = open_store(url)
    for key in s.keys():
        s.delete(key)
    yield s
    for key in s.keys():
        s.delete(key)
    s.close()
    if url.startswith("file:///dev/shm/"):
        import shutil

        shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)


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
                                 "nul\0", "x" * 600])
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


def test_file_store_is_shared_between_processes(tmp_path):
    url = f"file://{tmp_path}/shared"
    code = f"from kvwire import open_store; open_store({url!r}).put('from/child', b'hello from another process')"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert bytes(open_store(url).get("from/child")) == b"hello from another process"


def test_file_store_leaves_no_partial_file_when_a_write_fails(tmp_path, monkeypatch):
    s = FileStore(tmp_path / "s")
    s.put("k", b"old")

    class Boom(Exception):
        pass

    def chunks():
        yield b"new-but-"
        raise Boom

    from kvwire import codec

    with pytest.raises(Boom):
        codec.atomic_write(tmp_path / "s" / "k", chunks())
    assert bytes(s.get("k")) == b"old"
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["k"]  # no temp file left behind


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
