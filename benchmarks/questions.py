"""The bundled multiple-choice question set on each model alone: accuracy (95% Wilson interval),
latency per item, and the gap between the first two models (paired bootstrap).

    python benchmarks/questions.py [--models smollm2-135m-instruct,qwen2.5-coder-0.5b]
                                   [--methods letter,loglik,loglik_mean] [--limit N] [--json]

A fusion benchmark needs questions where the sharer alone (Qwen2.5-Coder-0.5B) clearly beats
the receiver alone (SmolLM2-135M); this measures that gap for every scoring method
(kvwire.hf.scoring): ``letter`` (next-token probability of the option letter, options
listed), ``loglik`` (summed log-likelihood of the option text as the answer) and
``loglik_mean`` (per token; computed from the same forward passes as ``loglik``).
Per-topic accuracy and how often each letter is predicted (a model at chance often
answers "A") are reported too. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvwire import hf, models
from kvwire.evals import accuracy, load, paired_difference
from kvwire.hf import scoring

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, run_main  # noqa: E402


def run_model(name: str, questions: list[Any], methods: list[str]) -> dict[str, Any]:
    model, tokenizer = hf.load_model(models.resolve(name))
    passes = sorted({"loglik" if m == "loglik_mean" else m for m in methods})
    correct: dict[str, list[bool]] = {m: [] for m in methods}
    seconds: dict[str, list[float]] = {m: [] for m in passes}
    letters: collections.Counter[str] = collections.Counter()
    for method in passes:  # warm-up: first calls allocate and pick kernels
        scoring.score(model, tokenizer, questions[0], method)  # type: ignore[arg-type]
    start = time.perf_counter()
    for index, question in enumerate(questions):
        for method in passes:
            prompt = scoring.build_prompt(tokenizer, question, method)  # type: ignore[arg-type]
            result = scoring.score(model, tokenizer, question, method, prompt=prompt)  # type: ignore[arg-type]
            seconds[method].append(result.seconds)
            if method in correct:
                correct[method].append(result.correct)
            if method == "letter":
                letters[question.letters[result.predicted]] += 1
            if method == "loglik" and "loglik_mean" in correct:
                per_token = [s / len(ids) for s, ids in zip(result.scores, prompt.option_ids)]
                correct["loglik_mean"].append(max(range(len(per_token)), key=per_token.__getitem__) == question.answer)
        if (index + 1) % 25 == 0:
            print(f"{name}: {index + 1}/{len(questions)} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    out: dict[str, Any] = {"model": name, "methods": {}}
    for method in methods:
        acc = accuracy(correct[method])
        timing = seconds["loglik" if method == "loglik_mean" else method]
        topics: dict[str, list[bool]] = collections.defaultdict(list)
        for question, ok in zip(questions, correct[method]):
            topics[question.topic].append(ok)
        out["methods"][method] = {**acc.to_json(), "median_item_s": statistics.median(timing),
                                  "mean_item_s": statistics.fmean(timing),
                                  "topics": {t: round(sum(v) / len(v), 3) for t, v in sorted(topics.items())},
                                  "correct_ids": [q.id for q, ok in zip(questions, correct[method]) if ok]}
    if "letter" in methods:
        out["letter_predictions"] = dict(sorted(letters.items()))
    out["_correct"] = correct
    del model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=f"{models.DEFAULT_MODEL},qwen2.5-coder-0.5b")
    parser.add_argument("--methods", default="letter,loglik,loglik_mean,listed")
    parser.add_argument("--questions", type=Path, default=None, help="a question set (default: the bundled one)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions (a quick look)")
    parser.add_argument("--json", action="store_true", help="include per-item correct ids in the JSON line")
    args = parser.parse_args()
    torch.manual_seed(0)
    questions = load(args.questions)[: args.limit]
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(scoring.METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(scoring.METHODS)}")
    runs = [run_model(name, questions, methods) for name in args.models.split(",")]

    gaps = {}
    if len(runs) >= 2:
        receiver, sharer = runs[0], runs[1]
        for method in methods:
            diff, low, high = paired_difference(sharer["_correct"][method], receiver["_correct"][method])
            gaps[method] = {"sharer_minus_receiver": diff, "ci95_low": low, "ci95_high": high,
                            "ci_method": "paired bootstrap over items, 10000 resamples"}
    for run in runs:
        for method, row in run["methods"].items():
            print(f"{run['model']:>24} {method:>12}: {100 * row['accuracy']:5.1f}% "
                  f"[{100 * row['ci95_low']:.1f}, {100 * row['ci95_high']:.1f}]  "
                  f"{1000 * row['median_item_s']:.0f} ms/item", file=sys.stderr)
            if not args.json:
                del row["correct_ids"]
        del run["_correct"]
    for method, gap in gaps.items():
        print(f"gap ({method}): {100 * gap['sharer_minus_receiver']:+.1f} points "
              f"[{100 * gap['ci95_low']:+.1f}, {100 * gap['ci95_high']:+.1f}]", file=sys.stderr)
    print(json.dumps({"benchmark": "questions", "questions": len(questions), "runs": runs, "gap": gaps,
                      "chance": statistics.fmean(1 / len(q.options) for q in questions), "machine": machine()}))


if __name__ == "__main__":
    run_main(main)
