"""How many malloc arenas the server's process may use (glibc).

glibc gives threads that contend for the heap arenas of their own, up to 8 per core, and rarely
gives an arena's freed pages back. A server whose request, decode and store threads each allocate
and free tensors and buffers of every size spreads them over many arenas, and its resident memory
rises for minutes after warm-up though nothing is retained: under 16 clients for 5 minutes RSS rose
7.6 % after the first third with glibc's default, and stayed flat (+0.02 %) with 2 arenas
(BENCHMARKS section 6). :func:`limit_arenas` sets that limit early, before the threads start;
``MALLOC_ARENA_MAX`` in the environment, glibc's own setting, wins over it.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def limit_arenas(count: int) -> bool:
    """Limit the process to ``count`` malloc arenas (0: leave the C library's default). Returns whether a
    limit was set: not where ``MALLOC_ARENA_MAX`` is set (glibc read it at start), nor off glibc."""
    if count < 0:
        raise ValueError(f"malloc arenas must be >= 0 (0: the C library's default), got {count}")
    if count == 0 or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        log.debug("no mallopt in this C library: the malloc arena limit is not set")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, count) == 1
