"""The pipeline runner on tiny random models: prefix mode is exact, text mode is the baseline.

This is also the API in brief::

    spec = PipelineSpec.from_toml("examples/document_pipeline.toml")
    pipeline = Pipeline(model, tokenizer, spec, store="memory://")
    result = pipeline.run("prefix")          # or "text"
    comparison = pipeline.compare()          # both, side by side
"""

from __future__ import annotations

import pytest
import torch

from kvwire import AgentSpec, Pipeline, PipelineSpec, hf, open_store

SPEC = PipelineSpec(
    name="tiny-review",
    system="You are the reviewer.",
    input_text="def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)",
    input_label="Code",
    max_new_tokens=8,
    agents=(AgentSpec("analyst", "List the bugs.", role="analyst"),
            AgentSpec("fixer", "Suggest a fix for each bug.", role="fixer"),
            AgentSpec("critic", "Point out what is wrong or missing.", max_new_tokens=5)),
)


def test_prefix_mode_is_exact_against_recomputation(tiny_model, tiny_tokenizer):
    arch, model, spec = tiny_model
    result = Pipeline(model, tiny_tokenizer, SPEC, model_spec=spec).run("prefix")
    assert [a.agent for a in result.agents] == ["analyst", "fixer", "critic"]
    for index, agent in enumerate(result.agents):
        assert agent.cached_tokens == (0 if index == 0 else result.agents[index - 1].context_tokens
                                       + result.agents[index - 1].new_tokens - 1)
        reference = hf.generate(model, agent.context_ids, max_new_tokens=SPEC.new_tokens(index), use_cache=False)
        assert agent.output_ids == reference.tokens, (arch, agent.agent)
        torch.testing.assert_close(agent.first_logits, reference.first_logits, atol=1e-4, rtol=0)
    assert result.agents[2].new_tokens <= 5
    for agent in result.agents:  # a reply cut at its limit says so (tests/pipeline/test_transcript.py: its text)
        ended = agent.output_ids[-1] == tiny_tokenizer.eos_token_id
        assert agent.finish_reason == ("stop" if ended else "length")


def test_compare_reports_exactness_and_explains_differences(tiny_model, tiny_tokenizer):
    arch, model, spec = tiny_model
    comparison = Pipeline(model, tiny_tokenizer, SPEC, model_spec=spec).compare()
    assert comparison.exact, [a.note for a in comparison.agents]
    first = comparison.agents[0]
    assert first.same_context and first.identical  # nothing upstream: both modes see the same ids
    for agent in comparison.agents:
        # outputs may differ only where text mode re-tokenized a generated turn into other ids
        assert agent.identical or not agent.same_context, agent.note
        if not agent.same_context:
            assert "re-tokenizing" in agent.note
    payload = comparison.to_json()
    assert set(payload) >= {"speedup", "ttft_speedup", "efficiency", "identical", "exact", "agents"}


def test_agents_only_talk_through_the_store(tiny_model, tiny_tokenizer, tmp_path):
    arch, model, spec = tiny_model
    store = open_store(f"file://{tmp_path}/store")
    result = Pipeline(model, tiny_tokenizer, SPEC, store=store, model_spec=spec).run("prefix", session="s1")
    assert len(store.keys("packets/")) == 3
    assert store.keys("sessions/s1/") == ["sessions/s1/r0/handoff/0-analyst", "sessions/s1/r0/handoff/1-fixer",
                                          "sessions/s1/r0/handoff/2-critic"]
    # each hop sends only the tokens it added: its cache minus what it received
    for agent in result.agents:
        added = agent.context_tokens + agent.new_tokens - 1 - agent.cached_tokens
        assert agent.packet_bytes == spec.kv_bytes(added)


def test_text_mode_sends_no_packets(tiny_model, tiny_tokenizer):
    arch, model, spec = tiny_model
    store = open_store("memory://")
    result = Pipeline(model, tiny_tokenizer, SPEC, store=store, model_spec=spec).run("text")
    assert store.keys("packets/") == [] and all(a.cached_tokens == 0 for a in result.agents)


def test_unknown_mode_is_refused(tiny_model, tiny_tokenizer):
    from kvwire import KvwireError

    arch, model, spec = tiny_model
    with pytest.raises(KvwireError, match="unknown mode"):
        Pipeline(model, tiny_tokenizer, SPEC, model_spec=spec).run("telepathy")


@pytest.mark.parametrize("mode", ["prefix", "splice"])
def test_special_token_strings_in_the_input_and_instructions_are_plain_text(tiny_model, tiny_tokenizer, mode):
    """An input that quotes the tokenizer's control tokens runs in every mode (it stopped prefix mode with a
    TranscriptError: handoffs keep the raw text), and no agent's context holds a control token from it."""
    from dataclasses import replace

    from kvwire.hf.tokens import special_ids

    arch, model, spec = tiny_model
    if mode == "splice" and arch == "gemma3":
        pytest.skip("splice mode refuses sliding-window models")

    def pipeline(quoted: str) -> PipelineSpec:
        agents = tuple(replace(a, instruction=f"{a.instruction} {quoted}",
                               system=f"You are agent {a.name}." if mode == "splice" else None) for a in SPEC.agents)
        return replace(SPEC, input_text=f"log: {quoted} end {quoted}", agents=agents)

    control = special_ids(tiny_tokenizer)
    plain = Pipeline(model, tiny_tokenizer, pipeline(""), model_spec=spec).run("text")
    comparison = Pipeline(model, tiny_tokenizer, pipeline(tiny_tokenizer.eos_token), model_spec=spec).compare(mode)
    for quoting, reference in zip(comparison.other.agents, plain.agents):
        assert sum(i in control for i in quoting.context_ids) == sum(i in control for i in reference.context_ids)
    if mode == "prefix":
        assert comparison.exact


def test_an_agent_past_the_context_window_is_named_and_the_turns_before_it_are_kept(tiny_model, tiny_tokenizer):
    """The tiny models' window is 1,024 positions: the analyst fits, the fixer's context plus its 400 new tokens
    do not. The error says which agent, before its prefill, and carries the analyst's finished turn."""
    from kvwire import ContextTooLong

    arch, model, spec = tiny_model
    long = PipelineSpec(name="too-long", system="Be brief.", input_text="def f(x): return x  # " * 60,
                        input_label="Code", max_new_tokens=4,
                        agents=(AgentSpec("analyst", "List the bugs."),
                                AgentSpec("fixer", "Fix them.", max_new_tokens=400)))
    with pytest.raises(ContextTooLong, match=r"agent 'fixer' \(2 of 2\): .* past the model's context window") as e:
        Pipeline(model, tiny_tokenizer, long, model_spec=spec).run("prefix")
    assert [turn.agent for turn in e.value.finished] == ["analyst"] and e.value.finished[0].output_ids


def test_a_model_whose_cache_is_not_what_its_config_says_is_refused_before_any_turn(tiny_tokenizer):
    """Falcon with multi-query attention caches one KV head where its config counts four (and MLA or recurrent
    layers are other such layouts): the modes that pass caches refuse it before a turn is spent, saying to use
    text mode, which still runs it. It used to fail after the first agent, as an "invalid packet"."""
    from transformers import FalconConfig, FalconForCausalLM

    from kvwire import ModelError

    torch.manual_seed(0)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
                                            eos_token_id=tiny_tokenizer.eos_token_id)).eval()
    started = []
    pipeline = Pipeline(falcon, tiny_tokenizer, SPEC, on_event=lambda event: started.append(event))
    for mode in ("prefix", "splice"):
        with pytest.raises(ModelError, match=r"falcon models cache keys \[1, 1, 2, 16\].* not the \[B, 4, T, 16\]"):
            pipeline.run(mode)
    assert started == []
    assert [a.agent for a in pipeline.run("text").agents] == ["analyst", "fixer", "critic"]


def test_a_cache_layer_without_keys_is_named_not_a_crash(tiny_model):
    from kvwire import ModelError

    arch, model, spec = tiny_model
    cache = hf.prefill(model, [1, 2, 3])
    cache.layers[1].keys = None  # what a recurrent layer leaves (recurrent_gemma's)
    with pytest.raises(ModelError, match="keep no attention keys and values in cache layer 1"):
        hf.extract(cache, spec, torch.tensor([[1, 2, 3]]))
