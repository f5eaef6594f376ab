"""Integration on the real default model, SmolLM2-135M-Instruct (converted once from its GGUF).

Prefix mode must be exact here too: every agent's greedy output equals a
recomputation from the same ids, and first-token logits agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvwire import AgentSpec, Pipeline, PipelineSpec, hf, open_store
from kvwire.wire import codec
from kvwire.kv.chain import packet_key

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).parents[2]
LOGIT_ATOL = 1e-3  # fp32 logits of magnitude ~20; cached vs uncached attention differ by rounding only


def test_spec_of_the_default_model(real_model):
    model, tokenizer, spec = real_model
    assert (spec.architecture, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (
        "LlamaForCausalLM", 30, 3, 64, "float32")
    assert spec.rope == {"rope_theta": 100000.0, "rope_type": "default"} and len(spec.fingerprint) == 64
    assert hf.eos_token_ids(model) == frozenset([0, 2])  # <|im_end|> (generation_config), <|endoftext|> (by name)


def test_loaded_weights_start_on_64_byte_boundaries_and_stay_tied(real_model):
    """Safetensors offsets leave weights misaligned; load_model moves them (matrix products run faster)."""
    model, tokenizer, spec = real_model
    assert all(p.data_ptr() % 64 == 0 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights stay one parameter


def test_three_agents_are_exact_against_recomputation(real_model, tmp_path):
    model, tokenizer, spec = real_model
    pipeline_spec = PipelineSpec.from_toml(ROOT / "examples" / "document_pipeline.toml")
    text = pipeline_spec.input_text
    text = text[:text.index("\n\n", len(text) // 2)]  # the report's first half (~1,000 tokens): any length will do
    pipeline_spec = PipelineSpec(pipeline_spec.name, pipeline_spec.agents[:3], text,
                                 pipeline_spec.input_label, pipeline_spec.system, max_new_tokens=12)
    store = open_store(f"file://{tmp_path}/store")
    result = Pipeline(model, tokenizer, pipeline_spec, store=store, model_spec=spec).run("prefix")
    for index, agent in enumerate(result.agents):
        assert agent.transcript_matches_template or agent.retokenized_turns
        reference = hf.generate(model, agent.context_ids, max_new_tokens=12)  # no upstream cache
        assert agent.output_ids == reference.tokens, agent.agent
        torch.testing.assert_close(agent.first_logits, reference.first_logits, atol=LOGIT_ATOL, rtol=0)
        if index:
            assert agent.cached_tokens > 800 and agent.context_tokens - agent.cached_tokens < 40
    # the packets in the store are real safetensors files that `kvwire inspect` can read
    first = store.keys("packets/")[0]
    proc = subprocess.run([sys.executable, "-m", "kvwire", "inspect", "--json",
                           str(Path(store.root) / first)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["spec"]["fingerprint"] == spec.fingerprint


def test_literal_recomputation_without_any_cache(real_model):
    """The strictest reference: every step recomputes the whole sequence, no cache at all."""
    model, tokenizer, spec = real_model
    pipeline_spec = PipelineSpec("short", (AgentSpec("a", "Name one bug."), AgentSpec("b", "Fix it.")),
                                 input_text="def mean(xs): return sum(xs) / len(xs)", max_new_tokens=6)
    result = Pipeline(model, tokenizer, pipeline_spec, model_spec=spec).run("prefix")
    second = result.agents[1]
    assert second.cached_tokens > 0
    reference = hf.generate(model, second.context_ids, max_new_tokens=6, use_cache=False)
    assert second.output_ids == reference.tokens
    torch.testing.assert_close(second.first_logits, reference.first_logits, atol=LOGIT_ATOL, rtol=0)


def test_demo_pipeline_compare_is_identical(real_model):
    model, tokenizer, spec = real_model
    from importlib import resources

    with resources.as_file(resources.files("kvwire") / "data" / "code_review.toml") as path:
        demo = PipelineSpec.from_toml(path).with_max_new_tokens(16)
    comparison = Pipeline(model, tokenizer, demo, model_spec=spec).compare()
    assert comparison.exact and comparison.identical, [a.note for a in comparison.agents]
    assert all(a.max_logit_diff is not None and a.max_logit_diff < LOGIT_ATOL for a in comparison.agents)
    assert comparison.prefix.agents[1].cached_tokens > 400


def test_size_matches_a_real_packet(real_model):
    model, tokenizer, spec = real_model
    context = torch.tensor([tokenizer("hello " * 100, add_special_tokens=False)["input_ids"]])
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=context, past_key_values=cache, use_cache=True)
    packet = hf.extract(cache, spec, context)
    tokens = context.shape[1]
    assert packet.nbytes == spec.kv_bytes(tokens) == 2 * 30 * 3 * 64 * tokens * 4
    proc = subprocess.run([sys.executable, "-m", "kvwire", "size", "--tokens", str(tokens), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["bytes"] == packet.nbytes
    assert len(codec.encode(packet)) > packet.nbytes  # header + token ids + mask on top


def test_a_packet_from_updated_weights_is_refused(real_model):
    model, tokenizer, spec = real_model
    store = open_store("memory://")
    pipeline_spec = PipelineSpec("p", (AgentSpec("a", "Say hi."), AgentSpec("b", "Say bye.")), max_new_tokens=3)
    Pipeline(model, tokenizer, pipeline_spec, store=store, model_spec=spec).run("prefix", session="s")
    stored = codec.decode(store.get(store.keys("packets/")[0]))
    with torch.no_grad():
        weight = model.model.layers[0].mlp.down_proj.weight
        original = weight[0, 0].clone()
        weight[0, 0] += 1e-3
        try:
            updated = hf.model_spec(model)
        finally:
            weight[0, 0] = original
    with pytest.raises(Exception, match="different weights"):
        hf.build_cache(stored, model, updated)
    assert packet_key(stored.id) in store.keys()


def test_demo_command_json(real_model):
    """The demo repeats its comparison (after a warm-up) and reports the run of median speedup."""
    proc = subprocess.run([sys.executable, "-m", "kvwire", "demo", "--json", "--max-new-tokens", "2",
                           "--repeats", "3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert payload["identical"] is True and payload["identical_every_repeat"] is True
    speedups = payload["repeat_speedups"]
    assert len(speedups) == 3 and all(isinstance(s, float) and s > 0 for s in speedups)
    assert payload["speedup"] == sorted(speedups)[1]  # the median run is the one reported
    assert "the run of median speedup of 3" in proc.stderr


def test_repeats_need_a_comparison():
    proc = subprocess.run([sys.executable, "-m", "kvwire", "run", "examples/three_agents.toml", "--mode", "prefix",
                           "--repeats", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--repeats repeats a comparison" in proc.stderr
    graph = subprocess.run([sys.executable, "-m", "kvwire", "run", "examples/review_board.toml", "--repeats", "3"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert graph.returncode == 2 and "benchmarks/graph.py" in graph.stderr


def test_eos_ids_are_every_end_of_generation_token_the_tokenizer_has(real_model, tiny_folder):
    model, tokenizer, _ = real_model
    assert hf.eos_token_ids(model) == {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    tiny, tiny_tokenizer = hf.load_model(tiny_folder)  # its eos, and <|endoftext|> (its padding) by name
    assert hf.eos_token_ids(tiny) == {tiny_tokenizer.eos_token_id,
                                      tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")}
