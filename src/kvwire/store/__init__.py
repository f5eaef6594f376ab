"""Stores, chosen by URL. See :func:`open_store` for every accepted URL."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from ..errors import UnknownStoreError
from .base import Store, check_key
from .file import FileStore
from .memory import MemoryStore

__all__ = ["Store", "MemoryStore", "FileStore", "open_store", "check_key"]


def open_store(url: str = "memory://") -> Store:
    """Open the store a URL names.

    - ``memory://``        a private in-process dict (the default)
    - ``memory://NAME``    an in-process dict shared by every ``memory://NAME`` in this process
    - ``file:///DIR``      one file per key under ``/DIR`` (created if missing); use
                           ``file:///dev/shm/NAME`` for zero-copy exchange between processes on one host
    - a plain path ``/DIR`` or ``./DIR`` is taken as ``file://`` for convenience

    Anything else raises :class:`UnknownStoreError`.
    """
    if not isinstance(url, str) or not url:
        raise UnknownStoreError(f"store URL must be a non-empty string, got {url!r}")
    if url.startswith(("/", "./", "../")):
        return FileStore(url)
    parts = urlsplit(url)
    if parts.scheme == "memory":
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise UnknownStoreError(f"bad memory store URL {url!r}", "use memory:// or memory://NAME")
        return MemoryStore(parts.netloc)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UnknownStoreError(f"file store URL {url!r} names host {parts.netloc!r}",
                                    "write file:///absolute/dir (three slashes)")
        if not parts.path:
            raise UnknownStoreError(f"file store URL {url!r} has no directory", "write file:///absolute/dir")
        return FileStore(unquote(parts.path))
    raise UnknownStoreError(
        f"unknown store URL {url!r}",
        "supported: memory://, memory://NAME, file:///DIR",
    )
