"""``kvwire run`` / ``kvwire demo`` on a linear pipeline: load the model, run one mode or compare
two (repeated, warmed up), and report -- the timing table, outputs, speedups and fidelity.

:mod:`kvwire.cli` parses the options and calls :func:`run_pipeline`; :mod:`kvwire.cli.graph`
does the same for graph files and shares :func:`load`, :func:`warm_up` and :func:`timing_table`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from .console import err, out


def load(model: str | None, weights: str = "fp32", device: str = "cpu") -> tuple[Any, Any]:
    from .. import hf, models
    from ..hf.weights import check_format
    from ..wire.options import CodecOptions

    check_format(weights)  # before a model is fetched or converted
    hf.check_device(device, weights)
    CodecOptions.from_env()  # a bad KVWIRE_ENCODING or KVWIRE_SIGNING_KEY: said now, not after the load
    path = models.resolve(model)
    where = f" on {device}" if device != "cpu" else ""
    with err.status(f"loading model from {path}" + (f" ({weights} weights)" if weights != "fp32" else "") + where):
        loaded = hf.load_model(path, weights=weights, device=device)
    err.print(f"model {path} ({weights} weights){where}", markup=False, highlight=False)
    return loaded


def run_pipeline(spec: Any, mode: str, compare: bool, store_url: str, model: str | None,
                 max_new_tokens: int | None, as_json: bool, splice_options: dict[str, Any] | None = None,
                 rounds: int = 1, timeline_path: Path | None = None, repeats: int = 1, weights: str = "fp32",
                 device: str = "cpu") -> None:
    from ..store import open_store

    if repeats > 1 and not compare:
        raise click.UsageError("--repeats repeats a comparison: use --mode compare (or --compare)")
    if max_new_tokens is not None:
        spec = spec.with_max_new_tokens(max_new_tokens)
    if compare and rounds > 1:
        raise click.UsageError("--rounds runs one mode; compare modes one round at a time")
    store = open_store(store_url)  # fail on a bad URL before loading a model
    model_obj, tokenizer = load(model, weights, device)
    _warn_if_it_may_not_fit(spec, model_obj, tokenizer, rounds)
    _warn_if_the_template_adds_a_system_prompt(spec, tokenizer)
    from ..errors import ContextTooLong

    with store:
        try:
            runs, payload, comparisons = _execute(spec, mode, compare, store, model_obj, tokenizer,
                                                  splice_options or {}, rounds, repeats)
        except ContextTooLong as error:
            if error.finished:  # the replies written before the agent that did not fit are not lost
                err.print(f"finished before the error ({len(error.finished)} turn(s)):")
                for agent in error.finished:
                    err.print(reply_line(agent), markup=True)
            raise
    console = err if as_json else out
    console.print(timing_table(spec.name, runs))
    if timeline_path is not None:
        _draw_timeline(console, spec.name, runs, timeline_path)
    _print_outputs(console, runs[-1])
    from ..hf.weights import format_of

    weights_used = format_of(model_obj)
    if comparisons:
        _print_comparison(console, comparisons, weights_used)
    if as_json:
        print(json.dumps({**payload, "weights": weights_used}))


def _warn_if_the_template_adds_a_system_prompt(spec: Any, tokenizer: Any) -> None:
    """``system = ""`` reads as "no system prompt", but a chat template with a default of its own (SmolLM2's,
    Qwen2.5's) writes that default into a chat without one: say so once, before the run."""
    from .. import hf

    empty = [agent.name for i, agent in enumerate(spec.agents) if not spec.system_for(i)]
    if empty and hf.default_system_prompt(tokenizer):
        who = "every agent" if len(empty) == len(spec.agents) else ", ".join(empty)
        err.print(f"[yellow]note:[/] {who} has no system prompt, so this model's chat template writes its own default "
                  "one (\"You are a helpful AI assistant...\"); give system = \"...\" to choose it", markup=True)


def _warn_if_it_may_not_fit(spec: Any, model: Any, tokenizer: Any, rounds: int) -> None:
    """One note before anything runs when a linear pipeline could outgrow the model's window: if every agent
    wrote its whole max_new_tokens, the first agent that would not fit (an estimate: every agent's text
    tokenized once, and a few tokens a turn for the chat template). Replies usually end sooner, so it runs."""
    from .. import hf

    window = hf.context_window(model)
    if window is None or not spec.graph.is_linear:
        return
    text = "\n".join([spec.system_for(0)] + [spec.turn(i) for i in range(len(spec.agents))])
    needed = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    for round in range(rounds):
        for index, agent in enumerate(spec.agents):
            needed += 16 + spec.new_tokens(index)  # the template's tokens around a turn, and its reply
            if needed > window:
                where = f"agent {agent.name!r}" + (f" in round {round + 1}" if rounds > 1 else "")
                err.print(f"[yellow]note:[/] if every agent wrote its max_new_tokens, {where} would need about "
                          f"{needed:,} positions, past the model's window of {window:,}; the run stops there if "
                          "so (lower --max-new-tokens or shorten the input to be sure)", markup=True)
                return


def _execute(spec: Any, mode: str, compare: bool, store: Any, model: Any, tokenizer: Any, options: dict[str, Any],
             rounds: int, repeats: int) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """Run ``mode`` (or compare it with text, ``repeats`` times) under a progress bar: the runs to show,
    the JSON payload, and the comparisons made (none for a plain run)."""
    from ..kv.splice import Recompute
    from ..pipeline.linear import Pipeline

    steps = (2 if compare else 1) * len(spec.agents) * rounds * repeats
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task(f"{spec.name}", total=steps)

        def on_event(event: dict[str, Any]) -> None:
            if event["event"] == "agent_start":
                progress.update(task, description=f"{spec.name}: {event['mode']:6} {event['agent']}")
            else:
                progress.advance(task)

        pipeline = Pipeline(model, tokenizer, spec, store=store, on_event=on_event,
                            recompute=Recompute(options.get("fraction", 0.0), options.get("first", 0),
                                                select=options.get("select", Recompute.select),
                                                guard=options.get("guard", 0.0)),
                            placement=options.get("placement", "end"), splice_when=options.get("when") or "cheaper")
        if not compare:
            result = pipeline.run(mode, rounds=rounds)  # type: ignore[arg-type]
            return [result], result.to_json(), []
        progress.update(task, description=f"{spec.name}: warm-up")
        warm_up(model)
        comparisons = repeated_compare(pipeline, mode, repeats)
    comparison = median(comparisons)
    payload = comparison.to_json()
    payload["repeat_speedups"] = [c.speedup for c in comparisons]
    payload["identical_every_repeat"] = all(c.identical for c in comparisons)
    return [comparison.text, comparison.other], payload, comparisons


def _draw_timeline(console: Any, name: str, runs: list[Any], path: Path) -> None:
    from ..plots import timeline

    # one process: turns back to back (fidelity measurement between them is not part of the run)
    drawn = timeline([(run.mode + (f" ({run.settings})" if run.settings else ""),
                       [{**a.to_json(), "started_at": None} for a in run.agents]) for run in runs],
                     path, title=f"{name}: where the time went")
    console.print(f"timeline: {drawn}")


def reply_line(agent: Any) -> str:
    """An agent's reply as a console line (markup in the reply shown as written), saying when it was cut."""
    cut = f" [dim]\\[cut at {agent.new_tokens} tokens: max_new_tokens][/]" if agent.finish_reason == "length" else ""
    return f"[bold]{escape(agent.agent)}[/] ({agent.mode}): {escape(agent.output_text)}{cut}"


def _print_outputs(console: Any, run: Any) -> None:
    for agent in run.agents:
        console.print(reply_line(agent), markup=True)
        if agent.decision:
            console.print(f"  {agent.agent} sent {agent.decision}")
        for event in agent.events:
            console.print(f"  {agent.agent}: rebuilt its context ({event})")


def _print_comparison(console: Any, comparisons: list[Any], weights: str = "fp32") -> None:
    """The speedup of the median comparison, then how exact (prefix) or how close (splice) its outputs were."""
    comparison = median(comparisons)
    mode_name = comparison.other.mode + (f" ({comparison.other.settings})" if comparison.other.settings else "")
    console.print(
        f"end-to-end speedup {mode_name} vs text: [bold]{comparison.speedup:.2f}x[/] "
        f"(ideal {comparison.ideal_speedup:.2f}x, efficiency {comparison.efficiency:.2f}); "
        + (f"TTFT speedup agents 2..N: {comparison.ttft_speedup:.1f}x" if len(comparison.agents) > 1 else
           "one agent: no cache is passed, so no TTFT to compare"), markup=True)
    if len(comparisons) > 1:
        console.print(f"  the run of median speedup of {len(comparisons)} (warm-up first, modes alternating "
                      f"which goes first): {' / '.join(f'{c.speedup:.2f}x' for c in comparisons)}")
    if comparison.efficiency > 1.25:  # noise moves it by ~0.1 where decoding dominates
        console.print(f"  [yellow]note:[/] {mode_name} beat its ideal ({comparison.efficiency:.2f}x of it): the "
                      "text run was slowed by something else (a busy machine?); "
                      + ("rerun" if len(comparisons) > 1 else "rerun with --repeats 3"), markup=True)
    if comparison.other.mode == "prefix":
        _print_exactness(console, comparisons, weights)
    else:
        _print_fidelity(console, comparison)


def _print_exactness(console: Any, comparisons: list[Any], weights: str) -> None:
    every = all(c.identical for c in comparisons)
    verdict = "identical" if every else "NOT identical"
    if len(comparisons) > 1:
        verdict += " in every run" if every else f" in {sum(not c.identical for c in comparisons)} run(s)"
    exact = all(c.exact for c in comparisons)
    approximate = median(comparisons).approximate
    claim = "yes" if exact else "NO"
    if exact and approximate:  # a lossy packet encoding (KVWIRE_ENCODING=int4, say): close, not exact
        lossy = sorted({a.lossy_encoding for a in median(comparisons).other.agents if a.lossy_encoding})
        claim = (f"not claimed for {', '.join(approximate)}" + (f": caches travel as {', '.join(lossy)} packets, "
                                                                 "which are lossy (KVWIRE_ENCODING)" if lossy else ""))
    console.print(f"outputs text vs prefix: [bold]{verdict}[/]; prefix exact vs recomputation: {claim}", markup=True)
    chosen = median(comparisons)
    for index, agent in enumerate(chosen.agents):
        if not agent.identical or not agent.same_context or agent.exact is None:
            console.print(f"  {agent.agent}: {agent.note}")
            _print_both(console, chosen, index)
    if not exact and weights != "fp32":
        console.print(f"  [yellow]note:[/] {weights} weights are not batch-invariant: a prefill and a decode step "
                      "round a value to bf16 differently now and then, and a near-tie between two tokens can "
                      "then flip (docs/engine.md, weight formats); prefix mode is exact under --weights fp32",
                      markup=True)


def _print_both(console: Any, comparison: Any, index: int) -> None:
    """Both replies of an agent whose outputs differ, one under the other, so the difference can be read."""
    if comparison.agents[index].identical:
        return
    for run in (comparison.text, comparison.other):
        reply = run.agents[index]
        console.print(f"    {run.mode:>7}: {escape(reply.output_text)}", markup=True, soft_wrap=True)


def _print_fidelity(console: Any, comparison: Any) -> None:
    kl = f"{comparison.kl:.4f}" if comparison.kl is not None else "n/a"
    console.print(f"fidelity vs text, agents 2..N: greedy token agreement [bold]{comparison.agreement:.0%}"
                  f"[/], mean next-token KL {kl} nats (approximate mode)", markup=True)
    if comparison.exact_agreement is not None:
        console.print(f"fidelity vs an exact recomputation of the same ids (the splice error alone): "
                      f"agreement {comparison.exact_agreement:.0%}")
    for agent in comparison.agents:
        if agent.fidelity is not None and comparison.other.mode == "splice":
            first = agent.fidelity.first_divergence
            console.print(f"  {agent.agent}: agreement {agent.fidelity.agreement:.0%}, first divergence "
                          f"{'none' if first is None else f'at token {first}'}"
                          + (f", KL {agent.fidelity.kl:.4f}" if agent.fidelity.kl is not None else ""))
        elif not agent.identical or not agent.same_context:
            console.print(f"  {agent.agent}: {agent.note}")
        _print_both(console, comparison, comparison.agents.index(agent))


def warm_up(model: Any) -> None:
    """One short forward pass and decode step before anything is timed: the first touches every weight
    (a freshly loaded model's pages), starts the thread pool and builds kernels, and would otherwise be
    charged to whichever mode runs first -- text mode, once read 4.9 s for a 126-token prefill that took
    0.34 s a moment later."""
    from .. import hf

    hf.generate(model, list(range(16)), max_new_tokens=2)


def repeated_compare(pipeline: Any, mode: str, repeats: int) -> list[Any]:
    """``repeats`` comparisons of text and ``mode``, the mode that goes first alternating (so neither
    pays the machine's drift every time); splice mode's KL needs text first."""
    alternate = mode != "splice"
    return [pipeline.compare(mode, candidate_first=alternate and i % 2 == 1) for i in range(repeats)]


def median(comparisons: list[Any]) -> Any:
    """The comparison of median end-to-end speedup (the lower middle one of an even count)."""
    ordered = sorted(comparisons, key=lambda c: c.speedup)
    return ordered[(len(ordered) - 1) // 2]


def timing_table(title: str, runs: list[Any]) -> Table:
    computing = any(run.mode == "splice" or any(a.compute_s for a in run.agents) for run in runs)
    caption = "tokens: context / served from cache / generated"
    if computing:  # model work before an agent's own prefill, counted where it was done
        caption += ("; compute: model work before the agent's own prefill (splicing: own prefix, selection and "
                    "recompute; a graph's input shared by several agents: its one prefill)")
    table = Table(title=title, caption=caption)
    rounds = any(a.round for run in runs for a in run.agents)  # --rounds: the same agents again, told apart
    columns = ["agent"] + ["round"] * rounds + ["mode", "tokens", "TTFT", "prefill", "decode", "transfer", "total"]
    if computing:
        columns.insert(columns.index("prefill") + 1, "compute")
    for column in columns:
        table.add_column(column, justify="left" if column in ("agent", "mode") else "right")
    for run in runs:
        for a in run.agents:
            times = [a.ttft_s, a.prefill_s, a.decode_s, a.transfer_s, a.total_s]
            if computing:
                times.insert(2, a.compute_s)
            table.add_row(escape(a.agent), *[str(a.round + 1)] * rounds, a.mode,
                          f"{a.context_tokens}/{a.cached_tokens}/{a.new_tokens}",
                          *(f"{seconds:.2f}s" for seconds in times))
        table.add_row("[bold]all[/]", *[""] * rounds, run.mode, *[""] * (len(columns) - 3 - rounds),
                      f"[bold]{run.total_s:.2f}s[/]", end_section=True)
    return table
