"""Stores, chosen by URL. See :func:`open_store` for every accepted URL."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from ..errors import UnknownStoreError, VersionConflict
from .base import Store, check_key, parse_bytes, parse_query
from .file import FileStore
from .memory import MemoryStore

__all__ = ["Store", "MemoryStore", "FileStore", "VersionConflict", "open_store", "check_key",
           "parse_bytes"]


def open_store(url: str = "memory://") -> Store:
    """Open the store a URL names.

    - ``memory://``        a private in-process dict (the default)
    - ``memory://NAME``    an in-process dict shared by every ``memory://NAME`` in this process
    - ``file:///DIR``      one file per key under ``/DIR`` (created if missing); use
                           ``file:///dev/shm/NAME`` for zero-copy exchange between processes on one host
    - a plain path ``/DIR`` or ``./DIR`` is taken as ``file://`` for convenience

    Every URL but a plain path takes ``?budget=SIZE`` (``64MiB``, ``2GB``, ``4096``): a
    byte budget with least-recently-used eviction. An unknown parameter, like any
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
    raise UnknownStoreError(
        f"unknown store URL {url!r}",
        "supported: memory://, memory://NAME, file:///DIR",
    )

