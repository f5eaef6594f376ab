"""Timing a model whose weights are not at hand (issue 44): a model made from its ``config.json`` with seeded random
weights (``hf.random_model``), as ``benchmarks/pipeline.py`` and ``graph.py`` take it with ``--random-weights``.

A pass's time depends on shapes and kernels, not on the weights' values; what must hold is that the model is the
config's, deterministic, never stops early (replies of one fixed length in every mode), and that passing caches stays
exact on it. The 7B configs are only read here (their K/V arithmetic); a tiny one runs.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvwire import PipelineSpec, hf, models
from kvwire.errors import ModelError
from kvwire.hf.loading import read_config
from kvwire.pipeline.linear import Pipeline

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
TINY = CONFIGS / "tiny-llama.json"


def test_the_seeds_kv_arithmetic_holds_on_the_llama_2_7b_shape():
    """The seed: 1.07 GB of K/V for 2,048 tokens of Llama-2-7B in fp16. Qwen2.5-7B's grouped heads hold 1/8 of a
    Llama layer's K/V heads, over 28 layers."""
    llama = hf.config_spec(read_config(CONFIGS / "llama-2-7b.json"), torch.float16)
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim) == (32, 32, 128)
    assert llama.kv_bytes(2048) == 2 * 32 * 32 * 128 * 2048 * 2 == 1_073_741_824
    qwen = hf.config_spec(read_config(CONFIGS / "qwen2.5-7b.json"), torch.bfloat16)
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim) == (28, 4, 128)
    assert qwen.kv_bytes(2048) == 2 * 28 * 4 * 128 * 2048 * 2


def test_a_random_model_is_the_configs_seeded_and_never_stops():
    a = hf.random_model(TINY, tokenizer_vocab=49152)
    b = hf.random_model(TINY, tokenizer_vocab=49152)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))  # the same seed, the same model
    assert not torch.equal(next(a.parameters()), next(hf.random_model(TINY, seed=1).parameters()))
    assert a.config.num_hidden_layers == 2 and a.config.hidden_size == 64
    assert a.config.vocab_size == 49152  # grown from 32,000: every id of the tokenizer is one the model has
    assert hf.random_model(TINY).config.vocab_size == 32000  # a tokenizer that fits changes nothing
    assert hf.eos_token_ids(a) == frozenset()
    out = hf.generate(a, [1, 40000, 5], max_new_tokens=12)
    assert len(out.tokens) == 12  # no end-of-sequence: every reply runs to its limit


def test_a_random_model_loads_in_bf16_and_fp16():
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model = hf.random_model(TINY, dtype=dtype)
        assert next(model.parameters()).dtype == torch_dtype
        assert hf.model_spec(model).dtype == str(torch_dtype).removeprefix("torch.")
        assert len(hf.generate(model, [1, 2, 3], max_new_tokens=3).tokens) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "fp8"}, "unknown dtype 'fp8'"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"config": "missing.json"}, "no config file at missing.json"),
])
def test_bad_input_is_one_error_before_anything_is_built(kwargs, message):
    kwargs = {"config": TINY, **kwargs}
    with pytest.raises(ModelError, match=message):
        hf.random_model(kwargs.pop("config"), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_on_a_machine_without_one_is_said_before_anything_is_built():
    with pytest.raises(ModelError, match="no cuda device here"):
        hf.random_model(TINY, device="cuda")


def test_a_damaged_config_names_its_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "num_attention_heads": 0}')
    with pytest.raises(ModelError, match="cannot read the model config"):
        hf.random_model(bad)


def test_prefix_is_exact_on_a_random_model():
    """Text vs prefix on the five-agent document pipeline, greedy: the same tokens, and each prefix agent's output
    equal to a recomputation from its own ids (a random model's logits are full of near-ties, so this is a hard
    case for exactness, not an easy one)."""
    tokenizer = hf.load_tokenizer(models.resolve())
    model = hf.random_model(TINY, tokenizer_vocab=len(tokenizer))
    spec = PipelineSpec.from_toml(ROOT / "examples" / "document_pipeline.toml").with_max_new_tokens(6)
    comparison = Pipeline(model, tokenizer, spec, model_spec=hf.model_spec(model)).compare("prefix")
    assert comparison.exact and comparison.identical
    assert all(a.new_tokens == 6 for a in comparison.prefix.agents)


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_pipeline_py_times_a_model_made_from_a_config():
    proc = run("pipeline.py", "--random-weights", str(TINY), "--dtype", "bf16", "--repeats", "1", "--max-new-tokens",
               "3", "--stores", "memory://", "--only", "a", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a-code-review" in proc.stderr and "K/V of 2048 tokens in bfloat16" in proc.stderr  # the table
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["model"] == {"model": None, "random_weights": "tiny-llama.json", "device": "cpu", "dtype": "bf16",
                               "weights": "random"}
    row = result["workloads"][0]
    assert row["identical"] and row["exact"] and row["new_tokens"] == [3, 3]
    assert [a["agent"] for a in row["agents"]] == ["analyst", "fixer"]  # each agent's prefill and decode
    spec = hf.config_spec(read_config(TINY), torch.bfloat16)
    assert result["kv_arithmetic"]["bytes"] == spec.kv_bytes(2048) < result["kv_arithmetic"]["packet_bytes"]


def test_graph_py_times_fan_out_on_a_model_made_from_a_config():
    proc = run("graph.py", "--random-weights", str(TINY), "--only", "decode", "--decode-context", "64",
               "--decode-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "decode engine_cascade" in proc.stderr
    decode = json.loads(proc.stdout.strip().splitlines()[-1])["decode"]
    assert decode["identical_outputs"] and set(decode["ways"]["engine_cascade"]) == {"1", "4", "8"}


@pytest.mark.parametrize("options, says", [
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"weights": "int8"}, "--weights int8 converts a checkpoint's weights; --random-weights makes its own"),
    ({"random_weights": Path("missing.json")}, "no config file at missing.json"),
])
def test_the_benchmarks_check_their_model_options_before_building(options, says):
    """``benchmarks/common.load_model``, which every benchmark taking ``--random-weights`` calls first."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import load_model
    finally:
        sys.path.pop(0)
    weights = options.pop("weights", "fp32")
    args = argparse.Namespace(**{"model": None, "random_weights": TINY, "device": "cpu", "dtype": "fp32", **options})
    with pytest.raises(ModelError, match=re.escape(says)):
        load_model(args, weights=weights)


def test_device_transfer_py_times_a_cache_through_the_stores():
    proc = run("device_transfer.py", "--random-weights", str(TINY), "--tokens", "64", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kv_bytes"] == result["spec_kv_bytes"] == hf.config_spec(read_config(TINY)).kv_bytes(64)
    assert set(result["stores"]) == {"memory", "file"} and "copy_in_memory" in result["rates_bytes_per_s"]
    assert "through memory" in proc.stderr and "break-even link" in proc.stderr
