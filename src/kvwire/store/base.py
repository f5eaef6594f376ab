"""The store contract: bytes in, bytes out, by key, with versions and an optional byte budget.

A store knows nothing about packets (the codec turns packets into bytes) and
nothing about chains (``kvwire.kv.chain`` does). Every backend implements the same
handful of methods and passes the same contract test (``tests/store/test_store.py``).

Keys are ``/``-separated paths of ``[A-Za-z0-9._-]`` segments, e.g.
``packets/3f2a...`` or ``sessions/s1/handoff/analyst``; no empty segment and no
segment starting with ``.`` (those are the backends' own: ``..``, temporary
files, version records), at most 512 characters. They are checked before any
backend sees them, so a key can never escape a ``file://`` store's directory.

Versions. Every key has a version: 0 while it is absent, 1 after the put that
creates it, +1 for each later put. ``put(key, data, expect_version=v)`` stores
only if the key is at version ``v`` (0: only if absent) and raises
:class:`~kvwire.errors.VersionConflict` otherwise, so of two writers that read
the same version and both write, exactly one wins and the other is told. A key
that is deleted or evicted starts again at version 1 when it is put anew.

Budget. A store opened with ``budget=N`` bytes (``?budget=64MiB`` in its URL)
counts the bytes of the values it holds (``used_bytes``; keys and bookkeeping
are not counted). A put that would go over the budget first evicts the least
recently used keys (a ``get``, ``get_versioned`` or ``put`` counts as a use)
until the new value fits, whole keys at a time, so no partial value is ever
left behind; ``evictions`` counts the keys this store object evicted. A single
value larger than the whole budget raises :class:`~kvwire.errors.StoreError`
and stores nothing. The budget is enforced by the puts of the store object that
has it: processes that share one ``file://`` or ``redis://`` store should all
open it with the same budget.
"""

from __future__ import annotations

import errno
import re
from abc import ABC, abstractmethod
from types import TracebackType
from urllib.parse import parse_qsl

from ..errors import (OverBudget, StoreAccessDenied, StoreError, StoreUnavailable, UnknownStoreError, VersionConflict,
                      reason)

_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
MAX_KEY_LENGTH = 512

Buffer = bytes | bytearray | memoryview


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key, else raise :class:`StoreError` saying why."""
    if not isinstance(key, str) or not key:
        raise StoreError(f"store key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise StoreError(f"store key is {len(key)} characters long, the limit is {MAX_KEY_LENGTH}")
    for segment in key.split("/"):
        if not _SEGMENT.fullmatch(segment):
            raise StoreError(
                f"invalid store key {key!r}: segment {segment!r}",
                "keys are '/'-separated segments of letters, digits, '.', '_' and '-' "
                "that do not start with '.'",
            )
    return key


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """A byte count from an int or a string with an optional unit, case-insensitive.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB,
    TiB) powers of 1024: ``"64MiB"`` -> 67108864, ``"1GB"`` -> 1000000000,
    ``"4096"`` -> 4096. Raises :class:`StoreError` naming ``what`` on anything else.
    """
    if isinstance(text, bool):
        raise StoreError(f"{what} must be a byte count, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise StoreError(f"{what} must not be negative, got {text}")
        return text
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise StoreError(f"{what} {text!r} is not a byte count",
                         "write a whole number with an optional unit: 4096, 500MB, 64MiB, 2GiB")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_budget(budget: str | int | None) -> int | None:
    """``None`` (no budget) or a positive byte count (see :func:`parse_bytes`)."""
    if budget is None:
        return None
    value = parse_bytes(budget, "store budget")
    if value == 0:
        raise StoreError("store budget must be at least one byte", "omit it for a store without a budget")
    return value


def parse_query(url: str, query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """The ``name=value`` pairs of a store URL's query; each name at most once and in ``allowed``."""
    params: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise UnknownStoreError(f"store URL {url!r} has a malformed query {query!r}",
                                "write ?name=value&name=value") from None
    for name, value in pairs:
        if name not in allowed:
            accepted = ", ".join(allowed) if allowed else "none"
            raise UnknownStoreError(f"store URL {url!r} has an unknown parameter {name!r}",
                                    f"accepted: {accepted}")
        if name in params:
            raise UnknownStoreError(f"store URL {url!r} gives {name!r} twice")
        params[name] = value
    return params


# errno values of file operations that may succeed when tried again (a busy or flaky disk, NFS hiccups)
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.EIO, errno.ESTALE, errno.ETIMEDOUT,
                              errno.ENOLCK})
DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def os_store_error(message: str, err: OSError, hint: str | None = None) -> StoreError:
    """A file-system error as the store error class retrying it deserves.

    ``EIO``, ``EAGAIN``, ``ESTALE`` ... -> :class:`StoreUnavailable` (transient);
    ``EACCES``, ``EPERM``, ``EROFS`` -> :class:`StoreAccessDenied`; anything else
    (a full disk, say) -> a plain :class:`StoreError`, not retried.
    """
    text = f"{message}: {reason(err)}"
    if err.errno in TRANSIENT_ERRNOS:
        return StoreUnavailable(text, hint or "the file system failed for now; it is retried")
    if err.errno in DENIED_ERRNOS:
        return StoreAccessDenied(text, hint or "give this user write access to the store directory, or choose another")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreError(text, hint or "free space on that file system, or open the store with a smaller ?budget=")
    return StoreError(text, hint)


def check_expect(expect_version: int | None) -> int | None:
    """Validate ``put``'s ``expect_version``: ``None`` or an int >= 0."""
    if expect_version is None:
        return None
    if isinstance(expect_version, bool) or not isinstance(expect_version, int) or expect_version < 0:
        raise StoreError(f"expect_version must be None or an int >= 0 (0: the key is absent), "
                         f"got {expect_version!r}")
    return expect_version


def check_version(key: str, expect_version: int | None, current: int) -> None:
    """Raise :class:`VersionConflict` if ``expect_version`` is given and is not ``current``."""
    if expect_version is not None and expect_version != current:
        raise VersionConflict(key, expect_version, current)


def check_fits(key: str, size: int, budget: int | None, url: str) -> None:
    """Raise :class:`OverBudget` if a value of ``size`` bytes could never fit in ``budget``."""
    if budget is not None and size > budget:
        raise OverBudget(
            f"value for {key!r} is {size} bytes, more than the whole budget of {budget} bytes of {url}",
            "raise the store's budget (?budget=...) or store a smaller value",
        )


class Store(ABC):
    """A key -> bytes map with per-key versions. ``get`` of a missing key returns ``None``.

    Values come back as a buffer (``bytes`` or a read-only ``memoryview``) that the
    caller must not modify; backends may hand out views of shared memory. A view
    handed out stays valid and unchanged after the key is overwritten, deleted or
    evicted.

    ``budget`` is the byte budget (``None``: unlimited), ``used_bytes`` the bytes
    of the values held now, ``evictions`` the number of keys this object evicted.
    """

    url: str
    budget: int | None = None
    evictions: int = 0

    @abstractmethod
    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        """Store ``data`` under ``key`` atomically and return the key's new version.

        Readers see the old value or the new one, whole. With ``expect_version``,
        store only if the key is at that version (0: absent), else raise
        :class:`~kvwire.errors.VersionConflict` and change nothing. With a budget,
        evict least recently used keys first until the value fits; a value larger
        than the whole budget raises :class:`~kvwire.errors.StoreError`.
        """

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        """The value under ``key`` and its version, read together, or ``None`` if absent."""

    def get(self, key: str) -> bytes | memoryview | None:
        """The value under ``key``, or ``None`` if there is none."""
        found = self.get_versioned(key)
        return None if found is None else found[0]

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value (not a use: LRU order is unchanged)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""

    @abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """All keys starting with ``prefix``, sorted."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the values held now."""

    def close(self) -> None:
        """Release connections or handles. The default does nothing."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
