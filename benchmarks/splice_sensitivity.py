"""Where splice's error comes from: how much each stale slot, per layer, moves the receiver.

    python benchmarks/splice_sensitivity.py [--pipeline examples/stdlib_private_prompts.toml]
                                            [--agent -1] [--group 32] [--json]

Runs the pipeline in splice mode (R = 0) and takes one receiver's context (default: the
last agent's) and the segments it spliced. Its reference is an exact prefill of the same
ids and a greedy continuation from it. Each measurement starts from the exact cache and
puts the *spliced* (stale) K/V back into some slots at some layers only, then measures the
teacher-forced KL of the receiver's continuation against the reference (ground truth, one
forward pass of the receiver's turn and continuation each):

- per layer: every spliced slot stale at that one layer;
- per group of ``--group`` consecutive slots: stale at every layer; next to it what each
  selection criterion sees of the group: layer-1 K/V deviation (CacheBlend), the
  deviation averaged over all layers (what only a full prefill can tell), and the
  attention probe's reading score (the default criterion's other half);
- coverage: the share of the summed group KL that the 15 % of slots each criterion
  would choose fall in (the slots' groups, weighted by the slots chosen).

The last stdout line is one JSON object. Takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvwire import PipelineSpec, hf, models
from kvwire.kv import splice
from kvwire.evals.fidelity import mean_kl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, run_main, splice_inputs  # noqa: E402


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", type=Path, default=ROOT / "examples" / "stdlib_private_prompts.toml")
    parser.add_argument("--agent", type=int, default=-1, help="which receiver (index among agents 2..N)")
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    log = sys.stderr if args.json else sys.stdout

    model, tokenizer = hf.load_model(models.resolve())
    spec = hf.model_spec(model)
    tables = hf.rope_tables(model)
    workload = PipelineSpec.from_toml(args.pipeline)
    context, segments = splice_inputs(model, tokenizer, spec, workload, args.agent)
    new_tokens = workload.new_tokens(len(workload.agents) - 1 if args.agent == -1 else args.agent + 1)

    stale = splice.assemble(model, spec, tables, context, segments)  # R = 0: only the gaps recomputed
    end, positions = stale.length, stale.positions
    slots = [s for seg in segments for s in range(seg.offset, seg.offset + seg.packet.length)]
    exact = hf.new_cache(model)
    model(input_ids=torch.tensor([context[:end]]), past_key_values=exact, use_cache=True, logits_to_keep=1)
    reference = hf.generate(model, context, max_new_tokens=new_tokens, eos_ids=frozenset()).tokens
    forced = context[end:] + reference[:-1]

    def logits(cache):
        return hf.forward_logits(model, hf.clone_cache(cache, model), forced)[-len(reference):]

    reference_logits = logits(exact)

    def kl_with_stale(mask):  # mask [L, end]: where the spliced K/V replace the exact ones
        mixed = hf.clone_cache(exact, model)
        for layer, (mine, theirs) in enumerate(zip(mixed.layers, stale.cache.layers)):
            mine.keys[:, :, mask[layer]] = theirs.keys[:, :, mask[layer]]
            mine.values[:, :, mask[layer]] = theirs.values[:, :, mask[layer]]
        return mean_kl(reference_logits, logits(mixed))

    L = len(exact.layers)
    every = torch.zeros(L, end, dtype=torch.bool)
    every[:, slots] = True
    total = {"R=0 as spliced": mean_kl(reference_logits, logits(stale.cache)), "every slot stale": kl_with_stale(every)}
    print(f"{len(slots)} spliced slots of {end}; KL {total}", file=log, flush=True)

    deviation = torch.stack([(a.keys - b.keys).pow(2).sum((0, 1, 3)) / a.keys.pow(2).mean()
                             + (a.values - b.values).pow(2).sum((0, 1, 3)) / a.values.pow(2).mean()
                             for a, b in zip(exact.layers, stale.cache.layers)]) / exact.layers[0].keys.shape[1]
    reads = hf.attention_to_cache(model, stale.cache, torch.tensor([context[end:]]), positions[:end],
                                  positions[end:]).sum(dim=0)

    per_layer = []
    for layer in range(L):
        mask = torch.zeros(L, end, dtype=torch.bool)
        mask[layer, slots] = True
        per_layer.append({"layer": layer, "kl": kl_with_stale(mask),
                          "deviation": float(deviation[layer, slots].mean())})
        print(f"layer {layer:2}: KL {per_layer[-1]['kl']:.2e}  mean deviation {per_layer[-1]['deviation']:.3f}",
              file=log, flush=True)

    groups = []
    for start in range(0, len(slots), args.group):
        members = slots[start:start + args.group]
        mask = torch.zeros(L, end, dtype=torch.bool)
        mask[:, members] = True
        groups.append({"first": members[0], "last": members[-1], "kl": kl_with_stale(mask),
                       "deviation_layer1": float(deviation[1, members].mean()),
                       "deviation_all_layers": float(deviation[:, members].mean()),
                       "reading": float(reads[members].sum()),
                       "text": tokenizer.decode(context[members[0]:members[-1] + 1])[:60]})
        g = groups[-1]
        print(f"slots {g['first']:5}-{g['last']:5}: KL {g['kl']:.2e}  dev L1 {g['deviation_layer1']:.4f}  "
              f"dev all {g['deviation_all_layers']:.3f}  reading {g['reading']:.2f}  {g['text']!r}",
              file=log, flush=True)

    budget = round(0.15 * len(slots))
    index = torch.tensor(slots)
    rankings = {"kv-deviation": index[torch.argsort(deviation[1, index], descending=True)],
                "attention": index[torch.argsort(reads[index], descending=True)],
                "all-layer deviation (needs a prefill)": index[torch.argsort(deviation[:, index].mean(0),
                                                                             descending=True)],
                "last slots": index.flip(0)}
    rankings["attention+deviation"] = torch.tensor(splice._interleave([rankings["attention"], rankings["kv-deviation"]],
                                                                      budget))
    summed = sum(g["kl"] for g in groups)
    coverage = {}
    for name, ranking in rankings.items():
        chosen = ranking[:budget].tolist()
        covered = sum(g["kl"] * sum(g["first"] <= s <= g["last"] for s in chosen) / (g["last"] - g["first"] + 1)
                      for g in groups)
        coverage[name] = covered / summed if summed else 0.0
    print("share of the summed group KL in the slots each criterion picks at R = 0.15: "
          + ", ".join(f"{k} {v:.0%}" for k, v in coverage.items()), file=log)
    if args.json:
        print(json.dumps({"pipeline": str(args.pipeline), "agent": args.agent, "spliced": len(slots),
                          "context": end, "kl": total, "per_layer": per_layer, "groups": groups,
                          "coverage_at_0.15": coverage, "machine": machine()}))


if __name__ == "__main__":
    run_main(main)
