"""Real tasks through the server (issue 41, pipeline e): an unmodified agent framework, smolagents, drives a
pipeline over HumanEval against ``kvwire serve --splice R`` and against ``--no-reuse``; every final reply is
judged by the task's own tests.

    python benchmarks/eval_server.py [--pipeline examples/humaneval/private.toml] [--model qwen2.5-coder-0.5b]
                                     [--weights int8] [--splice 0.15] [--splice-when cheaper]
                                     [--shard 1/16] [--limit N] [--out FILE.jsonl] [--json]

Two ``kvwire serve`` processes on the same model and weights, started here: one with ``--no-reuse`` (every
prompt prefilled in full: what text mode computes; ``text`` in the results) and one with ``--splice R``
(``splice``). Each task runs through the first, then through the second, so both see the same machine. Nothing
here talks to kvwire but over HTTP: each agent is a smolagents ``OpenAIServerModel`` (temperature 0, its own
``max_tokens``) and is sent what the in-process pipeline reads (its own system prompt, the input and each
earlier agent's instruction as user messages, each earlier reply as an assistant message), streamed, so that
time to first token is where a framework sees it (the first content delta). The pipeline must be linear.

The records are ``kvwire eval``'s (:func:`kvwire.evals.report.summarize` reads them): pass@1 with its interval;
beside ``--no-reuse``, tasks gained and lost and the exact McNemar p; consistency (final replies identical); reuse
(agents 2..N: prompt tokens the server served from cache, read from its ``kvwire_cached_tokens_total`` around
each request, over their prompt tokens); end to end and TTFT of agents 2..N as ratios. Targets (issue 41):
pass@1 within 1 point of ``--no-reuse``, TTFT of agents 2..N at least 3x, end to end never slower.

What differs from ``kvwire eval --mode splice``: the server splices what earlier requests computed, message by
message -- completions, and (since 2026-12-07) earlier requests' own user messages, such as the first agent's
turn carrying the input -- with the template's turn headers between them recomputed, and it decodes in its
batched engine. Run nothing else meanwhile: the ratios are timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from smolagents import ChatMessage, MessageRole, OpenAIServerModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, run_main  # noqa: E402
from serve import Server, metric  # noqa: E402

from kvwire.evals.report import summarize  # noqa: E402
from kvwire.evals.answers import judge  # noqa: E402
from kvwire.evals.tasks import load_tasks, parse_shard, select  # noqa: E402
from kvwire.pipeline.spec import PipelineSpec  # noqa: E402

CACHED = "kvwire_cached_tokens_total"


def conversation(spec: PipelineSpec, index: int, replies: list[str]) -> list[dict[str, str]]:
    """What agent ``index`` is sent: its opening, then every earlier agent's turn and reply, then its own turn."""
    messages = list(spec.opening(index))
    for earlier, reply in enumerate(replies):
        messages += [{"role": "user", "content": spec.turn(earlier)}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": spec.turn(index)}]


def ask(server: Server, spec: PipelineSpec, index: int, messages: list[dict[str, str]]) -> dict:
    """One agent's request through smolagents, streamed: its reply, TTFT, total, prompt and cached tokens."""
    model = OpenAIServerModel(model_id=server.model, api_base=server.url, api_key="none", temperature=0,
                              max_tokens=spec.new_tokens(index))
    chat = [ChatMessage(role=MessageRole(m["role"]), content=[{"type": "text", "text": m["content"]}])
            for m in messages]
    cached_before = metric(server.root, CACHED)
    start = time.perf_counter()
    first, parts, prompt_tokens = None, [], 0
    for delta in model.generate_stream(chat):
        if delta.content:
            first = first if first is not None else time.perf_counter() - start
            parts.append(delta.content)
        if delta.token_usage is not None:
            prompt_tokens = delta.token_usage.input_tokens
    total = time.perf_counter() - start
    cached = int(metric(server.root, CACHED) - cached_before)
    return {"agent": spec.agents[index].name, "context_tokens": prompt_tokens, "cached_tokens": cached,
            "ttft_s": first if first is not None else total, "total_s": total, "reply": "".join(parts)}


def run_task(server: Server, spec: PipelineSpec, task, mode: str) -> dict:
    """The pipeline on one task against one server: a ``kvwire eval`` record."""
    spec = dataclasses.replace(spec, input_text=task.input)
    replies: list[str] = []
    agents = []
    for index in range(len(spec.agents)):
        agents.append(ask(server, spec, index, conversation(spec, index, replies)))
        replies.append(agents[-1]["reply"])
    final = replies[-1].strip()
    start = time.perf_counter()
    verdict = judge(task, final)
    later = agents[1:]
    return {"task": task.id, "mode": mode, "passed": verdict.passed, "reason": verdict.reason, "final": final,
            "answer": verdict.answer, "total_s": sum(a["total_s"] for a in agents),
            "judge_s": time.perf_counter() - start, "ttft_later_s": sum(a["ttft_s"] for a in later),
            "context_later": sum(a["context_tokens"] for a in later),
            "reused_later": sum(a["cached_tokens"] for a in later), "recomputed_later": 0, "kl": None,
            "agents": [{k: v for k, v in a.items() if k != "reply"} for a in agents]}


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else ""


def table(summaries, splice: float) -> str:
    label = {"text": "--no-reuse", "splice": f"--splice {splice:g}"}
    lines = ["| server | pass@1 (95 % CI) | vs --no-reuse | McNemar p | consistency | reuse 2..N | e2e | TTFT 2..N |"
             " tokens allow |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        vs = f"+{s.gained}/-{s.lost}" if s.gained is not None else ""
        lines.append(f"| {label.get(s.mode, s.mode)} | {s.passed}/{s.tasks} ({s.ci95[0]:.2f}-{s.ci95[1]:.2f}) | {vs} "
                     f"| {'' if s.mcnemar_p is None else f'{s.mcnemar_p:.2f}'} "
                     f"| {'' if s.consistency is None else f'{s.consistency:.0%}'} | {s.reuse:.0%} "
                     f"| {_ratio(s.speedup)} | {_ratio(s.ttft_speedup)} | {_ratio(s.ttft_bound)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=Path, default=ROOT / "examples" / "humaneval" / "private.toml")
    parser.add_argument("--tasks", default="humaneval", help="humaneval or a JSONL task file")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--splice", type=float, default=0.15, help="the --splice server's R")
    parser.add_argument("--splice-when", choices=("cheaper", "always"), default="cheaper")
    parser.add_argument("--shard", default="1/16", help="I/N: every N-th task from the I-th (default 1/16: 11 tasks)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="the records, one JSON line each (kvwire eval's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 0.0 <= args.splice <= 1.0:  # said before two servers load the model, not by the second one
        parser.error(f"--splice {args.splice:g}: R must be in [0, 1]")
    spec = PipelineSpec.from_toml(args.pipeline)
    if not spec.graph.is_linear:
        raise SystemExit(f"{args.pipeline}: this benchmark drives linear pipelines; it has a graph")
    tasks = select(load_tasks(args.tasks).tasks, limit=args.limit, shard=parse_shard(args.shard))
    common = ["--model", args.model, "--weights", args.weights]
    records = []
    with tempfile.TemporaryDirectory() as workdir:
        servers = {"text": Server(Path(workdir), *common, "--no-reuse"),
                   "splice": Server(Path(workdir), *common, "--splice", str(args.splice),
                                    "--splice-when", args.splice_when)}
        try:
            for number, task in enumerate(tasks, 1):
                for mode, server in servers.items():
                    record = run_task(server, spec, task, mode)
                    records.append(record)
                    print(f"[{number}/{len(tasks)}] {task.id} {mode}: {'pass' if record['passed'] else 'fail'}, "
                          f"{record['total_s']:.1f} s, TTFT 2..N {record['ttft_later_s']:.2f} s, "
                          f"cached {record['reused_later']}/{record['context_later']}", file=sys.stderr, flush=True)
                    if args.out is not None:
                        with args.out.open("a") as out:
                            out.write(json.dumps(record) + "\n")
        finally:
            for server in servers.values():
                server.stop()
    summaries = summarize(records)
    print(table(summaries, args.splice))
    summary = {"benchmark": "eval_server", "pipeline": spec.name, "model": args.model, "weights": args.weights,
               "splice": args.splice, "splice_when": args.splice_when, "tasks": [t.id for t in tasks],
               "modes": [s.to_json() for s in summaries], "machine": machine()}
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    run_main(main)
