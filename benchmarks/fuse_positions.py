"""Does the sharer's cache at the end of a question carry its answer? The ridge, fused only there.

    python benchmarks/fuse_positions.py [--ridge CKPT] [--items 150] [--variants 0:0.3:0,3:0.5:0,8:1:0] [--json]

A probe for issue 21, with no training: the closed-form ridge projector (``kvwire fit-ridge``)
fused into the receiver's cache only at the context's last ``K`` tokens (the end of the question
and the chat template's assistant header, where a model's next-token features live) and only in
receiver layers from ``L`` on, at weight ``W``: elsewhere the receiver keeps its own cache
bit for bit. Each variant ``K:W:L`` (``K`` 0: every position) is scored on the bundled questions
as ``benchmarks/fuse.py`` scores them (each option's mean log-likelihood after the question),
next to the same variant fed another question's sharer cache (the other-context control), the
receiver alone and the sharer alone. What tells reading from adapting: of the items only the
sharer answers right, how many the fused receiver gets right, matched against the control.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvwire import hf, models
from kvwire.evals import accuracy, load, paired_difference
from kvwire.fuse import mode, registry, ridge
from kvwire.fuse.train import Party
from kvwire.hf import scoring
from kvwire.store import open_store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, run_main  # noqa: E402

SHARER = "qwen2.5-coder-0.5b"
METHOD = "loglik_mean"


class AtTheEnd:
    """A projector that fuses like ``inner`` at full weight, then keeps the receiver's own K/V everywhere
    but the last ``last`` context tokens (0: all) of layers ``first_layer`` on, mixed in at ``weight``."""

    def __init__(self, inner: ridge.RidgeProjector, last: int, weight: float, first_layer: int) -> None:
        if inner.weight != 1.0:
            raise ValueError("AtTheEnd mixes the projection in itself: give it the projector at weight 1")
        self.inner, self.last, self.weight, self.first_layer = inner, last, weight, first_layer

    def __call__(self, own_keys: Any, own_values: Any, sharer: Any, positions: torch.Tensor,
                 rope: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        fused_keys, fused_values = self.inner(own_keys, own_values, sharer, positions, rope)
        keys, values = list(own_keys), list(own_values)
        start = 0 if self.last == 0 else max(0, own_keys[0].shape[2] - self.last)
        for t in range(self.first_layer, len(keys)):
            for out, own, fused in ((keys, own_keys, fused_keys), (values, own_values, fused_values)):
                mixed = own[t].clone()
                mixed[:, :, start:] += self.weight * (fused[t][:, :, start:] - own[t][:, :, start:])
                out[t] = mixed
        return keys, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ridge", type=Path, default=None, help="ridge checkpoint (default: found for the pair)")
    parser.add_argument("--items", type=int, default=150, help="questions (the first N of fuse.py's shuffle)")
    parser.add_argument("--variants", default="0:0.3:0,3:0.5:0,8:1:0,16:1:0,8:0.5:18",
                        help="comma-separated LAST:WEIGHT:FIRST_LAYER (LAST 0: every position)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    log = sys.stderr if args.json else sys.stdout
    try:
        variants = [(int(k), float(w), int(first)) for k, w, first in
                    (v.split(":") for v in args.variants.split(",") if v.strip())]
    except ValueError:
        parser.error(f"--variants takes LAST:WEIGHT:FIRST_LAYER triples, got {args.variants!r}")
    if not variants or any(k < 0 or not 0 <= w <= 1 or first < 0 for k, w, first in variants):
        parser.error("each variant needs LAST >= 0, 0 <= WEIGHT <= 1 and FIRST_LAYER >= 0")

    receiver, sharer = _party(models.DEFAULT_MODEL), _party(SHARER)
    path = args.ridge or next((p for p in registry.find(registry.fusers_dir(), sharer.spec, receiver.spec)
                               if p.name.startswith("ridge")), None)
    if path is None:
        parser.error(f"no ridge checkpoint for the pair: run kvwire fit-ridge --sharer {SHARER}, or pass --ridge")
    base, config = ridge.load(path, receiver.spec, sharer.spec, weight=1.0)  # AtTheEnd applies each weight
    names = [f"last{k}@{w:g}/L{first}" for k, w, first in variants]
    store = open_store("memory://")  # one store: the sharer publishes once, every variant receives it
    runners = {name: mode.FuseRunner(receiver, sharer, AtTheEnd(base, *v), config, store=store)
               for name, v in zip(names, variants)}

    questions = load()
    order = torch.randperm(len(questions), generator=torch.Generator().manual_seed(args.seed)).tolist()
    questions = [questions[i] for i in order[: args.items]]
    records: dict[str, list[bool]] = {"receiver": [], "sharer": [], **{n: [] for n in names},
                                      **{f"{n}:other": [] for n in names}}
    start = time.perf_counter()
    for i, question in enumerate(questions):
        other = questions[(i + len(questions) // 2) % len(questions)]  # as benchmarks/fuse.py's control
        messages = [{"role": "user", "content": question.text(with_options=False)}]
        theirs = [{"role": "user", "content": other.text(with_options=False)}]
        prompt = scoring.build_prompt(receiver.tokenizer, question, METHOD)
        records["receiver"].append(scoring.score(receiver.model, receiver.tokenizer, question, METHOD).correct)
        records["sharer"].append(scoring.score(sharer.model, sharer.tokenizer, question, METHOD).correct)
        packet_id = next(iter(runners.values())).share(messages)[0]  # the sharer reads the question once
        for name, runner in runners.items():
            for key, fused in ((name, runner.fused_cache(messages, packet_id)),
                               (f"{name}:other", runner.fuse_other(messages, theirs))):
                result = scoring.score(receiver.model, receiver.tokenizer, question, METHOD, cache=fused.cache,
                                       prompt=prompt)
                records[key].append(result.correct)
        print(f"[{i + 1}/{len(questions)}] {time.perf_counter() - start:.0f} s: "
              + ", ".join(f"{k} {sum(v)}" for k, v in records.items()), file=log)

    only_sharer = [s and not r for r, s in zip(records["receiver"], records["sharer"])]
    only_receiver = [r and not s for r, s in zip(records["receiver"], records["sharer"])]
    summary = {}
    for key, outcomes in records.items():
        diff, low, high = paired_difference(outcomes, records["receiver"])
        summary[key] = {**accuracy(outcomes).to_json(), "minus_receiver_points": [100 * diff, 100 * low, 100 * high],
                        "right_where_only_sharer_right": sum(o for o, m in zip(outcomes, only_sharer) if m),
                        "right_where_only_receiver_right": sum(o for o, m in zip(outcomes, only_receiver) if m)}
        row = summary[key]
        print(f"{key:18} {100 * row['accuracy']:5.1f} %  minus receiver {100 * diff:+.1f} [{100 * low:+.1f}, "
              f"{100 * high:+.1f}]  right where only the sharer is: {row['right_where_only_sharer_right']}/"
              f"{sum(only_sharer)}, where only the receiver is: {row['right_where_only_receiver_right']}/"
              f"{sum(only_receiver)}", file=log)
    print(json.dumps({"items": len(questions), "method": METHOD, "ridge": str(path), "variants": names,
                      "paths": summary, "records": records, "machine": machine()}))


def _party(name: str) -> Party:
    model, tokenizer = hf.load_model(models.resolve(name))
    return Party(model, tokenizer, hf.model_spec(model), name)


if __name__ == "__main__":
    run_main(main)
