"""Hosts on one machine: Linux network namespaces joined by veth pairs, links shaped with ``tc``.

A :class:`Network` is a small switched LAN made of network namespaces. Each *host*
is a namespace with one interface, ``eth0``, at ``10.213.0.N/24``; a veth pair joins
it to a bridge in a *switch* namespace. Each host's link is shaped in both
directions with a token-bucket filter (``tc qdisc ... tbf rate R``: the host's
egress on ``eth0``, its ingress on the switch's port), so a put from host A to the
store's host crosses A's link and then the store's, as on a real LAN::

        h1 (10.213.0.2) --eth0==port-- +--------+ --port==eth0-- store (10.213.0.1)
        h2 (10.213.0.3) --eth0==port-- | switch | --port==eth0-- h3 (10.213.0.4)
                                       +--------+

``netem`` is not available in this kernel, so latency and loss are not emulated: they
are parameters of the cost model (:mod:`kvwire.pipeline.cost`, :mod:`kvwire.pipeline.breakeven`).

What it guarantees:

- **Only this machine.** The addresses exist only inside the namespaces; nothing is
  added to the machine's own network namespace (no interface, route or address), so
  nothing outside can be reached and runs cannot see each other.
- **No collisions.** Namespaces are named ``kvwn<pid>-<random>-<host>`` (the creating
  process's pid and 4 random hex digits): parallel runs, and other people's runs,
  never share one. Interfaces are created inside the namespaces, where their short
  names cannot collide.
- **Cleaned up on every exit path.** :meth:`Network.close` (a ``with`` block, a
  ``finally``) stops every process the network started, first politely, then with
  SIGKILL, and deletes its namespaces (their veth pairs go with them); an ``atexit``
  hook closes any network still open when the interpreter exits; and every new
  network first removes the namespaces of earlier runs whose process is gone
  (:func:`cleanup_stale`: a run killed with SIGKILL leaves them behind).
- **Bounded.** Every command has a timeout and every wait a deadline.

Creating namespaces needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip`` and
``tc`` (Debian's ``iproute2``, which ``make setup`` installs). Where either is missing,
:func:`require_netns` skips the test with the reason, or fails it when
``KVWIRE_REQUIRE_NETNS=1`` (for machines known to allow namespaces).

Example::

    with Network(["store", "h1", "h2"], rate_bits=100e6) as net:
        net.start("store", ["redis-server", "--bind", net.address("store"), ...])
        result = net.run("h1", [sys.executable, "-c", "..."])   # a process on host h1
        net.set_rate("h1", 1e9)                                  # reshape a link
        net.link_down("store"); ...; net.link_up("store")        # a link that drops
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REQUIRE_ENV = "KVWIRE_REQUIRE_NETNS"
PREFIX = "kvwn"  # every namespace this harness creates starts with it
SUBNET = "10.213.0"  # hosts are SUBNET.1, .2, ... /24, inside the namespaces only
COMMAND_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_NAME = re.compile(rf"{PREFIX}(\d+)-([0-9a-f]{{4}})-([a-z0-9]+)")
_HOST = re.compile(r"[a-z][a-z0-9]{0,9}")
_LIVE: set[Network] = set()


@dataclass(frozen=True)
class Profile:
    """A link profile: every host's link shaped to ``rate_bits`` bits/s (``None``: unshaped, as fast as
    the veth carries, which is CPU-bound: ~3-4 Gbit/s of TCP on this busy 2-core machine)."""

    name: str
    rate_bits: float | None


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("10mbit", 10e6), Profile("100mbit", 100e6), Profile("1gbit", 1e9), Profile("10gbit", 10e9),
    Profile("veth", None))}


def tool(name: str) -> str | None:
    """The path of ``ip`` or ``tc``, also where root's PATH is not set (``/usr/sbin``, ``/sbin``)."""
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name)
                                       if p.is_file() and os.access(p, os.X_OK)), None)


def _ip(*args: str, timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("ip") or "ip", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("tc") or "tc", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          check=check)


_checked: str | None = None  # "" when namespaces work here, else why not


def netns_unavailable() -> str:
    """Why namespaces cannot be used here ("" when they can): tools missing, or no privileges.

    Tries once per process: create a namespace with a veth pair shaped by ``tbf``, then delete it.
    """
    global _checked
    if _checked is None:
        _checked = _try_netns()
    return _checked


def _try_netns() -> str:
    missing = [name for name in ("ip", "tc") if tool(name) is None]
    if missing:
        return (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
                "`make setup` or `apt-get install iproute2` provides them")
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-check"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        return f"cannot create a network namespace (needs root or CAP_SYS_ADMIN + CAP_NET_ADMIN): {detail.strip()}"
    try:
        _ip("-n", name, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
        _tc("-n", name, "qdisc", "add", "dev", "va", "root", "tbf", "rate", "1mbit", "burst", "32kb", "latency", "50ms")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        return f"namespaces work but veth pairs or tc tbf do not: {detail.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return ""


def require_netns() -> None:
    """Skip the calling test (or fail it under ``KVWIRE_REQUIRE_NETNS=1``) where namespaces cannot be made."""
    import pytest

    reason = netns_unavailable()
    if reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the network-namespace tests to run)", pytrace=False)
        pytest.skip(reason)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def cleanup_stale() -> list[str]:
    """Delete namespaces of this harness whose creating process is gone (a run killed with SIGKILL);
    their processes are killed first. Returns the names removed. Live runs' namespaces are left alone."""
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for line in listing.splitlines():
        match = _NAME.fullmatch(line.split()[0]) if line.strip() else None
        if match is None or alive(int(match.group(1))):
            continue
        _delete_namespace(line.split()[0])
        removed.append(line.split()[0])
    if removed:
        log.warning("removed %d namespaces left by runs that died: %s", len(removed), ", ".join(removed))
    return removed


def _namespace_pids(namespace: str) -> list[int]:
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(pid) for pid in out.split() if pid.isdigit()]


def _delete_namespace(namespace: str) -> None:
    """Kill what runs in ``namespace`` (processes its run started), then delete it."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (pids := _namespace_pids(namespace)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    result = _ip("netns", "del", namespace, check=False)
    if result.returncode and "No such file" not in result.stderr:
        log.warning("could not delete namespace %s: %s", namespace, result.stderr.strip())


def _close_all() -> None:
    for network in list(_LIVE):
        network.close()


atexit.register(_close_all)


def tbf(rate_bits: float) -> list[str]:
    """``tc`` arguments of a token bucket for ``rate_bits`` bits/s: a bucket of 4 ms of traffic (at least
    64 KiB, so the kernel's timer granularity never caps the rate) and a 50 ms queue."""
    burst = max(64 << 10, int(rate_bits / 8 * 0.004))
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "50ms"]


class Network:
    """Hosts ``hosts`` (short lowercase names) on one switch, each link at ``rate_bits`` bits/s (None: unshaped).

    Host ``hosts[i]`` has address ``SUBNET.(i + 1)``. See the module docstring for the guarantees.
    """

    def __init__(self, hosts: Iterable[str], rate_bits: float | None = None) -> None:
        self.hosts = list(hosts)
        bad = [h for h in self.hosts if not _HOST.fullmatch(h) or h == "switch"]
        if bad or len(set(self.hosts)) != len(self.hosts) or not 0 < len(self.hosts) < 250:
            raise ValueError(f"hosts must be 1-249 distinct short lowercase names (not 'switch'), got {self.hosts}")
        self.run_id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.rates: dict[str, float | None] = {}
        self.processes: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self._closed = False
        cleanup_stale()
        _LIVE.add(self)
        try:
            self._build(rate_bits)
        except BaseException:
            self.close()
            raise

    # -- names ------------------------------------------------------------------------------------

    def namespace(self, host: str) -> str:
        if host != "switch" and host not in self.hosts:
            raise KeyError(f"no host {host!r} in {self.hosts}")
        return f"{self.run_id}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def _port(self, host: str) -> str:
        return f"p-{host}"

    # -- building ---------------------------------------------------------------------------------

    def _add_namespace(self, host: str) -> str:
        name = self.namespace(host)
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _build(self, rate_bits: float | None) -> None:
        switch = self._add_namespace("switch")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in self.hosts:
            name = self._add_namespace(host)
            # created directly inside the two namespaces: the machine's own namespace never sees them
            _ip("link", "add", self._port(host), "netns", switch, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", switch, "link", "set", self._port(host), "master", "br0")
            _ip("-n", switch, "link", "set", self._port(host), "up")
            _ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            self.set_rate(host, rate_bits)

    # -- links ------------------------------------------------------------------------------------

    def set_rate(self, host: str, rate_bits: float | None) -> None:
        """Shape ``host``'s link to ``rate_bits`` bits/s both ways (``None``: remove the shaping)."""
        ends = [(self.namespace(host), "eth0"), (self.namespace("switch"), self._port(host))]
        for namespace, device in ends:
            if rate_bits is None:
                _tc("-n", namespace, "qdisc", "del", "dev", device, "root", check=False)
            else:
                _tc("-n", namespace, "qdisc", "replace", "dev", device, "root", *tbf(rate_bits))
        self.rates[host] = rate_bits

    def set_rates(self, rate_bits: float | None) -> None:
        for host in self.hosts:
            self.set_rate(host, rate_bits)

    def link_down(self, host: str) -> None:
        """Take ``host``'s link down (``ip link set eth0 down`` on the host): nothing passes until :meth:`link_up`."""
        _ip("-n", self.namespace(host), "link", "set", "eth0", "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.namespace(host), "link", "set", "eth0", "up")

    def counters(self, host: str) -> dict[str, int]:
        """Bytes and packets ``host``'s interface has sent and received so far (the kernel's counters)."""
        out = _ip("-n", self.namespace(host), "-s", "-j", "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}

    # -- processes --------------------------------------------------------------------------------

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec``: the process itself, no wrapper)."""
        return [tool("ip") or "ip", "netns", "exec", self.namespace(host), *argv]

    def start(self, host: str, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` on ``host``; :meth:`close` stops it if it still runs."""
        popen.setdefault("stdin", subprocess.DEVNULL)
        process = subprocess.Popen(self.command(host, argv), **popen)
        self.processes.append(process)
        return process

    def run(self, host: str, argv: list[str], timeout: float = 300.0, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to completion (bounded by ``timeout``), capturing its output."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def stop(self, process: subprocess.Popen) -> None:
        """SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`; waits for it."""
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)

    # -- the end ----------------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        return list(self._namespaces)

    def close(self) -> None:
        """Stop every process started here and delete every namespace (idempotent; never raises on a
        missing namespace)."""
        if self._closed:
            return
        self._closed = True
        try:
            for process in self.processes:
                try:
                    self.stop(process)
                except (OSError, subprocess.SubprocessError) as err:
                    log.warning("could not stop process %s: %s", process.pid, err)
            for namespace in reversed(self._namespaces):
                _delete_namespace(namespace)
        finally:
            _LIVE.discard(self)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def existing(run_id: str) -> list[str]:
    """Namespaces on this machine whose name starts with ``run_id`` (to check that a run left none)."""
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
            if line.strip() and line.split()[0].startswith(run_id + "-")]


# -- services on the hosts ---------------------------------------------------------------------------


@dataclass
class RedisHost:
    """A ``redis-server`` on one host of a :class:`Network`, bound to that host's address only, with a
    password (Redis refuses clients from other hosts without one: protected mode)."""

    network: Network
    host: str
    process: subprocess.Popen
    directory: Path
    password: str
    port: int = 6379

    def url(self, query: str = "") -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.network.address(self.host)}:{self.port}/0" + (f"?{query}" if query else "")

    def log_tail(self, lines: int = 20) -> str:
        log_file = self.directory / "redis.log"
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:]) if log_file.exists() else ""


def start_redis(network: Network, host: str, directory: Path, *extra: str, timeout: float = 30.0,
                password: bool = True) -> RedisHost:
    """Start ``redis-server`` on ``host`` and return once its log says it accepts connections
    (``password=False``: without ``--requirepass``, as Redis starts by default)."""
    from .redis_server import require_redis_server

    binary = require_redis_server()
    directory.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(16) if password else ""
    log_file = directory / "redis.log"
    process = network.start(host, [binary, "--bind", network.address(host), "--port", "6379", "--save", "",
                                   "--dir", str(directory), "--logfile", str(log_file), "--daemonize", "no",
                                   *(["--requirepass", secret] if secret else []), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = RedisHost(network, host, process, directory, secret)
    deadline = time.monotonic() + timeout
    while "Ready to accept connections" not in (log_file.read_text(errors="replace") if log_file.exists() else ""):
        if process.poll() is not None:
            raise RuntimeError(f"redis-server on {host} exited with {process.returncode}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server on {host} not ready after {timeout:g} s:\n{server.log_tail()}")
        time.sleep(0.01)
    return server
