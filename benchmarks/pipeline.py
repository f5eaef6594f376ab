"""Prefix vs text on the workloads that motivate kvwire, side by side in one process.

    python benchmarks/pipeline.py [--json] [--repeats 3] [--max-new-tokens 32]
                                  [--stores memory:// file:///dev/shm/kvwire-bench]
                                  [--weights fp32|bf16|int8|int4]

Workloads: (a) the two-agent code review of `kvwire demo`, (b) a five-agent document
pipeline over a ~1500-token incident report, (c) five agents over a ~3000-token
support conversation. Each repeat runs both modes (alternating which goes first);
the figures are medians over repeats. The last stdout line is one JSON object:
{"workloads": [{"name", "store", "speedup", "ttft_speedup", "efficiency", "identical", ...}], "machine": {...}}
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from importlib import resources
from pathlib import Path


from kvwire import PipelineSpec, hf, models, open_store
from kvwire.pipeline.linear import Pipeline
from kvwire.wire.spec import WEIGHT_FORMATS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, positive, run_main  # noqa: E402


def workloads() -> list[tuple[str, PipelineSpec]]:
    with resources.as_file(resources.files("kvwire") / "data" / "code_review.toml") as path:
        review = PipelineSpec.from_toml(path)
    return [
        ("a-code-review", review),
        ("b-document-1500", PipelineSpec.from_toml(ROOT / "examples" / "document_pipeline.toml")),
        ("c-support-3000", PipelineSpec.from_toml(ROOT / "examples" / "support_conversation.toml")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--stores", nargs="+", default=["memory://", "file:///dev/shm/kvwire-bench"])
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run (prefix match)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--weights", default="fp32", choices=WEIGHT_FORMATS,
                        help="the model's linear weights (kvwire.hf.weights; default: fp32)")
    args = parser.parse_args()

    model, tokenizer = hf.load_model(models.resolve(args.model), weights=args.weights)
    spec = hf.model_spec(model)
    chosen = [(n, w) for n, w in workloads() if not args.only or any(n.startswith(o) for o in args.only)]

    # burn-in: first forward passes pay for allocation and thread start-up
    Pipeline(model, tokenizer, chosen[0][1].with_max_new_tokens(4), model_spec=spec).compare()

    rows = []
    for url in args.stores:
        for name, workload in chosen:
            workload = workload.with_max_new_tokens(args.max_new_tokens)
            store = open_store(url)
            runs = []
            for repeat in range(args.repeats):
                pipeline = Pipeline(model, tokenizer, workload, store=store, model_spec=spec)
                runs.append(pipeline.compare("prefix", candidate_first=bool(repeat % 2)))
                for key in store.keys():
                    store.delete(key)
            store.close()
            if url.startswith("file:///dev/shm/"):
                shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
            row = summarize(name, url, runs)
            rows.append(row)
            print(f"{name:16} {url:30} speedup {row['speedup']:.2f}x (ideal {row['ideal_speedup']:.2f}x) "
                  f"efficiency {row['efficiency']:.3f} ttft {row['ttft_speedup']:.1f}x "
                  f"text {row['text_s']:.1f}s prefix {row['prefix_s']:.1f}s transfer {row['transfer_s']:.3f}s "
                  f"identical {row['identical']} exact {row['exact']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"workloads": rows, "machine": machine(), "repeats": args.repeats,
                          "max_new_tokens": args.max_new_tokens, "weights": args.weights}))


def summarize(name: str, url: str, runs: list) -> dict:
    def median(values):
        return statistics.median(values)

    last = runs[-1]
    return {
        "name": name,
        "store": url,
        "speedup": median([c.speedup for c in runs]),
        "ttft_speedup": median([c.ttft_speedup for c in runs]),
        "efficiency": median([c.efficiency for c in runs]),
        "ideal_speedup": median([c.ideal_speedup for c in runs]),
        "identical": all(c.identical for c in runs),
        "exact": all(c.exact for c in runs),
        "text_s": median([c.text.total_s for c in runs]),
        "prefix_s": median([c.prefix.total_s for c in runs]),
        "transfer_s": median([sum(a.transfer_s for a in c.prefix.agents) for c in runs]),
        "context_tokens": [a.context_tokens for a in last.prefix.agents],
        "new_tokens": [a.new_tokens for a in last.prefix.agents],
        "per_repeat": [{"speedup": c.speedup, "efficiency": c.efficiency, "ttft_speedup": c.ttft_speedup}
                       for c in runs],
    }


if __name__ == "__main__":
    run_main(main)
