"""The products kvwire.hf.linears picks from, side by side on the default model: F.linear, thin, oneDNN.

    python benchmarks/linears.py [--json] [--repeats 7]

- ``linears``: the 210 decoder linears of one pass of M rows, and the output layer, each
  product (median ms); the weights (425 MB and 113 MB) do not fit in cache, so every pass
  reads them from memory, as a decode step does.
- ``policies``: per available policy (``off`` = F.linear throughout, ``mkl``, ``onednn``), whole
  engine decode steps of 1, 4 and 8 rows sharing a 1,700-token context (median ms a step),
  ``hf.generate`` on one row (its 1,700-token prefill, s, and decode tokens/s), outputs
  compared with ``off``'s. Policies alternate within each repeat, so all see the same host.

The last stdout line is one JSON object; ``auto`` says which policy this machine gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvwire import hf, models
from kvwire.hf import linears as lin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, median_time, positive, run_main, shared_context  # noqa: E402

CONTEXT, NEW = 1700, 32


def products() -> dict:
    ways = {"f_linear": lambda w, x: F.linear(x, w),
            "thin": lambda w, x: torch.mm(w, (x if x.shape[0] > 1 else torch.cat([x, x])).T)}
    if lin._has_onednn():
        ways["onednn"] = lambda w, x: lin._onednn(x, w, None)
    return ways


def linear_table(model, rows_list, repeats) -> list[dict]:
    layers = [m for layer in hf.decoder_layers(model) for m in layer.modules() if type(m) is torch.nn.Linear]
    head = model.get_output_embeddings()
    out = []
    with torch.inference_mode():
        for rows in rows_list:
            xs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}
            x = torch.randn(rows, head.in_features)
            row: dict = {"rows": rows}
            for name, way in products().items():
                row[f"layers_{name}_ms"] = 1e3 * median_time(lambda: [way(m.weight, xs[m.in_features]) for m in layers],
                                                             repeats)
                row[f"head_{name}_ms"] = 1e3 * median_time(lambda: way(head.weight, x), repeats)
            names = list(products())
            print(f"M={rows:4d}  decoder linears " + " / ".join(f"{row[f'layers_{n}_ms']:6.1f}" for n in names) +
                  "   output layer " + " / ".join(f"{row[f'head_{n}_ms']:5.1f}" for n in names)
                  + f" ms ({', '.join(names)})",
                  file=sys.stderr, flush=True)
            out.append(row)
    return out


def policy_table(model, rows_list, repeats) -> dict:
    names = ["off"] + (["mkl"] if lin._has_mkl() else []) + (["onednn"] if lin._has_onednn() else [])
    shared, suffixes, _, prefix = shared_context(model, CONTEXT, max(rows_list))

    def steps(rows):
        engine = hf.Engine(model, max_batch=max(rows_list))
        results = engine.run([hf.Request(shared + s, prefix=prefix, max_new_tokens=NEW, eos_ids=frozenset())
                              for s in suffixes[:rows]])
        return [r.tokens for r in results], 1e3 * engine.stats.decode_s / engine.stats.decode_steps

    samples: dict = {n: {"steps": {r: [] for r in rows_list}, "prefill_s": [], "decode_tps": []} for n in names}
    tokens: dict = {n: {} for n in names}
    for _ in range(repeats):
        for name in names:
            with lin.using(name):
                for rows in rows_list:
                    tokens[name][rows], ms = steps(rows)
                    samples[name]["steps"][rows].append(ms)
                out = hf.generate(model, shared, max_new_tokens=NEW, eos_ids=frozenset())
                tokens[name]["generate"] = out.tokens
                samples[name]["prefill_s"].append(out.prefill_s)
                samples[name]["decode_tps"].append((NEW - 1) / out.decode_s)
    table = {}
    for name in names:
        s = samples[name]
        table[name] = {"ms_per_step": {str(r): statistics.median(v) for r, v in s["steps"].items()},
                       "prefill_s": statistics.median(s["prefill_s"]),
                       "decode_tokens_per_s": statistics.median(s["decode_tps"]),
                       "identical_to_off": tokens[name] == tokens["off"]}
        t = table[name]
        print(f"{name:7s} steps " + "  ".join(f"{r} rows {t['ms_per_step'][str(r)]:5.1f} ms" for r in rows_list) +
              f"   generate: prefill {t['prefill_s']:.2f} s, decode {t['decode_tokens_per_s']:.1f} tok/s"
              f"   identical to off: {t['identical_to_off']}", file=sys.stderr, flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=positive, default=7)
    args = parser.parse_args()
    model, _ = hf.load_model(models.resolve())
    start = time.perf_counter()
    payload = {"auto": lin._auto().name,
               "linears": linear_table(model, (1, 2, 4, 5, 8, 16, 32, 64, 128), args.repeats),
               "policies": policy_table(model, (1, 4, 8), max(1, args.repeats // 2)),
               "seconds": None, "machine": None}
    payload["seconds"] = time.perf_counter() - start
    payload["machine"] = machine()
    print(json.dumps(payload) if args.json else json.dumps(payload, indent=1))


if __name__ == "__main__":
    run_main(main)
