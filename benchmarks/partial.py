"""Partial-layer transfer from SmolLM2-135M to its fine-tuned variant: fidelity and speed against k,
and against a choice of recomputed layers (DroidSpeak).

    python -m kvwire.variant                  # once: the variant (LoRA on stdlib source), ~minutes
    python benchmarks/partial.py [--json] [--ks 0,3,...] [--new-tokens 32] [--plot benchmarks/results/partial.png]
    python benchmarks/partial.py --replot benchmarks/results/partial.json --plot benchmarks/results/partial.png

Sender: the base model prefills a context (recording the hidden state entering every
layer, so every plan's packet comes from one prefill). Receiver: the variant. Reference:
the variant's own full recomputation of the context (text mode), its greedy continuation
and its teacher-forced logits on it. For each split k (layers 0..k-1 from the base, k..29
computed by the variant) and each recompute set (the m layers where swapping in the base's
K/V alone hurts most, measured per layer first), the receiver completes the packet
(timed: median of --repeats after a warm-up), generates greedily, and is compared with the
reference: greedy token agreement, first divergence, mean teacher-forced KL. The receiver's
time is reported against a full prefill of the same context, measured side by side.

Contexts: the review snippet bundled with kvwire and source files of the standard library
that the variant was not trained on (held out), each under a short instruction.
The last stdout line is one JSON object.
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

from kvwire.wire import codec
from kvwire.evals import fidelity
from kvwire import hf, models, variant
from kvwire.hf import partial
from kvwire.wire.layers import LayerPlan
from kvwire.plots import partial_curve

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, positive, run_main  # noqa: E402


def contexts(tokenizer: Any, count: int, chars: int) -> list[tuple[str, torch.Tensor]]:
    """(name, ids [1, T]) chat prompts over code the variant did not train on."""
    snippet = (ROOT / "src" / "kvwire" / "data" / "review_snippet.py").read_text()
    sources = [("review_snippet.py", snippet, "List the bugs in this code.")]
    for path in variant.held_out_files()[1: 1 + max(0, count - 1)]:
        sources.append((path.name, path.read_text(encoding="utf-8", errors="replace")[:chars],
                        "Explain what this module does, briefly."))
    out = []
    for name, code, instruction in sources[:count]:
        messages = [{"role": "user", "content": f"{instruction}\n\n```python\n{code}\n```"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append((name, torch.tensor([tokenizer.encode(text, add_special_tokens=False)])))
    return out


def median_seconds(fn: Any, repeats: int) -> tuple[float, Any]:
    result = fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@torch.inference_mode()
def measure_context(base: Any, receiver: Any, spec: Any, ids: torch.Tensor, ks: list[int], sets: dict[str, list[int]],
                    new_tokens: int, repeats: int) -> dict[str, Any]:
    L = spec.num_layers
    head, last = ids[:, :-1], ids[:, -1:]
    reference = hf.generate(receiver, ids, max_new_tokens=new_tokens)
    forced = torch.cat([last, torch.tensor([reference.tokens[:-1]])], dim=1)  # [1, n]: teacher forcing

    def own_prefill() -> Any:
        cache = hf.new_cache(receiver)
        receiver(input_ids=head, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    prefill_s, own = median_seconds(own_prefill, repeats)
    ref_logits = hf.forward_logits(receiver, hf.clone_cache(own, receiver), forced)

    sender_cache = hf.new_cache(base)
    with partial.record(base, range(L)) as recorder:
        base(input_ids=head, past_key_values=sender_cache, use_cache=True, logits_to_keep=1)
    hidden = recorder.hidden()
    sensitivity = partial.layer_sensitivity(receiver, own, sender_cache, forced)

    def run(plan: LayerPlan) -> dict[str, Any]:
        packet = codec.decode(codec.encode(partial.extract(sender_cache, hidden, spec, head, plan)))
        receive_s, cache = median_seconds(lambda: partial.complete(packet, receiver, allow_variant=True), repeats)
        logits = hf.forward_logits(receiver, hf.clone_cache(cache, receiver), forced)
        out = hf.generate(receiver, ids, cache=cache, max_new_tokens=new_tokens)
        fid = fidelity.measure(reference.tokens, out.tokens, ref_logits, logits)
        return {"plan": plan.describe(), "recomputed_layers": len(plan.recomputed), "reused_layers": len(plan.reused),
                "receive_s": receive_s, "time_ratio": receive_s / prefill_s, "packet_bytes": packet.nbytes,
                **fid.to_json()}

    splits = [{"k": k, **run(LayerPlan.prefix(L, k))} for k in ks]
    chosen = [{"set": name, "layers": layers, **run(LayerPlan.recompute(L, layers))} for name, layers in sets.items()]
    return {"tokens": int(head.shape[1]), "prefill_s": prefill_s, "sensitivity": sensitivity, "splits": splits,
            "recompute_sets": chosen}


def summarize(per_context: list[dict[str, Any]], key: str, field: str) -> list[dict[str, Any]]:
    """Mean over contexts of each row (rows matched by position)."""
    rows = []
    for group in zip(*(c[key] for c in per_context)):
        row = {k: v for k, v in group[0].items() if k in (field, "plan", "layers", "recomputed_layers",
                                                             "reused_layers")}
        for name in ("agreement", "kl", "time_ratio", "receive_s", "packet_bytes"):
            row[name] = statistics.fmean(r[name] for r in group)
        firsts = [r["first_divergence"] for r in group]
        row["first_divergence"] = [f if f is not None else "none" for f in firsts]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--variant", default=variant.DEFAULT_NAME)
    parser.add_argument("--ks", default="0,3,6,9,12,15,18,21,24,27,30")
    parser.add_argument("--sets", default="1,2,4,8", help="recompute the m most sensitive layers, for each m")
    parser.add_argument("--contexts", type=int, default=3)
    parser.add_argument("--chars", type=int, default=2400, help="characters of each held-out source file")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--replot", type=Path, default=None, help="only redraw --plot from a saved JSON line")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text().strip().splitlines()[-1])
        partial_curve(saved["splits"], saved["recompute_sets"], saved["sensitivity"], args.plot or Path("partial.png"))
        return

    base, tokenizer = hf.load_model(models.resolve())
    receiver, _ = variant.load(args.variant)
    spec = hf.model_spec(base)
    L = spec.num_layers
    ks = [int(k) for k in args.ks.split(",")]
    prompts = contexts(tokenizer, args.contexts, args.chars)

    # per-layer sensitivity first (on the first context), to choose the recompute sets
    probe = measure_context(base, receiver, spec, prompts[0][1], [], {}, args.new_tokens, 1)
    ranked = sorted(range(L), key=lambda layer: -probe["sensitivity"][layer])
    sets = {f"top-{m}": sorted(ranked[:m]) for m in (int(m) for m in args.sets.split(","))}
    print(f"most sensitive layers (first context): {ranked[:8]}", file=sys.stderr)

    per_context = []
    for name, ids in prompts:
        print(f"context {name}: {ids.shape[1]} tokens", file=sys.stderr)
        per_context.append({"context": name, **measure_context(base, receiver, spec, ids, ks, sets, args.new_tokens,
                                                                args.repeats)})
    sensitivity = [statistics.fmean(c["sensitivity"][layer] for c in per_context) for layer in range(L)]
    splits = summarize(per_context, "splits", "k")
    chosen = summarize(per_context, "recompute_sets", "set")
    for row in splits:
        print(f"k={row['k']:2d}  agreement {100 * row['agreement']:5.1f}%  KL {row['kl']:.4f}  "
              f"receiver time {row['time_ratio']:.2f}x of a prefill", file=sys.stderr)
    for row in chosen:
        print(f"{row['set']:>7} {row['plan']}: agreement {100 * row['agreement']:5.1f}%  KL {row['kl']:.4f}  "
              f"time {row['time_ratio']:.2f}x", file=sys.stderr)
    if args.plot:
        partial_curve(splits, chosen, sensitivity, args.plot)
    result = {"benchmark": "partial", "sender": models.DEFAULT_MODEL, "receiver": f"variant:{args.variant}",
              "layers": L, "new_tokens": args.new_tokens, "contexts": [c["context"] for c in per_context],
              "context_tokens": [c["tokens"] for c in per_context], "sensitivity": sensitivity,
              "sets_chosen_on": prompts[0][0], "splits": splits, "recompute_sets": chosen,
              "per_context": per_context if args.json else None, "machine": machine()}
    print(json.dumps(result))


if __name__ == "__main__":
    run_main(main)
