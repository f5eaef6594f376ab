"""Every benchmark script starts: ``--help`` answers with its usage, and a bad count is one usage error.

The scripts import helpers from the tests and from each other, so a module moved elsewhere breaks
them only when someone runs them (``benchmarks/rope.py`` imported ``test_rope`` from a folder the
reshape had emptied). Starting each one here catches that the day it happens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")


def start(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


# Runs every script's ``--help`` in one interpreter (torch and transformers imported once, not twenty times):
# each as ``python SCRIPT --help`` would run it, its output and how it ended printed as one JSON line.
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for script in sys.argv[1:]:
    sys.argv, out = [script, "--help"], io.StringIO()
    sys.path.insert(0, script.rsplit("/", 1)[0])
    code, error = None, ""
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as end:  # sys.exit("usage: ...") prints its text to stderr, as Python would
            code = end.code if not isinstance(end.code, str) else print(end.code, file=sys.stderr) or 1
        except BaseException:
            error = traceback.format_exc()
    sys.path.pop(0)
    results[script] = {"output": out.getvalue(), "code": code, "error": error}
print(json.dumps(results))
"""


def test_every_benchmark_answers_help():
    import json

    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(runs) == len(SCRIPTS) > 10
    for script, run in runs.items():
        name = Path(script).name
        assert not run["error"], f"{name}: {run['error'][-800:]}"
        assert "usage:" in run["output"], f"{name}: {run['output'][-800:]}"


def test_a_count_of_zero_is_a_usage_error_not_a_median_of_nothing():
    proc = start(ROOT / "benchmarks" / "engines.py", "--repeats", "0")
    assert proc.returncode == 2 and "--repeats: must be at least 1, not 0" in proc.stderr
