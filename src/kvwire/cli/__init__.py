"""The ``kvwire`` command: parse, call the library, print. Library errors become exit codes.

Results go to stdout (a table, or with ``--json`` one JSON object as the last line);
progress and logs go to stderr. Exit codes: 0 ok, 1 a kvwire error (one
``error: ...`` line saying what is wrong and what to do), 2 bad usage, 130 interrupted.

One module per command group; this one holds the group and :func:`main` (the entry point):

- :mod:`.fetch` -- ``fetch``, ``size``: a model made ready offline, and its KV-cache bytes.
- :mod:`.run` -- ``demo``, ``run``, ``agent``: a pipeline in one process, or one agent per process
  (:mod:`.pipeline` runs and reports a linear pipeline, :mod:`.graph` a graph).
- :mod:`.probe` -- ``probe``, ``plot``: where caches pay off, and the splice benchmark's plot.
- :mod:`.packets` -- ``inspect``: a packet file verified and shown.
- :mod:`.fuse`, :mod:`.fuser` -- ``check``, ``fit-ridge``, ``fuse``; ``fuser-data``, ``train-fuser``.
- :mod:`.serve` -- ``serve``: the OpenAI-compatible server.
- :mod:`.eval` -- ``eval``: a pipeline over a task set (HumanEval, or your own), every mode judged by the tests.
- :mod:`.console`, :mod:`.types` -- the two consoles (stdout, stderr) and shared option types.
"""

from __future__ import annotations

import logging
import sys

import click
from rich.logging import RichHandler
from rich.markup import escape

from ..errors import KvwireError
from .console import err
from .eval import eval_cmd
from .fetch import fetch_cmd, size_cmd
from .fuse import check_cmd, fit_ridge_cmd, fuse_cmd
from .fuser import fuser_data_cmd, train_fuser_cmd
from .packets import inspect_cmd
from .probe import plot_cmd, probe_cmd
from .run import agent_cmd, demo_cmd, run_cmd
from .serve import serve_cmd

__all__ = ["cli", "main"]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err, show_time=False, show_path=False)])
    logging.getLogger("kvwire").setLevel(logging.INFO)
    try:
        cli.main(standalone_mode=False)
    except KvwireError as error:
        err.print(f"[bold red]error:[/] {escape(str(error))}", markup=True, highlight=False)
        sys.exit(1)
    except OSError as error:  # a path given on the command line that cannot be read or written
        err.print(f"[bold red]error:[/] {escape(describe_os_error(error))}", markup=True, highlight=False)
        sys.exit(1)
    except click.exceptions.Abort:
        err.print("interrupted")
        sys.exit(130)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


def describe_os_error(error: OSError) -> str:
    """``PATH: what is wrong (what to do)`` for an OSError about a path (Python's own reads
    ``[Errno 20] Not a directory: 'PATH'``); other OSErrors as they are."""
    if error.filename is None or not error.strerror:
        return str(error)
    path = f"{error.filename} -> {error.filename2}" if error.filename2 is not None else str(error.filename)
    return f"{path}: {error.strerror} (check the path: its folders must exist and be folders kvwire may use)"


@click.group()
@click.version_option(package_name="kvwire")
def cli() -> None:
    """Pass KV-caches between the agents of an LLM pipeline instead of re-encoding text."""


for command in (fetch_cmd, demo_cmd, run_cmd, agent_cmd, probe_cmd, plot_cmd, inspect_cmd, size_cmd,
                check_cmd, fit_ridge_cmd, fuse_cmd, fuser_data_cmd, train_fuser_cmd, serve_cmd, eval_cmd):
    cli.add_command(command)
