"""Every benchmark script starts: ``--help`` answers with its usage, and a bad count is one usage error.

The scripts import helpers from the tests and from each other, so a module moved elsewhere breaks
them only when someone runs them (``benchmarks/rope.py`` imported ``test_rope`` from a folder the
reshape had emptied). Starting each one here catches that the day it happens.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")


def start(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_every_benchmark_answers_help():
    with ThreadPoolExecutor(4) as pool:
        runs = dict(zip(SCRIPTS, pool.map(lambda s: start(s, "--help"), SCRIPTS)))
    assert len(runs) > 10
    for script, proc in runs.items():
        assert "usage:" in proc.stdout + proc.stderr, f"{script.name}: {proc.stderr[-800:]}"
        assert "Traceback" not in proc.stderr, f"{script.name}: {proc.stderr[-800:]}"


def test_a_count_of_zero_is_a_usage_error_not_a_median_of_nothing():
    proc = start(ROOT / "benchmarks" / "engines.py", "--repeats", "0")
    assert proc.returncode == 2 and "--repeats: must be at least 1, not 0" in proc.stderr
