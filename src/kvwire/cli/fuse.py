"""``kvwire check``, ``kvwire fit-ridge`` and ``kvwire fuse``: the CLI side of cache-to-cache between models.

The library does the work (:mod:`kvwire.fuse`); this module parses options, loads the
models, draws progress and prints tables. :mod:`kvwire.cli` adds these commands to the
``kvwire`` group (errors become one ``error: ...`` line there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.markup import escape
from rich.table import Table

from .console import err, out
from .types import SEED, FiniteFloat, WritablePath
from ..models import MODEL_HELP



@click.command("check")
@click.argument("model_a")
@click.argument("model_b")
@click.option("--weights/--no-weights", "weights", default=None,
              help="load both models to compare weight fingerprints (default: only when the verdict needs it)")
@click.option("--fusers", "fusers_root", type=click.Path(path_type=Path), default=None,
              help="where trained fusers are looked for (default: $KVWIRE_HOME/fusers)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def check_cmd(model_a: str, model_b: str, weights: bool | None, fusers_root: Path | None, as_json: bool) -> None:
    """Compare MODEL_A (the sharer) and MODEL_B (the receiver) side by side and say how caches can pass:
    directly (identical weights), by partial-layer transfer (a fine-tuned variant) or by a fuser
    (different models; is one trained for the pair?). Models: registered names, folders or .gguf files."""
    from .. import models

    models.resolve(model_a), models.resolve(model_b)  # a missing model fails before transformers is imported
    from ..fuse import check

    with err.status(f"reading {model_a} and {model_b}"):
        comparison = check.compare(model_a, model_b, weights, fusers_root)
    if as_json:
        print(json.dumps(comparison.to_json()))
        return
    table = Table(title=f"kvwire check: A = {model_a}, B = {model_b}",
                  caption="rows that differ are highlighted")
    table.add_column("")
    table.add_column(f"A: {model_a}", overflow="fold")
    table.add_column(f"B: {model_b}", overflow="fold")
    for row in comparison.rows:
        style = "" if row.same else "bold yellow"
        table.add_row(row.name, row.a, row.b, style=style)
    out.print(table)
    colour = {"identical": "green", "variant": "yellow", "different": "red"}[comparison.verdict]
    out.print(f"verdict: [bold {colour}]{comparison.verdict}[/] -- {comparison.reason}", markup=True)
    for direction, paths in comparison.fusers.items():
        out.print(f"  fusers {direction}: " + (", ".join(paths) if paths else "none"))
        for path in paths:
            out.print(f"    {path}: {comparison.gains.get(path, '')}")
    out.print(f"what to do: {comparison.advice}")


def _party(model: str) -> Any:
    from .. import hf, models
    from ..fuse.train import Party

    path = models.resolve(model)
    with err.status(f"loading {path.name}"):
        loaded, tokenizer = hf.load_model(path)
        spec = hf.model_spec(loaded)
    return Party(loaded, tokenizer, spec, model)


@click.command("fit-ridge")
@click.option("--sharer", required=True, help="the model whose cache is projected (" + MODEL_HELP + ")")
@click.option("--receiver", default=None, help="the model that reads the projection (default: the bundled default)")
@click.option("--samples", type=click.IntRange(2), default=24, show_default=True,
              help="standard library texts both models read")
@click.option("--chars", type=click.IntRange(100), default=1200, show_default=True, help="characters per text")
@click.option("--layer-map", type=click.Choice(["terminal", "proportional"]), default="terminal", show_default=True)
@click.option("--weight", type=FiniteFloat(0.0, 1.0), default=1.0, show_default=True,
              help="fusing weight saved with it: own + weight x (projection - own)")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--out", "out_dir", type=WritablePath(file_okay=False), default=None,
              help="checkpoint folder (default: $KVWIRE_HOME/fusers/ridge-SHARER-to-RECEIVER)")
@click.option("--json", "as_json", is_flag=True, help="print the fit report as one JSON object")
def fit_ridge_cmd(sharer: str, receiver: str | None, samples: int, chars: int, layer_map: str, weight: float,
                  seed: int, out_dir: Path | None, as_json: bool) -> None:
    """Fit the ridge-regression baseline projecting SHARER's K/V onto RECEIVER's, per receiver layer,
    on standard library code both models read; report held-out R^2 per layer and save a checkpoint."""
    from .. import models
    from ..fuse import checkpoint, registry, ridge

    receiver = receiver or models.DEFAULT_MODEL
    config = ridge.RidgeConfig(layer_map=layer_map, samples=samples, chars=chars, weight=weight,  # type: ignore[arg-type]
                               seed=seed)
    out_dir = out_dir or registry.fusers_dir() / f"ridge-{Path(sharer).name}-to-{Path(receiver).name}"
    checkpoint.check_writable(out_dir)  # before the models load and the fit runs
    sharer_party, receiver_party = _party(sharer), _party(receiver)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def on_progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                title = "both models read the texts" if stage == "read" else "choosing lambda, solving per layer"
                tasks[stage] = bar.add_task(title, total=total)
            bar.update(tasks[stage], completed=done)

        result = ridge.fit(receiver_party, sharer_party, config, on_progress)
    path = ridge.save(out_dir, result, receiver_party.ref(), sharer_party.ref())
    report = result.report()
    report["checkpoint"] = str(path)
    if as_json:
        print(json.dumps(report))
        return
    table = Table(title=f"ridge {sharer} -> {receiver}: held-out fit per receiver layer",
                  caption=f"{result.tokens:,} receiver tokens ({result.held_out_tokens:,} held out); "
                          f"lambda = alpha x mean diag(X^T X)")
    for column in ("layer", "reads", "K alpha", "K R^2", "K rel. err", "V alpha", "V R^2", "V rel. err"):
        table.add_column(column, justify="right")
    for f in result.layers:
        table.add_row(str(f.layer), str(f.sharer_layer), f"{f.key_alpha:g}", f"{f.key_r2:.3f}",
                      f"{f.key_rel_error:.3f}", f"{f.value_alpha:g}", f"{f.value_r2:.3f}", f"{f.value_rel_error:.3f}")
    out.print(table)
    mean = report["mean"]
    out.print(f"mean held-out R^2: keys {mean['key_r2']:.3f}, values {mean['value_r2']:.3f}; fitted in "
              f"{result.fit_s:.1f}s (reading {result.read_s:.1f}s, solving {result.solve_s:.2f}s); "
              f"{result.projector.parameter_count():,} parameters")
    out.print(f"saved: {path}")


def _prompt_text(prompt: str | None, prompt_file: Path | None) -> str:
    """PROMPT and the --file's text, joined; refused if empty or not UTF-8."""
    try:
        text = prompt_file.read_text(encoding="utf-8") if prompt_file else None
    except UnicodeDecodeError as error:
        raise click.BadParameter(f"{prompt_file} is not UTF-8 text ({error.reason} at byte {error.start})",
                                 param_hint="--file") from None
    content = "\n\n".join(part for part in (prompt, text) if part)
    if not content.strip():
        raise click.UsageError("give a PROMPT or --file")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise click.UsageError("the prompt is not valid UTF-8 text (its bytes are in another encoding)") from None
    return content


def _fuser(sharer: str, receiver: str, projector_path: Path | None, allow_worse: bool) -> tuple[Any, ...]:
    """Both models loaded, and the projector for the pair (``projector_path``, else the trained one found for it):
    ``(sharer party, receiver party, projector, its config, its path)``. A projector whose recorded gain is not
    positive, or a pair nothing was trained for, is refused before any model loads."""
    from .. import hf, models
    from ..errors import NoFuserError
    from ..fuse import checkpoint, gain, mode, projector, registry

    if projector_path is not None:
        gain.check(checkpoint.read_config(projector_path)[0], str(projector_path), allow_worse)
    else:
        shapes = [hf.spec_from_pretrained(models.resolve(name)) for name in (sharer, receiver)]
        if shapes[0].differences(shapes[1]) and not registry.candidates(registry.fusers_dir(), *shapes):
            raise mode.no_fuser(sharer, receiver)
    sharer_party, receiver_party = _party(sharer), _party(receiver)
    if projector_path is None:
        found = registry.find(registry.fusers_dir(), sharer_party.spec, receiver_party.spec)
        if not found:
            mode.FuseRunner(receiver_party, sharer_party, None, None)  # raises, saying what to do
            raise NoFuserError("no projector")  # unreachable: the runner refused already
        projector_path = found[0]
    proj, config = projector.load(projector_path, receiver_party.spec, sharer_party.spec, allow_worse)
    return sharer_party, receiver_party, proj, config, projector_path


@click.command("fuse")
@click.argument("prompt", required=False)
@click.option("--sharer", required=True, help="the model that reads the context and shares its cache")
@click.option("--receiver", default=None, help="the model that generates (default: the bundled default)")
@click.option("--projector", "projector_path", type=click.Path(path_type=Path), default=None,
              help="a ridge or fuser checkpoint (default: the one kvwire check finds for the pair)")
@click.option("--file", "prompt_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="read the user message from a file (appended after PROMPT if both are given)")
@click.option("--paths", default="receiver,sharer,text,fuse", show_default=True,
              help="which paths to run, comma-separated: receiver, sharer, text (text-to-text), fuse")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=48, show_default=True)
@click.option("--hint-tokens", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="text-to-text: tokens the sharer writes for the receiver")
@click.option("--store", "store_url", default="memory://", show_default=True, help="where the sharer's packet goes")
@click.option("--allow-worse", is_flag=True,
              help="use a projector even if its recorded gain over the receiver alone is not positive")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
def fuse_cmd(prompt: str | None, sharer: str, receiver: str | None, projector_path: Path | None,
             prompt_file: Path | None, paths: str, max_new_tokens: int, hint_tokens: int, store_url: str,
             allow_worse: bool, as_json: bool) -> None:
    """Fuse mode: SHARER reads the prompt (no generation), its cache is aligned, projected and fused into
    RECEIVER's, and RECEIVER answers; compared with the receiver alone, the sharer alone and
    text-to-text (the sharer writes, the receiver reads), with the end-to-end time of each path."""
    from .. import models
    from ..fuse import mode
    from ..store import open_store

    chosen = [p.strip() for p in paths.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(mode.PATHS))
    if unknown or not chosen:
        raise click.BadParameter(f"unknown paths {unknown}; use {', '.join(mode.PATHS)}", param_hint="--paths")
    content = _prompt_text(prompt, prompt_file)
    receiver = receiver or models.DEFAULT_MODEL
    store = open_store(store_url)  # fail on a bad URL before loading models
    sharer_party, receiver_party, proj, config, projector_path = _fuser(sharer, receiver, projector_path, allow_worse)
    with store:
        runner = mode.FuseRunner(receiver_party, sharer_party, proj, config, store=store,
                                 options=mode.FuseOptions(max_new_tokens=max_new_tokens, hint_tokens=hint_tokens))
        messages = [{"role": "user", "content": content}]
        results = {}
        with err.status("") as status:
            for path in chosen:
                status.update(f"running the {path} path")
                results[path] = runner.run(path, messages)  # type: ignore[arg-type]
        comparison = mode.FuseComparison(results, config.describe())
    console = err if as_json else out
    table = Table(title=f"fuse: {sharer} -> {receiver} ({config.kind} at {projector_path})",
                  caption="seconds, end to end; sharer = its prefill (fuse) or prefill + writing (text)")
    for column in ("path", "context", "sharer", "transfer", "fuse", "prefill", "decode", "total"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for r in results.values():
        table.add_row(r.path, str(r.context_tokens), f"{r.sharer_s:.2f}", f"{r.transfer_s:.2f}", f"{r.fuse_s:.2f}",
                      f"{r.prefill_s:.2f}", f"{r.decode_s:.2f}", f"[bold]{r.total_s:.2f}[/]")
    console.print(table)
    for r in results.values():
        if r.hint:
            console.print(f"[bold]sharer's hint[/] (text path): {escape(r.hint)}", markup=True)
        console.print(f"[bold]{escape(r.path)}[/]: {escape(r.output_text)}", markup=True)
    speedup = comparison.speedup()
    if speedup is not None:
        console.print(f"fuse vs text-to-text, end to end: [bold]{speedup:.2f}x[/]", markup=True)
    if as_json:
        print(json.dumps(comparison.to_json()))
