"""``kvwire train-fuser`` and ``kvwire fuser-data``: the CLI side of training a fuser (progress, tables).

The library does the work (:mod:`kvwire.fuse.train`); this module parses options,
loads the models, draws a progress bar (loss, tokens/s, ETA) and prints the result.
:mod:`kvwire.cli` adds these commands to the ``kvwire`` group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from .console import err, out
from .types import SEED, FiniteFloat, WritablePath

MODEL_HELP = "a registered name (kvwire fetch --list), a local HF model folder, or a .gguf file"


def _party(model: str | None) -> Any:
    from .. import hf, models
    from ..fuse.train import Party

    path = models.resolve(model)
    with err.status(f"loading {path.name}"):
        loaded, tokenizer = hf.load_model(path)
        spec = hf.model_spec(loaded)
    return Party(loaded, tokenizer, spec, Path(str(model)).name if model else models.DEFAULT_MODEL)


@click.command("fuser-data")
@click.argument("out_dir", type=WritablePath(file_okay=False))
@click.option("--seed", type=SEED, default=0, show_default=True, help="option order and held-out modules")
@click.option("--held-out", type=FiniteFloat(0.0, 0.9), default=0.15, show_default=True,
              help="share of stdlib modules kept for validation")
@click.option("--kind", type=click.Choice(["dense", "questions"]), default="dense", show_default=True,
              help="dense: (question or code, response) pairs trained on every response token; questions: "
                   "multiple-choice questions with a one-letter answer (the earlier recipe)")
@click.option("--examples", type=click.IntRange(1), default=None,
              help="keep only the first N training examples (what train-fuser --examples N reads)")
@click.option("--distill", "distill_with", default=None, metavar="SHARER",
              help="dense: replace each training knowledge question's answer with this model's own greedy "
                   "answer (cached in OUT_DIR/distill-cache.jsonl); validation keeps the truth. " + MODEL_HELP)
@click.option("--distill-tokens", type=click.IntRange(1, 512), default=32, show_default=True,
              help="--distill: the most tokens of a sharer-written answer")
def fuser_data_cmd(out_dir: Path, seed: int, held_out: float, kind: str, examples: int | None,
                   distill_with: str | None, distill_tokens: int) -> None:
    """Write OUT_DIR/train.jsonl and val.jsonl built from Python's standard library, split by module
    (a module is in one of the two, never both); nothing about what kvwire's benchmark questions ask."""
    from ..fuse import dense, stdlib_qa

    if distill_with and kind != "dense":
        raise click.UsageError("--distill writes sharer answers to dense examples; drop --kind questions")
    with err.status("building examples from the standard library"):
        if kind == "dense":
            train, val = dense.dataset(seed, held_out)
        else:
            train, val = stdlib_qa.dataset(seed, held_out)
    train = train[:examples] if examples else train
    if distill_with:
        train = _distilled(train, distill_with, out_dir, distill_tokens)
    stdlib_qa.save(train, out_dir / "train.jsonl")
    (out_dir / "val.jsonl").unlink(missing_ok=True)  # --held-out 0: no validation file (not an empty one)
    if val:
        stdlib_qa.save(val, out_dir / "val.jsonl")
    out.print(f"{len(train)} training and {len(val)} validation questions ({stdlib_qa.corpus_fingerprint()}) "
              f"in {out_dir}")
    if not val:
        err.print("[yellow]note:[/] no validation file: train-fuser needs held-out modules to record a fuser's gain "
                  "(give --held-out above 0 to train on this data)", markup=True)


def _distilled(train: list, model: str, out_dir: Path, max_new_tokens: int) -> list:
    """``train`` with the sharer's own answers (:mod:`kvwire.fuse.distill`), under a progress bar;
    what was done is written to OUT_DIR/distill.json."""
    from ..fuse import distill

    party = _party(model)
    with Progress(SpinnerColumn(), TextColumn("sharer answers"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err) as bar:
        task = bar.add_task("distill", total=None)
        train, info = distill.distill(train, party, out_dir / "distill-cache.jsonl", max_new_tokens,
                                      on_item=lambda done, total: bar.update(task, completed=done, total=total))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "distill.json").write_text(json.dumps(info, indent=1) + "\n")
    out.print(f"{info['distilled']} answers written by {info['sharer']} ({info['differs_from_truth']} differ from "
              f"the truth, {info['dropped_empty']} empty and dropped)")
    return train


@click.command("train-fuser")
@click.option("--sharer", default=None, help="the model whose cache is fused in (required for --method fuser); "
                                             + MODEL_HELP)
@click.option("--receiver", default=None, help="the model that reads the fused cache; " + MODEL_HELP)
@click.option("--data", "data_path", default="dense", show_default=True,
              help="'dense' (knowledge and code-continuation pairs from the standard library, split by module), "
                   "'stdlib' (multiple-choice questions from it, letters listed), 'choice' (the same questions asked "
                   "alone, each option a response: for --objective choice), a folder from kvwire fuser-data, "
                   "or a JSONL file of {\"prompt\", \"answer\"} objects")
@click.option("--steps", type=click.IntRange(1), default=600, show_default=True, help="optimizer steps")
@click.option("--batch", type=click.IntRange(1), default=4, show_default=True, help="examples per step")
@click.option("--lr", type=FiniteFloat(0.0, min_open=True), default=None,
              help="peak learning rate (default 1e-3 for a fuser, 2e-4 for LoRA)")
@click.option("--method", type=click.Choice(["fuser", "lora"]), default="fuser", show_default=True,
              help="lora: the baseline -- the receiver fine-tuned with LoRA on the same data and steps")
@click.option("--objective", type=click.Choice(["response", "choice"]), default="response", show_default=True,
              help="response: the loss on every response token; choice: which option of a choice question the "
                   "receiver prefers, scored as the bundled benchmark scores (needs --data choice)")
@click.option("--choice-filter", type=click.Choice(["none", "sharer-right"]), default="sharer-right",
              show_default=True, help="--objective choice: train only on the questions the sharer answers right "
                                      "(its pick measured once per question and kept)")
@click.option("--targets", type=click.Choice(["answer", "sharer"]), default="answer", show_default=True,
              help="multiple choice: train the first answer token towards the example's answer, or towards the "
                   "sharer's own distribution over the letters (needs --sharer, also for --method lora)")
@click.option("--sharer-temperature", type=FiniteFloat(0.0), default=0.0, show_default=True,
              help="with --targets sharer: its letter distribution at this temperature (0: its top letter)")
@click.option("--out", "out_dir", type=WritablePath(file_okay=False), default=None,
              help="output folder (default $KVWIRE_HOME/fusers/RECEIVER--SHARER, where kvwire check finds it)")
@click.option("--resume", is_flag=True, help="continue from the newest checkpoint under --out")
@click.option("--checkpoint-every", type=click.IntRange(1), default=100, show_default=True)
@click.option("--eval-every", type=click.IntRange(1), default=100, show_default=True)
@click.option("--eval-examples", type=click.IntRange(0), default=64, show_default=True,
              help="held-out examples scored at each evaluation")
@click.option("--precompute", is_flag=True, help="compute the sharer's K/V of every example before training")
@click.option("--sharer-cache", type=WritablePath(file_okay=False), default=None,
              help="where the sharer's K/V are kept (default $KVWIRE_HOME/sharer-kv)")
@click.option("--hidden", type=click.IntRange(1, 16384), default=256, show_default=True, help="fuser width per layer")
@click.option("--blocks", type=click.IntRange(0), default=1, show_default=True, help="fuser residual blocks")
@click.option("--gate-noise/--no-gate-noise", default=True, show_default=True,
              help="train the gates with Gumbel noise (C2C), or as an annealed sigmoid")
@click.option("--final-token", type=click.Choice(["aligned", "sharer-last"]), default="aligned", show_default=True,
              help="the sharer token the last fused receiver token reads: its aligned one, or the sharer's last "
                   "prompt token")
@click.option("--fuse-last", type=click.IntRange(0), default=0, show_default=True,
              help="fuse only the receiver's last K mapped layers (0: all)")
@click.option("--examples", type=click.IntRange(1), default=None, help="use only the first N training examples")
@click.option("--lora-rank", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="--method lora: the adapters' rank (rank 32 on the default model: 3.3M parameters, the size of "
                   "a --hidden 128 --blocks 0 fuser)")
@click.option("--control-share", type=FiniteFloat(0.0, 0.95), default=0.25, show_default=True,
              help="share of training rows fed another module's sharer K/V and trained towards the receiver "
                   "alone, so that a gain must come from reading the sharer")
@click.option("--control-weight", type=FiniteFloat(0.0), default=1.0, show_default=True,
              help="weight of a control row's KL against a real row's cross-entropy")
@click.option("--min-gap", type=FiniteFloat(-10.0, 10.0), default=None,
              help="keep only examples where the sharer's loss on the response is at least this many nats per "
                   "character below the receiver's (measured once; default: keep all)")
@click.option("--eval-questions", type=click.IntRange(0, 323), default=150, show_default=True,
              help="bundled multiple-choice questions scored at each evaluation")
@click.option("--hours", type=FiniteFloat(0.0, 240.0, min_open=True), default=None,
              help="a time budget for the whole command (sharer precompute included): the step count is set "
                   "from the first steps' pace, at most --steps")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
def train_fuser_cmd(sharer: str | None, receiver: str | None, data_path: str, out_dir: Path | None, resume: bool,
                    precompute: bool, sharer_cache: Path | None, examples: int | None, as_json: bool,
                    hours: float | None, choice_filter: str, **options: Any) -> None:
    """Train a fuser that lets RECEIVER read SHARER's cache (both frozen), or the LoRA baseline.

    Writes OUT/fuser (or OUT/lora): a checkpoint naming both models; OUT/log.jsonl and OUT/loss.png;
    OUT/checkpoints/step-N for --resume.
    """
    import time

    from .. import models
    from ..errors import CheckpointError, FuserError
    from ..fuse.data import chat_aligner
    from ..fuse.checkpoint import check_writable
    from ..fuse.run_folder import check_fresh_out
    from ..fuse.train import TrainConfig, Trainer

    deadline = time.monotonic() + 3600 * hours if hours else None
    method, targets = options["method"], options["targets"]
    if (method == "fuser" or targets == "sharer") and sharer is None:
        raise FuserError(f"--sharer is required to train {'a fuser' if method == 'fuser' else 'towards its answers'}",
                         "e.g. --sharer qwen2.5-coder-0.5b")
    train, val, info = _data(data_path, options["seed"], examples, options["eval_examples"])
    options["lr"] = options["lr"] or (1e-3 if method == "fuser" else 2e-4)
    config = TrainConfig(**options)
    if out_dir is None:
        names = [str(receiver or models.DEFAULT_MODEL), *([str(sharer)] if sharer else [])]
        out_dir = models.home() / "fusers" / "--".join(Path(n).name for n in names)
    if resume and not any((out_dir / "checkpoints").glob("step-*")):
        raise CheckpointError(f"no checkpoint to resume under {out_dir / 'checkpoints'}", "start without --resume")
    if not resume:
        check_fresh_out(out_dir, method)  # before the models load
    check_writable(out_dir / ("fuser" if method == "fuser" else "lora"))
    receiver_party = _party(receiver)
    sharer_party = _party(sharer) if method == "fuser" or targets == "sharer" else None
    aligner = alignment = None
    if sharer_party is not None:
        aligner, alignment = chat_aligner(receiver_party.tokenizer, sharer_party.tokenizer)
    if config.objective == "choice" and choice_filter != "none" and not resume:
        if sharer_party is None:
            raise FuserError("--choice-filter sharer-right needs --sharer", "or pass --choice-filter none")
        train = _choice_filter(train, choice_filter, sharer_party, sharer_cache or models.home() / "sharer-kv", info)
    with err.status("tokenizing and aligning"):
        trainer = Trainer(config, receiver_party, sharer_party, train, val, out_dir,
                          aligner=aligner, alignment=alignment,
                          store=sharer_cache or models.home() / "sharer-kv", data_info=info)
    if resume:
        step = trainer.resume()
        err.print(f"resuming {out_dir} at step {step}")
    if precompute and sharer_party is not None:
        with Progress(SpinnerColumn(), TextColumn("sharer K/V"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True) as progress:
            task = progress.add_task("precompute", total=None)
            computed = trainer.prepare_sharer(lambda done, total: progress.update(task, completed=done, total=total))
        err.print(f"sharer K/V: {computed} computed, the rest already stored")
    if config.min_gap is not None and not resume:
        _gap_filter(trainer, config.min_gap)
    result = _train(trainer, config, deadline)
    _report(result, trainer, as_json)


def _data(data_path: str, seed: int, examples: int | None, eval_examples: int) -> tuple[list, list, dict[str, Any]]:
    """(train, validation, what the checkpoint records of them) for ``--data``; examples that name their
    module are refused if a module is on both sides."""
    from ..fuse import dense, stdlib_qa

    with err.status("preparing training data"):
        if data_path == "dense":
            train, val = dense.dataset(seed, kinds=dense.RECIPE_KINDS)
            info = {"source": "dense", "kinds": list(dense.RECIPE_KINDS), "corpus": dense.corpus_id(), "seed": seed,
                    "excluded_modules": sorted(dense.benchmark_modules())}
        elif data_path == "choice":
            from ..fuse import choice

            train, val = choice.dataset(seed)
            info = {"source": "choice", "corpus": stdlib_qa.corpus_fingerprint(), "seed": seed,
                    "excluded_modules": sorted(dense.benchmark_modules())}
        elif data_path == "stdlib":
            train, val = stdlib_qa.dataset(seed)
            info = {"source": "stdlib", "corpus": stdlib_qa.corpus_fingerprint(), "seed": seed}
        else:
            train, val = stdlib_qa.load_dataset(data_path, seed=seed)
            info = {"source": str(data_path)}
    if examples is not None:
        train = train[:examples]
    if not val:  # before any model loads: without held-out examples no gain is recorded, and fuse mode refuses it
        from ..errors import FuserDataError

        raise FuserDataError(f"no validation examples in {data_path} (built with --held-out 0?): a fuser records its "
                             "gain on held-out modules, and one without a recorded gain is refused",
                             f"rebuild it with kvwire fuser-data {data_path} --held-out 0.15")
    if all(ex.subject for ex in (*train, *val)):  # examples that name what they are about: split by module
        info.update(train_modules=dense.check_disjoint(train, val),
                    val_modules=sorted({dense.module_of(ex) for ex in val}))
    info.update(train_examples=len(train), val_examples=min(len(val), eval_examples), mix=dense.mix(train))
    return train, val, info


def _choice_filter(train: list, rule: str, sharer: Any, store: Path, info: dict[str, Any]) -> list:
    """The choice questions ``rule`` keeps, the sharer's picks measured once (kept beside its K/V)."""
    from ..errors import FuserDataError
    from ..fuse import choice, dense

    choice.check_questions(train)  # before the sharer scores anything
    with Progress(SpinnerColumn(), TextColumn("the sharer's own picks"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True) as progress:
        task = progress.add_task("picks", total=None)
        picks = choice.picks(choice.scorer(sharer.model, sharer.tokenizer), train,
                             store / f"picks-{sharer.spec.fingerprint[:16]}.json", sharer.spec.fingerprint[:16],
                             lambda done, total: progress.update(task, completed=done, total=total))
    kept = choice.keep(train, rule, picks)
    if len(kept) < 8:
        raise FuserDataError(f"only {len(kept)} of {len(train)} training questions pass --choice-filter {rule}",
                             "use more --examples, or --choice-filter none")
    info["choice_filter"] = {"rule": rule, "kept": len(kept), "of": len(train)}
    info.update(train_examples=len(kept), mix=dense.mix(kept))
    err.print(f"choice filter: the sharer answers {len(kept)} of {len(train)} training questions right; "
              "those are trained on")
    return kept


def _gap_filter(trainer: Any, min_gap: float) -> None:
    with Progress(SpinnerColumn(), TextColumn("receiver's own loss"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task("gaps", total=None)
        gaps = trainer.gaps(lambda done, total: progress.update(task, completed=done, total=total))
    kept = trainer.filter_by_gap(gaps)
    err.print(f"gap filter: {kept['kept']} of {kept['of']} examples have the sharer at least "
              f"{min_gap} nats/char ahead (median gap of all {kept['gap_median_all']:.3f})")


def _train(trainer: Any, config: Any, deadline: float | None = None) -> Any:
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} tok/s"),
               TextColumn("{task.fields[held]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err) as progress:
        task = progress.add_task(f"training {config.method}", total=config.steps, completed=trainer.step,
                                 loss="-", speed="-", held="")
        window: list[Any] = []

        def on_step(record: Any) -> None:
            window.append(record)
            del window[:-20]
            speed = sum(r.tokens for r in window) / max(sum(r.seconds for r in window), 1e-9)
            loss = sum(r.loss for r in window) / len(window)
            progress.update(task, completed=record.step, total=trainer.config.steps, loss=f"{loss:.3f}",
                            speed=f"{speed:,.0f}")

        def on_eval(record: Any) -> None:
            acc = f", acc {100 * record.accuracy:.1f}% (alone {100 * record.baseline_accuracy:.1f}%)" \
                if record.accuracy is not None else ""
            held = f"held-out {record.loss:.3f} (alone {record.baseline_loss:.3f}"
            if record.control_loss is not None:
                held += f", other context {record.control_loss:.3f}"
            held += f"){acc}"
            if record.mc_accuracy is not None:
                held += (f", questions {100 * record.mc_accuracy:.1f}% (alone {100 * record.mc_baseline_accuracy:.1f}%"
                         + (f", other context {100 * record.mc_control_accuracy:.1f}%"
                            if record.mc_control_accuracy is not None else "") + ")")
            progress.update(task, held=held)
            progress.console.print(f"step {record.step}: {held}")

        return trainer.run(on_step=on_step, on_eval=on_eval, deadline=deadline)


def _report(result: Any, trainer: Any, as_json: bool) -> None:
    from ..fuse import gain

    last = result.evals[-1] if result.evals else None
    summary = {
        "method": trainer.config.method, "checkpoint": str(result.checkpoint), "steps": trainer.step,
        "parameters": result.parameters, "bytes": result.nbytes,
        "train_loss_last": result.steps[-1].loss if result.steps else None,
        "seconds": sum(r.seconds for r in result.steps),
        "eval": None if last is None else {"loss": last.loss, "accuracy": last.accuracy,
                                           "baseline_loss": last.baseline_loss,
                                           "baseline_accuracy": last.baseline_accuracy, "examples": last.examples},
        "plot": str(result.out / "loss.png"), "log": str(result.out / "log.jsonl"),
        "gain": gain.figures(trainer.best) if trainer.best is not None else None,
    }
    table = Table(title=f"{trainer.config.method} trained")
    table.add_column("")
    table.add_column("")
    table.add_row("checkpoint", summary["checkpoint"])
    table.add_row("parameters", f"{result.parameters:,} ({result.nbytes / 2**20:.1f} MiB)")
    table.add_row("steps", f"{trainer.step} ({summary['seconds']:.0f} s of training in this process)")
    if last is not None:
        table.add_row("held-out loss", f"{last.loss:.3f} (receiver alone {last.baseline_loss:.3f})")
        if last.accuracy is not None:
            table.add_row("held-out accuracy", f"{100 * last.accuracy:.1f}% (receiver alone "
                          f"{100 * last.baseline_accuracy:.1f}%, {last.examples} questions)")
    if summary["gain"] is not None:
        verdict = "helps" if gain.is_positive(summary["gain"]) else \
            "[bold red]does not help: fuse mode refuses it without --allow-worse[/]"
        table.add_row("validated gain", f"{verdict}; {gain.describe(summary['gain'])} (step {trainer.best.step})")
    table.add_row("curve", summary["plot"])
    out.print(table)
    if as_json:
        out.print(json.dumps(summary), soft_wrap=True)
