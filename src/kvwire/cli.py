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
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import codec
from .errors import KvwireError

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

MODEL_HELP = "bundled default (SmolLM2-135M-Instruct), a local HF model folder, or a .gguf file"


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err, show_time=False, show_path=False)])
    logging.getLogger("kvwire").setLevel(logging.INFO)
    try:
        cli.main(standalone_mode=False)
    except KvwireError as error:
        err.print(f"[bold red]error:[/] {error}", markup=True, highlight=False)
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


@click.group()
@click.version_option(package_name="kvwire")
def cli() -> None:
    """Pass KV-caches between the agents of an LLM pipeline instead of re-encoding text."""


# -- model helpers ---------------------------------------------------------------------------------


def _load(model: str | None) -> tuple[Any, Any]:
    from . import hf, models

    path = models.resolve(model)
    with err.status(f"loading model from {path}"):
        return hf.load_model(path)


@cli.command("fetch")
@click.option("--model", default=None, help=MODEL_HELP)
def fetch_cmd(model: str | None) -> None:
    """Make a model ready offline (converts the bundled GGUF once) and print its folder."""
    from . import models

    out.print(str(models.resolve(model)))


# -- demo and run ----------------------------------------------------------------------------------


@cli.command("demo")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--store", "store_url", default="memory://", show_default=True, help="store URL")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None, help="per agent (default 32)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
def demo_cmd(model: str | None, store_url: str, max_new_tokens: int | None, as_json: bool) -> None:
    """Two-agent code review (analyst -> fixer), text vs prefix, side by side."""
    from .pipefile import PipelineSpec

    with resources.as_file(resources.files("kvwire") / "data" / "code_review.toml") as path:
        spec = PipelineSpec.from_toml(path)
    _run(spec, "compare", store_url, model, max_new_tokens, as_json)


@cli.command("run")
@click.argument("pipeline_file", type=click.Path(path_type=Path))
@click.option("--mode", type=click.Choice(["text", "prefix", "compare"]), default="compare", show_default=True)
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--store", "store_url", default="memory://", show_default=True,
              help="memory://, memory://NAME or file:///DIR")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None, help="override every agent's limit")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
def run_cmd(pipeline_file: Path, mode: str, model: str | None, store_url: str, max_new_tokens: int | None,
            as_json: bool) -> None:
    """Run the agents of PIPELINE_FILE (TOML; see examples/) in text, prefix or compare mode."""
    from .pipefile import PipelineSpec

    spec = PipelineSpec.from_toml(pipeline_file)
    _run(spec, mode, store_url, model, max_new_tokens, as_json)


def _run(spec: Any, mode: str, store_url: str, model: str | None, max_new_tokens: int | None,
         as_json: bool) -> None:
    from .pipeline import Pipeline
    from .store import open_store

    if max_new_tokens is not None:
        spec = spec.with_max_new_tokens(max_new_tokens)
    store = open_store(store_url)  # fail on a bad URL before loading a model
    model_obj, tokenizer = _load(model)
    modes = ["text", "prefix"] if mode == "compare" else [mode]
    steps = len(modes) * len(spec.agents)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task(f"{spec.name}", total=steps)

        def on_event(event: dict[str, Any]) -> None:
            if event["event"] == "agent_start":
                progress.update(task, description=f"{spec.name}: {event['mode']:6} {event['agent']}")
            else:
                progress.advance(task)

        with store:
            pipeline = Pipeline(model_obj, tokenizer, spec, store=store, on_event=on_event)
            if mode == "compare":
                comparison = pipeline.compare()
                runs, payload = [comparison.text, comparison.prefix], comparison.to_json()
            else:
                result = pipeline.run(mode)  # type: ignore[arg-type]
                runs, payload, comparison = [result], result.to_json(), None
    console = err if as_json else out
    console.print(_timing_table(spec.name, runs))
    for agent in runs[-1].agents:
        console.print(f"[bold]{agent.agent}[/] ({agent.mode}): {agent.output_text}", markup=True)
    if comparison is not None:
        console.print(
            f"end-to-end speedup prefix vs text: [bold]{comparison.speedup:.2f}x[/] "
            f"(ideal {comparison.ideal_speedup:.2f}x, efficiency {comparison.efficiency:.2f}); "
            f"TTFT speedup agents 2..N: {comparison.ttft_speedup:.1f}x", markup=True)
        verdict = "identical" if comparison.identical else "NOT identical"
        console.print(f"outputs text vs prefix: [bold]{verdict}[/]; prefix exact vs recomputation: "
                      f"{'yes' if comparison.exact else 'NO'}", markup=True)
        for agent in comparison.agents:
            if not agent.identical or not agent.same_context:
                console.print(f"  {agent.agent}: {agent.note}")
    if as_json:
        print(json.dumps(payload))


def _timing_table(title: str, runs: list[Any]) -> Table:
    table = Table(title=title, caption="tokens: context / served from cache / generated")
    for column in ("agent", "mode", "tokens", "TTFT", "prefill", "decode", "transfer", "total"):
        table.add_column(column, justify="left" if column in ("agent", "mode") else "right")
    for run in runs:
        for a in run.agents:
            table.add_row(a.agent, a.mode, f"{a.context_tokens}/{a.cached_tokens}/{a.new_tokens}",
                          *(f"{seconds:.2f}s" for seconds in (a.ttft_s, a.prefill_s, a.decode_s, a.transfer_s,
                                                              a.total_s)))
        table.add_row("[bold]all[/]", run.mode, "", "", "", "", "", f"[bold]{run.total_s:.2f}s[/]", end_section=True)
    return table


# -- packets ---------------------------------------------------------------------------------------


@cli.command("inspect")
@click.argument("packet_file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def inspect_cmd(packet_file: Path, as_json: bool) -> None:
    """Verify a packet file and print its metadata and shapes."""
    info = codec.load(packet_file).describe()
    if as_json:
        print(json.dumps(info))
        return
    table = Table(title=str(packet_file), show_header=False)
    for key, value in info.items():
        if key == "spec":
            for name, field in value.items():
                table.add_row(f"spec.{name}", str(field))
        else:
            table.add_row(key, str(value))
    out.print(table)


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


if __name__ == "__main__":
    main()
