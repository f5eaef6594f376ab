"""Longer checks, kept out of the default suite: `make test-slow` (a few minutes).

Exactness at the lengths the benchmarks use, on the real default model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwire import PipelineSpec, hf
from kvwire.pipeline.linear import Pipeline
from kvwire.kv.splice import Recompute

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
ROOT = Path(__file__).parents[2]


def test_prefix_is_exact_over_a_3000_token_conversation(real_model):
    model, tokenizer, spec = real_model
    workload = PipelineSpec.from_toml(ROOT / "examples" / "support_conversation.toml")
    comparison = Pipeline(model, tokenizer, workload, model_spec=spec).compare("prefix")
    assert comparison.exact and comparison.identical, [a.note for a in comparison.agents]
    assert comparison.prefix.agents[-1].cached_tokens > 3300


def test_full_recompute_splice_is_exact_for_five_private_agents(real_model):
    model, tokenizer, spec = real_model
    workload = PipelineSpec.from_toml(ROOT / "examples" / "document_private_prompts.toml").with_max_new_tokens(16)
    result = Pipeline(model, tokenizer, workload, model_spec=spec, recompute=Recompute(1.0),
                      splice_when="always").run("splice")
    for agent in result.agents[1:]:
        reference = hf.generate(model, agent.context_ids, max_new_tokens=16)
        assert agent.output_ids == reference.tokens, agent.agent
