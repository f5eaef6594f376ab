"""Exactness on tiny random models: a cache passed as a packet continues generation
exactly as a recomputation from the same ids without any cache would.

Runs on four cache shapes (see tests/support/tiny.py): Llama GQA, Qwen2, GPT-NeoX MHA and
Gemma3 with sliding-window layers.
"""

from __future__ import annotations

import pytest
import torch

from kvwire import ChainError, PacketError, hf, join, open_store, publish, receive
from kvwire.wire import codec

LOGIT_ATOL = 1e-4


def ids(n, seed=0, vocab=400):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model, context):
    """The cache a sender holds after reading all but the last token of ``context``."""
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=context[:, :-1], past_key_values=cache, use_cache=True)
    return cache


def test_packet_round_trip_continues_exactly(tiny_model):
    arch, model, spec = tiny_model
    context = ids(30)
    sender = prefill(model, context)
    packet = codec.decode(codec.encode(hf.extract(sender, spec, context[:, :-1], producer="a")))
    got = hf.generate(model, context, cache=hf.build_cache(packet, model, spec), max_new_tokens=12)
    want = hf.generate(model, context, max_new_tokens=12, use_cache=False)
    assert got.prefilled == 1 and want.prefilled == 30
    assert got.tokens == want.tokens, arch
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=LOGIT_ATOL, rtol=0)


def test_sliding_layers_get_their_true_length(tiny_model):
    arch, model, spec = tiny_model
    context = ids(20, seed=1)
    packet = hf.extract(prefill(model, context), spec, context[:, :-1])
    cache = hf.build_cache(packet, model, spec)
    assert hf.cache_length(cache) == 19
    for index, layer in enumerate(cache.layers):
        stored = layer.keys.shape[2]
        assert stored == (7 if spec.layer_kinds[index] == "sliding_attention" else 19), (arch, index)


def test_a_three_hop_delta_chain_is_exact(tiny_model):
    """Agent 1 reads a prompt and replies; agents 2 and 3 each append a turn to the received
    cache and publish only their delta. Every reply equals a from-scratch recomputation."""
    arch, model, spec = tiny_model
    store = open_store("memory://")
    transcript = ids(25, seed=2)[0].tolist()
    head, cache = None, None
    for hop in range(3):
        if hop:
            transcript += ids(6, seed=10 + hop)[0].tolist()  # this agent's own instruction turn
            got = receive(store, head.id, spec)
            assert got.context.token_ids[0].tolist() == transcript[:got.context.length]
            cache = hf.build_cache(got.context, model, spec)
            head = got.head
        gen = hf.generate(model, transcript, cache=cache, max_new_tokens=8, eos_ids=frozenset())
        ref = hf.generate(model, transcript, max_new_tokens=8, eos_ids=frozenset(), use_cache=False)
        assert gen.tokens == ref.tokens, (arch, hop)
        torch.testing.assert_close(gen.first_logits, ref.first_logits, atol=LOGIT_ATOL, rtol=0)
        transcript += gen.tokens
        covered = transcript[: hf.cache_length(gen.cache)]
        delta = hf.extract(gen.cache, spec, torch.tensor([covered]), parent=head, producer=f"agent{hop}")
        assert delta.start == (head.end if head else 0)
        publish(store, delta)
        head = delta
    assert len(store.keys("packets/")) == 3


def test_a_cache_built_from_a_chains_links_is_its_join_bit_for_bit(tiny_model):
    """build_cache takes a received chain's links as they are (one copy into the cache, not a join and then a
    copy): the same K/V as building from their join, sliding-window layers included, the links left untouched
    and not aliased; links that do not continue each other are refused as join refuses them."""
    arch, model, spec = tiny_model
    transcript = ids(40, seed=7)
    links, parent = [], None
    for end in (17, 29, 39):  # three agents' parts of one context
        link = hf.extract(prefill(model, transcript[:, : end + 1]), spec, transcript[:, :end], parent=parent)
        links.append(codec.decode(codec.encode(link)))  # as received: views of the store's bytes
        parent = links[-1]
    snapshot = [t.clone() for link in links for t in (*link.keys, *link.values)]
    built, joined = hf.build_cache(links, model, spec), hf.build_cache(join(links), model, spec)
    for mine, reference in zip(built.layers, joined.layers):
        assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)
    for layer in built.layers:
        layer.keys.add_(1.0)  # the cache owns its tensors: the links do not change
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (t for link in links for t in (*link.keys, *link.values))))
    gen = hf.generate(model, transcript, cache=hf.build_cache(links, model, spec), max_new_tokens=6,
                      eos_ids=frozenset())
    ref = hf.generate(model, transcript, max_new_tokens=6, eos_ids=frozenset(), use_cache=False)
    assert gen.tokens == ref.tokens
    with pytest.raises(ChainError, match="names parent"):
        hf.build_cache([links[0], links[2]], model, spec)


def test_generation_never_modifies_the_packet(tiny_model):
    arch, model, spec = tiny_model
    context = ids(16, seed=3)
    packet = codec.decode(codec.encode(hf.extract(prefill(model, context), spec, context[:, :-1])))
    snapshot = [t.clone() for t in (*packet.keys, *packet.values)]
    hf.generate(model, context, cache=hf.build_cache(packet, model, spec), max_new_tokens=6)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (*packet.keys, *packet.values)))
    codec.decode(codec.encode(packet))  # still verifies


def test_decode_grows_the_cache_in_reserved_room_with_the_same_bits(tiny_model):
    """hf.generate decodes into room reserved after the context (no copy of the whole cache a step);
    what it hands back is a plain cache, contiguous, bit-identical to growing it by concatenation --
    past the room too -- and the reserved cache's own tensors are never the caller's."""
    from transformers.cache_utils import DynamicLayer

    arch, model, spec = tiny_model
    context = ids(24, seed=5)
    grown, plain = prefill(model, context), prefill(model, context)
    before = [layer.keys for layer in grown.layers]
    snapshot = [k.clone() for k in before]
    steps = [torch.tensor([[7 + i]]) for i in range(6)]
    with torch.inference_mode():
        with hf.reserved(grown, room=4):  # 6 steps: the last two run past the room
            for step in steps:
                model(input_ids=step, past_key_values=grown, use_cache=True)
        for step in steps:
            model(input_ids=step, past_key_values=plain, use_cache=True)
    for ours, theirs in zip(grown.layers, plain.layers):
        assert type(ours) is type(theirs)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), arch
        if type(ours) is DynamicLayer:
            assert ours.keys.is_contiguous() and ours.values.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot))  # the context's tensors untouched
    got = hf.generate(model, context, max_new_tokens=10)
    assert got.cache.get_seq_length() == 24 + 9 and all(
        layer.keys.is_contiguous() for layer in got.cache.layers if type(layer) is DynamicLayer)


def test_a_fully_cached_context_is_refused(tiny_model):
    arch, model, spec = tiny_model
    context = ids(10, seed=4)
    cache = prefill(model, context)
    with pytest.raises(PacketError, match="leave at least one"):
        hf.generate(model, context[:, :-1], cache=cache)


def test_a_packet_from_another_model_is_refused(tiny_model, tiny_tokenizer):
    from tests.support import tiny

    arch, model, spec = tiny_model
    other = tiny.model(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=1)  # same shape, other weights
    other_spec = hf.model_spec(other)
    assert other_spec.fingerprint != spec.fingerprint
    context = ids(10, seed=5)
    packet = hf.extract(prefill(other, context), other_spec, context[:, :-1])
    with pytest.raises(Exception, match="different weights"):
        hf.build_cache(packet, model, spec)


def test_fingerprint_follows_the_weights(tiny_model):
    arch, model, spec = tiny_model
    with torch.no_grad():
        param = next(model.parameters())
        original = param[0, 0].clone()
        param[0, 0] += 1e-3  # a tiny update, as from one fine-tuning step
        try:
            assert hf.model_spec(model).fingerprint != spec.fingerprint
        finally:
            param[0, 0] = original
    assert hf.model_spec(model).fingerprint == spec.fingerprint


def test_a_chain_joined_then_reinjected_matches_one_packet(tiny_model):
    """join(deltas) gives the same cache as extracting the whole context at once."""
    arch, model, spec = tiny_model
    context = ids(24, seed=6)
    cache = prefill(model, context)
    whole = hf.extract(cache, spec, context[:, :-1])
    first = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=context[:, :10], past_key_values=first, use_cache=True)
    root = hf.extract(first, spec, context[:, :10])
    codec.encode(root)
    with torch.inference_mode():
        model(input_ids=context[:, 10:-1], past_key_values=first, use_cache=True)
    delta = hf.extract(first, spec, context[:, :-1], parent=root)
    joined = join([root, delta])
    for a, b in zip((*joined.keys, *joined.values), (*whole.keys, *whole.values)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
