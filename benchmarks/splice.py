"""Splice mode on the real default model: speed and fidelity against text, per recompute setting.

    python benchmarks/splice.py [--json] [--repeats 2] [--plot BENCHMARKS-splice.png]

Workload: five agents with private system prompts over a ~1500-token incident report
(examples/document_private_prompts.toml), 32 new tokens each. For every repeat one
text run is the reference; splice runs with R in {0, 0.05, 0.15, 0.3, 1.0} (CacheBlend-
style selection at layer 1) and with the first k tokens of each segment recomputed
(EPIC-style) are measured against it: end-to-end and TTFT speedup (agents 2..5),
greedy token agreement and teacher-forced next-token KL. Figures are medians over
repeats. The last stdout line is one JSON object {"rows": [...], "machine": {...}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvwire import PipelineSpec, hf, models
from kvwire.pipeline import Pipeline
from kvwire.plots import splice_curve
from kvwire.splice import Recompute

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402

FRACTIONS = (0.0, 0.05, 0.15, 0.3, 1.0)
FIRST_K = (8, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--plot", type=Path, default=None, help="write the speed/fidelity curve to this PNG")
    parser.add_argument("--pipeline", type=Path, default=ROOT / "examples" / "document_private_prompts.toml")
    args = parser.parse_args()

    model, tokenizer = hf.load_model(models.resolve())
    spec = hf.model_spec(model)
    workload = PipelineSpec.from_toml(args.pipeline).with_max_new_tokens(args.max_new_tokens)
    settings = [("R", f"R={f:g}", Recompute(fraction=f)) for f in FRACTIONS]
    settings += [("first-k", f"first={k}", Recompute(first=k)) for k in FIRST_K]

    Pipeline(model, tokenizer, workload.with_max_new_tokens(2), model_spec=spec).run("splice")  # burn-in
    samples: dict[str, list[dict]] = {label: [] for _, label, _ in settings}
    for repeat in range(args.repeats):
        text = Pipeline(model, tokenizer, workload, model_spec=spec).run("text", keep_logits=True)
        for _, label, recompute in settings:
            run = Pipeline(model, tokenizer, workload, model_spec=spec, recompute=recompute).run(
                "splice", reference=text)
            later, text_later = run.agents[1:], text.agents[1:]
            spliced = sum(a.cached_tokens + a.recomputed_tokens for a in later)
            samples[label].append({
                "speedup": text.total_s / run.total_s,
                "ttft_speedup": sum(a.ttft_s for a in text_later) / sum(a.ttft_s for a in later),
                "agreement": statistics.mean(a.fidelity.agreement for a in later),
                "kl": statistics.mean(a.fidelity.kl for a in later if a.fidelity.kl is not None),
                "exact_agreement": statistics.mean(a.exact_fidelity.agreement for a in later),
                "exact_kl": statistics.mean(a.exact_fidelity.kl for a in later),
                "recomputed_share": sum(a.recomputed_tokens for a in later) / spliced if spliced else 0.0,
                "agents": [a.fidelity.to_json() for a in later],
                "agents_exact": [a.exact_fidelity.to_json() for a in later],
            })
            row = samples[label][-1]
            print(f"repeat {repeat} {label:9} speedup {row['speedup']:.2f}x ttft {row['ttft_speedup']:.2f}x "
                  f"agreement {row['agreement']:.0%} kl {row['kl']:.4f} (vs exact: {row['exact_agreement']:.0%}, "
                  f"kl {row['exact_kl']:.5f}) recomputed {row['recomputed_share']:.1%}",
                  file=sys.stderr if args.json else sys.stdout)

    rows = []
    for strategy, label, recompute in settings:
        runs = samples[label]
        rows.append({
            "strategy": strategy, "setting": label, "fraction": recompute.fraction, "first": recompute.first,
            **{key: statistics.median(r[key] for r in runs)
               for key in ("speedup", "ttft_speedup", "agreement", "kl", "exact_agreement", "exact_kl",
                           "recomputed_share")},
            "per_repeat": runs,
        })
    good = [r for r in rows if r["strategy"] == "R" and r["agreement"] >= 0.9]
    good_exact = [r for r in rows if r["strategy"] == "R" and r["exact_agreement"] >= 0.9]
    summary = {"smallest_R_with_90pct_agreement": min((r["fraction"] for r in good), default=None),
               "smallest_R_with_90pct_exact_agreement": min((r["fraction"] for r in good_exact), default=None)}
    if args.plot:
        splice_curve(rows, args.plot, title=f"splice on {workload.name}, SmolLM2-135M")
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary, "machine": machine(), "repeats": args.repeats,
                          "title": f"splice on {workload.name}, SmolLM2-135M"}))


if __name__ == "__main__":
    main()
