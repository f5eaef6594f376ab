"""Decode speed per weight format, and kvwire against llama.cpp on the same pipelines, in one run.

    python benchmarks/engines.py [--json] [--only formats pipelines] [--formats fp32 bf16 int8 int4]
                                 [--workloads 32 256] [--threads 2]

**formats**: for each weight format (``--weights``), on the default model:
- single-row decode, ms a token, with a short context (~30 tokens) and at ~1,700 tokens, each
  beside the same steps through transformers' modules (``kvwire.hf.step`` off);
- prefill tokens/s over the ~1,700-token incident report, the formats alternating round after round;
- batched decode: 4 and 8 rows sharing the report, each row's tokens/s against one row's (the row
  counts alternating round after round, medians of ``--repeats``);
- fidelity against fp32: on the five agents' contexts of the document pipeline, teacher-forced on
  fp32's own greedy 32 tokens, the mean KL(fp32 || format) per token and top-1 agreement.

**pipelines**: the five-agent document pipeline (prefill-heavy, 32 tokens an agent) and its
decode-heavy variant (256 tokens an agent), each engine passing text and passing the cache:
- kvwire ``text`` and ``prefix`` modes, in each chosen format;
- llama.cpp (``pip install llama-cpp-python==0.3.36``, an optional extra that builds from source
  in ~10 minutes: never in the default install or CI) on the same GGUF, the same threads: *text*
  evaluates every agent's whole context from an empty cache; *cache* keeps one context in the
  process and evaluates only what its cache does not hold (llama.cpp's own prompt cache). It reads
  exactly kvwire's text-mode token ids -- each agent's context, then kvwire's output tokens one
  evaluation at a time -- so both engines compute the same tokens, the same number of them: those
  of the last pipeline format by default (``--llama-replays``; formats part at different tokens).

**decode**: whether a pipeline decodes on the engine's fastest path (issue 42). ``kvwire run
examples/document_pipeline.toml --max-new-tokens N --weights F --json`` as a user runs it (its own process),
each agent's decode ms a token from the run's JSON; beside each, ``hf.generate``'s loop -- the one the formats
section times -- at that agent's context plus half its reply (the mean context its steps read), in this
process. ``--repeats`` rounds of one pipeline run and one loop timing per agent; per agent the medians.
Target: every agent within 10 % of the loop.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvwire import PipelineSpec, hf, models
from kvwire.hf import step
from kvwire.pipeline.linear import Pipeline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, positive, run_main  # noqa: E402

DOCUMENT = ROOT / "examples" / "document_pipeline.toml"
SHORT_PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."
DECODE_TOKENS = 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", nargs="*", default=["formats", "pipelines", "decode"],
                        choices=["formats", "pipelines", "decode"])
    parser.add_argument("--decode-formats", nargs="*", default=["int8"], choices=["fp32", "bf16", "int8", "int4"],
                        help="formats the decode section runs in")
    parser.add_argument("--decode-tokens", type=positive, default=256, help="decode section: tokens an agent")
    parser.add_argument("--formats", nargs="*", default=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--pipeline-formats", nargs="*", default=None,
                        help="formats the pipelines run in (default: fp32 and int4)")
    parser.add_argument("--workloads", nargs="*", type=int, default=[32, 256], help="tokens an agent")
    parser.add_argument("--repeats", type=positive, default=3, help="decode timings: median of this many")
    parser.add_argument("--threads", type=positive, default=None, help="torch and llama.cpp threads (default: torch's)")
    parser.add_argument("--llama-replays", default=None,
                        help="whose text-mode token ids llama.cpp replays: one of the pipeline formats (default: "
                             "the last, so it computes as many tokens as the compact format it is compared with)")
    parser.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_worker:  # the llama.cpp side, in its own process: its OpenMP pool and crashes stay there
        job = json.load(sys.stdin)
        llama = _llama(job["threads"], sys.stderr)
        print(json.dumps([_llama_row(llama, job["tokens"], mode, job["runs"]) for mode in ("text", "cache")]))
        return
    log = sys.stderr if args.json else sys.stdout
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    result: dict[str, Any] = {"machine": machine(), "threads": threads}
    path = models.resolve()
    if "formats" in args.only:
        result["formats"] = formats(path, args.formats, args.repeats, log)
    if "pipelines" in args.only:
        names = args.pipeline_formats or ["fp32", "int4"]
        replays = args.llama_replays or names[-1]
        if replays not in names:
            parser.error(f"--llama-replays {replays} is not one of the pipeline formats ({', '.join(names)})")
        result["pipelines"] = pipelines(path, names, args.workloads, threads, log, replays)
    if "decode" in args.only:
        result["decode"] = [decode_row(path, name, args.decode_tokens, args.repeats, threads, log)
                            for name in args.decode_formats]
    print(json.dumps(result))


# -- formats ---------------------------------------------------------------------------------------

def formats(path: Path, names: list[str], repeats: int, log: Any) -> dict[str, Any]:
    reference, tokenizer = hf.load_model(path)
    spec = PipelineSpec.from_toml(DOCUMENT).with_max_new_tokens(32)
    contexts = [a.context_ids for a in Pipeline(reference, tokenizer, spec).run("text").agents]
    report = contexts[0][: len(contexts[0]) - 8]  # the system prompt and the report, ~1,700 tokens
    targets = []  # fp32's own greedy continuation of each context: the tokens fidelity is scored on
    for ids in contexts:
        gen = hf.generate(reference, ids, max_new_tokens=32, eos_ids=frozenset())
        targets.append((ids, gen.tokens))
    reference_logits = [_forced_logits(reference, ids, out) for ids, out in targets]
    short = hf.encode_with_offsets(tokenizer, hf.render_chat(tokenizer, [{"role": "user", "content": SHORT_PROMPT}]))[0]
    out: dict[str, Any] = {}
    loaded: dict[str, Any] = {}  # every format's model stays loaded for the side-by-side prefills
    for name in names:
        model = reference if name == "fp32" else hf.load_model(path, weights=name)[0]
        row: dict[str, Any] = {"weights": name}
        row["decode_ms_short"] = 1e3 * _decode_s(model, short, repeats)
        row["decode_ms_1700"] = 1e3 * _decode_s(model, report, repeats)
        with step.disabled():  # the same steps through transformers' modules, for the before-and-after
            row["modules_decode_ms_short"] = 1e3 * _decode_s(model, short, repeats)
            row["modules_decode_ms_1700"] = 1e3 * _decode_s(model, report, repeats)
        row["context_1700"] = len(report)
        row.update(_batched(model, tokenizer, report, repeats))
        if name != "fp32":
            kls, agree, count = [], 0, 0
            for (ids, outs), ref in zip(targets, reference_logits):
                logits = _forced_logits(model, ids, outs)
                ref_logp, logp = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
                kls.append(float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()))
                agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
                count += len(outs)
            row["kl_vs_fp32"] = statistics.mean(kls)
            row["top1_agreement_vs_fp32"] = agree / count
        out[name] = row
        print(f"{name}: decode {row['decode_ms_short']:.1f} ms/token short, {row['decode_ms_1700']:.1f} at "
              f"{len(report)} tokens (through the modules: {row['modules_decode_ms_short']:.1f} / "
              f"{row['modules_decode_ms_1700']:.1f}); batched 4 rows "
              f"{row['batch4_vs_one']:.2f}x, 8 rows {row['batch8_vs_one']:.2f}x"
              + (f"; vs fp32: KL {row['kl_vs_fp32']:.4f}, top-1 {100 * row['top1_agreement_vs_fp32']:.1f} %"
                 if name != "fp32" else ""), file=log)
        loaded[name] = model
    # prefill side by side: the formats alternate, round after round (one measurement of a format moves by
    # ~20 % on a 2-core host, more than the formats differ), the first round a warm-up
    seconds: dict[str, list[float]] = {name: [] for name in loaded}
    for round_ in range(repeats + 1):
        for name, model in loaded.items():
            took = _prefill_s(model, report)
            if round_:
                seconds[name].append(took)
    for name, row in out.items():
        row["prefill_tokens_per_s"] = len(report) / statistics.median(seconds[name])
        row["prefill_tokens_per_s_runs"] = [len(report) / s for s in seconds[name]]
    fp32_rate = out["fp32"]["prefill_tokens_per_s"] if "fp32" in out else None
    print("prefill, " + ", ".join(
        f"{name} {row['prefill_tokens_per_s']:.0f} tokens/s"
        + (f" ({row['prefill_tokens_per_s'] / fp32_rate:.2f}x fp32)" if fp32_rate and name != "fp32" else "")
        for name, row in out.items()) + f" ({len(report)} tokens, formats alternating, median of {repeats})",
        file=log)
    return out


def _forced_logits(model: Any, ids: list[int], outs: list[int]) -> torch.Tensor:
    """Logits [n, V] predicting each of ``outs`` after ``ids`` (teacher forced, one pass)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids + outs[:-1]])).logits[0, len(ids) - 1:]
    return logits.float()


def _decode_s(model: Any, ids: list[int], repeats: int) -> float:
    """Seconds a decode step takes after ``ids`` (median over ``repeats`` runs of DECODE_TOKENS steps)."""
    times = []
    for _ in range(repeats + 1):  # the first warms up
        gen = hf.generate(model, ids, max_new_tokens=DECODE_TOKENS + 1, eos_ids=frozenset())
        times.append(gen.decode_s / DECODE_TOKENS)
    return statistics.median(times[1:])


def _prefill_s(model: Any, ids: list[int]) -> float:
    return hf.generate(model, ids, max_new_tokens=1, eos_ids=frozenset()).prefill_s


def _batched(model: Any, tokenizer: Any, report: list[int], repeats: int) -> dict[str, Any]:
    """Per-row decode rate of 1, 4 and 8 rows sharing the report, as the engine batches them: the row counts
    alternate, round after round (a warm-up round first), and each rate is the median of ``repeats`` rounds --
    one 24-step run of a row count moved by 20-40 % on a 2-core host, more than the ratios' margins."""
    prefix = hf.Prefix.from_cache(hf.generate(model, report, max_new_tokens=1, eos_ids=frozenset()).cache, report)
    runs: dict[int, list[float]] = {1: [], 4: [], 8: []}
    for round_ in range(repeats + 1):
        for rows in runs:
            asks = [f"Question {i}: what happened first?" for i in range(rows)]
            requests = [hf.Request(report + tokenizer(q, add_special_tokens=False)["input_ids"], prefix=prefix,
                                   max_new_tokens=24, eos_ids=frozenset()) for q in asks]
            engine = hf.Engine(model)
            for request in requests:
                engine.add(request)
            engine.step()  # the prefills and the first token
            start, steps = time.perf_counter(), 0
            while engine.busy:
                engine.step()
                steps += 1
            if round_:
                runs[rows].append(rows * steps / (time.perf_counter() - start))
    rates = {rows: statistics.median(values) for rows, values in runs.items()}
    return {"batch4_vs_one": rates[4] / rates[1], "batch8_vs_one": rates[8] / rates[1],
            "batch1_tokens_per_s": rates[1], "batch_tokens_per_s_runs": {str(r): v for r, v in runs.items()}}


# -- decode: the pipeline as users run it against the engine's own loop -----------------------------

def decode_row(path: Path, weights: str, tokens: int, repeats: int, threads: int, log: Any) -> dict[str, Any]:
    """``kvwire run`` of the document pipeline in its own process, each agent's decode rate beside the loop's at
    the same mean context (see the module docstring). ``repeats`` rounds, each one pipeline run and then one
    timing of the loop per agent (so both see the host's same minutes); per agent the medians are compared."""
    command = [sys.executable, "-m", "kvwire", "run", str(DOCUMENT), "--max-new-tokens", str(tokens), "--weights",
               weights, "--mode", "prefix", "--json"]
    model, tokenizer = hf.load_model(path, weights=weights)
    filler = tokenizer(PipelineSpec.from_toml(DOCUMENT).input_text, add_special_tokens=False)["input_ids"]
    rounds: list[list[dict[str, Any]]] = []
    for index in range(repeats):
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)})  # torch's threads, as here
        if proc.returncode != 0:
            raise SystemExit(f"kvwire run failed: {proc.stderr.strip()[-500:]}")
        measured = []
        for agent in json.loads(proc.stdout.strip().splitlines()[-1])["agents"]:
            steps = max(agent["new_tokens"] - 1, 1)
            mean_context = agent["context_tokens"] + steps // 2 - DECODE_TOKENS // 2  # the loop's steps centred there
            ids = (filler * (mean_context // len(filler) + 1))[:mean_context]  # decode time depends on the length
            measured.append({"agent": agent["agent"], "context_tokens": agent["context_tokens"],
                             "new_tokens": agent["new_tokens"], "pipeline_ms": 1e3 * agent["decode_s"] / steps,
                             "loop_ms": 1e3 * _decode_s(model, ids, 1)})
        rounds.append(measured)
        print(f"decode {weights}: round {index + 1}/{repeats}: " + ", ".join(
            f"{m['agent']} {m['pipeline_ms']:.1f}/{m['loop_ms']:.1f}" for m in measured) + " ms (run/loop)", file=log)
    agents = []
    for position, first in enumerate(rounds[0]):
        runs = [measured[position]["pipeline_ms"] for measured in rounds]
        loops = [measured[position]["loop_ms"] for measured in rounds]
        pipeline_ms, loop_ms = statistics.median(runs), statistics.median(loops)
        agents.append({**first, "pipeline_ms": pipeline_ms, "loop_ms": loop_ms,
                       "pipeline_vs_loop": pipeline_ms / loop_ms, "pipeline_ms_runs": runs, "loop_ms_runs": loops})
        print(f"decode {weights}: {first['agent']:<12} context {first['context_tokens']:>5}  kvwire run "
              f"{pipeline_ms:5.1f} ms/token  loop {loop_ms:5.1f}  ({pipeline_ms / loop_ms:.2f}x, medians of "
              f"{repeats})", file=log)
    worst = max(a["pipeline_vs_loop"] for a in agents)
    print(f"decode {weights}: the pipeline's worst agent {worst:.2f}x the loop (target <= 1.10)", file=log)
    return {"weights": weights, "tokens_per_agent": tokens, "repeats": repeats, "agents": agents,
            "worst_vs_loop": worst, "within_10_percent": worst <= 1.10, "command": " ".join(command[1:])}


# -- pipelines -------------------------------------------------------------------------------------

def pipelines(path: Path, names: list[str], workloads: list[int], threads: int, log: Any,
              replays: str) -> list[dict[str, Any]]:
    rows = []
    try:
        import llama_cpp  # noqa: F401
        have_llama = True
    except ImportError:
        have_llama = False
    for tokens in workloads:
        spec = PipelineSpec.from_toml(DOCUMENT).with_max_new_tokens(tokens)
        ids_run = None
        for name in names:
            model, tokenizer = hf.load_model(path, weights=name)
            Pipeline(model, tokenizer, spec.with_max_new_tokens(4)).run("prefix")  # warm-up
            outputs = {}
            for mode in ("text", "prefix"):
                run = Pipeline(model, tokenizer, spec).run(mode)
                outputs[mode] = [a.output_ids for a in run.agents]
                rows.append(_kvwire_row(tokens, name, mode, run))
                if mode == "prefix":  # the exactness claim within a format, over this whole workload
                    same = [a == b for a, b in zip(outputs["text"], outputs["prefix"])]
                    rows[-1]["agents_same_as_text"] = f"{sum(same)} of {len(same)}"
                print(_describe(rows[-1]), file=log)
                if mode == "text" and name == replays:  # llama.cpp computes exactly these tokens
                    ids_run = [(a.context_ids, a.output_ids) for a in run.agents]
        if have_llama and ids_run is not None:
            job = json.dumps({"threads": threads, "tokens": tokens, "runs": ids_run})
            proc = subprocess.run([sys.executable, __file__, "--llama-worker"], input=job, capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                rows.append({"engine": "llama.cpp", "tokens_per_agent": tokens,
                             "failed": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"})
                print(f"llama.cpp failed: {rows[-1]['failed']}", file=log)
                continue
            for row in json.loads(proc.stdout.strip().splitlines()[-1]):
                rows.append({**row, "replays": replays})
                print(_describe(row), file=log)
    if not have_llama:
        rows.append({"engine": "llama.cpp", "skipped": "llama-cpp-python is not installed "
                     "(pip install llama-cpp-python==0.3.36; it builds from source, ~10 minutes)"})
        print(rows[-1]["skipped"], file=log)
    return rows


def _kvwire_row(tokens: int, weights: str, mode: str, run: Any) -> dict[str, Any]:
    agents = run.agents
    new = sum(a.new_tokens for a in agents)
    prefilled = sum(a.context_tokens - a.cached_tokens for a in agents)
    prefill_s = sum(a.prefill_s for a in agents)
    return {"engine": "kvwire", "weights": weights, "mode": mode, "tokens_per_agent": tokens,
            "end_to_end_s": sum(a.total_s for a in agents), "ttft_s": [a.ttft_s for a in agents],
            "prefill_tokens": prefilled, "prefill_tokens_per_s": prefilled / max(prefill_s, 1e-9),
            "decode_ms_per_token": 1e3 * sum(a.decode_s for a in agents) / max(new - len(agents), 1),
            "generated": new}


def _llama(threads: int, log: Any) -> Any:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    gguf = models.default_gguf()
    print(f"llama.cpp: {gguf.name}, {threads} threads", file=log)
    return Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False)


def _llama_row(llama: Any, tokens: int, mode: str, runs: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """llama.cpp over kvwire's token ids: each agent's context, then its output tokens one evaluation each."""
    llama.reset()
    cached: list[int] = []
    total = ttft = prefill_s = decode_s = 0.0
    ttfts, prefilled, steps, generated = [], 0, 0, 0
    for context, outputs in runs:
        start = time.perf_counter()
        if mode == "text":
            llama.reset()
            cached = []
        common = 0
        while common < min(len(cached), len(context)) and cached[common] == context[common]:
            common += 1
        if common == len(context):
            common -= 1  # at least one token computed: its logits pick the first output
        llama.n_tokens = common
        llama.eval(context[common:])
        ttft = time.perf_counter() - start
        prefill_s += ttft
        prefilled += len(context) - common
        _argmax(llama)  # the first token (kvwire's is used)
        decode_start = time.perf_counter()
        for token in outputs[:-1]:
            llama.eval([token])
            _argmax(llama)
            steps += 1
        decode_s += time.perf_counter() - decode_start
        cached = context + outputs[:-1]
        total += time.perf_counter() - start
        ttfts.append(ttft)
        generated += len(outputs)
    return {"engine": "llama.cpp", "weights": "Q4_1 (GGUF)", "mode": mode, "tokens_per_agent": tokens,
            "end_to_end_s": total, "ttft_s": ttfts, "prefill_tokens": prefilled,
            "prefill_tokens_per_s": prefilled / max(prefill_s, 1e-9),
            "decode_ms_per_token": 1e3 * decode_s / max(steps, 1), "generated": generated}


def _argmax(llama: Any) -> int:
    """The greedy token of llama.cpp's last logits (read in place, as its sampler reads them)."""
    import llama_cpp
    import numpy as np

    logits = llama_cpp.llama_get_logits_ith(llama.ctx, -1)
    return int(np.ctypeslib.as_array(logits, shape=(llama.n_vocab(),)).argmax())


def _describe(row: dict[str, Any]) -> str:
    return (f"{row['tokens_per_agent']:>3} tokens/agent  {row['engine']:<9} {row['weights']:<11} {row['mode']:<6} "
            f"end to end {row['end_to_end_s']:6.1f} s  first TTFT {row['ttft_s'][0]:.2f} s  prefill "
            f"{row['prefill_tokens_per_s']:.0f} tokens/s ({row['prefill_tokens']})  decode "
            f"{row['decode_ms_per_token']:.1f} ms/token ({row['generated']} tokens)"
            + (f"  outputs as text mode: {row['agents_same_as_text']} agents" if "agents_same_as_text" in row else ""))


if __name__ == "__main__":
    run_main(main)
