"""The process's C heap under glibc: how many malloc arenas it may use, and free pages handed back.

glibc gives threads that contend for the heap arenas of their own, up to 8 per core, and rarely
gives an arena's freed pages back. A server whose request, decode and store threads each allocate
and free tensors and buffers of every size spreads them over many arenas, and its resident memory
climbs for minutes though nothing is retained: under 16 clients for 5 minutes, glibc's default
climbed for two minutes and levelled at ~1,470 MB; with 2 arenas and a trim every 30 s RSS was
flat from 30 s on at ~1,130-1,270 MB (BENCHMARKS section 6). :func:`limit_arenas` sets that limit
early, before the threads start; ``MALLOC_ARENA_MAX`` in the environment, glibc's own setting, wins
over it. :func:`trim_every` hands free pages back to the system on a timer (``malloc_trim``), so RSS
follows what is live; :func:`trim_now` does it once (the compact load, :mod:`kvwire.hf.loading`, after
freeing each few linears' fp32 weights). Off glibc (musl, macOS) all three do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def _libc(name: str, argtypes: list[Any]) -> Any:
    """The C library's function ``name`` returning an int, or None where it has none (not glibc)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        log.debug("no %s in this C library: left as it is", name)
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def limit_arenas(count: int) -> bool:
    """Limit the process to ``count`` malloc arenas (0: leave the C library's default). Returns whether a
    limit was set: not where ``MALLOC_ARENA_MAX`` is set (glibc read it at start), nor off glibc."""
    if count < 0:
        raise ValueError(f"malloc arenas must be >= 0 (0: the C library's default), got {count}")
    if count == 0 or "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int])
    return mallopt is not None and mallopt(M_ARENA_MAX, count) == 1


def trim_now() -> bool:
    """Call glibc's ``malloc_trim(0)`` once: hand every arena's free pages back to the system. Returns whether it
    ran (not off glibc)."""
    malloc_trim = _libc("malloc_trim", [ctypes.c_size_t])
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def trim_every(seconds: float) -> threading.Event | None:
    """Call glibc's ``malloc_trim(0)`` every ``seconds`` on a daemon thread (it returns the free pages of
    every arena to the system; a few milliseconds). Returns the event that stops it, or None where there
    is nothing to start (``seconds`` 0, or not glibc)."""
    if seconds < 0:
        raise ValueError(f"malloc trim interval must be >= 0 seconds (0: never), got {seconds}")
    malloc_trim = _libc("malloc_trim", [ctypes.c_size_t]) if seconds else None
    if malloc_trim is None:
        return None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(seconds):
            malloc_trim(0)

    threading.Thread(target=loop, name="kvwire-malloc-trim", daemon=True).start()
    return stop
