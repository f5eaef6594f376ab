"""Real redis-server processes for the tests, on loopback, started and stopped by the tests.

A server is ready when it answers PING; a cluster when every node reports
``cluster_state:ok`` and all 16384 slots are served (both polled, never a fixed
sleep). Without ``redis-server`` (and, for clusters, ``redis-cli``) on PATH the
Redis tests are skipped with the reason shown, or fail when
``KVWIRE_REQUIRE_REDIS=1`` (as ``.ci/run`` sets) so CI cannot pass without them.
"""

from __future__ import annotations

import os
import random
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


def require_redis_server(program: str = "redis-server") -> str:
    """The path of ``redis-server`` (or ``redis-cli``); skips the test (or fails it under
    ``KVWIRE_REQUIRE_REDIS=1``) if absent."""
    binary = shutil.which(program)
    if binary is None:
        package = "redis-server" if program == "redis-server" else "redis-tools"
        reason = f"{program} is not installed: `make setup` or `apt-get install {package}` provides it"
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


def free_cluster_port() -> int:
    """A port for a cluster node: it and its bus port (+10000) free, both below the ephemeral range
    (Redis refuses ports above 55535; random ports keep parallel test runs apart)."""
    for _ in range(200):
        port = random.randrange(11000, 22000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_ca(directory: Path, name: str = "kvwire test CA") -> tuple[Path, Path]:
    """A throw-away self-signed CA: (certificate, key) as PEM files in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
             "-keyout", ca_key, "-out", ca)
    return ca, ca_key


def make_tls_files(directory: Path) -> TLSFiles:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it (openssl)."""
    ca, ca_key = make_ca(directory)
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr)
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
             "-extfile", ext, "-out", cert)
    return TLSFiles(ca, cert, key)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 with its data in ``directory``.

    ``password`` sets requirepass, ``tls`` serves TLS only, ``durable`` turns on
    appendonly with appendfsync always (so a kill -9 loses nothing acknowledged);
    ``extra`` are more redis-server arguments.
    """

    def __init__(self, directory: Path, *, password: str | None = None, tls: TLSFiles | None = None,
                 durable: bool = False, extra: tuple[str, ...] = (), port: int | None = None) -> None:
        self.binary = require_redis_server()
        self.directory = directory
        self.password, self.tls, self.durable, self.extra = password, tls, durable, extra
        self.port = port or free_port()
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

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

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


class RedisClusterNodes:
    """A Redis Cluster of ``masters`` masters (no replicas) on 127.0.0.1, each node a :class:`RedisServer`
    in its own directory, joined with ``redis-cli --cluster create``.

    Nodes run with ``cluster-require-full-coverage no`` (keys on live masters keep working while one
    master is down) and a short ``cluster-node-timeout``; ``durable`` as for :class:`RedisServer`.
    """

    def __init__(self, directory: Path, masters: int = 3, *, durable: bool = False, node_timeout_ms: int = 2000,
                 extra: tuple[str, ...] = ()) -> None:
        require_redis_server()
        self.cli = require_redis_server("redis-cli")
        config = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                  "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no")
        self.nodes = [RedisServer(directory / f"node-{i}", durable=durable, extra=config + extra,
                                  port=free_cluster_port()) for i in range(masters)]

    def url(self, query: str = "") -> str:
        """A kvwire URL naming every node as a startup node."""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://{hosts}/0" + (f"?{query}" if query else "")

    def start(self) -> RedisClusterNodes:
        """Start every node, join them into one cluster, and return once it serves every slot."""
        for node in self.nodes:
            node.start()
        try:
            subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in self.nodes),
                            "--cluster-yes"], check=True, capture_output=True, timeout=START_TIMEOUT_S)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll every live node until it reports ``cluster_state:ok`` with all slots assigned and served."""
        deadline = time.monotonic() + timeout
        clients = [node.raw() for node in self.nodes if node.running]
        try:
            while True:
                infos = []
                for client in clients:
                    try:
                        infos.append(client.execute_command("CLUSTER", "INFO").decode())
                    except Exception:  # noqa: BLE001 - a node still loading: ask again
                        infos.append("")
                if all("cluster_state:ok" in info and "cluster_slots_ok:16384" in info for info in infos):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster not ok after {timeout:g} s:\n" + "\n".join(infos))
                time.sleep(POLL_S)
        finally:
            for client in clients:
                client.close()

    def node_of(self, redis_key: str) -> RedisServer:
        """The master serving the slot of ``redis_key`` (a raw Redis key, hash tag included)."""
        client = next(node for node in self.nodes if node.running).raw()
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", redis_key))
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(node for node in self.nodes if node.port == int(master[1]))
        finally:
            client.close()
        raise RuntimeError(f"no master serves the slot of {redis_key}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
