"""Real text that exists offline wherever kvwire runs: the Python standard library's own source.

:func:`stdlib_chunks` cuts the running interpreter's top-level ``.py`` files into chunks
of whole lines, deterministically for a seed; :func:`instruction` wraps one as a user
message of a coding assistant (one of a few fixed requests), the kind of context a
sharer and a receiver read in fuse mode. The ridge projector is fitted on these.

The standard library differs a little between Python versions; :func:`corpus_id` names
what was read, and is recorded with anything fitted on it.
"""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
from pathlib import Path

from ..errors import FuserDataError

REQUESTS = (
    "Explain what this code from the Python standard library does.",
    "Review this code from the Python standard library and point out anything surprising.",
    "Summarize the purpose of each function in this code.",
    "Which standard library module is this code from, and what is it for?",
)


def stdlib_files() -> list[Path]:
    """The top-level ``.py`` files of the running Python's standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FuserDataError(f"no Python source files in {root}", "run kvwire with a full CPython installation")
    return files


def stdlib_chunks(count: int, chars: int = 1200, seed: int = 0, exclude: frozenset[str] = frozenset()) -> list[str]:
    """``count`` chunks of about ``chars`` characters (whole lines, at least 5 of them) from random
    places in random standard library files; files named in ``exclude`` (stems) are skipped.

    Example: ``stdlib_chunks(2, 300, seed=1)`` -> two ~300-character excerpts of, say,
    ``fractions.py`` and ``textwrap.py`` (the same ones every time for seed 1 on one Python).
    """
    if count < 0 or chars < 50:
        raise FuserDataError(f"need count >= 0 and chars >= 50, got {count} and {chars}")
    files = [f for f in stdlib_files() if f.stem not in exclude]
    rng = random.Random(seed)
    chunks: list[str] = []
    attempts = 0
    while len(chunks) < count:
        attempts += 1
        if attempts > 100 * (count + 1):
            raise FuserDataError(f"could not cut {count} chunks of {chars} characters from the standard library")
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 10:
            continue
        start = rng.randrange(0, len(lines) - 5)
        taken, size = [], 0
        for line in lines[start:]:
            if size + len(line) > chars and len(taken) >= 5:
                break
            taken.append(line)
            size += len(line)
        text = "".join(taken).strip("\n")
        if text.strip() and len(text) <= 2 * chars:
            chunks.append(text)
    return chunks


def instruction(chunk: str, index: int = 0) -> list[dict[str, str]]:
    """A user message asking about ``chunk`` (request ``index`` of :data:`REQUESTS`, cycling)."""
    return [{"role": "user", "content": f"{REQUESTS[index % len(REQUESTS)]}\n\n```python\n{chunk}\n```"}]


def corpus_id() -> str:
    """Names the corpus: the Python version and a hash of the standard library's file names and sizes."""
    digest = hashlib.blake2b(digest_size=8)
    for path in stdlib_files():
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return f"python-{sys.version_info.major}.{sys.version_info.minor}-stdlib-{digest.hexdigest()}"
