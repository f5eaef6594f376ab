"""``memory://`` -- a dict in this process; the default store and the reference backend."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ..errors import StoreError
from .base import Buffer, Store, check_expect, check_fits, check_key, check_version, parse_budget


@dataclass
class _Shelf:
    """What ``memory://NAME`` stores of one name share: the entries in LRU order (least
    recently used first), key -> (value, version), the bytes they hold, one lock."""

    entries: OrderedDict[str, tuple[bytes, int]] = field(default_factory=OrderedDict)
    used: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class MemoryStore(Store):
    """Values live in a dict. ``memory://NAME`` stores with the same name share one dict
    within a process; a bare ``memory://`` is private to the object.

    ``budget`` (bytes, or a string such as ``"64MiB"``) bounds the bytes this object
    lets the dict hold, evicting least recently used keys; stores sharing a name
    share the entries and their LRU order, each enforces its own budget.
    """

    _named: dict[str, _Shelf] = {}
    _named_lock = threading.Lock()

    def __init__(self, name: str = "", *, budget: int | str | None = None) -> None:
        self.budget = parse_budget(budget)
        self.evictions = 0
        self.url = f"memory://{name}" + (f"?budget={self.budget}" if self.budget is not None else "")
        if name:
            with MemoryStore._named_lock:
                self._shelf = MemoryStore._named.setdefault(name, _Shelf())
        else:
            self._shelf = _Shelf()

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        check_key(key)
        check_expect(expect_version)
        value = data if isinstance(data, bytes) else bytes(data)  # bytes are immutable: no copy needed
        check_fits(key, len(value), self.budget, self.url)
        shelf = self._shelf
        with shelf.lock:
            old = shelf.entries.get(key)
            check_version(key, expect_version, old[1] if old else 0)
            if old is not None:
                del shelf.entries[key]
                shelf.used -= len(old[0])
            if self.budget is not None:
                while shelf.used + len(value) > self.budget:
                    _, (evicted, _) = shelf.entries.popitem(last=False)
                    shelf.used -= len(evicted)
                    self.evictions += 1
            version = old[1] + 1 if old else 1
            shelf.entries[key] = (value, version)
            shelf.used += len(value)
            return version

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        check_key(key)
        shelf = self._shelf
        with shelf.lock:
            entry = shelf.entries.get(key)
            if entry is not None:
                shelf.entries.move_to_end(key)
            return entry

    def exists(self, key: str) -> bool:
        check_key(key)
        return key in self._shelf.entries

    def delete(self, key: str) -> bool:
        check_key(key)
        shelf = self._shelf
        with shelf.lock:
            entry = shelf.entries.pop(key, None)
            if entry is None:
                return False
            shelf.used -= len(entry[0])
            return True

    def keys(self, prefix: str = "") -> list[str]:
        if not isinstance(prefix, str):
            raise StoreError(f"key prefix must be a string, got {prefix!r}")
        with self._shelf.lock:
            return sorted(k for k in self._shelf.entries if k.startswith(prefix))

    @property
    def used_bytes(self) -> int:
        return self._shelf.used
