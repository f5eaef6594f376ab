"""RoPE re-rotation error per variant: keys moved p -> q against keys the model computes at q.

    python benchmarks/rope.py [--json]

For each RoPE variant (tiny random Llama-style models configured with it, plus the
real default model, a GPT-NeoX with partial rotary, a Gemma3 with per-layer-type
bases, and the interleaved families Cohere, GLM and GPT-J), take the tables
``hf.rope_tables`` measured on the model (convention and probe error), run 24 tokens
at positions p.. and q.., move the cached keys of every layer from p to q with
kvwire.wire.rope, and report the worst relative error (Frobenius norm)
at layer 0 (keys depend only on token and position: the rotation alone) and over all
layers (attention is translation invariant), plus the round-trip error p -> q -> p.
Target: below 1e-4 at fp32. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvwire import hf, models
from kvwire.wire import rope

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support: tiny models and the RoPE families
sys.path.insert(0, str(ROOT / "benchmarks"))
from tests.support import rope_families  # noqa: E402
from tests.support import tiny  # noqa: E402
from common import machine, run_main  # noqa: E402
from tests.wire.test_rope import VARIANTS, keys_at, llama, rel  # noqa: E402


def errors(model, p: int, q: int, n: int = 24) -> dict:
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(0))
    tables = hf.rope_tables(model)
    at_p, at_q = keys_at(model, ids, p), keys_at(model, ids, q)
    src, dst = torch.arange(p, p + n), torch.arange(q, q + n)
    worst, layer0, trip = 0.0, 0.0, 0.0
    for layer, (kp, kq) in enumerate(zip(at_p, at_q)):
        kept = kp.shape[2]
        moved = rope.rotate(kp, tables[layer], src[-kept:], dst[-kept:])
        error = rel(moved, kq)
        worst = max(worst, error)
        if layer == 0:
            layer0 = error
            trip = rel(rope.rotate(moved, tables[0], dst[-kept:], src[-kept:]), kp)
    return {"rope_type": tables[0].rope_type, "convention": tables[0].convention,
            "probe_error": max(t.probe_error for t in tables), "p": p, "q": q, "layer0": layer0,
            "all_layers": worst, "round_trip": trip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, parameters in VARIANTS.items():
        q = 150 if name == "longrope" else 900
        rows.append({"model": f"tiny llama, {name}", **errors(llama(parameters), 100, q)})
    tok = tiny.tokenizer()
    for arch in ("qwen2", "neox", "gemma3"):
        rows.append({"model": f"tiny {arch}", **errors(tiny.model(arch, len(tok), tok.eos_token_id), 100, 900)})
    for name in ("cohere", "glm", "gptj"):  # interleaved pairs; tiny configs allow 512 positions
        rows.append({"model": f"tiny {name}", **errors(rope_families.build(name), 100, 480)})
    model, _ = hf.load_model(models.resolve())
    rows.append({"model": "SmolLM2-135M-Instruct", **errors(model, 37, 3000)})
    for row in rows:
        print(f"{row['model']:28} {row['rope_type']:8} {row['convention']:11} {row['p']:4} -> {row['q']:4}  "
              f"layer0 {row['layer0']:.1e}  all layers {row['all_layers']:.1e}  round trip {row['round_trip']:.1e}",
              file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"rows": rows, "target": 1e-4, "machine": machine()}))


if __name__ == "__main__":
    run_main(main)
