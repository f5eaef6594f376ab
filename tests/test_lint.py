"""ruff over the sources, tests, benchmarks and examples, with the rules in pyproject.toml: among them
B015 and B018, a comparison or an expression whose value is dropped -- a check that cannot fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks", "examples"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
