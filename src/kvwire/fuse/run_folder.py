"""What a training run keeps in its ``--out`` folder besides checkpoints: the log, and the rule that a
new run never writes over an earlier one.

    OUT/log.jsonl      one JSON object per line: a step's record, or {"step": N, "eval": {...}}
    OUT/checkpoints/   resumable checkpoints (:mod:`.train`)
    OUT/fuser | lora   the final module
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .train_config import EvalRecord, StepRecord

LOG_FILE = "log.jsonl"


def check_fresh_out(out: str | Path, method: str) -> None:
    """A new run never writes over an earlier one's checkpoints or final module (:class:`CheckpointError`)."""
    out = Path(out)
    name = "fuser" if method == "fuser" else "lora"
    earlier = [p for p in (out / "checkpoints", out / name) if p.is_dir() and any(p.iterdir())]
    if earlier:
        raise CheckpointError(f"{out} already holds a training run ({', '.join(p.name + '/' for p in earlier)})",
                              "pass --resume to continue it, or give a new --out to start over")


def append(out: Path, entry: dict[str, Any]) -> None:
    """Add one line to the run's log."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / LOG_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def truncate(out: Path, step: int) -> tuple[list[StepRecord], list[EvalRecord]]:
    """Keep the log's lines up to ``step`` (a resumed run rewrites what came after; unreadable lines
    are dropped) and return the step and evaluation records kept."""
    path = out / LOG_FILE
    kept: list[str] = []
    history: list[StepRecord] = []
    evals: list[EvalRecord] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int) or entry["step"] > step:
                continue
            try:
                if "eval" in entry:
                    evals.append(EvalRecord(**entry["eval"]))
                else:
                    history.append(StepRecord(**entry))
            except TypeError:
                continue
            kept.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    return history, evals
