"""Splice mode on the real default model: speed and fidelity against text, per recompute setting.

    python benchmarks/splice.py [--json] [--repeats 2] [--plot splice.png] [--pipeline examples/....toml]

Default workload: five agents with private system prompts over a ~1500-token incident
report (examples/document_private_prompts.toml), 32 new tokens each; ``--pipeline`` runs
another (examples/stdlib_private_prompts.toml: three agents over Python's bisect.py;
examples/license_private_prompts.toml: three over the Apache License). For every repeat
one text run is the reference; splice runs are measured against it for R in {0, 0.05,
0.15, 0.3, 1} with each selection criterion (the default "attention+start", "attention+deviation" and
CacheBlend's "kv-deviation"; at R = 0 and R = 1 nothing is selected, so one run serves
both) and with the first k tokens of each segment recomputed (EPIC): end-to-end and TTFT
speedup (agents 2..N), the selection's own time as a share of text mode's prefill, greedy
token agreement and teacher-forced next-token KL, against text and against an exact
recomputation of the same ids. Speed figures are medians over repeats (fidelity is
deterministic). The last stdout line is one JSON object {"rows": [...], "summary": {...},
"machine": {...}}; summary.kl_drop_at_0.15 is exact KL at R = 0 over exact KL at R = 0.15
per criterion (the knob's target: >= 4), summary.selection_share_of_prefill each
criterion's selection time over the last agent's splice as a share of a full prefill of
its context (medians of 3, back to back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kvwire import PipelineSpec, hf, models
from kvwire.kv import splice
from kvwire.pipeline.linear import Pipeline
from kvwire.plots import splice_curve
from kvwire.kv.splice import Recompute

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, median_time, positive, run_main, splice_inputs  # noqa: E402

FRACTIONS = (0.05, 0.15, 0.3)
CRITERIA = ("attention+start", "attention+deviation", "kv-deviation")
FIRST_K = (8, 32)


def settings() -> list[tuple[str, str, Recompute]]:
    """(strategy, label, recompute): the shared ends R = 0 and R = 1, each criterion in between, EPIC."""
    rows = [("both", "R=0", Recompute(0.0))]
    rows += [(c, f"R={f:g} {c}", Recompute(f, select=c)) for c in CRITERIA for f in FRACTIONS]  # type: ignore[arg-type]
    rows += [("both", "R=1", Recompute(1.0))]
    return rows + [("first-k", f"first={k}", Recompute(first=k)) for k in FIRST_K]


def selection_cost(model, tokenizer, spec, workload, repeats: int = 3) -> dict[str, float]:
    """Each criterion's selection time over the last agent's splice as a share of a full prefill
    of the same context (medians, measured back to back in this process)."""
    context, segments = splice_inputs(model, tokenizer, spec, workload)
    tables = hf.rope_tables(model)
    ids = torch.tensor([context])

    def prefill() -> None:
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=hf.new_cache(model), use_cache=True, logits_to_keep=1)

    full = median_time(prefill, repeats)
    shares = {}
    for criterion in CRITERIA:
        times = [splice.assemble(model, spec, tables, context, segments,
                                 recompute=Recompute(0.15, select=criterion)).timings["select_s"]
                 for _ in range(repeats + 1)][1:]
        shares[criterion] = statistics.median(times) / full
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=positive, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the pipeline file's")
    parser.add_argument("--plot", type=Path, default=None, help="write the speed/fidelity curve to this PNG")
    parser.add_argument("--pipeline", type=Path, default=ROOT / "examples" / "document_private_prompts.toml")
    args = parser.parse_args()
    log = sys.stderr if args.json else sys.stdout

    model, tokenizer = hf.load_model(models.resolve())
    spec = hf.model_spec(model)
    workload = PipelineSpec.from_toml(args.pipeline)
    if args.max_new_tokens:
        workload = workload.with_max_new_tokens(args.max_new_tokens)
    table = settings()

    Pipeline(model, tokenizer, workload.with_max_new_tokens(2), model_spec=spec,
             recompute=Recompute(0.15), splice_when="always").run("splice")  # burn-in (the attention probe included)
    samples: dict[str, list[dict]] = {label: [] for _, label, _ in table}
    for repeat in range(args.repeats):
        text = Pipeline(model, tokenizer, workload, model_spec=spec).run("text", keep_logits=True)
        text_later = text.agents[1:]
        text_prefill = sum(a.prefill_s for a in text_later)
        for _, label, recompute in table:
            run = Pipeline(model, tokenizer, workload, model_spec=spec, recompute=recompute,
                           splice_when="always").run(
                "splice", reference=text)
            later = run.agents[1:]
            spliced = sum(a.cached_tokens + a.recomputed_tokens for a in later)
            samples[label].append({
                "speedup": text.total_s / run.total_s,
                "ttft_speedup": sum(a.ttft_s for a in text_later) / sum(a.ttft_s for a in later),
                "ttft_s": sum(a.ttft_s for a in later),
                "text_ttft_s": sum(a.ttft_s for a in text_later),
                "select_share": sum(a.select_s for a in later) / text_prefill,  # selection vs a full prefill
                "agreement": statistics.mean(a.fidelity.agreement for a in later),
                "kl": statistics.mean(a.fidelity.kl for a in later if a.fidelity.kl is not None),
                "exact_agreement": statistics.mean(a.exact_fidelity.agreement for a in later),
                "exact_kl": statistics.mean(a.exact_fidelity.kl for a in later),
                "recomputed_share": sum(a.recomputed_tokens for a in later) / spliced if spliced else 0.0,
                "agents": [a.fidelity.to_json() for a in later],
                "agents_exact": [a.exact_fidelity.to_json() for a in later],
            })
            row = samples[label][-1]
            print(f"repeat {repeat} {label:26} speedup {row['speedup']:.2f}x ttft {row['ttft_speedup']:.2f}x "
                  f"(selection {row['select_share']:.1%} of a prefill) agreement {row['agreement']:.0%} "
                  f"kl {row['kl']:.2e} (vs exact: {row['exact_agreement']:.0%}, kl {row['exact_kl']:.2e}) "
                  f"recomputed {row['recomputed_share']:.1%}", file=log, flush=True)

    rows = []
    for strategy, label, recompute in table:
        runs = samples[label]
        rows.append({
            "strategy": strategy, "setting": label, "fraction": recompute.fraction, "first": recompute.first,
            "select": recompute.select if strategy != "first-k" else None,
            **{key: statistics.median(r[key] for r in runs)
               for key in ("speedup", "ttft_speedup", "ttft_s", "text_ttft_s", "select_share", "agreement", "kl",
                           "exact_agreement", "exact_kl", "recomputed_share")},
            "per_repeat": runs,
        })
    by_label = {r["setting"]: r for r in rows}
    summary = {
        "kl_drop_at_0.15": {c: by_label["R=0"]["exact_kl"] / max(by_label[f"R=0.15 {c}"]["exact_kl"], 1e-30)
                            for c in CRITERIA},
        "kl_drop_at_0.3": {c: by_label["R=0"]["exact_kl"] / max(by_label[f"R=0.3 {c}"]["exact_kl"], 1e-30)
                           for c in CRITERIA},
        "smallest_R_with_90pct_exact_agreement": {
            c: min((r["fraction"] for r in rows if r["strategy"] in (c, "both") and r["exact_agreement"] >= 0.9),
                   default=None) for c in CRITERIA},
    }
    summary["selection_share_of_prefill"] = selection_cost(model, tokenizer, spec, workload)
    print("exact KL R=0 / R=0.15: " + ", ".join(f"{c} {v:.1f}x" for c, v in summary["kl_drop_at_0.15"].items())
          + "; selection time / prefill: " + ", ".join(f"{c} {v:.1%}" for c, v in
                                                        summary["selection_share_of_prefill"].items()), file=log)
    title = f"splice on {workload.name}, SmolLM2-135M"
    if args.plot:
        splice_curve(rows, args.plot, title=title)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary, "machine": machine(), "repeats": args.repeats,
                          "pipeline": str(args.pipeline.relative_to(ROOT)) if args.pipeline.is_relative_to(ROOT)
                          else str(args.pipeline), "title": title}))


if __name__ == "__main__":
    run_main(main)
