"""``kvwire probe`` and ``kvwire plot``: measure where caches pay off, and plot a splice benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..models import MODEL_HELP
from .console import err, out
from .pipeline import load as _load
from .types import FiniteFloat, WritablePath, device_option, weights_option


MAX_LARGE = 512 << 20  # bytes: Redis's proto-max-bulk-len by default; the probe holds ~3 copies of it


@click.command("probe")
@click.argument("url", default="memory://")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--large", default="16MiB", show_default=True, help="size of the bandwidth probe value")
@click.option("--encoding", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="packet encoding to measure the codec in (default: $KVWIRE_ENCODING, else the model's dtype)")
@click.option("--prefill-rate", type=FiniteFloat(min=0, min_open=True), default=None,
              help="tokens/s to decide with instead of this machine's measured prefill (what if a GPU prefilled?)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@weights_option
@device_option
def probe_cmd(url: str, model: str | None, large: str, encoding: str | None, prefill_rate: float | None,
              as_json: bool, weights: str, device: str) -> None:
    """Measure a store's latency and put/get rates, the model's prefill speed and the codec, and where
    caches pay off."""
    from dataclasses import replace

    from .. import hf
    from ..wire.options import CodecOptions
    from ..pipeline.cost import CostModel, probe_model, probe_store
    from ..store import open_store, parse_bytes

    from ..errors import KvwireError

    try:
        large_bytes = parse_bytes(large, "--large")
    except KvwireError as error:  # a usage error like any other bad option: exit 2, not 1
        raise click.BadParameter(str(error), param_hint="--large") from None
    if large_bytes < 1024:
        raise click.BadParameter(f"{large!r} is too small to measure a bandwidth; give at least 1KiB",
                                 param_hint="--large")
    if large_bytes > MAX_LARGE:  # the probe holds the value, the store's copy and the reply at once
        raise click.BadParameter(f"{large!r} is more than a probe needs or a store takes in one value; give at "
                                 f"most 512MiB (Redis's largest value; 16MiB measures a link's rate)",
                                 param_hint="--large")
    options = CodecOptions.from_env()
    if encoding is not None:
        options = replace(options, encoding=encoding)
    with open_store(url) as store:
        with err.status(f"probing {store.url}"):
            store_cost = probe_store(store, large=large_bytes)
    model_obj, _ = _load(model, weights, device)
    spec = hf.model_spec(model_obj)
    with err.status("measuring prefill speed and the codec"):
        model_cost = probe_model(model_obj, spec.kv_bytes(1), spec=spec, options=options)
    if prefill_rate is not None:
        model_cost = replace(model_cost, prefill_rate=prefill_rate)
    costs = CostModel(store_cost, model_cost)
    if as_json:
        print(json.dumps(costs.to_json()))
        return
    even = costs.break_even_tokens()
    out.print(f"store {store_cost.url}: latency {store_cost.latency_s * 1000:.2f} ms (put + get), "
              f"put {store_cost.put_rate / 1e6:.0f} MB/s, get {store_cost.get_rate / 1e6:.0f} MB/s")
    measured = "given" if prefill_rate is not None else "measured"
    out.print(f"model {spec.architecture}: prefill {model_cost.prefill_rate:.0f} tokens/s ({measured}), "
              f"{model_cost.bytes_per_token:,} KV bytes per token, {model_cost.wire_bytes_per_token:,.0f} in "
              f"{model_cost.encoding or spec.dtype} packets; encode {model_cost.encode_rate / 1e9:.2f} GB/s, "
              f"decode {model_cost.decode_rate / 1e9:.2f} GB/s")
    out.print("sending the cache beats re-prefilling from "
              + (f"{even} upstream token{'s' if even != 1 else ''} on" if even is not None
                 else "no context length: send ids on this link"))


SPLICE_HINT = "pass what python benchmarks/splice.py --json prints, e.g. benchmarks/results/splice-stdlib.json"


@click.command("plot")
@click.argument("bench_json", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--out", "out_path", type=WritablePath(dir_okay=False), default=Path("splice.png"),
              show_default=True, help="the image to write: .png (added to a name without a suffix), .svg or .pdf")
def plot_cmd(bench_json: Path, out_path: Path) -> None:
    """Plot a splice benchmark (the JSON line of benchmarks/splice.py) to a PNG."""
    import warnings

    from ..errors import KvwireError, reason
    from ..plots import FORMATS, splice_curve, written_path

    out_path = written_path(out_path)  # the file matplotlib writes, and the name printed
    if out_path.suffix.lower() not in FORMATS:  # before the input is read: the input is not what is wrong
        raise click.BadParameter(f"{str(out_path)!r} is not a {', '.join(FORMATS)} file", param_hint="--out")
    rows, title = _splice_json(bench_json)
    try:
        with warnings.catch_warnings():  # a plot's own warnings are not the user's to act on
            warnings.simplefilter("ignore", UserWarning)
            path = splice_curve(rows, out_path, title=title)
    except OSError as error:
        raise KvwireError(f"cannot write --out {out_path}: {reason(error)}",
                          "give --out a path in a folder you can write to") from None
    out.print(str(path))


def _splice_json(path: Path) -> tuple[list, str]:
    """(rows, title) of a splice benchmark's JSON line, or one KvwireError saying what in ``path`` is wrong."""
    from ..errors import KvwireError, reason
    from ..plots import check_splice_rows

    what = f"{path} is not the JSON output of benchmarks/splice.py"
    try:
        lines = path.read_text(encoding="utf-8").strip().splitlines()
    except UnicodeDecodeError as error:
        raise KvwireError(f"{what}: it is {reason(error)}", SPLICE_HINT) from None
    if not lines:
        raise KvwireError(f"{what}: the file is empty", SPLICE_HINT)
    try:
        payload = json.loads(lines[-1])
    except json.JSONDecodeError as error:
        raise KvwireError(f"{what}: its last line is not JSON ({error.msg}, column {error.colno})", SPLICE_HINT) \
            from None
    except RecursionError:
        raise KvwireError(f"{what}: its last line is JSON nested too deeply", SPLICE_HINT) from None
    if not isinstance(payload, dict):
        raise KvwireError(f"{what}: its last line is not a JSON object with 'rows'", SPLICE_HINT)
    if "rows" not in payload:
        keys = ", ".join(map(repr, list(payload)[:6])) or "none"
        raise KvwireError(f"{what}: its last line has no 'rows' (its keys: {keys})", SPLICE_HINT)
    try:
        rows = check_splice_rows(payload["rows"])
    except ValueError as error:
        raise KvwireError(f"{what}: {error}", SPLICE_HINT) from None
    return rows, str(payload.get("title", "splice: speed vs fidelity"))
