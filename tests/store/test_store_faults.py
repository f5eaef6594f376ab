"""Transient and permanent store faults, each against a real redis-server configured to cause it.

Permanent faults -- a wrong or missing password, an ACL user without the rights kvwire
needs, a TLS certificate that does not verify against the given CA, a database the
server does not have, an unknown URL parameter -- raise a
:class:`~kvwire.errors.StoreConfigError` (:class:`~kvwire.errors.StoreAccessDenied` for
credentials and ACLs) whose hint says what to fix, and are never retried: the retry
count stays 0, in-process and in ``kvwire agent``, which exits at once with one
``error:`` line. A transient fault (the server killed, then restarted) raises
:class:`~kvwire.errors.StoreUnavailable` and is retried until the server is back.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvwire
from kvwire import StoreAccessDenied, StoreConfigError, StoreUnavailable, UnknownStoreError, open_store
from kvwire.pipeline.worker import Backoff, Retry, connect

PASSWORD = "s3cret-pass"
HANDOFF = "sessions/s/r0/handoff/0-A"
PIPELINE = """
name = "one"
input_text = "x"
max_new_tokens = 1

[[agents]]
name = "A"
instruction = "Say hi."
"""
SRC = Path(kvwire.__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
ENV.pop("KVWIRE_REDIS_PASSWORD", None)


@dataclass(frozen=True)
class Case:
    """A misconfiguration: the URL that hits it, the error class, the message and the hint it gives."""

    url: str
    error: type[Exception]
    message: str  # a regular expression the message matches
    hint: str  # and one the hint matches
    on_put: bool = False  # connecting works; the first command on kvwire's keys fails


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory):
    """requirepass, a single database, and an ACL user who may only touch other keys than kvwire's."""
    from tests.support.redis_server import RedisServer

    acl = ("--user", "stranger", "on", ">stranger-pass", "~other:*", "+@all")
    server = RedisServer(tmp_path_factory.mktemp("locked"), password=PASSWORD,
                         extra=("--databases", "1", *acl)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def foreign_ca_server(tmp_path_factory):
    """A TLS server whose certificate another CA signed than the one the client is given."""
    from tests.support.redis_server import RedisServer, make_ca, make_tls_files, require_redis_server

    require_redis_server()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make certificates")
    root = tmp_path_factory.mktemp("tls")
    server = RedisServer(root / "server", tls=make_tls_files(root / "real-ca")).start()
    other_ca, _ = make_ca(root / "other-ca", "some other CA")
    yield server, other_ca
    server.stop()


@pytest.fixture(scope="module")
def cases(locked_server, foreign_ca_server) -> dict[str, Case]:
    port = locked_server.port
    tls_server, other_ca = foreign_ca_server
    return {
        "wrong password": Case(f"redis://:not-the-password@127.0.0.1:{port}/0", StoreAccessDenied,
                               rf"redis at 127\.0\.0\.1:{port} refused the password for user 'default'",
                               "check the user and password"),
        "no password": Case(f"redis://127.0.0.1:{port}/0", StoreAccessDenied,
                            rf"redis at 127\.0\.0\.1:{port} requires a password and none was given",
                            "KVWIRE_REDIS_PASSWORD"),
        "ACL denial": Case(f"redis://stranger:stranger-pass@127.0.0.1:{port}/0", StoreAccessDenied,
                           rf"the redis user 'stranger' at 127\.0\.0\.1:{port} may not (store|read) '{HANDOFF}'",
                           r"grant it ~kvwire:\*", on_put=True),
        "no such database": Case(f"redis://:{PASSWORD}@127.0.0.1:{port}/5", StoreConfigError,
                                 rf"redis at 127\.0\.0\.1:{port} has no database 5 \(ERR DB index is out of range\)",
                                 "use a database the server has"),
        "TLS not verified": Case(f"rediss://127.0.0.1:{tls_server.port}/0?ssl_ca_certs={other_ca}&connect_timeout=5",
                                 StoreConfigError,
                                 rf"TLS with redis at 127\.0\.0\.1:{tls_server.port} failed: .*certificate verify "
                                 "failed", "ssl_ca_certs"),
        "unknown parameter": Case(f"redis://:{PASSWORD}@127.0.0.1:{port}/0?retries=3", UnknownStoreError,
                                  r"unknown parameter 'retries'", "accepted: budget, prefix"),
    }


CASES = ["wrong password", "no password", "ACL denial", "no such database", "TLS not verified", "unknown parameter"]


@pytest.mark.parametrize("name", CASES)
def test_a_permanent_fault_fails_at_once_without_a_retry(name, cases, caplog, monkeypatch):
    case = cases[name]
    monkeypatch.delenv("KVWIRE_REDIS_PASSWORD", raising=False)
    retry = Retry(5, Backoff(0.01, 2.0, 0.05))
    with caplog.at_level(logging.WARNING, logger="kvwire.pipeline.worker"):
        with pytest.raises(case.error, match=case.message) as caught:
            store = connect(case.url, retry)
            assert case.on_put, f"{name}: connecting should have failed"
            try:
                with pytest.raises(case.error, match=case.message):
                    store.put(HANDOFF, b"turn", expect_version=0)
                store.get(HANDOFF)  # a read runs a script: denied the same way
            finally:
                assert store.retried == 0
                store.close()
    err = caught.value
    assert isinstance(err, StoreConfigError) and not isinstance(err, StoreUnavailable)
    assert err.hint is not None and re.search(case.hint, err.hint), err.hint  # it says what to fix
    assert [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()] == []  # retried 0 times
    assert PASSWORD not in str(err) and "stranger-pass" not in str(err)


def _agent_args(pipeline: Path, url: str) -> list[str]:
    return ["agent", str(pipeline), "--name", "A", "--session", "s", "--store", url, "--retries", "5"]


@pytest.mark.parametrize("name", CASES)
def test_kvwire_agent_stops_at_once_with_one_line(name, cases, tmp_path, capsys, monkeypatch):
    """``kvwire agent --retries 5`` (its ``main``, in this process): exit 1 at once, before loading a model,
    with one ``error:`` line naming the store and what to fix, and no retry reported."""
    from kvwire.cli import main

    case = cases[name]
    pipeline = tmp_path / "one.toml"
    pipeline.write_text(PIPELINE)
    monkeypatch.delenv("KVWIRE_REDIS_PASSWORD", raising=False)
    monkeypatch.setattr(sys, "argv", ["kvwire", *_agent_args(pipeline, case.url)])
    with pytest.raises(SystemExit) as exited:
        main()
    stderr = " ".join(capsys.readouterr().err.split())  # one line, however the console wrapped it
    assert exited.value.code == 1 and stderr.count("error:") == 1 and "Traceback" not in stderr, stderr
    assert re.search(case.message, stderr) and re.search(case.hint, stderr), stderr
    assert "attempt" not in stderr and "loading model" not in stderr, stderr


def test_an_agent_process_denied_by_an_acl_exits_at_once(cases, tmp_path):
    """The same as a real process: it connects, is refused its first read, and exits 1 without retrying."""
    pipeline = tmp_path / "one.toml"
    pipeline.write_text(PIPELINE)
    case = cases["ACL denial"]
    proc = subprocess.run([sys.executable, "-m", "kvwire", *_agent_args(pipeline, case.url)],
                          capture_output=True, text=True, env=ENV, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(case.message, lines[0]) and re.search(case.hint, lines[0]), lines[0]
    assert "attempt" not in proc.stderr, proc.stderr


def test_a_transient_fault_is_retried_until_the_server_is_back(tmp_path):
    """The server is killed (kill -9) under a reader and restarted from its append-only file: the read is
    retried -- the retry count is above zero -- and returns the value stored before the kill."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "durable", durable=True).start()
    try:
        store = connect(server.url("timeout=5&connect_timeout=2"), Retry(200, Backoff(0.02, 1.5, 0.1)))
        store.put("packets/kept", b"kept" * 1000)
        server.kill()
        got: list[bytes | None] = []
        reader = threading.Thread(target=lambda: got.append(bytes(store.get("packets/kept"))))
        reader.start()
        deadline = time.monotonic() + 60
        while store.retried == 0:  # the reader hit the dead server and is backing off
            assert time.monotonic() < deadline and reader.is_alive(), "no retry happened"
            time.sleep(0.01)
        server.start()
        reader.join(60)
        assert got == [b"kept" * 1000] and store.retried >= 1
        with pytest.raises(StoreUnavailable, match="gave up after 2 attempts"):  # and when it stays down...
            server.kill()
            connect(server.url("connect_timeout=1"), Retry(1, Backoff(0.01)))
    finally:
        server.stop()
    assert issubclass(StoreUnavailable, kvwire.StoreError) and not issubclass(StoreUnavailable, StoreConfigError)
    with pytest.raises(StoreUnavailable):
        open_store(f"redis://127.0.0.1:{server.port}/0?connect_timeout=1")


def _classify(err: Exception, cluster: bool) -> type:
    from kvwire.store.redis_common import parse_redis_url, store_error

    url = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001" if cluster else "redis://127.0.0.1:6379/0"
    return type(store_error(err, parse_redis_url(url, environ={}), "read 'k'"))


def test_the_classification_table():
    """The faults a cluster in failover or resharding answers with (hard to provoke on demand, so built here
    from redis-py's own exception classes, as its parser builds them from the server's replies)."""
    import redis.exceptions as rx

    transient = [rx.ConnectionError("Error 104 while reading from 127.0.0.1:7000: Connection reset by peer"),
                 rx.TimeoutError("Timeout reading from socket"), rx.BusyLoadingError("Redis is loading the dataset"),
                 rx.TryAgainError("Multiple keys request during rehashing of slot"),
                 rx.ClusterDownError("The cluster is down"), rx.MasterDownError("Link with MASTER is down"),
                 rx.MovedError("3999 127.0.0.1:7001"), rx.ClusterError("TTL exhausted."),
                 rx.SlotNotCoveredError('Slot "3999" is not covered by the cluster.'),
                 rx.ResponseError("BUSY Redis is busy running a script.")]
    for err in transient:
        assert _classify(err, cluster=True) is StoreUnavailable, err
    assert _classify(rx.ReadOnlyError("You can't write against a read only replica."), cluster=True) \
        is StoreUnavailable  # mid-failover in a cluster...
    assert _classify(rx.ReadOnlyError("You can't write against a read only replica."), cluster=False) \
        is StoreConfigError  # ...but a single-server URL naming a replica is a mistake to fix
    assert _classify(rx.MovedError("3999 127.0.0.1:7001"), cluster=False) is StoreConfigError  # redis:// at a node
    permanent = {rx.NoPermissionError("this user has no permissions to run the 'evalsha' command"): StoreAccessDenied,
                 rx.AuthenticationError("invalid username-password pair"): StoreAccessDenied,
                 rx.ResponseError("DB index is out of range"): StoreConfigError,
                 rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."): StoreConfigError,
                 rx.ResponseError("MISCONF Redis is configured to save RDB snapshots"): StoreConfigError,
                 rx.ResponseError("unknown command 'EVALSHA'"): StoreConfigError}
    for err, expected in permanent.items():
        for cluster in (False, True):
            assert _classify(err, cluster) is expected, err


def test_a_server_refuses_a_permanent_fault_at_start_and_degrades_on_a_transient_one(cases):
    """``kvwire serve``'s store guard: a wrong password is the configuration's to fix, so opening raises;
    an unreachable server only degrades it (serving without reuse, retried later)."""
    from tests.support.redis_server import free_port

    from kvwire.serve.reuse import StoreGuard

    with pytest.raises(StoreAccessDenied, match="refused the password"):
        StoreGuard(cases["wrong password"].url, retry_s=60).open()
    with pytest.raises(StoreConfigError, match="has no database 5"):
        StoreGuard(cases["no such database"].url, retry_s=60).open()
    states = []
    down = StoreGuard(f"redis://127.0.0.1:{free_port()}/0?connect_timeout=1", retry_s=60, on_state=states.append)
    down.open()
    assert down.state == "degraded" and states == ["degraded"] and "connection refused" in down.error


def test_a_server_that_never_replies_costs_one_timeout_per_call_not_two():
    """A listener that accepts connections but never answers (a hung server, a wrong service): the store
    gives up after one ``timeout`` -- redis-py's own immediate retry is for dropped connections only."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(StoreUnavailable, match="did not answer within 1 s"):
            open_store(f"redis://127.0.0.1:{port}/0?timeout=1&connect_timeout=1")
        assert len(accepted) == 1  # one connection, one PING: no second try of the same call
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
