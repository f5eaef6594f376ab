"""A store seen through a namespace: every key lives under ``ns/<name>/``, invisible from any other.

Tenants of one server, or pipelines of different users, may share a store (one Redis for
several servers, say) but must never read each other's caches. :class:`ScopedStore`
puts every key a user of it writes or reads under ``ns/<name>/``: two scopes cannot name
each other's keys, because the scope is part of the key itself, not a filter applied to
what was found. Content-addressed packets are stored once *per scope*: the same prompt sent
by two tenants is two packets, so neither can tell from the store (or from its timing)
what the other sent::

    scoped = ScopedStore(open_store("redis://..."), "tenant-a")
    scoped.put("packets/ab12...", data)     # stored as ns/tenant-a/packets/ab12...
    scoped.keys("packets/")                 # only tenant-a's, without the scope prefix

``name`` is a key segment (letters, digits, ``.``, ``_``, ``-``); callers pass a hash of
whatever identifies the tenant, never a secret.
"""

from __future__ import annotations

from .base import Buffer, Store, check_key
from .forwarding import ForwardingStore

SCOPES = "ns/"


def scoped(store: Store, name: str | None) -> Store:
    """``store`` itself for no scope (``None`` or ``""``), else a :class:`ScopedStore`."""
    return store if not name else ScopedStore(store, name)


class ScopedStore(ForwardingStore):
    """``store`` with every key under ``ns/<name>/`` (see the module docstring)."""

    def __init__(self, store: Store, name: str) -> None:
        super().__init__(store)
        check_key(name)
        if "/" in name:
            raise ValueError(f"a scope is one key segment, got {name!r}")
        self.name = name
        self.prefix = f"{SCOPES}{name}/"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        return self.store.put(self._key(key), data, expect_version=expect_version)

    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        return self.store.get_versioned(self._key(key))

    def get(self, key: str) -> bytes | memoryview | None:
        return self.store.get(self._key(key))

    def exists(self, key: str) -> bool:
        return self.store.exists(self._key(key))

    def delete(self, key: str) -> bool:
        return self.store.delete(self._key(key))

    def keys(self, prefix: str = "") -> list[str]:
        return [k[len(self.prefix):] for k in self.store.keys(self.prefix + prefix)]

    def __repr__(self) -> str:
        return f"ScopedStore({self.store!r}, {self.name!r})"
