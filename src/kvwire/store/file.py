"""``file:///DIR`` -- one file per key under a directory, shared by every process that opens it.

Layout under ``DIR``::

    packets/3f2a...              the value of key ``packets/3f2a...``, raw bytes
    .kvwire/lock                 flock(2)ed by writers (exclusive) and versioned readers (shared)
    .kvwire/versions/packets/3f2a...   the key's version, decimal text

Writes go to a temporary file in the key's directory and are fsynced outside
the lock; then, holding the lock, the writer checks the version, evicts if a
budget says so, writes the new version record and renames the value over the
key's file. A reader in any process therefore sees the previous value or the
whole new one, never half a packet; a writer killed mid-way leaves only a
``.*.tmp`` file, which readers ignore. The version record is written before the
value is renamed, so a crash between the two leaves the old value under a
higher version: a stale writer is still rejected, and no two different values
ever share a version. Reads ``mmap`` the file: on ``/dev/shm`` (a RAM
filesystem) that hands another process's packet to this one without a copy.

Least recently used order is the files' modification times: puts and gets set
them (to the nanosecond, explicitly, since the kernel's own timestamps are
coarse), so it is shared by every process without an index to keep consistent.
Eviction deletes whole files; a reader that already mapped an evicted value
keeps a valid view of it.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..wire.atomic import atomic_write, commit, stage
from ..errors import StoreAccessDenied, StoreError, reason
from .base import Buffer, Store, check_expect, check_fits, check_key, check_version, os_store_error, parse_budget

log = logging.getLogger(__name__)

META = ".kvwire"  # the store's own files; keys cannot start with '.', so no key reaches them

_clock_lock = threading.Lock()
_last_stamp = 0


def _stamp() -> int:
    """Nanoseconds since the epoch, strictly increasing within this process (the LRU clock)."""
    global _last_stamp
    with _clock_lock:
        _last_stamp = max(time.time_ns(), _last_stamp + 1)
        return _last_stamp


class FileStore(Store):
    """One file per key under ``root`` (created if missing); ``budget`` in bytes or
    a string such as ``"1GiB"`` bounds the bytes of the values, evicting least
    recently used keys (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, budget: int | str | None = None) -> None:
        self.root = Path(root)
        self.budget = parse_budget(budget)
        self.evictions = 0
        self.url = f"file://{self.root}" + (f"?budget={self.budget}" if self.budget is not None else "")
        self._meta = self.root / META
        try:
            (self._meta / "versions").mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise os_store_error(f"cannot create store directory {self.root}", err,
                                 "choose a writable directory") from None
        if not os.access(self.root, os.W_OK):
            raise StoreAccessDenied(f"store directory {self.root} is not writable", "choose a writable directory")

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _version_path(self, key: str) -> Path:
        return self._meta.joinpath("versions", *key.split("/"))

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Hold the store's lock file; a fresh descriptor per use, so threads exclude each other too."""
        try:
            fd = os.open(self._meta / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise os_store_error(f"cannot open the lock file of {self.root}", err,
                                 "the store directory must be writable by every process using it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the last descriptor releases the lock

    def _version(self, key: str, path: Path) -> int:
        """The key's version; call with the lock held. 0 if there is no value; a value
        without a record (written by an older kvwire) is at version 1."""
        if not path.is_file():
            return 0
        try:
            return int(self._version_path(key).read_text())
        except FileNotFoundError:
            return 1
        except (OSError, ValueError) as err:
            raise StoreError(f"unreadable version record for {key!r} in {self.root}: {reason(err)}",
                             f"delete {self._version_path(key)}; the key then counts as version 1") from None

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        path = self._path(key)
        check_expect(expect_version)
        size = memoryview(data).nbytes
        check_fits(key, size, self.budget, self.url)
        try:
            tmp = stage(path, [data])
        except OSError as err:
            raise os_store_error(f"cannot write {path}", err) from None
        try:
            with self._locked(exclusive=True):
                current = self._version(key, path)
                check_version(key, expect_version, current)
                if self.budget is not None:
                    self._evict_for(size, keep=path)
                atomic_write(self._version_path(key), [str(current + 1).encode()])
                stamp = _stamp()
                os.utime(tmp, ns=(stamp, stamp))
                commit(tmp, path)
        except OSError as err:
            raise os_store_error(f"cannot write {path}", err) from None
        finally:
            tmp.unlink(missing_ok=True)  # gone after a successful rename; stale after any failure
        return current + 1

    def _evict_for(self, size: int, keep: Path) -> None:
        """Delete least recently used values until ``size`` more bytes fit; call with the lock held.
        ``keep`` (the key being replaced) is not evicted, and its old bytes do not count."""
        held = self._scan()
        used = sum(s for p, s, _ in held if p != keep)
        for victim, victim_size, _ in sorted(held, key=lambda entry: (entry[2], str(entry[0]))):
            if used + size <= self.budget:
                break
            if victim == keep:
                continue
            key = victim.relative_to(self.root).as_posix()
            victim.unlink(missing_ok=True)
            self._version_path(key).unlink(missing_ok=True)
            used -= victim_size
            self.evictions += 1
            log.debug("evicted %s (%d bytes) from %s", key, victim_size, self.url)

    def _scan(self) -> list[tuple[Path, int, int]]:
        """(path, size, last use in ns) of every value file, skipping the store's own files."""
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):
                    continue
                path = Path(dirpath, name)
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue  # deleted by another process meanwhile
                found.append((path, st.st_size, st.st_mtime_ns))
        return found

    def get(self, key: str) -> memoryview | bytes | None:
        path = self._path(key)
        return self._read(path)

    def get_versioned(self, key: str) -> tuple[memoryview | bytes, int] | None:
        path = self._path(key)
        with self._locked(exclusive=False):
            value = self._read(path)
            if value is None:
                return None
            return value, self._version(key, path)

    def _read(self, path: Path) -> memoryview | bytes | None:
        """Map the value at ``path`` and mark it used; ``None`` if there is none."""
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                # private copy-on-write mapping: reads share the page cache, a stray write cannot reach the file
                value = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)) if size else b""
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as err:
            raise os_store_error(f"cannot read {path}", err) from None
        stamp = _stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError as err:  # replaced or evicted meanwhile, or a read-only store: LRU order only
            log.debug("cannot mark %s as used: %s", path, err.strerror)
        return value

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> bool:
        path = self._path(key)
        with self._locked(exclusive=True):
            try:
                path.unlink()
            except (FileNotFoundError, IsADirectoryError):
                return False
            except OSError as err:
                raise os_store_error(f"cannot delete {path}", err) from None
            self._version_path(key).unlink(missing_ok=True)
            return True

    def keys(self, prefix: str = "") -> list[str]:
        if not isinstance(prefix, str):
            raise StoreError(f"key prefix must be a string, got {prefix!r}")
        found = (p.relative_to(self.root).as_posix() for p, _, _ in self._scan())
        return sorted(k for k in found if k.startswith(prefix))

    @property
    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._scan())
