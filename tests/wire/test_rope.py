"""RoPE re-rotation: keys moved from positions p.. to q.. equal the keys the model
computes at q.. (fp32, relative error well below 1e-4), for every RoPE variant
transformers configs use; variants that cannot be moved exactly are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvwire import PacketError, hf
from kvwire.wire import codec, rope

REL_TOL = 1e-5  # the target is 1e-4; exact angles give ~1e-7 on layer 0

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 5e5},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e4},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.1 * i for i in range(8)], "original_max_position_embeddings": 256,
                 "rope_theta": 1e4},
}


def llama(rope_parameters, vocab=400):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024,
                         rope_parameters=rope_parameters, initializer_range=0.1)
    return LlamaForCausalLM(config).eval()


def keys_at(model, ids, start):
    """Every layer's cached keys for ``ids`` placed at positions start.."""
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None], past_key_values=cache,
              use_cache=True)
    return [layer.keys.clone() for layer in cache.layers]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def check_moves(model, p=100, q=200, n=20):
    ids = torch.randint(3, 400, (1, n), generator=torch.Generator().manual_seed(1))
    tables = hf.rope_tables(model)
    at_p, at_q = keys_at(model, ids, p), keys_at(model, ids, q)
    src, dst = torch.arange(p, p + n), torch.arange(q, q + n)
    # a sliding-window layer holds only its last keys: move those
    kept = [keys.shape[2] for keys in at_p]
    # layer 0 keys depend only on token and position: the rotation alone is tested
    assert rel(rope.rotate(at_p[0], tables[0], src[-kept[0]:], dst[-kept[0]:]), at_q[0]) < REL_TOL
    # deeper layers: attention is translation invariant, so every layer's keys move too
    for layer in range(1, len(at_p)):
        moved = rope.rotate(at_p[layer], tables[layer], src[-kept[layer]:], dst[-kept[layer]:])
        assert rel(moved, at_q[layer]) < 1e-4
    src, dst = src[-kept[0]:], dst[-kept[0]:]
    back = rope.rotate(rope.rotate(at_p[0], tables[0], src, dst), tables[0], dst, src)
    assert rel(back, at_p[0]) < 1e-6  # p -> q -> p is the identity
    free = rope.strip(at_p[0], tables[0], src)
    assert rel(rope.apply(free, tables[0], dst), at_q[0]) < REL_TOL
    return tables


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_llama_rope_variant_moves_exactly(variant):
    tables = check_moves(llama(VARIANTS[variant]), q=150 if variant == "longrope" else 200)
    assert tables[0].rope_type == variant


def test_yarn_scaling_is_not_applied_twice():
    tables = hf.rope_tables(llama(VARIANTS["yarn"]))
    assert tables[0].attention_scaling > 1.0  # it is in the cached keys; a second application would show above


def test_tiny_architectures(tiny_model):
    """Qwen2, GPT-NeoX (partial rotary: 4 of 16 dims) and Gemma3 (sliding 1e4 / full 1e6 bases)."""
    arch, model, spec = tiny_model
    tables = check_moves(model)
    if arch == "neox":
        assert tables[0].rotary_dim == 4 < tables[0].head_dim
    if arch == "gemma3":
        kinds = spec.layer_kinds
        sliding = tables[kinds.index("sliding_attention")]
        full = tables[kinds.index("full_attention")]
        assert not sliding.same_rotation(full) and full.inv_freq[1] < sliding.inv_freq[1]


def test_real_model(real_model):
    model, tokenizer, spec = real_model
    tables = check_moves(model, p=37, q=1500, n=12)
    assert tables[0].rope_type == "default" and tables[0].rotary_dim == 64


def test_dynamic_is_refused_past_its_static_range():
    table = hf.rope_tables(llama(VARIANTS["dynamic"]))[0]
    keys = torch.randn(1, 2, 4, 16)
    rope.rotate(keys, table, torch.arange(0, 4), torch.arange(1000, 1004))  # inside: fine
    with pytest.raises(PacketError, match="cannot be re-rotated exactly"):
        rope.rotate(keys, table, torch.arange(0, 4), torch.arange(1022, 1026))


def test_unknown_variants_are_refused():
    with pytest.raises(PacketError, match="cannot be moved exactly"):
        rope.RopeTable(torch.ones(4), 8, "mystery")


def test_packets_move_strip_and_reapply(tiny_model):
    arch, model, spec = tiny_model
    tables = hf.rope_tables(model)
    ids = torch.randint(3, 400, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(30, 42)[None], past_key_values=cache, use_cache=True)
    at_30 = hf.extract(cache, spec, ids).with_provenance(start=30)
    moved = rope.move(at_30, tables, 5)
    free = codec.decode(codec.encode(rope.strip_packet(at_30, tables)))  # position-free packets travel too
    placed = rope.apply_at(free, tables, 5)
    want = keys_at(model, ids, 5)
    for layer in range(spec.num_layers):
        kept = spec.kept_tokens(layer, 12)
        assert rel(moved.keys[layer], want[layer][:, :, -kept:]) < 1e-4
        assert rel(placed.keys[layer], want[layer][:, :, -kept:]) < 1e-4
        assert torch.equal(moved.values[layer], at_30.values[layer])
    assert (moved.start, moved.attention, free.rotary, placed.rotary) == (5, "segment", "stripped", "applied")
    with pytest.raises(PacketError, match="position-free"):
        hf.build_cache(free.with_provenance(start=0), model, spec)


@pytest.mark.parametrize("convention", rope.CONVENTIONS)
def test_the_two_conventions_pair_different_dims(convention):
    """rope.py's worked example: R = D = 4, inv_freq [1, 0.01], key [a, b, c, d] moved 0 -> 1."""
    a, b, c, d = 0.3, -1.2, 0.7, 2.0
    table = rope.RopeTable(torch.tensor([1.0, 0.01]), 4, "default", convention=convention)
    t0, t1 = rope.angles(table, torch.tensor(1))  # fp32(1 * inv_freq), as float64
    cos, sin = torch.cos, torch.sin
    if convention == "half":  # pairs (a, c) and (b, d)
        want = [a * cos(t0) - c * sin(t0), b * cos(t1) - d * sin(t1), c * cos(t0) + a * sin(t0),
                d * cos(t1) + b * sin(t1)]
    else:  # pairs (a, b) and (c, d)
        want = [a * cos(t0) - b * sin(t0), b * cos(t0) + a * sin(t0), c * cos(t1) - d * sin(t1),
                d * cos(t1) + c * sin(t1)]
    key = torch.tensor([a, b, c, d], dtype=torch.float64).view(1, 1, 1, 4)
    got = rope.rotate(key, table, torch.tensor([0]), torch.tensor([1]))
    assert torch.allclose(got.view(4), torch.stack(want), atol=1e-12)
