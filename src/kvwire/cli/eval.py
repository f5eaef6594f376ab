"""``kvwire eval``: a pipeline over a task set in several modes, each task judged by its own checker.

Parse, run :class:`kvwire.pipeline.evaluation.Evaluation` with a progress bar, print the table (and with
``--json`` one JSON object as the last line), plot pass@1 and consistency against reuse. The
results are the lines of ``OUT/results.jsonl``; the summary is computed from them alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..models import MODEL_HELP
from .console import err, out
from .types import GUARD_HELP, FiniteFloat, WritablePath, weights_option

MODES_HELP = ("comma-separated, of text, prefix, splice, graph, auto (default: text and the cache mode that applies: "
              "prefix for a shared transcript, splice for private prompts, graph for a graph); splice@R runs splice at "
              "its own recompute share, so text,splice@0,splice@0.15,splice@1 sweeps R in one run; graph's merges "
              "are exact (prefilled), graph@R splices them at R where that is cheaper. A mode the pipeline cannot "
              "run is skipped with the reason")


def _modes(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    from ..errors import KvwireError
    from ..pipeline.evaluation import MODES, canonical_mode

    try:
        modes = tuple(dict.fromkeys(canonical_mode(m) for m in value.split(",") if m.strip()))
    except KvwireError as err:
        raise click.BadParameter(str(err)) from None
    if not modes:
        raise click.BadParameter(f"no mode: use some of {', '.join(MODES)}")
    return modes


@click.command("eval")
@click.argument("tasks")
@click.option("--pipeline", "pipeline_file", type=click.Path(path_type=Path), default=None,
              help="the pipeline file whose agents solve each task (e.g. examples/humaneval/private.toml); "
              "required unless --rejudge")
@click.option("--mode", "modes", default=None, callback=_modes, help=MODES_HELP)
@click.option("--model", default=None, help=MODEL_HELP)
@weights_option
@click.option("--recompute", "fraction", type=FiniteFloat(0.0, 1.0), default=0.15, show_default=True,
              help="splice and graph merges: the share R of spliced tokens recomputed")
@click.option("--splice-when", "splice_when", type=click.Choice(["cheaper", "always"]), default="cheaper",
              show_default=True, help="splice: splice upstream turns only where that is estimated cheaper than "
              "prefilling them (short turns are prefilled, exactly), or always")
@click.option("--recompute-guard", "guard", type=FiniteFloat(0.0, None), default=0.0, show_default=True,
              help=GUARD_HELP)
@click.option("--answer-from", "answer_from", default="", help="the agent whose reply is the answer (default: the "
              "last)")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None, help="override every agent's limit")
@click.option("--limit", type=click.IntRange(1), default=None, help="only the first N tasks")
@click.option("--shard", default=None, help="I/N: only every N-th task from the I-th (1-based), after --limit")
@click.option("--out", "out_dir", type=WritablePath(file_okay=False), default=None,
              help="folder for results.jsonl and eval.png (default: eval-results/PIPELINE-TASKS-WEIGHTS)")
@click.option("--resume", is_flag=True, help="continue the results in --out (same pipeline, tasks, model, weights "
              "and settings): finished tasks are kept, the rest run")
@click.option("--rejudge", is_flag=True, help="run no model: judge the final replies stored in --out again with "
              "today's judge, report, and list the verdicts that changed (the previous file is kept beside it)")
@click.option("--no-kl", "no_kl", is_flag=True, help="do not measure the approximate modes' KL against text")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
def eval_cmd(tasks: str, pipeline_file: Path, modes: tuple[str, ...] | None, model: str | None, weights: str,
             fraction: float, splice_when: str, guard: float, answer_from: str, max_new_tokens: int | None,
             limit: int | None, shard: str | None, out_dir: Path | None, resume: bool, rejudge: bool, no_kl: bool,
             as_json: bool) -> None:
    """Run PIPELINE over TASKS (humaneval, or a JSONL file of your own) in each mode; report pass@1 with its
    interval, the tasks gained and lost against text (McNemar), the consistency of final answers, the reuse
    share and the time. Model-written code runs in a sandbox (kvwire.evals.sandbox)."""
    from ..evals.tasks import load_tasks
    from ..pipeline import evaluation as runner
    from .pipeline import load

    if rejudge:
        if out_dir is None:
            raise click.UsageError("--rejudge needs --out: the folder of the results to judge again")
        _rejudge(load_tasks(tasks), out_dir, as_json)
        return
    if pipeline_file is None:
        raise click.UsageError("Missing option '--pipeline' (the pipeline file whose agents solve each task)")
    spec, task_set, chosen = _plan(tasks, pipeline_file, max_new_tokens, limit, shard, answer_from)
    run_modes, skipped = runner.plan_modes(spec, modes, fraction)
    for mode, why in skipped.items():
        err.print(f"skipping mode {mode}: {why}", markup=False, highlight=False)
    out_dir = out_dir or Path("eval-results") / f"{spec.name}-{task_set.name}-{weights}"
    from ..evals.sandbox import isolation as sandbox_isolation

    isolation = sandbox_isolation().describe()
    model_obj, tokenizer = load(model, weights)
    from .. import hf

    model_spec = hf.model_spec(model_obj)
    header = runner.Header(spec.name, runner.file_digest(pipeline_file), task_set.name, task_set.digest,
                           str(model or "default"), model_spec.fingerprint, weights, fraction, max_new_tokens,
                           answer_from, splice_when, guard=guard)
    results = runner.Results(out_dir / "results.jsonl", header, resume)
    evaluation = runner.Evaluation(model_obj, tokenizer, spec, model_spec, recompute=fraction,
                                   answer_from=answer_from, kl=not no_kl, splice_when=splice_when, guard=guard)
    err.print(f"{len(chosen)} tasks x {len(run_modes)} modes ({', '.join(run_modes)}); sandbox: {isolation}",
              markup=False, highlight=False)
    _run(evaluation, chosen, run_modes, results)
    _report(results, {t.id for t in chosen}, run_modes, skipped, out_dir, isolation, as_json)



def _plan(tasks: str, pipeline_file: Path, max_new_tokens: int | None, limit: int | None, shard: str | None,
          answer_from: str) -> tuple[Any, Any, tuple[Any, ...]]:
    """The pipeline, the task set and the tasks this run takes; every problem said before a model loads."""
    from ..evals.tasks import load_tasks, parse_shard, select
    from ..pipeline.spec import PipelineSpec

    spec = PipelineSpec.from_toml(pipeline_file)
    if max_new_tokens is not None:
        spec = spec.with_max_new_tokens(max_new_tokens)
    task_set = load_tasks(tasks)
    chosen = select(task_set.tasks, limit=limit, shard=parse_shard(shard) if shard else None)
    names = [a.name for a in spec.agents]
    if answer_from and answer_from not in names:
        raise click.BadParameter(f"pipeline {spec.name!r} has no agent {answer_from!r} (agents: {', '.join(names)})",
                                 param_hint="'--answer-from'")
    return spec, task_set, chosen


def _run(evaluation: Any, chosen: tuple[Any, ...], run_modes: list[str], results: Any) -> None:
    """Every (task, mode) not finished yet, with a progress bar; Ctrl-C keeps what finished and says how to go on."""
    total = len(chosen) * len(run_modes)
    left = total - len(results.done() & {(t.id, m) for t in chosen for m in run_modes})
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=err, transient=False) as progress:
            bar = progress.add_task("eval", total=left)

            def on_progress(event: dict[str, Any]) -> None:
                if event["event"] == "task":
                    progress.update(bar, description=f"{event['task']}")
                else:
                    progress.advance(bar)

            for _ in evaluation.run(chosen, run_modes, results, on_progress):
                pass
    except KeyboardInterrupt:
        err.print(f"interrupted: {len(results.records)} finished (task, mode) results are kept in "
                  f"{results.path}; continue with the same command and --resume", markup=False, highlight=False)
        raise

def _rejudge(task_set: Any, out_dir: Path, as_json: bool) -> None:
    from types import SimpleNamespace

    from ..evals.sandbox import isolation as sandbox_isolation
    from ..pipeline import evaluation as runner

    isolation = sandbox_isolation().describe()
    path = out_dir / "results.jsonl"
    with Progress(TextColumn("re-judging {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        bar = progress.add_task("", total=None)

        def on_progress(event: dict[str, Any]) -> None:
            if event["event"] == "task":
                progress.update(bar, description=event["task"])
            else:
                progress.advance(bar)

        header, records, changed = runner.rejudge(path, task_set, on_progress=on_progress)
    for record in changed:
        err.print(f"{record['task']} {record['mode']}: {'passed' if record['was']['passed'] else 'failed'} -> "
                  f"{'passed' if record['passed'] else 'failed'} ({record['reason']}; was: {record['was']['reason']})",
                  markup=False, highlight=False)
    err.print(f"re-judged {len(records)} results with judge {header.judge}: {len(changed)} verdicts changed; the "
              f"previous file is kept beside {path}", markup=False, highlight=False)
    modes = list(dict.fromkeys(["text", *(r["mode"] for r in records)]))
    _report(SimpleNamespace(records=records, header=header, path=path), {r["task"] for r in records}, modes, {},
            out_dir, isolation, as_json)


def _report(results: Any, chosen: set[str], modes: list[str], skipped: dict[str, str], out_dir: Path,
            isolation: str, as_json: bool) -> None:
    from ..evals.report import summarize

    records = [r for r in results.records if r["task"] in chosen and r["mode"] in modes]
    summaries = summarize(records)
    own = " where a mode names none" if any("@" in mode for mode in modes) else ""
    table = Table(title=f"{results.header.pipeline} on {results.header.tasks} ({results.header.weights} weights, "
                  f"R={results.header.recompute:g}{own})")
    for column in ("mode", "pass@1 [95% CI]", "vs text +/-", "McNemar p", "consistency", "reuse", "end to end",
                   "TTFT 2..N", "tokens allow", "KL"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for s in summaries:
        table.add_row(
            s.mode, f"{100 * s.pass_at_1:.1f}% [{100 * s.ci95[0]:.0f}, {100 * s.ci95[1]:.0f}] ({s.passed}/{s.tasks})",
            "" if s.gained is None else f"+{s.gained} / -{s.lost}",
            "" if s.mcnemar_p is None else f"{s.mcnemar_p:.3g}",
            "" if s.consistency is None else f"{100 * s.consistency:.0f}%"
            + ("" if s.judge_consistency is None else f" (judge {100 * s.judge_consistency:.0f}%)"),
            f"{100 * s.reuse:.0f}%" + (f" (guard: {s.guarded} tasks)" if s.guarded else ""),
            "" if s.speedup is None else f"{s.speedup:.2f}x",
            "" if s.ttft_speedup is None else f"{s.ttft_speedup:.1f}x",
            "" if s.ttft_bound is None else f"{s.ttft_bound:.1f}x", "" if s.kl is None else f"{s.kl:.4f}")
    out.print(table)
    out.print(f"sandbox: {isolation}", markup=False, highlight=False)
    plot = None
    if summaries:
        from ..plots import eval_points

        plot = eval_points([s.to_json() for s in summaries], out_dir / "eval.png",
                           f"{results.header.pipeline} on {results.header.tasks}")
        out.print(f"results: {results.path}; plot: {plot}", markup=False, highlight=False)
    if as_json:
        out.print(json.dumps({"header": results.header.to_json(), "modes": [s.to_json() for s in summaries],
                              "skipped": skipped, "sandbox": isolation, "results": str(results.path),
                              "plot": str(plot) if plot else None}), markup=False, highlight=False, soft_wrap=True)
