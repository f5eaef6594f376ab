"""A -> B -> C -> A for four rounds, with B's weights updated after round 1.

    .venv/bin/python examples/cyclic_update.py

Prints every turn: how much of its context came from a received cache, and any
rebuild (a cache refused because the weights that made it differ from the
receiver's). Then checks the claim of issue 4: no stale cache was ever used, and
every turn after the update equals a fresh text-mode run with the same schedule.
"""

from __future__ import annotations

import copy

import torch

from kvwire import AgentSpec, PipelineSpec, hf, models
from kvwire.pipeline.linear import Pipeline

CYCLE = PipelineSpec(
    name="cycle",
    system="You are one of three agents planning a small web service together. Be brief.",
    input_text="We need a URL shortener with analytics.",
    max_new_tokens=12,
    agents=(AgentSpec("A", "Propose the next design step."), AgentSpec("B", "Refine the proposal."),
            AgentSpec("C", "Check it for problems.")),
)


def fine_tuned(model):
    """Stand-in for a fine-tuning step: the same architecture, slightly different weights."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        new.model.layers[-1].mlp.down_proj.weight.mul_(1.01)
    return new


def main() -> None:
    model, tokenizer = hf.load_model(models.resolve())
    b_weights = fine_tuned(model)

    def update_b(pipeline, round, index):
        if (round, index) == (2, 1) and pipeline.agent("B").model is not b_weights:
            spec = pipeline.update_model("B", b_weights)
            print(f"-- round 2: B's weights updated, fingerprint now {spec.fingerprint[:12]}")

    prefix = Pipeline(model, tokenizer, CYCLE).run("prefix", rounds=4, before_turn=update_b)
    for turn in prefix.agents:
        print(f"round {turn.round} {turn.agent}: {turn.cached_tokens:4}/{turn.context_tokens} tokens from a cache"
              + "".join(f"\n    rebuilt: {event}" for event in turn.events))
    stale = [t for t in prefix.agents if t.cached_tokens and t.cache_fingerprint != t.fingerprint]
    print(f"stale caches used: {len(stale)}; rebuilds: {prefix.rebuilds}")

    text = Pipeline(model, tokenizer, CYCLE).run("text", rounds=4, before_turn=update_b)
    after = [(p, t) for p, t in zip(prefix.agents, text.agents) if p.round >= 2]
    same = sum(p.output_ids == t.output_ids for p, t in after)
    print(f"turns after the update equal to a fresh text-mode run: {same}/{len(after)}")


if __name__ == "__main__":
    main()
