"""Real redis-server processes for the tests, on loopback, started and stopped by the tests.

A server is ready when it answers PING (polled, never a fixed sleep). Without a
``redis-server`` on PATH the Redis tests are skipped with the reason shown, or
fail when ``KVWIRE_REQUIRE_REDIS=1`` (as ``.ci/run`` sets) so CI cannot pass
without them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REQUIRE_ENV = "KVWIRE_REQUIRE_REDIS"
START_TIMEOUT_S = 30.0
POLL_S = 0.01


def require_redis_server() -> str:
    """The path of ``redis-server``; skips the test (or fails it under ``KVWIRE_REQUIRE_REDIS=1``) if absent."""
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server is not installed: `make setup` or `apt-get install redis-server` provides it"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the Redis tests to run)", pytrace=False)
        pytest.skip(reason)
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.fail("the redis package is missing: pip install -c constraints.txt redis", pytrace=False)
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TLSFiles:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it (openssl)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvwire test CA",
            "-keyout", ca_key, "-out", ca)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr)
    openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
            "-extfile", ext, "-out", cert)
    return TLSFiles(ca, cert, key)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 with its data in ``directory``.

    ``password`` sets requirepass, ``tls`` serves TLS only, ``durable`` turns on
    appendonly with appendfsync always (so a kill -9 loses nothing acknowledged);
    ``extra`` are more redis-server arguments.
    """

    def __init__(self, directory: Path, *, password: str | None = None, tls: TLSFiles | None = None,
                 durable: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.binary = require_redis_server()
        self.directory = directory
        self.password, self.tls, self.durable, self.extra = password, tls, durable, extra
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    def url(self, query: str = "", *, password: str | None = None) -> str:
        """A kvwire URL for this server (the server's password unless another is given)."""
        secret = self.password if password is None else password
        auth = f":{secret}@" if secret else ""
        scheme = "rediss" if self.tls else "redis"
        params = [f"ssl_ca_certs={self.tls.ca}"] if self.tls else []
        params += [query] if query else []
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0" + ("?" + "&".join(params) if params else "")

    def _command(self) -> list[str]:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--dir", str(self.directory),
                "--logfile", str(self.directory / "redis.log"), "--daemonize", "no",
                "--rename-command", "KEYS", ""]  # kvwire must list keys with SCAN: KEYS is disabled here
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.durable:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        return args + list(self.extra)

    def start(self) -> RedisServer:
        """Start the server and return once it answers PING."""
        self.process = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _client(self):
        import redis

        tls = dict(ssl=True, ssl_ca_certs=str(self.tls.ca)) if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2,
                           socket_connect_timeout=2, **tls)

    def _wait_ready(self) -> None:
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        client = self._client()
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # not listening yet, or still loading its append-only file
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server did not answer PING in {START_TIMEOUT_S:g} s:\n{self.log_tail()}")
                time.sleep(POLL_S)
        finally:
            client.close()

    def raw(self):
        """A plain redis-py client, to look at what kvwire wrote."""
        return self._client()

    def kill(self) -> None:
        """kill -9: no shutdown, no final save."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 20) -> str:
        log = self.directory / "redis.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"
