"""``kvwire demo``, ``kvwire run`` and ``kvwire agent``: run a pipeline in one process, or one agent of it
in its own process."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import click

from ..models import MODEL_HELP
from .console import err, out
from .pipeline import load as _load, run_pipeline as _run
from .types import GUARD_HELP, FiniteFloat, WritablePath, device_option, weights_option

REPEATS_HELP = ("run the comparison this many times, alternating which mode goes first, and report the run of "
                "median speedup (one run on a busy machine can read 20 % off)")


TIMELINE_FORMATS = (".png", ".svg", ".pdf")  # what matplotlib writes for --timeline


@click.command("demo")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--store", "store_url", default="memory://", show_default=True, help="store URL")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=None, help="per agent (default 32)")
@click.option("--repeats", type=click.IntRange(1, 50), default=3, show_default=True, help=REPEATS_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
@weights_option
@device_option
def demo_cmd(model: str | None, store_url: str, max_new_tokens: int | None, repeats: int, as_json: bool,
             weights: str, device: str) -> None:
    """Two-agent code review (analyst -> fixer), text vs prefix, side by side."""
    from ..pipeline.spec import PipelineSpec

    with resources.as_file(resources.files("kvwire") / "data" / "code_review.toml") as path:
        spec = PipelineSpec.from_toml(path)
    _run(spec, "prefix", True, store_url, model, max_new_tokens, as_json, repeats=repeats, weights=weights,
         device=device)


@click.command("run")
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
@click.option("--recompute-select", "select",
              type=click.Choice(["attention+start", "attention+deviation", "kv-deviation", "attention"]),
              default="attention+start", show_default=True,
              help="splice: which R share to recompute: what the receiver's turn reads most and the start of the "
                   "first upstream turn, half each; or the start's half by what deviates most at an early layer; or "
                   "deviation alone (CacheBlend); or reading alone")
@click.option("--recompute-first", "first", type=click.IntRange(0), default=0, show_default=True,
              help="splice: also recompute the first K tokens of every segment (EPIC)")
@click.option("--recompute-guard", "guard", type=FiniteFloat(0.0, None), default=0.0, show_default=True,
              help=GUARD_HELP)
@click.option("--splice-when", "splice_when", type=click.Choice(["cheaper", "always"]), default=None,
              help="splice: splice the upstream turns only where that is estimated cheaper than prefilling them "
                   "(short turns are prefilled, exactly), or always  [default: cheaper]")
@click.option("--positions", default="end", show_default=True,
              help="splice: end (re-base segments at the receiver's end), global (keep session positions) "
                   "or an integer offset")
@click.option("--timeline", "timeline_path", type=WritablePath(dir_okay=False), default=None,
              help="draw each agent's receive, prefill, decode and publish on one time axis to this PNG "
                   "(text mode above the cache mode)")
@click.option("--no-batch", "no_batch", is_flag=True, help="graph: decode agents one at a time (caches only)")
@click.option("--merge", "merge", type=click.Choice(["auto", "splice", "prefill"]), default=None,
              help="graph: how a merging agent reads its later branches: prefill them after the first branch's "
                   "chain (exact), splice them (approximate, --recompute R: each was computed without the others, "
                   "so a judge reading them spliced loses its cross-candidate attention), or auto: whichever is "
                   "estimated cheaper  [default: prefill]")
@click.option("--repeats", type=click.IntRange(1, 50), default=1, show_default=True,
              help="with a comparison of a linear pipeline: " + REPEATS_HELP)
@click.option("--memory-budget", default=None,
              help="graph: bytes the batched engine may hold (e.g. 512MiB); larger batches are split, and said so")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last stdout line")
@weights_option
@device_option
def run_cmd(pipeline_file: Path, mode: str, compare_flag: bool, model: str | None, store_url: str,
            max_new_tokens: int | None, rounds: int, fraction: float, select: str, first: int, guard: float,
            splice_when: str | None, positions: str,
            timeline_path: Path | None, no_batch: bool, merge: str | None, repeats: int, memory_budget: str | None,
            as_json: bool, weights: str, device: str) -> None:
    """Run the agents of PIPELINE_FILE (TOML; see examples/) in text, prefix, splice, graph or compare mode."""
    from ..pipeline.spec import PipelineSpec

    spec = PipelineSpec.from_toml(pipeline_file)
    if not spec.graph.is_linear or mode == "graph":
        if mode not in ("text", "graph", "compare") or compare_flag:
            raise click.UsageError(f"{pipeline_file} is a graph: run it with --mode text, graph or compare")
        if timeline_path is not None:
            raise click.UsageError("--timeline draws the turns of a linear pipeline; a graph's agents share batches")
        if splice_when is not None:
            raise click.UsageError("--splice-when is for splice mode; a graph's merges take "
                                   "--merge auto|splice|prefill")
        if repeats > 1:
            raise click.UsageError("--repeats repeats a linear pipeline's comparison; benchmarks/graph.py "
                                   "--repeats N repeats a graph's")
        from .graph import graph_tree, run_graph

        merge = merge or "prefill"
        tree = graph_tree(spec, fraction, merge, rounds, batch=not no_batch and mode != "text")
        (err if as_json else out).print(tree, soft_wrap=False)  # soft wrap crops labels
        from ..store import parse_bytes

        budget = parse_bytes(memory_budget, "--memory-budget") if memory_budget is not None else None
        run_graph(spec, mode, store_url, model, max_new_tokens, as_json, fraction, first, select, rounds,
                  not no_batch, budget, merge, weights, device, guard)
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
         {"fraction": fraction, "first": first, "select": select, "placement": placement, "when": splice_when,
          "guard": guard},
         rounds, timeline_path, repeats, weights, device)


@click.command("agent")
@click.argument("pipeline_file", type=click.Path(path_type=Path))
@click.option("--name", required=True, help="the agent of PIPELINE_FILE this process runs")
@click.option("--session", required=True, help="the run's id: the same for every agent of one run")
@click.option("--namespace", default=None,
              help="keep this run's keys under ns/NAME/ of the store: agents of another namespace (another "
                   "team, user or tenant sharing the store) never read its caches or handoffs, nor it theirs")
@click.option("--store", "store_url", required=True,
              help="file:///dev/shm/NAME (agents on one host), redis://HOST:PORT/DB or "
                   "redis+cluster://HOST:PORT,HOST:PORT (several hosts)")
@click.option("--mode", type=click.Choice(["prefix", "splice", "text", "auto"]), default=None,
              help="default: prefix with a shared system prompt, splice with private ones; auto: this process "
                   "measures its model at start, reads its store's costs from another agent on this host or "
                   "probes them within --probe-budget, and sends its cache only where that beats re-prefilling "
                   "the ids (real transfers refine the estimate)")
@click.option("--costs", "costs_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="--mode auto: decide with these costs (the JSON line of `kvwire probe URL --json`) instead of "
                   "probing")
@click.option("--probe-budget", type=FiniteFloat(0.01, 60.0), default=None,
              help="--mode auto: the most seconds the store probe may take (its traffic is reported)  "
                   "[default: 0.3]")
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
@weights_option
@device_option
def agent_cmd(pipeline_file: Path, name: str, session: str, namespace: str | None, store_url: str, mode: str | None,
              costs_file: Path | None, probe_budget: float | None, splice_when: str | None, fraction: float,
              first_round: int, rounds: int,
              model: str | None, max_new_tokens: int | None, timeout: float, retries: int, as_json: bool,
              weights: str, device: str) -> None:
    """Run one agent of PIPELINE_FILE as its own process: wait for its upstream handoff in the store,
    take its turn, leave its handoff for the next agent."""
    from ..pipeline import worker
    from ..pipeline.spec import PipelineSpec

    spec = PipelineSpec.from_toml(pipeline_file)
    if max_new_tokens is not None:
        spec = spec.with_max_new_tokens(max_new_tokens)
    index = worker.agent_index(spec, name)
    turn_mode = worker.resolve_mode(spec, mode)
    if costs_file is not None and turn_mode != "auto":
        raise click.UsageError("--costs is for --mode auto")
    if probe_budget is not None and (turn_mode != "auto" or costs_file is not None):
        raise click.UsageError("--probe-budget is for --mode auto without --costs (given costs need no probe)")
    if splice_when is not None and turn_mode != "splice":
        raise click.UsageError(f"--splice-when is for splice mode; this agent runs {turn_mode} mode")
    costs = _read_costs(costs_file) if costs_file is not None else None
    store = worker.connect(store_url, worker.Retry(retries), namespace=namespace)
    with store:
        worker.check_turn_free(store, spec, index, session, first_round)  # fail fast, before loading a model
        from ..pipeline.agent import Agent  # loads transformers
        from ..kv.splice import Recompute

        background = None
        if turn_mode == "auto" and costs is None:  # the store's and the codec's costs, measured beside the loading
            from .. import hf, models
            from ..pipeline.probe import BUDGET_S
            from ..pipeline.rates import Background
            from ..wire.options import CodecOptions

            budget = probe_budget if probe_budget is not None else BUDGET_S
            background = Background(store, hf.spec_from_pretrained(models.resolve(model), weights=weights),
                                    CodecOptions.from_env(), budget_s=budget)
            err.print(f"{name}: measuring {store.url} (within {budget:g} s) and the codec beside the model's "
                      "loading; each hop decides from the figures known by then", markup=False)
        model_obj, tokenizer = _load(model, weights, device)
        runner = worker.Worker(Agent(spec, index, model_obj, tokenizer, store, cost=costs,
                                     recompute=Recompute(fraction), splice_when=splice_when or "cheaper"),
                               store, timeout_s=timeout, background=background)
        if costs is not None:
            err.print(f"{name} decides with the costs in {costs_file}: {json.dumps(costs.to_json())}")
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
    from ..pipeline.cost import CostModel
    from ..errors import KvwireError as Error

    try:
        line = path.read_text().strip().splitlines()[-1]
        data = json.loads(line)
    except (OSError, ValueError, IndexError) as error:
        raise Error(f"{path} is not the JSON output of `kvwire probe --json`: {error}") from None
    return CostModel.from_json(data, str(path))

