"""Cache-to-cache between different models: accuracy and latency of every path on Python questions.

    python benchmarks/fuse.py [--json] [--items 150] [--method loglik_mean] [--ridge CKPT] [--fuser CKPT]
                              [--lora CKPT] [--hint-tokens 16] [--ridge-weights 0.1,0.3] [--repeat-items 3]

The receiver is SmolLM2-135M-Instruct, the sharer Qwen2.5-Coder-0.5B-Instruct (``make models``).
Questions: the bundled multiple-choice set (``kvwire/data/python_mc.jsonl``), scored by
:mod:`kvwire.hf.scoring`: by default each option's mean log-likelihood per token as the
answer to the question alone (``loglik_mean``; on this set it gives the sharer a clear lead
over the receiver, which the option-letter method does not). Paths, each timed end to
end per item (the sharer's work included where a path uses the sharer):

- ``receiver``: SmolLM2 alone;  ``sharer``: Qwen alone (its own chat template);
- ``text``: text-to-text -- Qwen writes an answer (``--hint-tokens``, greedy), appended to
  the question for SmolLM2, which then answers;
- ``ridge`` / ``fuser``: fuse mode -- Qwen prefills the question (no generation), its cache
  goes through a store as a packet, is aligned, projected (ridge baseline, learned fuser)
  and fused into SmolLM2's own cache, and SmolLM2 answers from it;
- ``lora``: SmolLM2 fine-tuned with LoRA on the fuser's training data (the baseline a
  fuser's gain must beat), when its checkpoint is given.

Checkpoints default to the ones kvwire finds for the pair under ``$KVWIRE_HOME/fusers``
(``kvwire fit-ridge``, ``kvwire train-fuser``); a path without one is skipped and listed.
Accuracy comes with a 95% Wilson interval; fuse vs receiver and vs text-to-text with a
paired bootstrap interval. The **repeat test** (the seed's drift diagnostic) asks the
receiver to repeat a standard library excerpt it was given; the share of characters it
repeats, in order, from its own cache and from each fused cache shows how far fusion
moves the receiver from what it read. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvwire import hf, models
from kvwire.errors import WorseThanAloneError
from kvwire.evals import accuracy, load, paired_difference
from kvwire.fuse import corpus, mode, projector, registry, ridge
from kvwire.fuse.train import Party
from kvwire.hf import scoring

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, run_main  # noqa: E402

SHARER = "qwen2.5-coder-0.5b"
REPEAT_REQUEST = "Repeat the following text exactly, with nothing before or after it:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--items", type=int, default=150, help="questions (the first N of a fixed shuffle)")
    parser.add_argument("--method", choices=scoring.METHODS, default="loglik_mean",
                        help="loglik_mean (default): mean log-likelihood per option token; letter: the option letter")
    parser.add_argument("--ridge", type=Path, default=None, help="ridge checkpoint (default: found for the pair)")
    parser.add_argument("--fuser", type=Path, action="append", default=None,
                        help="learned fuser checkpoint (default: found); repeat to compare several (paths fuser, "
                             "fuser-2, ...)")
    parser.add_argument("--controls", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each fuse path fed another question's sharer cache (PATH:other): a gain "
                             "that survives it is not reading the sharer")
    parser.add_argument("--allow-worse", action="store_true",
                        help="run projectors whose recorded gain over the receiver alone is not positive "
                             "(refused otherwise, and listed as skipped)")
    parser.add_argument("--lora", type=Path, default=None, help="LoRA-tuned receiver checkpoint (the baseline)")
    parser.add_argument("--ridge-weights", default="", help="also run ridge fuse at these fusing weights "
                        "(comma-separated, e.g. 0.25,0.5: paths ridge@0.25, ...)")
    parser.add_argument("--hint-tokens", type=int, default=16, help="text-to-text: tokens the sharer writes")
    parser.add_argument("--repeat-items", type=int, default=3, help="repeat-test excerpts (0: skip)")
    parser.add_argument("--paths", default="", help="run only these paths (comma-separated; default: all available)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    log = sys.stderr if args.json else sys.stdout

    receiver = _party(models.DEFAULT_MODEL)
    sharer = _party(SHARER)
    runners, skipped, info = _runners(args, receiver, sharer)
    lora_model = _lora(args.lora, receiver, info, skipped)
    questions = load()
    order = torch.randperm(len(questions), generator=torch.Generator().manual_seed(args.seed)).tolist()
    questions = [questions[i] for i in order[: args.items]]
    paths = ["receiver", "sharer", "text", *runners, *(["lora"] if lora_model is not None else [])]
    if args.controls:
        paths += [f"{name}:other" for name in runners if "@" not in name]
    if args.paths:
        wanted = [p.strip() for p in args.paths.split(",") if p.strip()]
        missing = sorted(set(wanted) - set(paths))
        if missing:
            parser.error(f"paths {missing} are not available here (available: {', '.join(paths)})")
        paths = wanted
    print(f"{len(questions)} questions, method {args.method}; paths {', '.join(paths)}"
          + (f"; skipped {', '.join(skipped)}" if skipped else ""), file=log)

    def one(path: str, question: Any, other: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        result = _score(path, question, args, receiver, sharer, runners, lora_model, other)
        return result, time.perf_counter() - start

    def other_of(n: int) -> Any:  # the control's text: another question, half the set away
        return questions[(n + len(questions) // 2) % len(questions)]

    for path in paths:  # burn-in: every path once, not counted
        one(path, questions[0], other_of(0))
    records: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    for n, question in enumerate(questions):
        line = []
        for path in paths:
            result, seconds = one(path, question, other_of(n))
            records[path].append({"id": question.id, "correct": result.correct, "predicted": result.predicted,
                                  "seconds": seconds})
            line.append(f"{path} {'+' if result.correct else '-'} {seconds:.2f}s")
        print(f"[{n + 1}/{len(questions)}] {question.id}: " + ", ".join(line), file=log)

    summary = {}
    for path in paths:
        outcomes = [r["correct"] for r in records[path]]
        times = [r["seconds"] for r in records[path]]
        summary[path] = {**accuracy(outcomes).to_json(), "latency_mean_s": statistics.mean(times),
                         "latency_median_s": statistics.median(times)}
    differences = {}
    for fused in (p for p in paths if p in runners):
        for other in ("receiver", "text", "lora", f"{fused}:other"):
            if other in records:
                diff, low, high = paired_difference([r["correct"] for r in records[fused]],
                                                    [r["correct"] for r in records[other]])
                differences[f"{fused}-{other}"] = {"points": 100 * diff, "ci95": [100 * low, 100 * high]}
        if "text" in summary:
            summary[fused]["latency_vs_text"] = summary[fused]["latency_mean_s"] / summary["text"]["latency_mean_s"]
    chosen = {name: runner for name, runner in runners.items() if name in paths}
    repeat = _repeat_test(args.repeat_items, args.seed, receiver, chosen) if args.repeat_items else {}

    print(f"\n{'path':10} {'accuracy':>24} {'mean latency':>13}", file=log)
    for path, row in summary.items():
        acc = f"{100 * row['accuracy']:.1f}% [{100 * row['ci95_low']:.1f}, {100 * row['ci95_high']:.1f}]"
        print(f"{path:10} {acc:>24} {row['latency_mean_s']:>12.2f}s", file=log)
    for name, d in differences.items():
        print(f"{name}: {d['points']:+.1f} points [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]", file=log)
    for path, r in repeat.items():
        print(f"repeat test, {path}: {100 * r['overlap']:.0f}% of the excerpt repeated", file=log)
    payload = {"items": len(questions), "method": args.method, "hint_tokens": args.hint_tokens, "paths": summary,
               "differences": differences, "repeat_test": repeat, "skipped": skipped, "checkpoints": info,
               "records": records, "machine": machine()}
    print(json.dumps(payload))


# -- set-up ------------------------------------------------------------------------------------------------


def _party(name: str) -> Party:
    model, tokenizer = hf.load_model(models.resolve(name))
    return Party(model, tokenizer, hf.model_spec(model), name)


def _runners(args: argparse.Namespace, receiver: Party, sharer: Party) -> tuple[dict, list[str], dict]:
    """One fuse runner per projector available: ``{"ridge": runner, "fuser": runner}``."""
    found = registry.find(registry.fusers_dir(), sharer.spec, receiver.spec)
    runners, skipped, info = {}, [], {}
    fusers = args.fuser or [None]
    chosen = [("ridge", args.ridge), *((f"fuser-{i + 1}" if i else "fuser", p) for i, p in enumerate(fusers))]
    for kind, given in chosen:
        path = given
        if path is None:
            path = next((p for p in found if _kind(p) == kind.split("-")[0]), None)
        if path is None:
            skipped.append(f"{kind} (no checkpoint for the pair: see kvwire check {SHARER} {models.DEFAULT_MODEL})")
            continue
        try:
            proj, config = projector.load(path, receiver.spec, sharer.spec, allow_worse=args.allow_worse)
        except WorseThanAloneError as refused:
            skipped.append(f"{kind} ({refused}; --allow-worse runs it)")
            continue
        runners[kind] = mode.FuseRunner(receiver, sharer, proj, config, store="memory://")
        info[kind] = {"path": str(path), "alignment": config.alignment, "layer_map": list(config.layer_map),
                      "parameters": _parameters(proj), "training": _brief(config.training),
                      "gain": dict(config.training or {}).get("gain")}
        if kind == "ridge":
            info[kind]["weight"] = proj.weight
            for weight in (float(w) for w in args.ridge_weights.split(",") if w.strip()):
                other, _ = ridge.load(path, receiver.spec, sharer.spec, weight=weight)
                runners[f"ridge@{weight:g}"] = mode.FuseRunner(receiver, sharer, other, config, store="memory://")
    return runners, skipped, info


def _kind(path: Path) -> str:
    from kvwire.fuse import checkpoint

    return checkpoint.read_config(path)[0].kind


def _parameters(proj: Any) -> int | None:
    count = getattr(proj, "parameter_count", None)
    return count() if callable(count) else None


def _brief(training: Any) -> dict[str, Any]:
    keep = ("mean", "fit_s", "tokens", "steps", "final_loss", "corpus", "source")
    return {k: v for k, v in dict(training).items() if k in keep}


def _lora(path: Path | None, receiver: Party, info: dict, skipped: list[str]) -> Any:
    if path is None:
        skipped.append("lora (pass --lora CKPT: kvwire train-fuser --method lora writes it)")
        return None
    from kvwire.fuse import train

    loader = getattr(train, "load_lora", None)
    if loader is None:
        skipped.append("lora (this kvwire has no kvwire.fuse.train.load_lora yet)")
        return None
    model = loader(path, receiver.spec, receiver.model)
    info["lora"] = {"path": str(path)}
    return model


# -- one item, one path ---------------------------------------------------------------------------------


def _score(path: str, question: Any, args: argparse.Namespace, receiver: Party, sharer: Party,
           runners: dict[str, mode.FuseRunner], lora_model: Any, other: Any) -> Any:
    method = args.method
    if path == "receiver":
        return scoring.score(receiver.model, receiver.tokenizer, question, method)
    if path == "sharer":
        return scoring.score(sharer.model, sharer.tokenizer, question, method)
    if path == "lora":
        return scoring.score(lora_model, receiver.tokenizer, question, method)
    messages = [{"role": "user", "content": question.text(with_options=method == "letter")}]
    prompt = scoring.build_prompt(receiver.tokenizer, question, method)
    if path == "text":
        hint_ids = hf.encode_with_offsets(sharer.tokenizer, hf.render_chat(sharer.tokenizer, messages))[0]
        gen = hf.generate(sharer.model, hint_ids, max_new_tokens=args.hint_tokens)
        hint = sharer.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
        text = hf.render_chat(receiver.tokenizer, mode.with_hint(messages, hint))
        ids = hf.encode_with_offsets(receiver.tokenizer, text)[0]
        with_hint = scoring.Prompt(tuple(ids), method, prompt.option_ids, prompt.letter_ids)
        return scoring.score(receiver.model, receiver.tokenizer, question, method, prompt=with_hint)
    if path.endswith(":other"):  # the control: the same fuser reading another question's sharer cache
        theirs = [{"role": "user", "content": other.text(with_options=method == "letter")}]
        fused = runners[path.split(":")[0]].fuse_other(messages, theirs)
    else:
        fused = runners[path].fuse(messages)
    if tuple(fused.ids) != prompt.ids:
        raise RuntimeError(f"{question.id}: fuse mode's receiver ids differ from the scoring prompt's")
    return scoring.score(receiver.model, receiver.tokenizer, question, method, cache=fused.cache, prompt=prompt)


def _repeat_test(count: int, seed: int, receiver: Party, runners: dict[str, mode.FuseRunner]) -> dict[str, Any]:
    """Ask the receiver to repeat an excerpt it was given, from its own cache and from each fused one."""
    excerpts = corpus.stdlib_chunks(count, chars=160, seed=seed + 7)
    results: dict[str, list[float]] = {"receiver": [], **{name: [] for name in runners}}
    samples: dict[str, str] = {}
    for excerpt in excerpts:
        messages = [{"role": "user", "content": f"{REPEAT_REQUEST}\n\n{excerpt}"}]
        limit = len(hf.encode_with_offsets(receiver.tokenizer, excerpt)[0]) + 8
        ids = hf.encode_with_offsets(receiver.tokenizer, hf.render_chat(receiver.tokenizer, messages))[0]
        outputs = {"receiver": hf.generate(receiver.model, ids, max_new_tokens=limit)}
        for name, runner in runners.items():
            fused = runner.fuse(messages)
            outputs[name] = hf.generate(receiver.model, fused.ids, cache=fused.cache, max_new_tokens=limit)
        for name, gen in outputs.items():
            text = receiver.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            results[name].append(mode.repeat_overlap(excerpt, text))
            samples.setdefault(name, text)
    return {name: {"overlap": statistics.mean(v), "per_excerpt": v, "first_output": samples[name]}
            for name, v in results.items()}


if __name__ == "__main__":
    run_main(main)
