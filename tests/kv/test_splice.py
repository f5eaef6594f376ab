"""Splicing upstream segments into a receiver's own context (tiny models).

A receiver with its own system prompt places a segment another agent computed
after a different prefix: keys are re-rotated to their new positions, gaps are
recomputed, and a chosen fraction R of the spliced tokens is recomputed. R = 1
reproduces a fresh prefill exactly; smaller R trades fidelity for speed.
"""

from __future__ import annotations

import pytest
import torch

from kvwire import ChainError, ModelError, ModelMismatchError, PacketError, hf
from kvwire.wire import codec
from kvwire.kv.splice import Recompute, Segment, assemble

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
    from tests.support import tiny

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


def test_appending_segments_together_equals_one_at_a_time(scene):
    """hf.append takes several packets at once (one copy of the cache instead of one per packet), and
    checks them all before it changes anything."""
    from kvwire.wire import rope

    model, spec, tables, context, segments = scene
    a, b = (rope.move(s.packet, tables, s.offset) for s in segments)
    own = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([context[:7]]), past_key_values=own, use_cache=True)
    one, both = hf.clone_cache(own, model), hf.clone_cache(own, model)
    hf.append(one, a)
    hf.append(one, b)
    hf.append(both, a, b)
    assert hf.cache_length(both) == 7 + a.length + b.length
    for x, y in zip(one.layers, both.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
    with pytest.raises(PacketError, match="position-free"):
        hf.append(own, a, rope.strip_packet(b, tables))
    assert hf.cache_length(own) == 7  # nothing appended


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


def test_recompute_reads_only_kept_earlier_slots_and_fresh_selected_ones(scene):
    """What a recomputed slot depends on: the kept (not selected) slots before it and the
    selected slots recomputed before it -- never a later slot, never the stale K/V a
    selected slot held. Garbage in exactly those places changes nothing."""
    model, spec, tables, context, segments = scene
    plain = assemble(model, spec, tables, context, segments)  # R = 0
    end = plain.length
    selected = torch.tensor([8, 9, 19, 20, 25])
    results = []
    for garbage in ([], [8, 9, 19, 20, 25, 26, 27, 28, 29]):  # the selected slots' old K/V and every later slot
        cache = hf.clone_cache(plain.cache, model)
        for layer in cache.layers:
            layer.keys[:, :, garbage] = 1e3
            layer.values[:, :, garbage] = -1e3
        hf.recompute(model, cache, spec, torch.tensor([context[:end]]), plain.positions[:end], selected)
        results.append(cache)
    for clean, dirty in zip(*(r.layers for r in results)):
        torch.testing.assert_close(dirty.keys[:, :, selected], clean.keys[:, :, selected], atol=1e-5, rtol=0)
        torch.testing.assert_close(dirty.values[:, :, selected], clean.values[:, :, selected], atol=1e-5, rtol=0)


def test_through_computes_the_receivers_turn_in_the_same_pass(scene):
    """``through=True``: the receiver's own turn after the last segment is computed in the splice's last pass, with
    the gaps and the recomputed share; the cache then covers every context id and ``first_logits`` picks the
    first reply token (``hf.generate(..., first_logits=...)``). The same numbers as splicing to the last segment
    and prefilling the turn after it, at every R and selection; at R = 1, a fresh prefill's."""
    model, spec, tables, context, segments = scene
    for recompute in (Recompute(0.0), Recompute(0.3), Recompute(0.3, select="kv-deviation"), Recompute(1.0)):
        through = assemble(model, spec, tables, context, segments, recompute=recompute, through=True)
        apart = assemble(model, spec, tables, context, segments, recompute=recompute)
        assert (through.length, apart.length) == (len(context), 30)
        assert torch.equal(through.selected, apart.selected)
        two_passes = hf.generate(model, context, cache=apart.cache, max_new_tokens=6, eos_ids=frozenset())
        one_pass = hf.generate(model, context, cache=through.cache, max_new_tokens=6, eos_ids=frozenset(),
                               first_logits=through.first_logits)
        assert one_pass.prefilled == 0 and one_pass.tokens == two_passes.tokens
        torch.testing.assert_close(one_pass.first_logits, two_passes.first_logits, atol=1e-4, rtol=0)
        for a, b in zip(through.cache.layers, two_passes.cache.layers):  # generate grew both by the same tokens
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
    ref = hf.generate(model, context, max_new_tokens=1, use_cache=False).first_logits
    torch.testing.assert_close(through.first_logits, ref, atol=1e-4, rtol=0)  # R = 1: exact


def test_the_receivers_own_tokens_are_computed_exactly_whatever_the_selection(scene):
    """The receiver's own tokens before the first segment are placeholders until the last pass computes them
    (the selection's probes read around them); whatever the selection, they equal a plain prefill of those
    tokens."""
    from kvwire.kv.splice import SELECTIONS

    model, spec, tables, context, segments = scene
    own = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([context[:7]]), past_key_values=own, use_cache=True)
    for select in SELECTIONS:
        for fraction in (0.0, 0.3):
            spliced = assemble(model, spec, tables, context, segments, recompute=Recompute(fraction, select=select))
            for mine, fresh in zip(spliced.cache.layers, own.layers):
                torch.testing.assert_close(mine.keys[:, :, :7], fresh.keys, atol=1e-5, rtol=0)
                torch.testing.assert_close(mine.values[:, :, :7], fresh.values, atol=1e-5, rtol=0)


def test_a_splice_runs_a_four_token_probe_then_one_pass_for_everything_else(scene):
    """What each forward pass of a splice carries (on a CPU every pass streams all the weights): with the default
    selection, the attention probe runs the turn's last 4 tokens alone, and one pass computes the own prefix,
    the gaps, the recomputed share and (``through``) the receiver's turn. K/V deviation adds a two-layer pass
    over the context; R = 0 or 1 selects nothing and runs the one pass."""
    model, spec, tables, context, segments = scene
    rows: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        for recompute, expected in ((Recompute(7 / 21), [4, 7 + 2 + 7 + 4]), (Recompute(0.0), [7 + 2 + 4]),
                                    (Recompute(1.0), [30 + 4])):
            rows.clear()
            assemble(model, spec, tables, context, segments, recompute=recompute, through=True)
            assert rows == expected, recompute
    finally:
        handle.remove()


def test_first_logits_need_the_cache_they_were_computed_into(scene):
    model, spec, tables, context, segments = scene
    apart = assemble(model, spec, tables, context, segments)
    with pytest.raises(PacketError, match="must cover all"):
        hf.generate(model, context, cache=apart.cache, first_logits=torch.zeros(400))


def test_fill_computes_chosen_slots_and_a_tail_in_one_pass(scene):
    """``hf.fill``, the one pass under every splice: chosen slots in place, a tail appended (or only read through,
    a probe that leaves the cache as it was), and what the reading tokens attended to."""
    model, spec, tables, context, segments = scene
    plain = assemble(model, spec, tables, context, segments)  # R = 0: the cache up to the last segment
    end, ids, positions = plain.length, torch.tensor([context]), plain.positions
    before = [layer.keys.clone() for layer in plain.cache.layers]
    reference = hf.clone_cache(plain.cache, model)
    probe = hf.fill(model, plain.cache, ids[:, :end], positions[:end], torch.zeros(0, dtype=torch.long),
                    ids[:, end:], positions[end:], keep_tail=False, reads=2)
    assert probe.reads.shape == (spec.num_layers, end) and hf.cache_length(plain.cache) == end
    assert all(torch.equal(layer.keys, old) for layer, old in zip(plain.cache.layers, before))
    # the same weights as transformers' own eager attention returns for the tail run after the cache
    eager = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=ids[:, end:], past_key_values=reference, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(eager)
    expected = torch.stack([a[0, :, -2:, :end].amax(dim=(0, 1)) for a in out.attentions])
    torch.testing.assert_close(probe.reads, expected, atol=1e-5, rtol=0)
    filled = hf.fill(model, plain.cache, ids[:, :end], positions[:end], torch.tensor([8, 19, 20]), ids[:, end:],
                     positions[end:])
    assert hf.cache_length(plain.cache) == len(context) and filled.logits.shape == (400,)
    with pytest.raises(PacketError, match="sorted, unique"):
        hf.fill(model, plain.cache, ids, positions, torch.tensor([5, 3]))


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
    from tests.support import tiny

    model = tiny.model("gemma3", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    spec = hf.model_spec(model)
    seg = segment_from(model, spec, rand(5, 1), rand(6, 2))
    with pytest.raises(ModelError, match="sliding-window"):
        assemble(model, spec, hf.rope_tables(model), rand(4, 3) + rand(6, 2) + rand(3, 4), [Segment(4, seg)])


def test_kv_deviation_takes_the_tokens_that_deviate_most(scene):
    """CacheBlend's criterion picks the spliced tokens whose layer-1 K/V differ most from a fresh computation."""
    model, spec, tables, context, segments = scene
    plain = assemble(model, spec, tables, context, segments)  # R = 0: segments as received
    end = plain.length
    fresh_k, fresh_v = hf.layer_kv(model, torch.tensor([context[:end]]), plain.positions[None, :end], 1)
    kept_k, kept_v = plain.cache.layers[1].keys, plain.cache.layers[1].values
    slots = [s for seg in segments for s in range(seg.offset, seg.offset + seg.packet.length)]
    score = {s: float(((fresh_k[:, :, s] - kept_k[:, :, s]) ** 2).sum() / (fresh_k ** 2).mean()
                      + ((fresh_v[:, :, s] - kept_v[:, :, s]) ** 2).sum() / (fresh_v ** 2).mean()) for s in slots}
    top = set(sorted(slots, key=score.get, reverse=True)[: round(0.3 * len(slots))])
    chosen = assemble(model, spec, tables, context, segments, recompute=Recompute(0.3, select="kv-deviation"))
    assert set(chosen.selected.tolist()) == top | set(GAPS) | set(OWN)  # and the gaps and own prefix, computed last


# -- which slots to recompute ------------------------------------------------------------------------------------


def test_attention_probe_reads_what_eager_attention_computes(scene):
    """hf.attention_to_cache: per layer, the largest weight any head of the probe tokens gives
    each cached slot -- the same numbers a full eager forward over the whole sequence returns."""
    model, spec, tables, context, segments = scene
    n = 30
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([context[:n]]), past_key_values=cache, use_cache=True)
    before = [layer.keys.clone() for layer in cache.layers]
    implementation = model.config._attn_implementation
    weights = hf.attention_to_cache(model, cache, torch.tensor([context[n:]]), torch.arange(n),
                                    torch.arange(n, len(context)), hidden=torch.tensor([3, 17]))
    assert model.config._attn_implementation == implementation  # restored
    assert hf.cache_length(cache) == n and all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before))
    assert weights.shape == (len(cache.layers), n) and float(weights[:, [3, 17]].abs().max()) == 0.0

    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([context]), output_attentions=True)
    finally:
        model.set_attn_implementation(implementation)
    full = torch.stack([a[0, :, n:, :n].amax(dim=(0, 1)) for a in out.attentions])  # [L, n]
    plain = hf.attention_to_cache(model, cache, torch.tensor([context[n:]]), torch.arange(n),
                                  torch.arange(n, len(context)))
    torch.testing.assert_close(plain, full, atol=1e-5, rtol=1e-4)
    # at layer 0 (same inputs either way) hiding two slots only moves their weight to the others
    unhidden = [s for s in range(n) if s not in (3, 17)]
    assert bool((weights[0, unhidden] >= plain[0, unhidden] - 1e-6).all())


def test_layer_kv_is_the_fresh_prefill_at_that_layer(scene):
    """hf.layer_kv, CacheBlend's probe: one layer's K/V without running the layers above it."""
    model, spec, tables, context, segments = scene
    ids = torch.tensor([context])
    full = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=full, use_cache=True)
    for layer in range(len(full.layers)):
        keys, values = hf.layer_kv(model, ids, torch.arange(len(context))[None], layer)
        torch.testing.assert_close(keys, full.layers[layer].keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(values, full.layers[layer].values, atol=1e-5, rtol=0)



def test_layer_kv_after_an_exact_past_computes_only_the_rest(scene):
    """Given a cache whose first slots are exact (the receiver's own prefix), layer_kv computes only the
    tokens after them -- the same K/V as the whole context from scratch (splicing's selection uses this)."""
    model, spec, tables, context, segments = scene
    ids = torch.tensor([context])
    full = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=full, use_cache=True)
    for past in (1, 7, len(context) - 1):
        for layer in (0, 1, len(full.layers) - 1):
            keys, values = hf.layer_kv(model, ids[:, past:], torch.arange(past, len(context))[None], layer,
                                       past=full, past_length=past)
            assert keys.shape[2] == len(context) - past
            torch.testing.assert_close(keys, full.layers[layer].keys[:, :, past:], atol=1e-5, rtol=0)
            torch.testing.assert_close(values, full.layers[layer].values[:, :, past:], atol=1e-5, rtol=0)
    with pytest.raises(PacketError, match="beyond"):
        hf.layer_kv(model, ids[:, :2], torch.arange(2)[None], 0, past=full, past_length=len(context) + 1)

def test_the_cli_offers_every_selection():
    from kvwire.cli import run_cmd
    from kvwire.kv.splice import SELECTIONS

    option = next(p for p in run_cmd.params if p.name == "select")
    assert tuple(option.type.choices) == SELECTIONS and option.default == Recompute().select


def test_interleaving_gives_each_ranking_an_equal_share():
    from kvwire.kv.splice import _interleave

    assert _interleave([torch.tensor([5, 1, 2, 7]), torch.tensor([5, 7, 1, 2])], 3) == [5, 7, 1]
    a, b = torch.randperm(50, generator=torch.Generator().manual_seed(1)), torch.arange(50)
    picked = _interleave([a, b], 20)
    assert len(set(picked)) == 20 and set(a[:10].tolist()) <= set(picked) and set(range(10)) <= set(picked)


OWN = list(range(7))  # the scene's own prefix
GAPS = [19, 20]


def _as_selection_sees_it(cache, model, placeholders=OWN + GAPS):
    """The scene's cache before the last pass: spliced segments; the own prefix and the gaps placeholders."""
    staged = hf.clone_cache(cache, model)
    for layer in staged.layers:
        layer.keys[:, :, placeholders], layer.values[:, :, placeholders] = 0.0, 0.0
    return staged


def _reading(model, plain, context):
    """Slot scores of the default's attention half: the receiver's turn run over the spliced segments alone."""
    end = plain.length
    staged = _as_selection_sees_it(plain.cache, model)
    reads = hf.attention_to_cache(model, staged, torch.tensor([context[end:]]), plain.positions[:end],
                                  plain.positions[end:], hidden=torch.tensor(OWN + GAPS))
    return reads.sum(dim=0)


def _taking_turns(rankings, budget):
    picked: list[int] = []
    while len(picked) < budget:
        for ranking in rankings:
            slot = next(s for s in ranking if s not in picked)
            if len(picked) < budget:
                picked.append(slot)
    return picked


def test_default_selection_takes_turns_between_reading_and_the_start(scene):
    """The default criterion: half of the budget for the slots the receiver's own turn reads most (an attention
    probe over the spliced segments, its own prefix and the gaps hidden: they are not computed yet), half for the
    first spliced slots, where the first segment starts after the receiver's own prefix."""
    model, spec, tables, context, segments = scene
    plain = assemble(model, spec, tables, context, segments)  # R = 0, gaps recomputed
    slots = [s for seg in segments for s in range(seg.offset, seg.offset + seg.packet.length)]
    reads = _reading(model, plain, context)
    by_reading = sorted(slots, key=lambda s: -float(reads[s]))
    picked = _taking_turns([by_reading, slots], 7)
    chosen = assemble(model, spec, tables, context, segments, recompute=Recompute(7 / 21))
    assert set(chosen.selected.tolist()) == set(picked) | set(OWN) | set(GAPS)
    assert chosen.recomputed == 7 and chosen.spliced == 14
    assert {7, 8, 9} <= set(picked)  # the start's half: the first segment's first slots


def test_deviation_selection_takes_turns_between_reading_and_deviation(scene):
    """``attention+deviation``: the start's half goes to the largest layer-1 K/V deviation from a fresh
    computation of the context (the own prefix computed fresh in it, from the first token)."""
    model, spec, tables, context, segments = scene
    plain = assemble(model, spec, tables, context, segments)
    end = plain.length
    slots = [s for seg in segments for s in range(seg.offset, seg.offset + seg.packet.length)]
    reads = _reading(model, plain, context)
    fresh_k, fresh_v = hf.layer_kv(model, torch.tensor([context[:end]]), plain.positions[None, :end], 1)
    kept = plain.cache.layers[1]
    deviates = {s: float(((fresh_k[:, :, s] - kept.keys[:, :, s]) ** 2).sum() / (fresh_k ** 2).mean()
                         + ((fresh_v[:, :, s] - kept.values[:, :, s]) ** 2).sum() / (fresh_v ** 2).mean())
                for s in slots}
    picked = _taking_turns([sorted(slots, key=lambda s: -float(reads[s])), sorted(slots, key=lambda s: -deviates[s])],
                           7)
    chosen = assemble(model, spec, tables, context, segments, recompute=Recompute(7 / 21, select="attention+deviation"))
    assert set(chosen.selected.tolist()) == set(picked) | set(OWN) | set(GAPS)


def _corrupt_tail(packet, layer, count, scale=-30.0):
    """The packet with the K/V of its last ``count`` tokens pushed far off at one ``layer``."""
    import dataclasses

    keys, values = list(packet.keys), list(packet.values)
    keys[layer], values[layer] = keys[layer].clone(), values[layer].clone()
    keys[layer][:, :, -count:] *= scale  # large keys: the receiver's queries lock onto them (checked below)
    values[layer][:, :, -count:] = values[layer][:, :, -count:].flip(-1) * abs(scale)  # and read wrong values
    return dataclasses.replace(packet, keys=tuple(keys), values=tuple(values))


def test_a_stale_tail_the_receiver_reads_is_recomputed(scene):
    """The failure CacheBlend's criterion cannot see: the last tokens of the upstream turn,
    right before the receiver's own, deviate only at a deeper layer (layer 1 looks as usual)
    and draw the receiver's attention there. The default selection recomputes them, and then
    no trace of their stale K/V is left: the output equals that of a splice whose tail was
    never stale, with the same slots recomputed. kv-deviation leaves them as they are."""
    model, spec, tables, context, segments = scene
    deep = len(segments[1].packet.keys) - 1  # deeper than select_layer=1
    tail = {27, 28, 29}  # segment B's last three slots
    bad = [segments[0], Segment(21, _corrupt_tail(segments[1].packet, deep, 3))]
    plain = assemble(model, spec, tables, context, bad)  # R = 0
    reads = hf.attention_to_cache(model, _as_selection_sees_it(plain.cache, model), torch.tensor([context[30:]]),
                                  plain.positions[:30], plain.positions[30:], hidden=torch.tensor(OWN + GAPS))
    assert float(reads[deep, sorted(tail)].min()) > 0.9  # the premise: the receiver's turn reads the stale tail
    budget = 6 / 21  # 3 slots by reading, 3 by the start

    def first_logits(cache):
        return hf.generate(model, context, cache=cache, max_new_tokens=1).first_logits

    new = assemble(model, spec, tables, context, bad, recompute=Recompute(budget))
    old = assemble(model, spec, tables, context, bad, recompute=Recompute(budget, select="kv-deviation"))
    assert tail <= set(new.selected.tolist()) and not tail <= set(old.selected.tolist())
    end = new.length
    for spliced in (new, old):  # the same slots recomputed over segments whose tail was never stale
        clean = assemble(model, spec, tables, context, segments).cache
        hf.recompute(model, clean, spec, torch.tensor([context[:end]]), spliced.positions[:end], spliced.selected)
        difference = float((first_logits(spliced.cache) - first_logits(clean)).abs().max())
        if spliced is new:
            assert difference < 1e-4
        else:
            assert difference > 1e-2  # the stale tail is still there


def test_staleness_says_how_far_the_receivers_context_moved_each_segment(scene):
    """Each segment's staleness is the mean relative change of the K/V of its recomputed slots: what they held as
    received against what the receiver's context makes of them. A segment whose K/V were pushed off reads far
    higher than a clean one; a segment none of whose slots was recomputed reads None."""
    model, spec, tables, context, segments = scene
    clean = assemble(model, spec, tables, context, segments, recompute=Recompute(0.3))
    assert len(clean.staleness) == 2 and all(value > 0.0 for value in clean.staleness)
    deep = len(segments[1].packet.keys) - 1
    bad = assemble(model, spec, tables, context, [segments[0], Segment(21, _corrupt_tail(segments[1].packet, deep, 3))],
                   recompute=Recompute(0.3))
    assert bad.staleness[1] > 3 * clean.staleness[1]
    none = assemble(model, spec, tables, context, segments, recompute=Recompute(0.0))
    assert none.staleness == [None, None] and none.guarded == 0


def test_the_guard_recomputes_from_the_first_segment_over_its_bound_exactly(scene):
    """``Recompute(guard=g)``: after the splice's pass, a segment whose staleness is over ``g`` is recomputed with
    everything after it, in one causal pass after what comes before it (the earlier segments stay spliced). Over
    the first segment, that is a fresh prefill's result; under no segment, the splice is left as it is."""
    model, spec, tables, context, segments = scene
    ref = hf.generate(model, context, max_new_tokens=6, eos_ids=frozenset(), use_cache=False)
    plain = assemble(model, spec, tables, context, segments, recompute=Recompute(0.3), through=True)
    a, b = plain.staleness
    for through in (True, False):
        fired = assemble(model, spec, tables, context, segments, recompute=Recompute(0.3, guard=min(a, b) / 2),
                         through=through)
        assert fired.guarded == 21 and fired.recomputed == 21 and fired.spliced == 0
        out = hf.generate(model, context, cache=fired.cache, max_new_tokens=6, eos_ids=frozenset(),
                          first_logits=fired.first_logits)
        assert out.tokens == ref.tokens
        torch.testing.assert_close(out.first_logits, ref.first_logits, atol=1e-4, rtol=0)
    quiet = assemble(model, spec, tables, context, segments, recompute=Recompute(0.3, guard=max(a, b) * 2),
                     through=True)
    assert quiet.guarded == 0 and torch.equal(quiet.first_logits, plain.first_logits)
    # over segment B alone: A stays as spliced, B and the turn are computed after it
    only_b = Recompute(0.3, guard=(a + b) / 2) if b > a else None
    if only_b is not None:
        second = assemble(model, spec, tables, context, segments, recompute=only_b, through=True)
        assert second.guarded == 9 and second.spliced == plain.spliced - (9 - sum(21 <= s < 30 for s in
                                                                                 plain.selected.tolist()))
    with pytest.raises(ValueError, match="guard"):
        Recompute(0.3, guard=-1.0)
    assert Recompute(0.15, guard=0.5).describe() == "R=0.15,guard=0.5"


def test_the_estimate_says_when_splicing_pays():
    """splice.estimate, in tokens prefilled: long segments after a short exact prefix are worth splicing;
    a few short ones, or recomputing all of them (R = 1), are not -- prefill those, exactly."""
    from kvwire.kv.splice import estimate

    long = estimate(1200, 100, [(110, 600), (600, 1100)], Recompute(0.15), 30)
    assert long.splice_pays and long.between == 1000 and long.prefill_tokens == 1100
    short = estimate(400, 300, [(305, 330), (330, 360)], Recompute(0.15), 30)
    assert not short.splice_pays and short.between == 60
    assert not estimate(1200, 100, [(110, 600), (600, 1100)], Recompute(1.0), 30).splice_pays
    cheap = estimate(1200, 100, [(110, 600), (600, 1100)], Recompute(0.0), 30)
    assert cheap.splice_tokens < long.splice_tokens  # nothing selected or recomputed at R = 0
    # the attention probe reads with the turn's last `probe` tokens (4 by default), not its whole 100
    whole = estimate(1200, 100, [(110, 600), (600, 1100)], Recompute(0.15, probe=0), 30)
    assert whole.splice_tokens - long.splice_tokens == pytest.approx(100 - 4)
