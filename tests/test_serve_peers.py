"""``benchmarks/serve_peers.py`` against llama.cpp's ``llama-server`` (issue 42): what a user sees when the peer
cannot be had, and that a killed benchmark leaves no server behind.

The benchmark itself needs a built ``llama-server`` (``python benchmarks/llama_server.py --build``, ~6 minutes on
2 cores) and runs for many minutes, so it is never run here; its figures are in BENCHMARKS section 13. A stand-in
``llama-server`` (a few lines of Python answering ``/health``) plays the peer where only the process handling is
under test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "serve_peers.py"
BUILD = ROOT / "benchmarks" / "llama_server.py"

# A stand-in llama-server: healthy at once, writes its pid, and holds every chat request open (never answers).
STAND_IN = """#!{python}
import http.server, json, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
open({pidfile!r}, "w").write(str(os.getpid()))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"status": "ok"}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        open({pidfile!r} + ".asked", "w").write("1")
        time.sleep(3600)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode != 0, proc.stdout[-500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip() and not line.startswith("llama-server: "
                                                                                                       "fetching")]
    assert expected in lines[-1], proc.stderr[-2000:]


def peers(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PEERS), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_an_engine_it_does_not_know_is_refused_before_any_server_starts():
    proc = peers("--engines", "llama", "kvwire-int9")
    assert proc.returncode == 2 and "--engines kvwire-int9: use llama, kvwire-FORMAT" in proc.stderr


@pytest.mark.slow  # ~10 s; a peer that ends at start (below) takes the same path
def test_a_llama_server_that_is_not_an_executable_is_one_line(tmp_path):
    one_line(peers("--engines", "llama", "--llama-server", str(tmp_path / "missing")),
             f"{tmp_path / 'missing'} is not an executable file")


def test_a_llama_server_that_ends_at_start_says_why_in_one_line(tmp_path):
    """A llama-server that cannot load the GGUF (or bind its port) ends at once: its own last line is the error."""
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\necho 'main: error: failed to load model' >&2\nexit 1\n")
    broken.chmod(0o755)
    one_line(peers("--engines", "llama", "--sessions", "1", "--llama-server", str(broken)),
             "exited with 1 before it was ready: main: error: failed to load model")


def test_no_compiler_is_one_line_saying_what_to_install(tmp_path):
    proc = subprocess.run([sys.executable, str(BUILD), "--build"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PATH": str(tmp_path), "CXX": "", "KVWIRE_HOME":
                                            str(tmp_path / "home")})
    one_line(proc, "no C++ compiler on PATH (c++, g++ or clang++): install one")
    assert not (tmp_path / "home" / "llama-server").exists() or not any((tmp_path / "home" / "llama-server").iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_benchmark_leaves_no_server_behind(tmp_path):
    """``kill -9`` of the benchmark mid-run: the server it started (its own process group) ends with it."""
    pidfile = tmp_path / "server.pid"
    stand_in = tmp_path / "llama-server"
    stand_in.write_text(STAND_IN.format(python=sys.executable, pidfile=str(pidfile)))
    stand_in.chmod(0o755)
    bench = subprocess.Popen([sys.executable, str(PEERS), "--engines", "llama", "--sessions", "1", "--pipelines",
                              "document", "--llama-server", str(stand_in)], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{pidfile}.asked").exists():  # the server is up and has been sent a request
            assert bench.poll() is None and time.monotonic() < deadline, "the benchmark ended before asking"
            time.sleep(0.1)
        server = int(pidfile.read_text())
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait()
        deadline = time.monotonic() + 10
        while _alive(server):
            assert time.monotonic() < deadline, f"the server {server} outlived the killed benchmark"
            time.sleep(0.1)
    finally:
        if bench.poll() is None:
            bench.kill()
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
