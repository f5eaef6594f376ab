"""``memory://`` -- a dict in this process; the default store and the reference backend."""

from __future__ import annotations

import threading

from .base import Store, check_key


class MemoryStore(Store):
    """Values live in a dict. ``memory://NAME`` stores with the same name share one dict
    within a process; a bare ``memory://`` is private to the object."""

    _named: dict[str, dict[str, bytes]] = {}
    _named_lock = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        if name:
            with MemoryStore._named_lock:
                self._data = MemoryStore._named.setdefault(name, {})
        else:
            self._data = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        check_key(key)
        value = data if isinstance(data, bytes) else bytes(data)  # bytes are immutable: no copy needed
        with self._lock:
            self._data[key] = value

    def get(self, key: str) -> bytes | None:
        check_key(key)
        return self._data.get(key)

    def exists(self, key: str) -> bool:
        check_key(key)
        return key in self._data

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return self._data.pop(key, None) is not None

    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self._data if k.startswith(prefix))
