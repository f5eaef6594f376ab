"""kvwire's cache folder: converted models, built kernels, trained fusers -- never inside the repository.

``$KVWIRE_HOME``, else ``$XDG_CACHE_HOME/kvwire``, else ``~/.cache/kvwire``.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelError


def home() -> Path:
    """kvwire's cache directory (converted models live here, never in the repository).

    A path that is, or lies inside, a file is refused naming the variable it came from (else every later
    step fails with "[Errno 20] Not a directory" or "[Errno 17] File exists").
    """
    if os.environ.get("KVWIRE_HOME"):
        variable, path = "KVWIRE_HOME", Path(os.environ["KVWIRE_HOME"]).expanduser()
        hint = "point KVWIRE_HOME at a folder kvwire may write to, or unset it for ~/.cache/kvwire"
    elif os.environ.get("XDG_CACHE_HOME"):
        variable, path = "XDG_CACHE_HOME", Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvwire"
        hint = "point XDG_CACHE_HOME at a folder, or set KVWIRE_HOME to a folder kvwire may write to"
    else:
        variable, path = None, Path.home() / ".cache" / "kvwire"
        hint = "move that file away, or set KVWIRE_HOME to a folder kvwire may write to"
    blocking = _file_on(path)
    if blocking is not None:
        named = f"{variable}={os.environ[variable]!r}" if variable else f"kvwire's cache folder {path}"
        inside = "" if blocking == path or (variable == "XDG_CACHE_HOME" and blocking == path.parent) else \
            f": {blocking} is a file"
        raise ModelError(f"{named} is not a folder{inside}", hint)
    return path


def _file_on(path: Path) -> Path | None:
    """The nearest existing part of ``path`` (itself, else its parent, ...) if it is not a folder, else None."""
    for part in (path, *path.parents):
        if part.exists():
            return None if part.is_dir() else part
    return None
