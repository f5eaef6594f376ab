"""A store that times its puts and gets: what a turn's packets really cost to move.

An agent's turn spends time on the model, on the codec and on the store; only the
last depends on the link between the agent's host and the store's. :class:`MeteredStore`
wraps any store and adds up the seconds and bytes of every ``put`` and ``get``
(:class:`Traffic`), so a benchmark can set the measured transfer next to what
:mod:`kvwire.pipeline.cost` predicted for the same bytes, apart from the compute around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .base import Buffer, Store
from .forwarding import ForwardingStore

T = TypeVar("T")


@dataclass
class Traffic:
    """Seconds and bytes of the puts and gets made through a :class:`MeteredStore`."""

    put_s: float = 0.0
    get_s: float = 0.0
    put_bytes: int = 0
    get_bytes: int = 0
    puts: int = 0
    gets: int = 0

    @property
    def seconds(self) -> float:
        return self.put_s + self.get_s

    @property
    def nbytes(self) -> int:
        return self.put_bytes + self.get_bytes


class MeteredStore(ForwardingStore):
    """``store`` with its ``put`` and ``get`` calls timed into ``traffic`` (everything else passes through)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.traffic = Traffic()

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        start = time.perf_counter()
        try:
            return self.store.put(key, data, expect_version=expect_version)
        finally:
            self.traffic.put_s += time.perf_counter() - start
            self.traffic.put_bytes += memoryview(data).nbytes
            self.traffic.puts += 1

    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        return self._timed_get(lambda: self.store.get_versioned(key), lambda found: found[0])

    def get(self, key: str) -> bytes | memoryview | None:
        return self._timed_get(lambda: self.store.get(key), lambda found: found)

    def _timed_get(self, read: Callable[[], T | None], value: Callable[[T], Buffer]) -> T | None:
        """``read()``, its seconds and the bytes of its ``value`` (none when it found nothing or failed) counted."""
        start = time.perf_counter()
        found = None
        try:
            found = read()
            return found
        finally:
            self.traffic.get_s += time.perf_counter() - start
            self.traffic.get_bytes += memoryview(value(found)).nbytes if found is not None else 0
            self.traffic.gets += 1
