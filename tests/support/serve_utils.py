"""Starting ``kvwire serve`` for tests: in this process (a thread) or as its own process, and plain HTTP.

Readiness is always ``GET /health`` answering 200, polled; never a fixed sleep. Servers
listen on loopback on a port the kernel picks (port 0), so nothing races for one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai

READY_TIMEOUT_S = 120.0
POLL_S = 0.02
ROOT = Path(__file__).parents[2]


def request(method: str, url: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one plain HTTP request; error statuses are returned, not raised."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def get_json(url: str) -> dict:
    status, _, body = request("GET", url)
    assert status == 200, (status, body)
    return json.loads(body)


def metric(root: str, name: str, **labels: str) -> float:
    """One sample of ``GET /metrics`` (0 if absent)."""
    _, _, body = request("GET", f"{root}/metrics")
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in body.decode().splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def wait_ready(root: str, process: subprocess.Popen | None = None, log: Path | None = None) -> dict:
    """Poll ``GET /health`` until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"kvwire serve exited with {process.returncode}:\n{_tail(log)}")
        try:
            status, _, body = request("GET", f"{root}/health")
            if status == 200:
                return json.loads(body)
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvwire serve did not become ready in {READY_TIMEOUT_S:g} s:\n{_tail(log)}")
        time.sleep(POLL_S)


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition()`` until true (for state the server reaches asynchronously)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


def client(base_url: str, api_key: str = "none") -> openai.OpenAI:
    """The official client, without its automatic retries (tests look at every answer)."""
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)


@contextmanager
def in_process(service):
    """``service`` served from a thread of this process; yields the running :class:`Background`."""
    from kvwire.serve import Background

    with Background(service) as server:
        wait_ready(server.root)
        yield server


class ServerProcess:
    """``python -m kvwire serve ARGS`` on a kernel-chosen loopback port; its log in ``directory``."""

    def __init__(self, directory: Path, *args: str, env: dict[str, str] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / f"serve-{time.time_ns()}.log"
        self.args = args
        self.env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
        self.process: subprocess.Popen | None = None
        self.root = ""

    def start(self) -> ServerProcess:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--port", "0", *self.args],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, cwd=ROOT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (found := re.search(r"listening on (http://[\d.]+:\d+)", self.log.read_text(errors="replace"))):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvwire serve did not start:\n{_tail(self.log)}")
            time.sleep(POLL_S)
        self.root = found.group(1)
        wait_ready(self.root, self.process, self.log)
        return self

    @property
    def url(self) -> str:
        return f"{self.root}/v1"

    def stop(self) -> int | None:
        """SIGTERM (uvicorn's clean shutdown), then SIGKILL after 30 s; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def stopped_cleanly(self) -> bool:
        """Stopped by SIGTERM through uvicorn's shutdown (which re-raises the signal: exit code 0 or -15),
        the service's threads joined, no traceback."""
        log = self.output()
        return self.process is not None and self.process.returncode in (0, -15) and \
            "Application shutdown complete" in log and "Traceback" not in log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.exists():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
