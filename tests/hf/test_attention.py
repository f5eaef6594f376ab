"""Plain attention (kvwire.hf.attention.plain_attention): transformers' sdpa with grouped KV heads read in place
under a mask on the CPU -- the same bits as transformers' own function, which copies every KV head per group."""

from __future__ import annotations

import types

import pytest
import torch
import transformers.integrations.sdpa_attention as transformers_sdpa

from kvwire import hf
from kvwire.hf.attention import NAME, plain_attention


def grouped(groups):
    return types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


def masks(kind, batch, q, kv, generator):
    """The masks transformers hands attention: bool (True = may attend) or additive float, causal after a
    cached prefix, optionally left-padded per row."""
    allowed = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)[None, None].repeat(batch, 1, 1, 1)
    if kind == "padded":
        for row in range(batch):
            allowed[row, :, :, : int(torch.randint(0, kv - q + 1, (1,), generator=generator))] = False
    if kind == "float":
        return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return allowed


@pytest.mark.parametrize("q,kv", [(1, 9), (7, 40), (31, 700), (64, 64)])
@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("kind", ["bool", "float", "padded"])
def test_the_same_bits_as_transformers_sdpa_without_copying_grouped_heads(q, kv, groups, kind, monkeypatch):
    generator = torch.Generator().manual_seed(q * kv + groups)
    batch, kv_heads, head = 2, 2, 16
    query = torch.randn(batch, kv_heads * groups, q, head, generator=generator)
    key, value = (torch.randn(batch, kv_heads, kv, head, generator=generator) for _ in range(2))
    mask = masks(kind, batch, q, kv, generator)
    expected, _ = transformers_sdpa.sdpa_attention_forward(grouped(groups), query, key, value, mask, scaling=0.25)

    def no_copies(*args):
        raise AssertionError("grouped heads were copied")

    monkeypatch.setattr(transformers_sdpa, "repeat_kv", no_copies)
    got, _ = plain_attention(grouped(groups), query, key, value, mask, scaling=0.25)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["no mask", "gradients", "ungrouped"])
def test_everything_else_is_transformers_function_itself(case, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    groups = 1 if case == "ungrouped" else 2
    query = torch.randn(1, 4, 5, 16, generator=generator, requires_grad=case == "gradients")
    key, value = (torch.randn(1, 4 // groups, 5, 16, generator=generator) for _ in range(2))
    mask = None if case == "no mask" else masks("bool", 1, 5, 5, generator)
    calls = []
    original = transformers_sdpa.sdpa_attention_forward
    monkeypatch.setattr("kvwire.hf.attention.sdpa_attention_forward",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    plain_attention(grouped(groups), query, key, value, mask, scaling=0.25)
    assert calls == [1]


def test_loaded_models_use_it_and_continue_a_cache_bit_for_bit_as_sdpa(tiny_folder):
    """``load_model`` adopts it; a prefill that continues a cache (prefix mode's new tokens, masked) gives sdpa's
    logits and K/V exactly."""
    model, _ = hf.load_model(tiny_folder)
    assert model.config._attn_implementation == NAME
    ids = torch.randint(3, 400, (1, 60), generator=torch.Generator().manual_seed(3))

    def continued(implementation):
        model.set_attn_implementation(implementation)
        cache = hf.new_cache(model)
        with torch.inference_mode():
            first = model(input_ids=ids[:, :45], past_key_values=cache, use_cache=True).logits
            then = model(input_ids=ids[:, 45:], past_key_values=cache, use_cache=True).logits
        return first, then, cache

    try:
        ours, theirs = continued(NAME), continued("sdpa")
    finally:
        model.set_attn_implementation(NAME)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    for mine, reference in zip(ours[2].layers, theirs[2].layers):
        assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)
