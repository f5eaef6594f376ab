"""Agents on separate network hosts: network namespaces joined by veth pairs, links shaped with ``tc``.

The harness (``tests/support/netns.py``) builds a small switched LAN out of network
namespaces on this machine: ``redis-server`` runs on one host, ``kvwire agent``
processes on the others, and every link is a token bucket of a chosen rate. These
tests show that the harness is what it claims (it shapes, it stays on this machine,
it leaves nothing behind, even when a run dies), that agents on three hosts produce
what one process produces, and what happens when the store's link drops in the
middle of a transfer: the agents retry and finish, or fail with one line naming the
store and what they were doing, and no reader ever sees part of a packet.

They use a tiny random model (a folder the test writes) and slow links (1-8 Mbit/s),
so packets of a few hundred KB take seconds to cross, as the real model's 100 MB
caches do on real links; the link-profile measurements with the real model live in
``benchmarks/network.py``. Without root (or without ``ip`` and ``tc``) they are skipped,
or fail under ``KVWIRE_REQUIRE_NETNS=1``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvwire
from kvwire import PipelineSpec

from tests.support import netns
from tests.support.netns import Network, start_redis

pytestmark = pytest.mark.netns

SRC = Path(kvwire.__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1", "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}
REPORT = (Path(__file__).resolve().parents[2] / "examples" / "data" / "incident_report.md").read_text()
# ~500 tokens of the tiny tokenizer: A's packet is ~400 KB (768 K/V bytes per token), 3 s at 1 Mbit/s
LONG = f'''
name = "long-trio"
system = "You are one of three agents taking turns."
input_text = """{REPORT[:640]}"""
max_new_tokens = 4

[[agents]]
name = "A"
instruction = "Summarize."

[[agents]]
name = "B"
instruction = "Add one point."

[[agents]]
name = "C"
instruction = "Check it."
'''


@pytest.fixture(scope="module", autouse=True)
def _netns():
    netns.require_netns()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random Llama (3 layers, 2 KV heads, head_dim 16) saved as a model folder that `kvwire agent
    --model` loads, so processes start fast and packets stay small."""
    from tests.support import tiny

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def long_trio(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pipeline") / "long-trio.toml"
    path.write_text(LONG)
    return path


@pytest.fixture(scope="module")
def reference(tiny_folder, long_trio) -> dict[str, list[int]]:
    """Each agent's output ids from one in-process prefix run of the same folder's model."""
    from kvwire import hf
    from kvwire.pipeline.linear import Pipeline

    model, tokenizer = hf.load_model(tiny_folder)
    result = Pipeline(model, tokenizer, PipelineSpec.from_toml(long_trio)).run("prefix")
    return {a.agent: a.output_ids for a in result.agents}


def agent(net: Network, host: str, pipeline: Path, name: str, url: str, folder: Path, tmp: Path, *args: str):
    """Start ``kvwire agent`` for ``name`` on ``host``; stdout and stderr go to files in ``tmp``."""
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = net.start(host, [sys.executable, "-m", "kvwire", "agent", str(pipeline), "--name", name,
                                   "--session", "s", "--store", url, "--model", str(folder), "--json", *args],
                            stdout=stdout, stderr=stderr, env=ENV)
    return process, out, err


def result(out: Path) -> dict:
    [line] = [line for line in out.read_text().splitlines() if line.startswith("{")]
    return json.loads(line)


def until(condition: Callable[[], bool], what: str, timeout: float = 120.0, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


def stored_packets(net: Network, host: str, url: str) -> dict[str, str]:
    """Every packet in the store, read from ``host`` and decoded in full: key -> "ok" or the error."""
    code = textwrap.dedent("""
        import json, sys
        from kvwire import codec, open_store
        from kvwire.errors import KvwireError
        store, found = open_store(sys.argv[1]), {}
        for key in store.keys("packets/"):
            try:
                codec.decode(store.get(key))
                found[key] = "ok"
            except KvwireError as err:
                found[key] = str(err)
        print(json.dumps(found))
    """)
    done = net.run(host, [sys.executable, "-c", code, url], env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# -- the harness -----------------------------------------------------------------------------------


def test_hosts_exist_only_inside_their_namespaces_and_vanish_on_every_exit_path():
    def addresses_here() -> str:  # the machine's own network namespace
        return subprocess.run(["ip", "-o", "addr", "show", "to", f"{netns.SUBNET}.0/24"], capture_output=True,
                              text=True, timeout=30).stdout

    with pytest.raises(RuntimeError, match="a run that fails"):
        with Network(["store", "h1"], rate_bits=10e6) as net:
            run_id = net.run_id
            assert len(netns.existing(run_id)) == 3  # switch, store, h1
            sleeper = net.start("h1", ["sleep", "600"])
            reach = net.run("h1", ["ip", "-o", "addr", "show", "dev", "eth0"])
            assert f"{net.address('h1')}/24" in reach.stdout
            assert addresses_here() == ""  # nothing of it in the machine's own namespace
            raise RuntimeError("a run that fails")
    assert netns.existing(run_id) == [] and sleeper.poll() is not None


def test_namespaces_of_a_run_that_was_killed_are_removed_by_the_next_run(tmp_path):
    """SIGKILL skips every finally and atexit: the next network finds the dead run's namespaces by their
    prefix and pid, kills what they still run and deletes them, and leaves a live run's alone."""
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent("""
        import time
        from tests.support import netns
        net = netns.Network(["h1"])
        net.start("h1", ["sleep", "600"])
        print(net.run_id, flush=True)
        time.sleep(600)
    """))
    dying = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        dead_run = dying.stdout.readline().strip()
        assert len(netns.existing(dead_run)) == 2
        with Network(["h1"]) as live:
            dying.kill()
            dying.wait(30)
            sleeping = [pid for name in netns.existing(dead_run) for pid in netns._namespace_pids(name)]
            assert sleeping  # the dead run's sleep still runs inside its namespace
            removed = netns.cleanup_stale()
            assert sorted(removed) == sorted(f"{dead_run}-{h}" for h in ("switch", "h1"))
            assert netns.existing(dead_run) == [] and not any(netns.alive(pid) for pid in sleeping)
            assert len(netns.existing(live.run_id)) == 2  # a live run is left alone
    finally:
        if dying.poll() is None:
            dying.kill()
        dying.wait(30)


def test_a_shaped_link_carries_no_more_than_its_rate(tmp_path):
    """A token bucket of 8 Mbit/s cannot move 1 MiB in less than ~1 s (its 64 KiB burst aside), and
    ``probe_store`` from the other host measures put and get rates no higher than the link's."""
    with Network(["store", "h1"], rate_bits=8e6) as net:
        server = start_redis(net, "store", tmp_path / "redis")
        code = textwrap.dedent("""
            import json, os, sys, time
            from kvwire import open_store
            from kvwire.pipeline.cost import probe_store
            store = open_store(sys.argv[1])
            start = time.perf_counter()
            store.put("x", os.urandom(1 << 20))
            put = time.perf_counter() - start
            cost = probe_store(store, large=512 << 10, repeats=2)
            print(json.dumps({"put_s": put, "put_rate": cost.put_rate, "get_rate": cost.get_rate}))
        """)
        before = net.counters("store")
        done = net.run("h1", [sys.executable, "-c", code, server.url()], env=ENV, timeout=120)
        assert done.returncode == 0, done.stderr
        after = net.counters("store")
    measured = json.loads(done.stdout.splitlines()[-1])
    link, burst = 8e6 / 8, 64 << 10  # bytes per second; a full bucket may leave at once
    assert measured["put_s"] > ((1 << 20) - burst) / link
    fastest = link * (512 << 10) / ((512 << 10) - burst)  # the probe's 512 KiB value with the burst's head start
    assert measured["put_rate"] < fastest and measured["get_rate"] < fastest
    assert after["rx_bytes"] - before["rx_bytes"] > 1 << 20  # the value crossed the store's link


def test_redis_without_a_password_refuses_other_hosts_and_the_agent_says_what_to_do(tiny_folder, long_trio,
                                                                                    tmp_path):
    """Redis as it starts by default (protected mode, no password) answers clients from other hosts with
    DENIED: a permanent fault, so the agent is not retried for seconds but exits at once with one line."""
    with Network(["store", "h1"]) as net:
        server = start_redis(net, "store", tmp_path / "redis", password=False)
        process, _, err = agent(net, "h1", long_trio, "A", server.url(), tiny_folder, tmp_path, "--retries", "5")
        assert process.wait(120) == 1
    stderr = err.read_text()
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "attempt 1 of" not in stderr, stderr
    assert "runs in protected mode" in lines[0] and "--requirepass" in lines[0], lines[0]


# -- agents on three hosts -------------------------------------------------------------------------


def test_three_agents_on_three_hosts_through_redis_on_a_fourth(tiny_folder, long_trio, reference, tmp_path):
    """A, B and C each on its own host, Redis on a fourth, every link 8 Mbit/s: B and C build their
    caches from packets that crossed two links, and every output equals one process's run."""
    with Network(["store", "h1", "h2", "h3"], rate_bits=8e6) as net:
        server = start_redis(net, "store", tmp_path / "redis")
        url = server.url()
        procs = {name: agent(net, host, long_trio, name, url, tiny_folder, tmp_path)
                 for name, host in (("C", "h3"), ("B", "h2"), ("A", "h1"))}  # downstream first: they wait
        for name, (process, _, err) in procs.items():
            assert process.wait(300) == 0, err.read_text()
        results = {name: result(out) for name, (_, out, _) in procs.items()}
        wire = {host: net.counters(host) for host in ("store", "h1", "h2", "h3")}
    assert {name: r["output_ids"] for name, r in results.items()} == reference
    assert results["B"]["cached_tokens"] > 0 and results["C"]["cached_tokens"] > results["B"]["cached_tokens"]
    put = sum(r["packet_put_bytes"] for r in results.values())
    got = sum(r["packet_get_bytes"] for r in results.values())
    assert put > 0 and got > put  # C read A's packet and B's
    assert wire["store"]["rx_bytes"] > put and wire["store"]["tx_bytes"] > got  # all of it crossed the store's link
    assert wire["h1"]["tx_bytes"] > results["A"]["packet_put_bytes"]  # A's packet left A's host
    assert results["B"]["packet_get_s"] > 0 and results["A"]["packet_put_s"] > 0


# -- a link that drops mid-transfer ----------------------------------------------------------------

# short timeouts and 64 KiB chunks: a put stalled by the dead link fails within seconds and is retried
# (a chunk must cross the link within ?timeout=: redis-py sends each chunk with one sendall)
FAULTY = "timeout=3&connect_timeout=2&chunk_size=64KiB"


def rx(net: Network, host: str) -> int:
    return net.counters(host)["rx_bytes"]


@pytest.mark.slow  # ~30 s; a link that stays down (below) runs in the default suite
def test_the_store_hosts_link_drops_mid_transfer_then_comes_back(tiny_folder, long_trio, reference, tmp_path):
    """The Redis host's link goes down for 8 s while A's packet is on its way: A's put stalls, times out and
    is retried until the link is back; B receives the whole packet; outputs equal one process's run."""
    with Network(["store", "h1", "h2"], rate_bits=1e6) as net:
        server = start_redis(net, "store", tmp_path / "redis")
        url = server.url(FAULTY)
        b = agent(net, "h2", long_trio, "B", url, tiny_folder, tmp_path, "--retries", "8")
        a = agent(net, "h1", long_trio, "A", url, tiny_folder, tmp_path, "--retries", "8")
        quiet = rx(net, "store")
        until(lambda: rx(net, "store") > quiet + (96 << 10), "A's packet to be on its way", timeout=180)
        assert a[0].poll() is None  # still putting: the link drops mid-transfer
        net.link_down("store")
        time.sleep(8)  # the outage (not a readiness wait): longer than redis-py's own reconnect
        net.link_up("store")
        for process, _, err in (a, b):
            assert process.wait(300) == 0, err.read_text()
        results = {"A": result(a[1]), "B": result(b[1])}
        packets = stored_packets(net, "h1", server.url())
    assert results["A"]["store_retries"] >= 1, a[2].read_text()
    errors = a[2].read_text()
    assert f"store {url.replace(server.password, '***')} unreachable while publishing packet packets/" in " ".join(
        errors.split()), errors
    assert results["B"]["cached_tokens"] > 0 and not results["B"]["events"]  # the whole packet, verified
    assert {name: r["output_ids"] for name, r in results.items()} == {k: reference[k] for k in ("A", "B")}
    assert packets and set(packets.values()) == {"ok"}


def test_a_link_that_stays_down_ends_the_agent_with_one_line_and_no_partial_packet(tiny_folder, long_trio,
                                                                                      tmp_path):
    """The store's link drops mid-put and stays down past the retries: A exits 1 with one `error:` line
    naming the store and the packet it was publishing; once the link is back, the store holds no part of it."""
    with Network(["store", "h1"], rate_bits=1e6) as net:
        server = start_redis(net, "store", tmp_path / "redis")
        url = server.url(FAULTY)
        a = agent(net, "h1", long_trio, "A", url, tiny_folder, tmp_path, "--retries", "1")
        quiet = rx(net, "store")
        until(lambda: rx(net, "store") > quiet + (96 << 10), "A's packet to be on its way", timeout=180)
        net.link_down("store")
        try:
            assert a[0].wait(120) == 1
        finally:
            net.link_up("store")
        packets = stored_packets(net, "h1", server.url())
    stderr = a[2].read_text()
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert f"store {url.replace(server.password, '***')} unreachable while publishing packet packets/" in lines[0]
    assert "gave up after 2 attempts" in lines[0], lines[0]
    assert packets == {}  # staged chunks are invisible; nothing was published


@pytest.mark.slow
@pytest.mark.real_model
def test_the_example_script_runs_three_hosts_and_leaves_nothing_behind():
    """examples/network_hosts.sh end to end (the real model, three processes): `make test-slow`."""
    root = Path(__file__).resolve().parents[2]
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    done = subprocess.run(["bash", str(root / "examples" / "network_hosts.sh"), "100mbit", "prefix"],
                          capture_output=True, text=True, timeout=1800, env={**ENV, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("h1:", "h2:", "h3:"))]
    assert len(lines) == 3 and "bytes through the store host's link" in done.stdout
    assert all(int(re.search(r"(\d+) from cache", line).group(1)) > 0 for line in lines[1:]), lines
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not {name for name in after - before if name.startswith(netns.PREFIX)}
