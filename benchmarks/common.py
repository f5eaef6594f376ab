"""What every benchmark script shares: the machine description and a median timer."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """CPU, cores, threads and versions; the load average says whether timings were shared."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    from kvwire.hf import linears

    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "linears": linears.policy().name,  # how passes computed their linear layers (kvwire.hf.linears)
            "loadavg_1m_at_end": os.getloadavg()[0],  # > cores: timings were shared with other work
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def shared_context(model: Any, context: int, rows: int,
                   suffix: int = 24) -> tuple[list[int], list[list[int]], Any, Any]:
    """``(shared, suffixes, cache, prefix)``: ``context`` random ids several agents share (prefilled into
    ``cache``, and as an engine ``hf.Prefix``), and ``rows`` random ``suffix``-token instructions (seed 0)."""
    from kvwire import hf

    g = torch.Generator().manual_seed(0)
    high = min(10000, model.config.vocab_size)
    shared = torch.randint(3, high, (context,), generator=g).tolist()
    suffixes = [torch.randint(3, high, (suffix,), generator=g).tolist() for _ in range(rows)]
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([shared], device=hf.model_device(model)), past_key_values=cache, use_cache=True)
    return shared, suffixes, cache, hf.Prefix.from_cache(cache, shared)


def die_with_parent() -> None:
    """A ``preexec_fn`` for a server a benchmark starts: the kernel sends it SIGTERM when the benchmark's process
    ends, however it ends (``kill -9`` included), so a killed benchmark leaves no server behind (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def splice_inputs(model: Any, tokenizer: Any, spec: Any, workload: Any, agent: int = -1) -> tuple[list[int], list]:
    """(context_ids, segments) that splice receiver ``agent`` (an index among agents 2..N)
    assembled in a splice run of ``workload`` at R = 0: to measure one splice in isolation."""
    from kvwire.kv import splice
    from kvwire.pipeline.linear import Pipeline

    calls = []
    original = splice.assemble

    def recording(model_, spec_, tables, context_ids, segments, **options):
        calls.append((list(context_ids), list(segments)))
        return original(model_, spec_, tables, context_ids, segments, **options)

    splice.assemble = recording
    try:
        Pipeline(model, tokenizer, workload, model_spec=spec).run("splice")
    finally:
        splice.assemble = original
    return calls[agent]


def run_main(main: Callable[[], Any]) -> None:
    """A script's entry point: kvwire's own errors (a model not fetched, a bad checkpoint, a store that is
    down) end it with one ``error:`` line that says what to do, and exit status 1, not a traceback."""
    from kvwire.errors import KvwireError

    try:
        main()
    except KvwireError as err:
        sys.exit(f"error: {err}")


def positive(text: str) -> int:
    """argparse type for counts a run needs at least one of (``--repeats``, ``--threads``): 0 or less is a usage
    error, not a median of nothing at the end of a run."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


RANDOM_WEIGHTS_HELP = """With --random-weights CONFIG the model is made from a config.json (benchmarks/configs/:
llama-2-7b.json, qwen2.5-7b.json; tiny-llama.json for a CPU) with seeded random weights, on --device in
--dtype: the same
shapes and kernels as the real model, so times, bytes and ratios hold for it; its replies are noise, and run
to their token limit (a random model has no end-of-sequence), and text vs prefix still must match token for
token. The text comes from the bundled tokenizer; a smaller vocabulary grows to hold its ids (Llama-2-7B:
~1 % more of a token's products; kvwire.hf.random_weights)."""


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--random-weights CONFIG``, ``--device`` and ``--dtype``: which model a benchmark times."""
    from kvwire.hf.random_weights import DTYPES

    parser.add_argument("--model", default=None, help="a local model folder or name (default: the bundled model)")
    parser.add_argument("--random-weights", metavar="CONFIG", type=Path, default=None,
                        help="make the model from this config.json with random weights (see below)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="the model's dtype (default fp32)")


def load_model(args: argparse.Namespace, weights: str = "fp32") -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, what)`` for :func:`add_model_options`' arguments: the device, dtype and config are
    checked before anything loads (one ``error:`` line through :func:`run_main`); ``what`` names the model for a
    results file."""
    from kvwire import hf, models
    from kvwire.errors import ModelError
    from kvwire.hf.random_weights import DTYPES

    hf.check_device(args.device, weights)
    if args.random_weights is None:
        model, tokenizer = hf.load_model(models.resolve(args.model), dtype=DTYPES[args.dtype], weights=weights,
                                         device=args.device)
        return model, tokenizer, {"model": args.model or "default", "random_weights": None, "device": args.device,
                                  "dtype": args.dtype, "weights": weights}
    if weights != "fp32":
        raise ModelError(f"--weights {weights} converts a checkpoint's weights; --random-weights makes its own",
                         "leave --weights out and choose --dtype")
    tokenizer = hf.load_tokenizer(models.resolve(args.model))
    model = hf.random_model(args.random_weights, dtype=args.dtype, device=args.device, tokenizer_vocab=len(tokenizer))
    return model, tokenizer, {"model": None, "random_weights": args.random_weights.name, "device": args.device,
                              "dtype": args.dtype, "weights": "random"}
