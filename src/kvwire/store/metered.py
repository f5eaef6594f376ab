"""A store that times its puts and gets: what a turn's packets really cost to move.

An agent's turn spends time on the model, on the codec and on the store; only the
last depends on the link between the agent's host and the store's. :class:`MeteredStore`
wraps any store and adds up the seconds and bytes of every ``put`` and ``get``
(:class:`Traffic`), so a benchmark can set the measured transfer next to what
:mod:`kvwire.pipeline.cost` predicted for the same bytes, apart from the compute around it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .base import Buffer, Store


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


class MeteredStore(Store):
    """``store`` with its ``put`` and ``get`` calls timed into ``traffic`` (everything else passes through)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.traffic = Traffic()

    @property
    def url(self) -> str:  # type: ignore[override]
        return self.store.url

    @property
    def budget(self) -> int | None:  # type: ignore[override]
        return self.store.budget

    @property
    def evictions(self) -> int:  # type: ignore[override]
        return self.store.evictions

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        start = time.perf_counter()
        try:
            return self.store.put(key, data, expect_version=expect_version)
        finally:
            self.traffic.put_s += time.perf_counter() - start
            self.traffic.put_bytes += memoryview(data).nbytes
            self.traffic.puts += 1

    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        start = time.perf_counter()
        found = None
        try:
            found = self.store.get_versioned(key)
            return found
        finally:
            self.traffic.get_s += time.perf_counter() - start
            self.traffic.get_bytes += memoryview(found[0]).nbytes if found is not None else 0
            self.traffic.gets += 1

    def get(self, key: str) -> bytes | memoryview | None:
        start = time.perf_counter()
        found = None
        try:
            found = self.store.get(key)
            return found
        finally:
            self.traffic.get_s += time.perf_counter() - start
            self.traffic.get_bytes += memoryview(found).nbytes if found is not None else 0
            self.traffic.gets += 1

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def keys(self, prefix: str = "") -> list[str]:
        return self.store.keys(prefix)

    @property
    def used_bytes(self) -> int:
        return self.store.used_bytes

    def close(self) -> None:
        self.store.close()
