"""The store contract: bytes in, bytes out, by key.

A store knows nothing about packets (the codec turns packets into bytes) and
nothing about chains (``kvwire.chain`` does). Every backend implements the same
handful of methods and passes the same contract test (``tests/test_store.py``).

Keys are ``/``-separated paths of ``[A-Za-z0-9._-]`` segments, e.g.
``packets/3f2a...`` or ``sessions/s1/handoff/analyst``; no empty, ``.`` or ``..``
segment, at most 512 characters. They are checked before any backend sees them,
so a key can never escape a ``file://`` store's directory.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from types import TracebackType

from ..errors import StoreError

_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
MAX_KEY_LENGTH = 512


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key, else raise :class:`StoreError` saying why."""
    if not isinstance(key, str) or not key:
        raise StoreError(f"store key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise StoreError(f"store key is {len(key)} characters long, the limit is {MAX_KEY_LENGTH}")
    for segment in key.split("/"):
        if segment in ("", ".", "..") or not _SEGMENT.fullmatch(segment):
            raise StoreError(
                f"invalid store key {key!r}: segment {segment!r}",
                "keys are '/'-separated segments of letters, digits, '.', '_' and '-' (no '..')",
            )
    return key


class Store(ABC):
    """A key -> bytes map. ``get`` of a missing key returns ``None``.

    Values come back as a buffer (``bytes`` or a read-only ``memoryview``) that the
    caller must not modify; backends may hand out views of shared memory.
    """

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` atomically: readers see the old value or the new one, whole."""

    @abstractmethod
    def get(self, key: str) -> bytes | memoryview | None:
        """The value under ``key``, or ``None`` if there is none."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""

    @abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """All keys starting with ``prefix``, sorted."""

    def close(self) -> None:
        """Release connections or handles. The default does nothing."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
