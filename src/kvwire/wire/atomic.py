"""Atomic file writes: a reader sees the old file or the whole new one, never half of it.

A write is two steps, so a caller can do work in between (the file store checks
versions and evicts under its lock there): :func:`stage` writes a fsynced temporary
file beside the target, :func:`commit` renames it over the target and fsyncs the
directory. A writer killed before the rename leaves only a ``.*.tmp`` file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def stage(path: Path, chunks: Iterable[Any]) -> Path:
    """Write ``chunks`` to a fsynced temporary file beside ``path``; return the temporary path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def commit(tmp: Path, path: Path) -> Path:
    """Rename a staged file over ``path`` and make the rename durable."""
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def atomic_write(path: Path, chunks: Iterable[Any]) -> Path:
    """:func:`stage` then :func:`commit`; the temporary file is removed if anything fails."""
    tmp = stage(path, chunks)
    try:
        return commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
