"""Splicing upstream segments into a receiver's own context (tiny models).

A receiver with its own system prompt places a segment another agent computed
after a different prefix: keys are re-rotated to their new positions, gaps are
recomputed, and a chosen fraction R of the spliced tokens is recomputed. R = 1
reproduces a fresh prefill exactly; smaller R trades fidelity for speed.
"""

from __future__ import annotations

import pytest
import torch

from kvwire import ChainError, ModelError, ModelMismatchError, PacketError, codec, hf
from kvwire.splice import Recompute, Segment, assemble

LLAMA_LIKE = ("llama", "qwen2", "neox")


def rand(n, seed):
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def segment_from(model, spec, prefix, body):
    """What a sender publishes: the K/V of ``body`` computed after its own ``prefix``."""
    ids = torch.tensor([prefix + body])
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return codec.decode(codec.encode(hf.extract(cache, spec, ids, start=len(prefix), producer="sender")))


@pytest.fixture(params=LLAMA_LIKE)
def scene(request, tiny_tokenizer):
    """Receiver context: [own prefix 7][segment A 12][gap 2][segment B 9][own turn 4]."""
    import tiny

    model = tiny.model(request.param, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    spec = hf.model_spec(model)
    own, body_a, gap, body_b, turn = rand(7, 1), rand(12, 2), rand(2, 3), rand(9, 4), rand(4, 5)
    seg_a = segment_from(model, spec, rand(5, 6), body_a)  # A was computed after a 5-token prefix
    seg_b = segment_from(model, spec, rand(9, 7) + body_a + gap, body_b)  # B after a 9-token prefix and A
    context = own + body_a + gap + body_b + turn
    segments = [Segment(7, seg_a), Segment(21, seg_b)]
    return model, spec, hf.rope_tables(model), context, segments


def test_full_recompute_is_exactly_a_fresh_prefill(scene):
    model, spec, tables, context, segments = scene
    spliced = assemble(model, spec, tables, context, segments, recompute=Recompute(fraction=1.0))
    assert (spliced.length, spliced.recomputed, spliced.gaps, spliced.spliced) == (30, 21, 2, 0)
    out = hf.generate(model, context, cache=spliced.cache, max_new_tokens=10, eos_ids=frozenset())
    ref = hf.generate(model, context, max_new_tokens=10, eos_ids=frozenset(), use_cache=False)
    assert out.tokens == ref.tokens
    torch.testing.assert_close(out.first_logits, ref.first_logits, atol=1e-4, rtol=0)


def test_partial_recompute_recomputes_what_it_says(scene):
    model, spec, tables, context, segments = scene
    for fraction, first in [(0.0, 0), (0.3, 0), (0.0, 3)]:
        spliced = assemble(model, spec, tables, context, segments, recompute=Recompute(fraction, first))
        assert spliced.gaps == 2 and spliced.length == 30
        expected = round(fraction * 21) + (3 * 2 if first else 0)
        assert spliced.recomputed == expected and spliced.spliced == 21 - expected
        out = hf.generate(model, context, cache=spliced.cache, max_new_tokens=4)
        assert len(out.tokens) >= 1


def test_recomputing_more_brings_the_logits_closer(scene):
    model, spec, tables, context, segments = scene
    ref = hf.generate(model, context, max_new_tokens=1, use_cache=False).first_logits
    errors = []
    for fraction in (0.0, 0.5, 1.0):
        spliced = assemble(model, spec, tables, context, segments, recompute=Recompute(fraction))
        logits = hf.generate(model, context, cache=spliced.cache, max_new_tokens=1).first_logits
        errors.append(float((logits - ref).abs().max()))
    assert errors[2] < 1e-4 and errors[0] > errors[2]


def test_explicit_and_global_positions(scene):
    model, spec, tables, context, segments = scene
    at_100 = assemble(model, spec, tables, context, segments, placement=100, recompute=Recompute(1.0))
    assert at_100.positions[:7].tolist() == list(range(7)) and int(at_100.positions[7]) == 100
    assert not at_100.contiguous
    # fully recomputed, the context equals a fresh forward pass at the same (gapped) positions
    gen = hf.generate(model, context, cache=at_100.cache, position_ids=at_100.positions[None], max_new_tokens=1)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([context]), position_ids=at_100.positions[None]).logits[0, -1]
    torch.testing.assert_close(gen.first_logits, ref, atol=1e-4, rtol=0)
    globally = assemble(model, spec, tables, context, [Segment(7, segments[0].packet.with_provenance(start=50)),
                                                       Segment(21, segments[1].packet.with_provenance(start=80))],
                        placement="global")
    assert int(globally.positions[7]) == 50 and int(globally.positions[21]) == 80


def test_overlaps_and_mismatches_are_refused(scene):
    model, spec, tables, context, segments = scene
    with pytest.raises(PacketError, match="overlaps the receiver's own tokens"):
        assemble(model, spec, tables, context, segments, placement=3)
    with pytest.raises(PacketError, match="overlaps"):
        assemble(model, spec, tables, context, [segments[0], Segment(10, segments[1].packet)])
    wrong = list(context)
    wrong[9] = (wrong[9] + 1) % 400
    with pytest.raises(ChainError, match="holds other tokens"):
        assemble(model, spec, tables, wrong, segments)
    with pytest.raises(PacketError, match="leave at least one token"):
        assemble(model, spec, tables, context[:30], segments)


def test_segments_from_another_model_or_rope_are_refused(scene, tiny_tokenizer):
    import dataclasses

    model, spec, tables, context, segments = scene
    other_rope = dataclasses.replace(spec, rope={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    foreign = segments[0].packet.with_provenance(spec=other_rope)
    with pytest.raises(ModelMismatchError, match="rope"):
        assemble(model, spec, tables, context, [Segment(7, foreign)])


def test_sliding_window_models_are_refused(tiny_tokenizer):
    import tiny

    model = tiny.model("gemma3", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    spec = hf.model_spec(model)
    seg = segment_from(model, spec, rand(5, 1), rand(6, 2))
    with pytest.raises(ModelError, match="sliding-window"):
        assemble(model, spec, hf.rope_tables(model), rand(4, 3) + rand(6, 2) + rand(3, 4), [Segment(4, seg)])


def test_selection_takes_the_tokens_that_deviate_most(scene):
    """R picks the spliced tokens whose layer-1 K/V differ most from a fresh computation."""
    model, spec, tables, context, segments = scene
    plain = assemble(model, spec, tables, context, segments)  # R = 0: segments as received
    end = plain.length
    fresh_k, fresh_v = hf.layer_kv(model, torch.tensor([context[:end]]), plain.positions[None, :end], 1)
    kept_k, kept_v = plain.cache.layers[1].keys, plain.cache.layers[1].values
    slots = [s for seg in segments for s in range(seg.offset, seg.offset + seg.packet.length)]
    score = {s: float(((fresh_k[:, :, s] - kept_k[:, :, s]) ** 2).sum() / (fresh_k ** 2).mean()
                      + ((fresh_v[:, :, s] - kept_v[:, :, s]) ** 2).sum() / (fresh_v ** 2).mean()) for s in slots}
    top = set(sorted(slots, key=score.get, reverse=True)[: round(0.3 * len(slots))])
    chosen = assemble(model, spec, tables, context, segments, recompute=Recompute(0.3))
    assert set(chosen.selected.tolist()) == top | {19, 20}  # plus the two gap tokens
