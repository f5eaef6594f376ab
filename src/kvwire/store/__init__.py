"""Stores, chosen by URL. See :func:`open_store` for every accepted URL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ..errors import UnknownStoreError, VersionConflict
from .base import Store, check_key, parse_bytes, parse_query
from .file import FileStore
from .memory import MemoryStore

if TYPE_CHECKING:
    from .cluster import RedisClusterStore
    from .redis import RedisStore

__all__ = ["Store", "MemoryStore", "FileStore", "RedisStore", "RedisClusterStore", "VersionConflict", "open_store",
           "check_key", "check_store_url", "parse_bytes"]


def open_store(url: str = "memory://") -> Store:
    """Open the store a URL names.

    - ``memory://``        a private in-process dict (the default)
    - ``memory://NAME``    an in-process dict shared by every ``memory://NAME`` in this process
    - ``file:///DIR``      one file per key under ``/DIR`` (created if missing); use
                           ``file:///dev/shm/NAME`` for zero-copy exchange between processes on one host
    - a plain path ``/DIR`` or ``./DIR`` is taken as ``file://`` for convenience
    - ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``   a Redis server (port 6379 and db 0 by
                           default), the store for agents on several hosts; see :mod:`kvwire.store.redis`
    - ``rediss://...``     the same over TLS; ``?ssl_ca_certs=/path/ca.pem`` names the CA to trust
    - ``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][/0]``   a Redis Cluster found through
                           any of the listed nodes; see :mod:`kvwire.store.cluster`
    - ``rediss+cluster://...``  the same over TLS

    Every URL but a plain path takes ``?budget=SIZE`` (``64MiB``, ``2GB``, ``4096``): a
    byte budget with least-recently-used eviction. Redis and Redis Cluster URLs also take
    ``prefix``, ``chunk_size``, ``connect_timeout``, ``timeout`` and the ``ssl_*``
    parameters listed in :mod:`kvwire.store.redis`. An unknown parameter, like any
    other URL, raises :class:`UnknownStoreError`.
    """
    if not isinstance(url, str) or not url:
        raise UnknownStoreError(f"store URL must be a non-empty string, got {url!r}")
    if url.startswith(("/", "./", "../")):
        return FileStore(url)
    parts = urlsplit(url)
    if parts.scheme == "memory":
        params = parse_query(url, parts.query, ("budget",))
        if parts.path not in ("", "/") or parts.fragment:
            raise UnknownStoreError(f"bad memory store URL {url!r}", "use memory:// or memory://NAME")
        return MemoryStore(parts.netloc, budget=params.get("budget"))
    if parts.scheme == "file":
        params = parse_query(url, parts.query, ("budget",))
        if parts.netloc not in ("", "localhost"):
            raise UnknownStoreError(f"file store URL {url!r} names host {parts.netloc!r}",
                                    "write file:///absolute/dir (three slashes)")
        if not parts.path:
            raise UnknownStoreError(f"file store URL {url!r} has no directory", "write file:///absolute/dir")
        return FileStore(unquote(parts.path), budget=params.get("budget"))
    if parts.scheme in ("redis", "rediss"):
        from .redis import RedisStore

        return RedisStore(url)
    if parts.scheme in ("redis+cluster", "rediss+cluster"):
        from .cluster import RedisClusterStore

        return RedisClusterStore(url)
    raise UnknownStoreError(
        f"unknown store URL {url!r}",
        "supported: memory://, memory://NAME, file:///DIR, redis://HOST:PORT/DB, rediss://HOST:PORT/DB, "
        "redis+cluster://HOST:PORT,HOST:PORT, rediss+cluster://...",
    )


def check_store_url(url: str) -> None:
    """Raise as :func:`open_store` would for a malformed ``url``, without contacting a Redis server
    (local stores are opened and closed: a directory that cannot be created is an error too)."""
    if isinstance(url, str) and url.startswith(("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")):
        from .redis_common import parse_redis_url

        parse_redis_url(url)
    else:
        open_store(url).close()


def __getattr__(name: str) -> Any:
    if name == "RedisStore":  # imported on first use: redis-py is only needed for redis:// stores
        from .redis import RedisStore

        return RedisStore
    if name == "RedisClusterStore":
        from .cluster import RedisClusterStore

        return RedisClusterStore
    raise AttributeError(f"module 'kvwire.store' has no attribute {name!r}")
