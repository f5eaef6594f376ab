"""Multi-round pipelines with model updates: a stale cache is never used.

A -> B -> C -> A ... for several rounds, in prefix mode. Midway, B's weights are
updated (as after a fine-tuning step). Receivers check the fingerprint of every
packet they are handed: B no longer accepts caches made by the old weights, and
A and C no longer accept B's, so each of them rebuilds from the token ids the
handoff carries -- logged and counted -- and nothing stale is ever attended to.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvwire import AgentSpec, PipelineSpec, VersionConflict, hf
from kvwire.kv.chain import packet_key
from kvwire.pipeline.linear import Freshness, Pipeline

CYCLE = PipelineSpec(
    name="cycle",
    system="You are one of three agents taking turns.",
    input_text="Plan a small web service.",
    max_new_tokens=5,
    agents=(AgentSpec("A", "Propose the next step."), AgentSpec("B", "Refine it."), AgentSpec("C", "Check it.")),
)


def updated(model, seed=1):
    """The same architecture after a small weight update."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for param in list(new.parameters())[-4:]:
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 1e-2)
    return new


def update_b_at(round_):
    state = {}

    def hook(pipeline, round, index):
        if round == round_ and index == 1 and "done" not in state:
            pipeline.update_model("B", state.setdefault("model", updated(pipeline.agent("B").model)))
            state["done"] = True
    return hook


def assert_no_stale_use(result):
    for turn in result.agents:
        if turn.cached_tokens:
            assert turn.cache_fingerprint == turn.fingerprint, (turn.agent, turn.round)


def test_update_midway_rebuilds_instead_of_using_stale_caches(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    pipeline = Pipeline(model, tiny_tokenizer, CYCLE, agent_models={"B": copy.deepcopy(model)})
    result = pipeline.run("prefix", rounds=4, before_turn=update_b_at(2))
    assert [(t.round, t.agent) for t in result.agents][:4] == [(0, "A"), (0, "B"), (0, "C"), (1, "A")]
    assert_no_stale_use(result)
    stale = [(t.round, t.agent) for t in result.agents if any(e.startswith("stale-fingerprint") for e in t.events)]
    assert stale == [(2, "B"), (2, "C"), (3, "B"), (3, "C")]  # A keeps using C's caches: same weights
    assert result.rebuilds == {"stale-fingerprint": 4}
    # every turn, rebuilt or not, equals a recomputation from its own ids with its own weights
    for turn in result.agents[1:]:
        weights = pipeline.agent(turn.agent).model if turn.round >= 2 or turn.agent != "B" else model
        ref = hf.generate(weights, turn.context_ids, max_new_tokens=5, use_cache=False)
        assert turn.output_ids == ref.tokens, (turn.round, turn.agent)


def test_a_missing_link_and_old_chains_are_rebuilt(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("qwen2", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    pipeline = Pipeline(model, tiny_tokenizer, CYCLE)

    def evict_root(pipeline, round, index):
        if (round, index) == (1, 1):  # before B's turn in round 1: the chain's first packet is gone
            roots = [k for k in pipeline.store.keys("packets/")]
            pipeline.store.delete(roots[0]) if roots else None

    result = pipeline.run("prefix", rounds=2, before_turn=evict_root)
    assert result.rebuilds.get("broken-chain", 0) >= 1
    assert_no_stale_use(result)

    aging = Pipeline(model, tiny_tokenizer, CYCLE, freshness=Freshness(max_rounds=1))
    result = aging.run("prefix", rounds=3)
    expired = [(t.round, t.agent) for t in result.agents if any(e.startswith("expired") for e in t.events)]
    assert expired and all(round >= 2 for round, _ in expired)
    assert_no_stale_use(result)

    by_age = Pipeline(model, tiny_tokenizer, CYCLE, freshness=Freshness(max_age_s=0.0))  # every cache too old
    result = by_age.run("prefix")
    assert result.rebuilds == {"expired": 2} and all(t.cached_tokens == 0 for t in result.agents)


def test_a_turn_is_taken_once(tiny_tokenizer):
    """Handoffs are written with compare-and-set: a second writer of the same turn is rejected."""
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    pipeline = Pipeline(model, tiny_tokenizer, CYCLE)
    pipeline.run("prefix", session="once")
    with pytest.raises(VersionConflict):
        pipeline.agents[0].turn("prefix", "once", None)
    assert packet_key("x").startswith("packets/")


@pytest.mark.real_model
def test_after_the_update_prefix_equals_a_fresh_text_run(real_model):
    model, tokenizer, spec = real_model
    b_model = updated(model, seed=3)
    prefix = Pipeline(model, tokenizer, CYCLE, model_spec=spec).run(
        "prefix", rounds=3, before_turn=_swap_b(b_model))
    text = Pipeline(model, tokenizer, CYCLE, model_spec=spec).run("text", rounds=3, before_turn=_swap_b(b_model))
    assert_no_stale_use(prefix)
    assert prefix.rebuilds.get("stale-fingerprint", 0) >= 2
    after = [(p, t) for p, t in zip(prefix.agents, text.agents) if p.round >= 1]
    for p, t in after:
        assert p.output_ids == t.output_ids or p.context_ids != t.context_ids, (p.round, p.agent)
    assert sum(p.output_ids == t.output_ids for p, t in after) >= len(after) - 1


def _swap_b(b_model):
    def hook(pipeline, round, index):
        if round == 1 and index == 1 and pipeline.agent("B").model is not b_model:
            pipeline.update_model("B", b_model)
    return hook


def test_budgets_release_and_oversized_packets(tiny_tokenizer):
    """Memory: a store budget evicts least-recently-used packets (receivers then rebuild),
    a packet larger than the whole budget is not sent (the next agent re-prefills), and a
    finished session can be released."""
    from tests.support import tiny

    from kvwire import open_store

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    tight = Pipeline(model, tiny_tokenizer, CYCLE, store=open_store("memory://?budget=16KiB"))
    result = tight.run("prefix")
    assert all(any(e.startswith("packet-too-large") for e in t.events) for t in result.agents)
    assert all(t.cached_tokens == 0 for t in result.agents) and result.peak_store_bytes <= 16 << 10
    roomy = Pipeline(model, tiny_tokenizer, CYCLE, store=open_store("memory://?budget=4MiB"))
    done = roomy.run("prefix", session="done", rounds=2)
    assert done.agents[-1].cached_tokens > 0 and 0 < done.peak_store_bytes <= 4 << 20
    assert done.peak_rss_bytes > 0
    removed = roomy.release("done")
    assert removed >= 6 + 1 and roomy.store.keys() == []
