"""The command line run in the test's own process, for checks that end before a model runs.

A fresh ``python -m kvwire`` spends ~7 s of a 2-core machine importing torch and transformers
before it can refuse anything; the default suite runs about a hundred such refusals. Here the
imports are paid once: :func:`run` calls the same entry point (``kvwire.cli.main``) with the
arguments and environment given, and returns what a subprocess would (exit status, stdout,
stderr; an exception the command line lets through comes back as its traceback on stderr,
as Python prints it). ``kvwire serve`` always runs as a process: it sets up the process itself (malloc
arenas, a trimming thread, signal handlers). Tests of what only a process shows (signals, exit on
Ctrl-C, a server that must end, what a fresh interpreter imports) keep their subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path
from unittest import mock


# commands that set up the process itself (malloc arenas and a trimming thread, signal handlers, threads):
# always a process of their own
OWN_PROCESS = {"serve"}


def run(*args: str, cwd: Path | str | None = None, **env: str) -> subprocess.CompletedProcess:
    """``python -m kvwire ARGS`` with ``env`` added to the environment, in this process (``serve``: a subprocess)."""
    from kvwire import cli

    if args and args[0] in OWN_PROCESS:
        return subprocess.run([sys.executable, "-m", "kvwire", *args], capture_output=True, text=True, timeout=600,
                              cwd=cwd, env={**os.environ, **env})

    stdout, stderr = io.StringIO(), io.StringIO()
    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    saved_level = logging.getLogger("kvwire").level  # main() sets it for the process
    os.environ.update(env)
    sys.argv = ["kvwire", *args]
    code = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        # click names the program after the interpreter's __main__ (pytest's here): as a process names it
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                mock.patch("click.core._detect_program_name", lambda *_, **__: "python -m kvwire"):
            try:
                cli.main()
            except SystemExit as end:
                code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
            except Exception:  # noqa: BLE001 -- what a subprocess would print and exit 1 with
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        logging.getLogger("kvwire").setLevel(saved_level)
    return subprocess.CompletedProcess(["kvwire", *args], code, stdout.getvalue(), stderr.getvalue())
