"""Partial-layer transfer (DroidSpeak's setting): the sender ships the K/V of some layers and the
hidden state entering each run of layers it does not ship; the receiver computes those runs
itself. With the same weights this is exact at every split k, on every tiny architecture
(sliding-window Gemma3 included), through the codec, and on the real default model.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from tests.support import helpers
from tests.support import tiny
from kvwire.wire import codec
from kvwire import hf, join
from kvwire.errors import ChainError, CorruptPacketError, ModelMismatchError, PacketError
from kvwire.hf import partial
from kvwire.wire.layers import LayerPlan

LOGIT_ATOL = 1e-4
REAL_ATOL = 1e-3  # as tests/pipeline/test_real_model.py: fp32 logits ~20, cached vs uncached differ by rounding


def ids(n, seed=0, vocab=400):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# -- the plan --------------------------------------------------------------------------------------------


def test_a_plan_names_the_runs_the_receiver_computes():
    plan = LayerPlan.recompute(8, [0, 1, 6, 7])
    assert plan.reused == (2, 3, 4, 5) and plan.runs == ((0, 2), (6, 8)) and plan.hidden_layers == (0, 6)
    assert plan.describe() == "reuse 2-5, recompute 0-1,6-7"
    split = LayerPlan.prefix(30, 24)
    assert split.runs == ((24, 30),) and split.hidden_layers == (24,) and not split.is_full
    assert LayerPlan.prefix(30, 0).hidden_layers == (0,)  # only the embeddings travel
    assert LayerPlan.prefix(30, 30).is_full and LayerPlan.prefix(30, 30).runs == ()


@pytest.mark.parametrize("k", [-1, 31, 2.5])
def test_k_out_of_range_is_refused(k):
    with pytest.raises(PacketError, match=r"out of range: a 30-layer model splits at k in 0\.\.30"):
        LayerPlan.prefix(30, k)


def test_bad_layer_lists_are_refused():
    with pytest.raises(PacketError, match="out of range"):
        LayerPlan.recompute(4, [4])
    with pytest.raises(PacketError, match="ascending and unique"):
        LayerPlan(4, (2, 1))


# -- exactness on tiny models ---------------------------------------------------------------------------


def test_every_split_and_recompute_set_is_exact_through_the_codec(tiny_model):
    """For every k in 0..L (and a few scattered recompute sets): encode, decode, complete, generate;
    the tokens equal a recomputation without any cache and the logits agree."""
    arch, model, spec = tiny_model
    L = spec.num_layers
    context = ids(24)
    want = hf.generate(model, context, max_new_tokens=8, use_cache=False)
    plans = [LayerPlan.prefix(L, k) for k in range(L + 1)]
    plans += [LayerPlan.recompute(L, layers) for layers in ([0, L - 1], [1], [L - 2, L - 1])]
    for plan in plans:
        packet = codec.decode(codec.encode(partial.send(model, context[:, :-1], plan, producer="sender")))
        assert packet.is_partial == (not plan.is_full)
        cache = partial.complete(packet, model, spec)
        got = hf.generate(model, context, cache=cache, max_new_tokens=8)
        assert got.prefilled == 1
        assert got.tokens == want.tokens, (arch, plan.describe())
        torch.testing.assert_close(got.first_logits, want.first_logits, atol=LOGIT_ATOL, rtol=0)


def test_the_sender_can_record_while_it_generates(tiny_model):
    """Hidden states recorded over a prefill and the decode steps after it cover the whole cache."""
    arch, model, spec = tiny_model
    prompt = ids(12, seed=3)
    plan = LayerPlan.prefix(spec.num_layers, 1)
    with partial.record(model, plan.hidden_layers) as recorder:
        sent = hf.generate(model, prompt, max_new_tokens=6)
    covered = torch.cat([prompt, torch.tensor([sent.tokens[:-1]])], dim=1)
    packet = partial.extract(sent.cache, recorder.hidden(), spec, covered, plan)
    context = torch.cat([covered, torch.tensor([[sent.tokens[-1]]])], dim=1)
    got = hf.generate(model, context, cache=partial.complete(packet, model, spec), max_new_tokens=5)
    assert got.tokens == hf.generate(model, context, max_new_tokens=5, use_cache=False).tokens, arch


# -- on the wire -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    return model, hf.model_spec(model)


def test_a_partial_packet_is_version_3_and_ordinary_packets_stay_version_2(llama):
    model, spec = llama
    context = ids(10)
    full = partial.send(model, context, LayerPlan.prefix(spec.num_layers, spec.num_layers))
    half = partial.send(model, context, LayerPlan.prefix(spec.num_layers, 2))
    assert not full.is_partial and codec.peek(codec.encode(full)).format_version == 2
    data = codec.encode(half)
    assert codec.peek(data).format_version == 3
    meta = json.loads(helpers.header_of(data)[1]["__metadata__"]["kvwire"])
    assert meta["partial"] == {"layers": [0, 1], "hidden_size": 64}
    names = set(helpers.header_of(data)[1]) - {"__metadata__"}
    assert names == {"token_ids", "mask", "keys.0", "values.0", "keys.1", "values.1", "hidden.2"}
    back = codec.decode(data)
    assert back.layers == (0, 1) and sorted(back.hidden) == [2] and back.id == half.id != full.id
    assert back.nbytes == half.nbytes and back.describe()["partial"]["hidden_layers"] == [2]
    int8 = codec.decode(codec.encode(half, encoding="int8"))  # K/V quantized, hidden states exact
    assert torch.equal(int8.hidden[2], half.hidden[2])


@pytest.mark.parametrize("edit, message", [
    (lambda h: h.pop("hidden.2"), "missing"),
    (lambda h: h["hidden.2"].__setitem__("shape", [1, 10, 32]), "hidden"),
    (helpers.edit_meta("partial", {"layers": [0, 5], "hidden_size": 64}), "layer indices in \\[0, 3\\)"),
    (helpers.edit_meta("partial", {"layers": [1, 0], "hidden_size": 64}), "ascending"),
    (helpers.edit_meta("partial", {"layers": [0], "hidden_size": 2 ** 40}), "hidden_size must be"),
    (helpers.edit_meta("partial", {"layers": [0, 1, 2], "hidden_size": 64}), "fewer than 3"),
    (helpers.edit_meta("partial", {"layers": [0, 1]}), "partial"),
    (helpers.edit_meta("format_version", 2), "unexpected"),
])
def test_a_malformed_partial_packet_is_refused(llama, edit, message):
    model, spec = llama
    data = codec.encode(partial.send(model, ids(10), LayerPlan.prefix(spec.num_layers, 2)))
    with pytest.raises(CorruptPacketError, match=message):
        codec.decode(helpers.rewrite(data, edit))


def test_partial_packets_do_not_join_chains_or_build_plain_caches(llama):
    model, spec = llama
    packet = partial.send(model, ids(10), LayerPlan.prefix(spec.num_layers, 1))
    with pytest.raises(ChainError, match="standalone"):
        join([packet, packet])
    with pytest.raises(PacketError, match="partial"):
        hf.build_cache(packet, model, spec)
    with pytest.raises(PacketError, match="standalone causal prefix"):
        packet.with_provenance(start=3).validate()


def test_kvwire_inspect_shows_a_partial_packet(llama, tmp_path):
    model, spec = llama
    path = codec.save(partial.send(model, ids(10), LayerPlan.recompute(spec.num_layers, [0, 2])), tmp_path / "p.kv")
    proc = subprocess.run([sys.executable, "-m", "kvwire", "inspect", str(path), "--json"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["partial"] == {"layers": [1], "hidden_layers": [0, 2], "hidden_size": 64}


# -- bad input -------------------------------------------------------------------------------------------


def test_another_architecture_is_refused(tiny_tokenizer, llama):
    model, spec = llama
    qwen = tiny.model("qwen2", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    packet = partial.send(model, ids(10), LayerPlan.prefix(spec.num_layers, 1))
    with pytest.raises(ModelMismatchError, match="same architecture"):
        partial.complete(packet, qwen)


def test_other_weights_need_an_explicit_yes(tiny_tokenizer, llama):
    model, spec = llama
    variant = copy.deepcopy(model)
    with torch.no_grad():
        for layer in hf.decoder_layers(variant)[2:]:
            layer.mlp.down_proj.weight.mul_(1.5)
    context = ids(16, seed=4)
    packet = partial.send(model, context[:, :-1], LayerPlan.prefix(spec.num_layers, 2))
    with pytest.raises(ModelMismatchError, match="allow_variant=True"):
        partial.complete(packet, variant)
    cache = partial.complete(packet, variant, allow_variant=True)
    # layers 0-1 are the base model's (the variant's are the same there), layer 2 is the variant's own
    own = hf.new_cache(variant)
    with torch.inference_mode():
        variant(input_ids=context[:, :-1], past_key_values=own, use_cache=True)
    for layer in range(spec.num_layers):
        torch.testing.assert_close(cache.layers[layer].keys, own.layers[layer].keys, atol=1e-5, rtol=0)


def test_layer_sensitivity_points_at_the_layers_whose_kv_differ(llama):
    """A variant whose layer-1 MLP differs computes the same K/V as the base in layers 0 and 1 (their
    inputs are unchanged) and other K/V in layer 2: only layer 2 is sensitive."""
    model, spec = llama
    variant = copy.deepcopy(model)
    with torch.no_grad():
        hf.decoder_layers(variant)[1].mlp.down_proj.weight.mul_(2.0)
    context = ids(12, seed=5)
    caches = []
    for net in (model, variant):
        caches.append(hf.new_cache(net))
        with torch.inference_mode():
            net(input_ids=context, past_key_values=caches[-1], use_cache=True)
    continuation = ids(6, seed=6)
    sensitivity = partial.layer_sensitivity(variant, caches[1], caches[0], continuation)
    assert sensitivity[0] < 1e-9 and sensitivity[1] < 1e-9 and sensitivity[2] > 1e-6
    mixed = partial.swap_layers(caches[1], caches[0], [2], variant)
    assert torch.equal(mixed.layers[2].keys, caches[0].layers[2].keys)
    assert torch.equal(mixed.layers[0].keys, caches[1].layers[0].keys)


def test_padding_and_unrecorded_layers_are_refused(llama):
    model, spec = llama
    plan = LayerPlan.prefix(spec.num_layers, 1)
    packet = partial.send(model, ids(10), plan)
    padded = packet.with_provenance(mask=torch.tensor([[0] + [1] * 9], dtype=torch.uint8))
    with pytest.raises(PacketError, match="padding"):
        partial.complete(padded, model, spec)
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids(10), past_key_values=cache, use_cache=True)
    with pytest.raises(PacketError, match="not recorded"):
        partial.extract(cache, {}, spec, ids(10), plan)


# -- the real default model -----------------------------------------------------------------------------


@pytest.mark.real_model
def test_every_split_is_exact_on_the_default_model(real_model):
    """SmolLM2-135M, every k in 0..30: greedy tokens identical to a recomputation without cache and
    logits within tolerance. One sender prefill records the hidden state entering every layer;
    each k is checked by teacher forcing the reference continuation (argmax at every step equal to
    the reference token is what greedy decoding from that cache produces), and one k end to end."""
    model, tokenizer, spec = real_model
    L = spec.num_layers
    messages = [{"role": "user", "content": "List three uses of Python's itertools module, briefly."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    context = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    reference = hf.generate(model, context, max_new_tokens=12, use_cache=False)
    forced = torch.tensor([[int(context[0, -1]), *reference.tokens[:-1]]])
    want_logits = hf.forward_logits(model, None, torch.cat([context[:, :-1], forced], dim=1))[-forced.shape[1]:]

    cache = hf.new_cache(model)
    with partial.record(model, range(L)) as recorder, torch.inference_mode():
        model(input_ids=context[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    hidden = recorder.hidden()
    for k in range(L + 1):
        plan = LayerPlan.prefix(L, k)
        packet = partial.extract(cache, hidden, spec, context[:, :-1], plan)
        logits = hf.forward_logits(model, partial.complete(packet, model, spec), forced)
        assert logits.argmax(-1).tolist() == reference.tokens, k
        torch.testing.assert_close(logits, want_logits, atol=REAL_ATOL, rtol=0)

    packet = codec.decode(codec.encode(partial.extract(cache, hidden, spec, context[:, :-1], LayerPlan.prefix(L, 20))))
    got = hf.generate(model, context, cache=partial.complete(packet, model, spec), max_new_tokens=12)
    assert got.tokens == reference.tokens and got.prefilled == 1
    torch.testing.assert_close(got.first_logits, reference.first_logits, atol=REAL_ATOL, rtol=0)
