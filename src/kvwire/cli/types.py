"""Click parameter types every ``kvwire`` command shares."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource


class FiniteFloat(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` and ``inf``: click's range lets ``nan`` through
    every bound (it compares false), and a NaN learning rate or weight trains or fits a broken module."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class EnvChoice(click.Choice):
    """``click.Choice`` whose error names the environment variable when the value came from one: click says
    "Invalid value for '--weights'" for a bad ``KVWIRE_WEIGHTS``, an option the user never typed."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            source = ctx.get_parameter_source(param.name) if ctx is not None and param and param.name else None
            if source is not ParameterSource.ENVIRONMENT or not isinstance(param, click.Option) or not param.envvar:
                raise
            variable = param.envvar if isinstance(param.envvar, str) else param.envvar[0]
            self.fail(f"{variable}={value!r} in the environment is not one of {', '.join(map(str, self.choices))}: "
                      "set it to one of them, or unset it", param, ctx)


class PrefillChunk(click.ParamType):
    """A first prefill chunk: a token count >= 1, ``auto`` (measured on the model) or ``none`` (whole prefills)."""

    name = "N|auto|none"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str | None:
        if value is None or isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        text = str(value).strip().lower()
        if text in ("auto", "none"):
            return None if text == "none" else "auto"
        if text.isdigit() and int(text) >= 1:
            return int(text)
        self.fail(f"{value!r} is not a token count >= 1, auto or none", param, ctx)


class WritablePath(click.Path):
    """``click.Path`` for what a command writes: a path inside a file (``--out notes.txt/plot.png``) is a usage
    error naming that file before anything runs, not ``[Errno 20] Not a directory`` or ``[Errno 17] File
    exists`` from the first write, after the work. Converts to a :class:`~pathlib.Path`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(path_type=Path, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = Path(super().convert(value, param, ctx))
        for part in path.parents:  # the nearest one that is there must be a folder
            if part.exists():
                if not part.is_dir():
                    self.fail(f"{str(path)!r} is inside {str(part)!r}, a file, not a folder", param, ctx)
                break
        return path


SEED = click.IntRange(-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes (beyond it: an overflow traceback)


WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")  # wire.spec.WEIGHT_FORMATS (not imported: no torch at parse time)


def weights_option(command: Any) -> Any:
    """``--weights fp32|bf16|int8|int4`` (or ``$KVWIRE_WEIGHTS``): the format the model's linear weights are
    multiplied in (:mod:`kvwire.hf.weights`)."""
    return click.option("--weights", type=EnvChoice(WEIGHT_FORMATS), default="fp32", show_default=True,
                        envvar="KVWIRE_WEIGHTS",
                        help="the model's linear weights: fp32 (as loaded), bf16, int8 weight-only (per-channel "
                             "scales), or int4 weight-only (a scale and offset per 32 inputs: a Q4_1 GGUF's own "
                             "codes; the fastest decode, but prefills a little slower than fp32). Agents that share "
                             "caches must use the same")(command)


def device_option(command: Any) -> Any:
    """``--device cpu|cuda|cuda:N|mps`` (or ``$KVWIRE_DEVICE``): where the model runs (checked before it loads,
    :func:`kvwire.hf.check_device`)."""
    return click.option("--device", default="cpu", show_default=True, envvar="KVWIRE_DEVICE",
                        help="where the model runs: cpu, cuda, cuda:N or mps (an accelerator takes --weights fp32; "
                             "packets are still stored from CPU memory)")(command)


GUARD_HELP = ("splice and a graph's spliced merges: the fidelity guard. After the splice's pass, a spliced segment "
              "whose recomputed K/V moved more than this share (relative) from what it brought is recomputed "
              "exactly, with everything after it (0: no guard; BENCHMARKS section 11)")
