"""Prefix vs text on the workloads that motivate kvwire, side by side in one process.

    python benchmarks/pipeline.py [--json] [--repeats 3] [--max-new-tokens 32]
                                  [--stores memory:// file:///dev/shm/kvwire-bench]
                                  [--weights fp32|bf16|int8|int4] [--splice]
                                  [--random-weights benchmarks/configs/llama-2-7b.json --device cuda --dtype bf16]

Workloads: (a) the two-agent code review of `kvwire demo`, (b) a five-agent document
pipeline over a ~1500-token incident report, (c) five agents over a ~3000-token
support conversation; with --splice also (d) the document pipeline with every agent's own
system prompt, splice at R = 0.15 against text (KL beside the times). Each repeat runs both
modes (alternating which goes first, text first for splice, whose KL needs text's logits);
the figures are medians over repeats, with the prefill and decode of every agent, and the
K/V bytes moved between the model's device and the host. The last stdout line is one JSON object:
{"workloads": [{"name", "store", "speedup", "ttft_speedup", "efficiency", "identical", ...}],
 "kv_arithmetic": {...}, "model": {...}, "machine": {...}}
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from importlib import resources
from pathlib import Path


from kvwire import PipelineSpec, hf, open_store
from kvwire.kv.splice import Recompute
from kvwire.pipeline.linear import Pipeline
from kvwire.wire.spec import WEIGHT_FORMATS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import RANDOM_WEIGHTS_HELP, add_model_options, load_model, machine, positive, run_main  # noqa: E402

SPLICE_R = 0.15
SEED_KV = (2048, 1.07e9)  # the seed's arithmetic: Llama-2-7B's fp16 K/V for 2,048 tokens, in bytes


def workloads(splice: bool = False) -> list[tuple[str, PipelineSpec, str]]:
    """``(name, pipeline, mode compared with text)`` of every workload."""
    with resources.as_file(resources.files("kvwire") / "data" / "code_review.toml") as path:
        review = PipelineSpec.from_toml(path)
    chosen = [
        ("a-code-review", review, "prefix"),
        ("b-document-1500", PipelineSpec.from_toml(ROOT / "examples" / "document_pipeline.toml"), "prefix"),
        ("c-support-3000", PipelineSpec.from_toml(ROOT / "examples" / "support_conversation.toml"), "prefix"),
    ]
    if splice:
        chosen.append(("d-document-private-splice",
                       PipelineSpec.from_toml(ROOT / "examples" / "document_private_prompts.toml"), "splice"))
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=RANDOM_WEIGHTS_HELP)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--max-new-tokens", type=positive, default=32)
    parser.add_argument("--stores", nargs="+", default=["memory://", "file:///dev/shm/kvwire-bench"])
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run (prefix match)")
    parser.add_argument("--splice", action="store_true",
                        help=f"also (d): private prompts, splice at R = {SPLICE_R} against text")
    add_model_options(parser)
    parser.add_argument("--weights", default="fp32", choices=WEIGHT_FORMATS,
                        help="the model's linear weights (kvwire.hf.weights; default: fp32)")
    args = parser.parse_args()

    model, tokenizer, what = load_model(args, weights=args.weights)
    spec = hf.model_spec(model)
    chosen = [w for w in workloads(args.splice) if not args.only or any(w[0].startswith(o) for o in args.only)]
    if not chosen:
        parser.error(f"--only {' '.join(args.only)} names no workload of {[w[0] for w in workloads(True)]}")
    recompute = Recompute(fraction=SPLICE_R)

    # burn-in: first forward passes pay for allocation and thread start-up
    Pipeline(model, tokenizer, chosen[0][1].with_max_new_tokens(4), model_spec=spec).compare(chosen[0][2])

    rows, out = [], sys.stderr if args.json else sys.stdout
    for url in args.stores:
        for name, workload, mode in chosen:
            workload = workload.with_max_new_tokens(args.max_new_tokens)
            store = open_store(url)
            runs = []
            for repeat in range(args.repeats):
                pipeline = Pipeline(model, tokenizer, workload, store=store, model_spec=spec, recompute=recompute)
                runs.append(pipeline.compare(mode, candidate_first=bool(repeat % 2) and mode != "splice"))
                for key in store.keys():
                    store.delete(key)
            store.close()
            if url.startswith("file:///dev/shm/"):
                shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
            row = summarize(name, url, runs)
            rows.append(row)
            kl = f" KL {row['kl']:.2e}" if row["kl"] is not None else ""
            print(f"{name:16} {url:30} {mode} speedup {row['speedup']:.2f}x (ideal {row['ideal_speedup']:.2f}x) "
                  f"efficiency {row['efficiency']:.3f} ttft {row['ttft_speedup']:.1f}x "
                  f"text {row['text_s']:.1f}s {mode} {row['prefix_s']:.1f}s transfer {row['transfer_s']:.3f}s "
                  f"device<->host {row['device_copy_bytes'] / 1e6:.1f} MB "
                  f"identical {row['identical']} exact {row['exact']}{kl}", file=out)
    arithmetic = kv_arithmetic(spec)
    print(f"K/V of {arithmetic['tokens']} tokens in {arithmetic['dtype']}: {arithmetic['bytes'] / 1e9:.3f} GB; "
          f"a packet of them {arithmetic['packet_bytes'] / 1e9:.3f} GB (the seed's arithmetic for Llama-2-7B in fp16: "
          f"{SEED_KV[1] / 1e9:.2f} GB)", file=out)
    if args.json:
        print(json.dumps({"workloads": rows, "kv_arithmetic": arithmetic, "model": what, "machine": machine(),
                          "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "weights": args.weights}))


def kv_arithmetic(spec) -> dict:
    """The K/V bytes of the seed's 2,048 tokens in this model's cache dtype, computed from the spec and counted in
    a real packet of that many tokens (encoded: the bytes a store would hold)."""
    import torch

    from kvwire.wire import codec
    from kvwire.wire.packet import Packet

    tokens = SEED_KV[0]
    shape = [(1, spec.num_kv_heads, spec.kept_tokens(layer, tokens), spec.head_dim) for layer in range(spec.num_layers)]
    packet = Packet(spec=spec, keys=tuple(torch.zeros(s, dtype=spec.torch_dtype) for s in shape),
                    values=tuple(torch.zeros(s, dtype=spec.torch_dtype) for s in shape),
                    token_ids=torch.zeros(1, tokens, dtype=torch.int64), mask=torch.ones(1, tokens, dtype=torch.uint8),
                    producer="benchmarks/pipeline.py")
    return {"tokens": tokens, "dtype": spec.dtype, "bytes": spec.kv_bytes(tokens),
            "packet_bytes": len(codec.encode(packet)), "seed_bytes": SEED_KV[1]}


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
        "device_copy_bytes": median([sum(a.device_copy_bytes for a in c.prefix.agents) for c in runs]),
        "kl": median([c.kl for c in runs]) if all(c.kl is not None for c in runs) else None,
        "agents": [{"agent": t.agent, "text_prefill_s": median([c.text.agents[i].prefill_s for c in runs]),
                    "prefill_s": median([c.prefix.agents[i].prefill_s for c in runs]),
                    "text_decode_s": median([c.text.agents[i].decode_s for c in runs]),
                    "decode_s": median([c.prefix.agents[i].decode_s for c in runs])}
                   for i, t in enumerate(last.text.agents)],
        "context_tokens": [a.context_tokens for a in last.prefix.agents],
        "new_tokens": [a.new_tokens for a in last.prefix.agents],
        "per_repeat": [{"speedup": c.speedup, "efficiency": c.efficiency, "ttft_speedup": c.ttft_speedup}
                       for c in runs],
    }


if __name__ == "__main__":
    run_main(main)
