"""The consoles every kvwire command prints to: results on stdout, progress and errors on stderr.

Written to a file or a pipe, rich would lay tables out 80 columns wide and cut their cells
(``expla…``, ``12.9…``), losing the numbers a saved log is kept for; there the width is 200
columns unless ``COLUMNS`` says otherwise.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from rich.console import Console

WIDTH_OFF_TERMINAL = 200


def _console(stream: TextIO, stderr: bool) -> Console:
    terminal = stream.isatty() if hasattr(stream, "isatty") else False
    width = None if terminal or os.environ.get("COLUMNS") else WIDTH_OFF_TERMINAL
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


out = _console(sys.stdout, stderr=False)
err = _console(sys.stderr, stderr=True)
