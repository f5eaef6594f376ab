"""``kvwire serve --malloc-arenas N --malloc-trim S``: the process's glibc malloc arenas are limited before its
threads start, and free heap pages are handed back every S seconds, which keeps RSS flat under load
(BENCHMARKS section 6); ``MALLOC_ARENA_MAX`` in the environment wins. ``trim_now`` hands them back once (the
compact load does, between linears)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import threading
import time

import pytest

from kvwire.serve import ServeConfig
from kvwire.allocator import limit_arenas, trim_every

GLIBC = platform.libc_ver()[0] == "glibc"

# eight threads each malloc once (ctypes releases the GIL, so they run at once); malloc_stats() then lists
# one "Arena N:" per arena on stderr
ARENAS_USED = """
import ctypes, sys, threading
from kvwire.allocator import limit_arenas
print(limit_arenas(int(sys.argv[1])), flush=True)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
barrier = threading.Barrier(8)
def grab():
    barrier.wait()
    libc.malloc(1 << 16)
threads = [threading.Thread(target=grab) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()
"""


def arenas_used(limit: int, **env: str) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, "-c", ARENAS_USED, str(limit)], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in {**os.environ, **env}.items() if v})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), len(re.findall(r"^Arena \d+:", proc.stderr, flags=re.M))


@pytest.mark.skipif(not GLIBC, reason="malloc arenas are glibc's")
def test_the_limit_holds_threads_to_that_many_arenas():
    env = {"MALLOC_ARENA_MAX": ""}  # unset: the test's own environment must not decide
    assert arenas_used(2, **env) == ("True", 2)
    said, unlimited = arenas_used(0, **env)  # 0: glibc's default, an arena for each new thread here
    assert said == "False" and unlimited > 2
    assert arenas_used(2, MALLOC_ARENA_MAX="3") == ("False", 3)  # glibc's own variable wins


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trimming_runs_on_its_own_thread_until_stopped():
    def trimmers():
        return [t for t in threading.enumerate() if t.name == "kvwire-malloc-trim"]

    assert trim_every(0) is None and not trimmers()  # 0: never
    stop = trim_every(0.01)
    assert stop is not None and len(trimmers()) == 1
    time.sleep(0.05)  # a few trims, none of them fatal
    stop.set()
    for thread in trimmers():
        thread.join(timeout=5)
    assert not trimmers()


# 64 MiB in 16 KiB chunks (below glibc's mmap threshold, so they live on the heap), all but the last freed:
# glibc keeps the freed pages resident (the last chunk pins the top of the heap) until a trim gives them back
HEAP_KEPT = """
import ctypes, sys
from kvwire.allocator import trim_now
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
chunks = [libc.malloc(1 << 14) for _ in range(4096)]
for chunk in chunks:
    ctypes.memset(chunk, 1, 1 << 14)
for chunk in chunks[:-1]:
    libc.free(chunk)
before = rss()
print(trim_now(), before - rss())
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_a_trim_hands_freed_heap_pages_back():
    proc = subprocess.run([sys.executable, "-c", HEAP_KEPT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MALLOC_TRIM_THRESHOLD_": str(1 << 30)})  # glibc must not trim itself
    assert proc.returncode == 0, proc.stderr
    ran, freed_mib = proc.stdout.split()
    assert ran == "True" and int(freed_mib) > 48


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="malloc arenas must be >= 0"):
        limit_arenas(-1)
    with pytest.raises(ValueError, match="malloc trim interval must be >= 0"):
        trim_every(-1)
    with pytest.raises(ValueError, match="malloc_arenas must be 0..1024"):
        ServeConfig(malloc_arenas=-2)
    with pytest.raises(ValueError, match="malloc_trim_s must be 0..86400"):
        ServeConfig(malloc_trim_s=-1)
    assert ServeConfig().malloc_arenas == 2 and ServeConfig().malloc_trim_s == 30.0


def test_the_cli_passes_the_option():
    for option in ("--malloc-arenas", "--malloc-trim"):
        proc = subprocess.run([sys.executable, "-m", "kvwire", "serve", option, "-1"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and option in proc.stderr
