"""``kvwire run`` on a graph file: the graph drawn layer by layer, then run (text, graph or compare).

:mod:`kvwire.cli` parses the options and calls :func:`run_graph` when the pipeline file
is a graph; the library does the work (:mod:`kvwire.pipeline.graph`).
"""

from __future__ import annotations

import json
from typing import Any

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.tree import Tree

from .console import err, out
from .pipeline import load, reply_line, timing_table, warm_up


def graph_tree(spec: Any, fraction: float, merge: str = "prefill", rounds: int = 1, batch: bool = True) -> Tree:
    """The graph, layer by layer: who reads whom, which layers decode as one batch (``batch``: else one
    at a time), which agents merge; with several rounds, what the next round's first agents read."""
    graph = spec.graph
    agents, layers = len(graph.names), len(graph.layers)
    tree = Tree(f"[bold]{spec.name}[/]: {agents} agent{'s' * (agents != 1)} in {layers} layer{'s' * (layers != 1)}")
    for depth, layer in enumerate(graph.layers):
        together = "one batch" if batch else "one at a time"
        label = f"layer {depth}" + (f" ({len(layer)} agents, {together})" if len(layer) > 1 else "")
        branch = tree.add(label)
        for index in layer:
            reads = [graph.names[u] for u in graph.upstream[index]]
            merging = graph.is_merge(index)
            note = (_root_note(spec, index) if not reads else f"reads {', '.join(reads)}"
                    + (f" (merge: {_MERGE_LABELS[merge]}, R={fraction:g})" if merging and merge != "prefill"
                       else " (merge: prefilled after the first branch's chain)" if merging
                       else f" (no merge: {reads[0]} already read the others)" if len(reads) > 1 else ""))
            branch.add(f"[bold]{graph.names[index]}[/] {note}")
    if rounds > 1:
        sinks = [graph.names[i] for i in graph.sinks]
        roots = ", ".join(graph.names[i] for i in graph.roots)
        tree.add(f"next round: [bold]{roots}[/] {'each read' if graph.shares_input else 'reads'} {', '.join(sinks)}"
                 + (" (merge: every agent no one read)" if len(sinks) > 1 else ""))
    return tree


def _root_note(spec: Any, index: int) -> str:
    """What an agent that starts the graph reads: the pipeline's input (shared when several start it),
    its own input, or nothing but the system prompt."""
    own = " and its own input" if spec.agents[index].input_text else ""
    if spec.input_text and spec.graph.shares_input:
        return f"reads the input (a message of its own, shared by {len(spec.graph.roots)} agents){own}"
    if spec.input_text:
        return f"reads the input{own}"
    return "reads its own input" if own else "starts the graph (reads no agent and no input)"


_MERGE_LABELS = {"auto": "spliced or prefilled, whichever is cheaper", "splice": "spliced"}


def _print_runs(console: Any, name: str, runs: list[Any]) -> None:
    """The timing table, then the last run's replies, rebuilds and merge decisions."""
    console.print(timing_table(name, runs))
    for agent in runs[-1].agents:
        console.print(reply_line(agent), markup=True)
        for event in agent.events:
            console.print(f"  {agent.agent}: rebuilt part of its context ({event})")
        if agent.decision:
            console.print(f"  {agent.agent}: {agent.decision}")


def _print_comparison(console: Any, comparison: Any) -> None:
    """The graph's speedup over text, TTFT of the agents that read a cache, and each merge's fidelity."""
    # the agents that read a cache: every one past the first, and every root when roots share the input
    reading = [(t.ttft_s, g.ttft_s) for t, g in zip(comparison.text.agents, comparison.other.agents)
               if g.cached_tokens]
    waited = sum(g for _, g in reading)
    ttft = (f"; TTFT speedup of the agents reading a cache: {sum(t for t, _ in reading) / waited:.1f}x"
            if waited > 0 else "")
    console.print(f"end-to-end speedup graph ({comparison.other.settings}) vs text: [bold]"
                  f"{comparison.speedup:.2f}x[/]{ttft}; decoded together: {comparison.other.batches}", markup=True)
    for a, result in zip(comparison.agents, comparison.other.agents):
        if result.exact_fidelity is not None:
            exact, text = result.exact_fidelity, result.fidelity
            console.print(f"  {a.agent} (merge): agreement {exact.agreement:.0%} with an exact recomputation "
                          f"(teacher forced {exact.forced_agreement:.0%}, KL {exact.kl:.4f}), "
                          f"{text.agreement:.0%} with text mode"
                          + (f" (KL {text.kl:.4f})" if text.kl is not None else ""))
        else:
            console.print(f"  {a.agent}: {a.note}")


def run_graph(spec: Any, mode: str, store_url: str, model: str | None, max_new_tokens: int | None,
              as_json: bool, fraction: float, first: int, select: str, rounds: int, batch: bool,
              budget: int | None, merge: str = "prefill", weights: str = "fp32", device: str = "cpu",
              guard: float = 0.0) -> None:
    from ..pipeline.graph import GraphRunner, check_graph_mode
    from ..kv.splice import Recompute
    from ..store import open_store

    if mode != "text":
        check_graph_mode(spec)  # before loading the model
    if max_new_tokens is not None:
        spec = spec.with_max_new_tokens(max_new_tokens)
    store = open_store(store_url)
    model_obj, tokenizer = load(model, weights, device)
    if mode == "compare":
        warm_up(model_obj)  # or text mode, which runs first, pays the cold start
    steps = (2 if mode == "compare" else 1) * len(spec.agents) * rounds
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task(spec.name, total=steps)

        def on_event(event: dict[str, Any]) -> None:
            if event["event"] == "layer_start":
                progress.update(task, description=f"{spec.name}: {event['mode']:5} {', '.join(event['agents'])}")
            else:
                progress.advance(task)

        with store:
            runner = GraphRunner(model_obj, tokenizer, spec, store=store,
                                 recompute=Recompute(fraction, first, select=select, guard=guard), batch=batch,
                                 memory_budget=budget, on_event=on_event, merge=merge)
            comparison = runner.compare(rounds) if mode == "compare" else None
            runs = [comparison.text, comparison.other] if comparison else [runner.run(mode, rounds=rounds)]
    console = err if as_json else out
    _print_runs(console, spec.name, runs)
    if comparison is not None:
        _print_comparison(console, comparison)
    if as_json:
        print(json.dumps(comparison.to_json() if comparison else runs[0].to_json()))
