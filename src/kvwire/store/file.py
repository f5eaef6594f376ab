"""``file:///DIR`` -- one file per key under a directory.

Writes go to a temporary file in the same directory, are fsynced, then renamed
over the key's file, so a reader in any process sees the previous value or the
whole new one, never half a packet; a writer killed mid-way leaves only a
``.*.tmp`` file, which readers ignore. Reads ``mmap`` the file: on ``/dev/shm``
(a RAM filesystem) that hands another process's packet to this one without a
copy.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from ..codec import atomic_write
from ..errors import StoreError
from .base import Store, check_key


class FileStore(Store):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot create store directory {self.root}: {err.strerror}",
                             "choose a writable directory") from None
        if not os.access(self.root, os.W_OK):
            raise StoreError(f"store directory {self.root} is not writable", "choose a writable directory")

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        path = self._path(key)
        try:
            atomic_write(path, [data])
        except OSError as err:
            raise StoreError(f"cannot write {path}: {err.strerror}") from None

    def get(self, key: str) -> memoryview | bytes | None:
        path = self._path(key)
        try:
            with path.open("rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return b""
                # private copy-on-write mapping: reads share the page cache, a stray write cannot reach the file
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as err:
            raise StoreError(f"cannot read {path}: {err.strerror}") from None
        return memoryview(mapped)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except (FileNotFoundError, IsADirectoryError):
            return False
        return True

    def keys(self, prefix: str = "") -> list[str]:
        found = []
        for path in self.root.rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    found.append(key)
        return sorted(found)
