"""A store that hands every call to another store: the base of kvwire's store wrappers.

A wrapper (timing, retrying, a local copy in front of a remote store) changes one or two
calls of the store it wraps and passes the rest through. :class:`ForwardingStore` passes
*everything* through -- ``url``, ``budget``, ``evictions``, ``put``, ``get``,
``get_versioned``, ``exists``, ``delete``, ``keys``, ``used_bytes``, ``close`` -- so a
wrapper overrides only what it changes, and a method added to :class:`~kvwire.store.base.Store`
is forwarded in one place::

    class Counting(ForwardingStore):
        def __init__(self, store):
            super().__init__(store)
            self.puts = 0

        def put(self, key, data, *, expect_version=None):
            self.puts += 1
            return self.store.put(key, data, expect_version=expect_version)

The wrapped store is ``self.store``. ``get`` goes to the wrapped store's own ``get``
(not through this object's ``get_versioned``), so a wrapper that changes reads overrides both.
"""

from __future__ import annotations

from .base import Buffer, Store


class ForwardingStore(Store):
    """``store`` as it is: every call and property forwarded (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

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
        return self.store.put(key, data, expect_version=expect_version)

    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        return self.store.get_versioned(key)

    def get(self, key: str) -> bytes | memoryview | None:
        return self.store.get(key)

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
