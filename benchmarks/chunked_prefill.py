"""A long prompt joins while others stream: their inter-token latency, with and without chunked prefill.

    python benchmarks/chunked_prefill.py --json [--long 3000] [--streams 4] [--chunks none,96,192,384] [--repeat 2]

The engine ``kvwire serve`` decodes with (:class:`kvwire.hf.Engine`), on the bundled default model:
``--streams`` rows decode from a shared ~500-token context; once each has produced 16 tokens a
``--long``-token prompt (random ids, nothing cached) joins. For each ``--chunks`` setting, in one run:

- the streams' inter-token latency before it joined (steady state: p50) and from its arrival until its
  first token (p50, p99, max): without chunking its whole prefill is one step in which nobody decodes;
- the long prompt's own time to first token, and against the unchunked one;
- that every stream and the long prompt produced the same tokens in every setting (greedy).

Each chunk rides in the streams' decode step (one pass); ``--prefill-chunk`` is the first chunk's
tokens, and later ones shrink as the prompt's context grows (:func:`kvwire.hf.chunk_tokens`). With
``--repeat N`` the settings run N rounds in turn and each figure is the median over the rounds, each
round's time to first token against that round's unchunked one (this machine's speed drifts).

Targets (issue 23): p99 inter-token latency while it joins at most 3x the steady p50; its time to first
token at most 1.3x the unchunked. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, run_main, shared_context  # noqa: E402

from kvwire import hf, models  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def one_run(model, chunk: int | None, args, shared, prefix, suffixes, long_ids) -> dict:
    engine = hf.Engine(model, max_batch=args.streams + 1, prefill_chunk=chunk, reserve_slots=args.reserve_slots)
    streams = [engine.add(hf.Request(shared + s, prefix=prefix, max_new_tokens=args.tokens, eos_ids=frozenset()))
               for s in suffixes]
    stamps: dict[int, list[float]] = {rid: [] for rid in streams}
    long_id, arrived, first, results = None, None, None, {}
    while engine.busy:
        step = engine.step()
        now = time.perf_counter()
        for rid, tokens in step.tokens.items():
            if rid in stamps:
                stamps[rid].extend([now] * len(tokens))
            elif rid == long_id and first is None:
                first = now
        results.update((r.id, r) for r in step.finished)
        if long_id in results:  # it is done: the streams' later tokens measure nothing
            for rid in streams:
                engine.cancel(rid)
        if long_id is None and min(len(s) for s in stamps.values()) >= 16:
            long_id = engine.add(hf.Request(long_ids, max_new_tokens=8, eos_ids=frozenset()))
            arrived = time.perf_counter()
    steady, joining = [], []
    for times in stamps.values():
        for a, b in zip(times, times[1:]):
            (joining if arrived <= b and a <= first else steady if b < arrived else []).append(b - a)
    return {"chunk": chunk, "steady_p50_ms": 1000 * statistics.median(steady),
            "joining_p50_ms": 1000 * statistics.median(joining), "joining_p99_ms": 1000 * quantile(joining, 0.99),
            "joining_max_ms": 1000 * max(joining), "long_ttft_s": first - arrived,
            "tokens": {str(i): results[rid].tokens for i, rid in enumerate(streams)},
            "long_tokens": results[long_id].tokens}


def median_run(repeats: list[dict]) -> dict:
    """One setting over the rounds: each figure's median, tokens the same in every round."""
    out = dict(repeats[0])
    for key, value in repeats[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in repeats)
    out["same_tokens"] = all(r["same_tokens"] for r in repeats)
    out["rounds"] = len(repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=int, default=3000, help="tokens of the prompt that joins")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--context", type=int, default=500, help="tokens of the streams' shared context")
    parser.add_argument("--tokens", type=int, default=400, help="each stream's token limit (enough to outlast it)")
    parser.add_argument("--chunks", default="none,96,192,384")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over the settings (medians reported)")
    parser.add_argument("--reserve-slots", type=int, default=0,
                        help="the engine's buffers allocated at start for this many slots a row (kvwire serve "
                             "--reserve-slots); 0: grown when the long prompt is admitted")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, ...)")
    parser.add_argument("--random-weights", metavar="CONFIG_JSON", type=Path, default=None,
                        help="the architecture in CONFIG_JSON (e.g. the default model's config.json) with random "
                             "weights, for a machine its weights cannot reach: the same work, so the same timings; "
                             "the tokens are a random model's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        chunks = [None if c.strip() == "none" else "auto" if c.strip() == "auto" else int(c)
                  for c in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks takes first-chunk sizes, 'auto' and 'none', comma-separated (e.g. none,auto,96,192), "
                     f"got {args.chunks!r}")
    if any(isinstance(c, int) and c < 1 for c in chunks) or args.repeat < 1 or args.long < 1 or args.streams < 1:
        parser.error("--chunks sizes, --repeat, --long and --streams must be positive")
    if args.reserve_slots < 0:
        parser.error("--reserve-slots must be >= 0")
    if None not in chunks:
        chunks.insert(0, None)  # the unchunked run every ratio is taken against
    if args.random_weights is not None and not args.random_weights.is_file():
        parser.error(f"--random-weights {args.random_weights}: no such file (give a model's config.json)")
    hf.check_device(args.device)
    if args.random_weights is not None:
        from transformers import AutoModelForCausalLM

        from kvwire.hf.loading import read_config

        torch.manual_seed(0)
        config = read_config(args.random_weights)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(args.device)
    else:
        model, _ = hf.load_model(models.resolve(), device=args.device)
    shared, suffixes, _, prefix = shared_context(model, args.context, args.streams)
    settings = list(chunks)  # as given: "auto" is measured once, here, as kvwire serve measures it at start
    if "auto" in chunks:
        auto = hf.auto_prefill_chunk(model)
        chunks = [auto if c == "auto" else c for c in chunks]
    vocab = model.config.get_text_config(decoder=True).vocab_size
    long_ids = torch.randint(3, vocab, (args.long,), generator=torch.Generator().manual_seed(1)).tolist()
    warm = argparse.Namespace(**{**vars(args), "tokens": 24})
    one_run(model, 64, warm, shared, prefix, suffixes, long_ids[:200])  # first passes of each shape
    rounds = []
    for _ in range(max(1, args.repeat)):
        runs = [one_run(model, chunk, args, shared, prefix, suffixes, long_ids) for chunk in chunks]
        whole = next(r for r in runs if r["chunk"] is None)
        for r in runs:
            r["ttft_vs_unchunked"] = r["long_ttft_s"] / whole["long_ttft_s"]
            r["p99_vs_steady_p50"] = r["joining_p99_ms"] / r["steady_p50_ms"]
            r["same_tokens"] = r["long_tokens"] == whole["long_tokens"] and all(  # as far as both streamed
                a[:len(b)] == b[:len(a)] for a, b in zip(r["tokens"].values(), whole["tokens"].values()))
        rounds.append(runs)
    runs = [median_run([round_[i] for round_ in rounds]) for i in range(len(chunks))]
    for r, setting in zip(runs, settings):
        r["setting"] = "none" if setting is None else str(setting)
        label = f"auto={r['chunk']}" if setting == "auto" else str(r["chunk"])
        print(f"chunk {label:>5}: streams steady p50 {r['steady_p50_ms']:.0f} ms; while a {args.long}-token "
              f"prompt joins p50 {r['joining_p50_ms']:.0f} / p99 {r['joining_p99_ms']:.0f} / max "
              f"{r['joining_max_ms']:.0f} ms ({r['p99_vs_steady_p50']:.1f}x steady); its TTFT {r['long_ttft_s']:.2f} s "
              f"({r['ttft_vs_unchunked']:.2f}x unchunked); same tokens {r['same_tokens']}", flush=True)
    if args.json:
        print(json.dumps({"long": args.long, "streams": args.streams, "context": args.context,
                          "reserve_slots": args.reserve_slots, "device": str(args.device),
                          "random_weights": args.random_weights is not None,
                          "runs": [{k: v for k, v in r.items() if k not in ("tokens", "long_tokens")} for r in runs],
                          "machine": machine()}))


if __name__ == "__main__":
    run_main(main)
