"""The batched-decode engine (kvwire.hf.engine): rows join and leave between steps, rows that
share a context attend to it once per step, and every row's output equals the same request
decoded alone -- greedy tokens identical, logits within float tolerance."""

from __future__ import annotations

import logging

import pytest
import torch

import kvwire
from kvwire import EngineError, ModelError, PacketError, hf, join
from kvwire.wire import codec

NO_EOS = frozenset()


def prefilled(model, ids):
    """A DynamicCache holding ``ids`` (the context several agents share)."""
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def alone(model, request, **kwargs):
    """The same request decoded by itself, without any cache: the reference."""
    return hf.generate(model, request.input_ids, max_new_tokens=request.max_new_tokens,
                       eos_ids=request.eos_ids if request.eos_ids is not None else None,
                       sampling=request.sampling, keep_logits=True, **kwargs)


def assert_same(result, reference, atol=1e-4):
    assert result.tokens == reference.tokens
    torch.testing.assert_close(result.first_logits, reference.first_logits, atol=atol, rtol=0)
    if result.step_logits is not None:
        torch.testing.assert_close(result.step_logits, reference.step_logits[0], atol=atol, rtol=0)


def random_ids(n, seed):
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "neox"])
def model3(request, tiny_tokenizer):
    """(model, spec) of each tiny architecture the engine decodes (gemma3's sliding windows are refused)."""
    from tests.support import tiny

    model = tiny.model(request.param, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    return model, hf.model_spec(model)


@pytest.mark.parametrize("attention", ["cascade", "copy"])
def test_rows_sharing_a_prefix_equal_each_alone(model3, attention):
    model, spec = model3
    shared = random_ids(40, 0)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    requests = [hf.Request(shared + random_ids(n, n), prefix=prefix, max_new_tokens=m, eos_ids=NO_EOS,
                           keep_logits=True) for n, m in ((5, 8), (9, 3), (3, 12), (12, 6))]
    requests.append(hf.Request(random_ids(17, 99), max_new_tokens=7, eos_ids=NO_EOS, keep_logits=True))  # no prefix
    own = random_ids(25, 7)  # a private cache of another context
    requests.append(hf.Request(own + random_ids(4, 8), cache=prefilled(model, own), max_new_tokens=5,
                               eos_ids=NO_EOS, keep_logits=True))
    engine = hf.Engine(model, attention=attention)
    results = engine.run(requests)
    for result, request in zip(results, requests):
        assert_same(result, alone(model, request))
        assert result.finish_reason == "length" and result.prefilled == len(request.input_ids) - result.cached
    assert [r.cached for r in results] == [40, 40, 40, 40, 0, 25]
    assert engine.stats.max_batch == 6 and engine.stats.prefill_steps == 1


def test_decode_steps_walk_the_weights_directly_and_equal_transformers_modules(model3, monkeypatch):
    """The engine's decode steps go through kvwire.hf.step (Llama and Qwen2; NeoX's partial rotary stays
    on transformers' modules) with the engine's own attention -- rows of different lengths, a shared
    prefix, a private cache -- and give the tokens and logits of the same engine through the modules."""
    from kvwire.hf import passes as engine_module  # where the engine runs its passes

    model, _ = model3
    shared = random_ids(24, 60)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    own = random_ids(11, 61)
    requests = [hf.Request(shared + random_ids(n, n + 62), prefix=prefix, max_new_tokens=m, eos_ids=NO_EOS,
                           keep_logits=True) for n, m in ((2, 9), (6, 4), (3, 7))]
    requests.append(hf.Request(own + random_ids(5, 63), cache=prefilled(model, own), max_new_tokens=6,
                               eos_ids=NO_EOS, keep_logits=True))
    with hf.step.disabled():
        reference = hf.Engine(model).run(requests)
    real, calls = engine_module.step_rows, {"n": 0}

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "step_rows", counted)
    results = hf.Engine(model).run(requests)
    assert (calls["n"] > 0) == (model.config.model_type in ("llama", "qwen2"))
    for result, expected in zip(results, reference):
        assert result.tokens == expected.tokens
        torch.testing.assert_close(result.step_logits, expected.step_logits, atol=1e-4, rtol=0)
        for a, b in zip(result.own_keys, expected.own_keys):  # the K/V the rows leave behind
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_partial_attentions_combine_to_attention_over_the_whole_context():
    """Shared-prefix attention's arithmetic: attention over a prefix and over each row's own part,
    merged by their log-sum-exps, equals attention over both at once -- with torch's fused CPU
    kernel and with the direct fp32 computation used elsewhere."""
    from kvwire.hf import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 5, 8, generator=g) for _ in range(3))
    pk, pv = torch.randn(1, 2, 11, 8, generator=g), torch.randn(1, 2, 11, 8, generator=g)
    allowed = torch.rand(3, 1, 5, 5, generator=g) > 0.4
    allowed[..., 0] = True  # every query sees at least one own slot
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    whole = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([pk.expand(3, -1, -1, -1), k], 2), torch.cat([pv.expand(3, -1, -1, -1), v], 2),
        attn_mask=torch.cat([torch.zeros(3, 1, 5, 11), mask], -1))
    for fused in (True, False):
        attention.fused_partials = fused
        try:
            merged, _ = attention._merge(*attention.partial_attention(q, k, v, mask, 8**-0.5),
                                         *attention.partial_attention(q, pk, pv, None, 8**-0.5))
        finally:
            attention.fused_partials = attention._FLASH_CPU is not None
        torch.testing.assert_close(merged, whole, atol=1e-5, rtol=0)


def test_the_plain_partials_decode_like_the_fused_ones(model3, monkeypatch):
    """Off the CPU, shared-prefix attention computes its parts directly; outputs still equal each alone."""
    from kvwire.hf import attention

    monkeypatch.setattr(attention, "fused_partials", False)
    model, spec = model3
    shared = random_ids(30, 40)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    requests = [hf.Request(shared + random_ids(n, 41 + n), prefix=prefix, max_new_tokens=5, eos_ids=NO_EOS,
                           keep_logits=True) for n in (3, 8)]
    for result, request in zip(hf.Engine(model).run(requests), requests):
        assert_same(result, alone(model, request))


def test_the_output_layer_in_slices_gives_the_same_logits():
    from kvwire.hf.head import SlicedLinear

    linear = torch.nn.Linear(64, 1000)
    x = torch.randn(8, 3, 64, generator=torch.Generator().manual_seed(0))
    sliced = SlicedLinear(linear, slice_bytes=64 * 4 * 300, min_rows=1)  # 300 rows a slice: 4 slices, the last short
    assert sliced.rows == 300
    with torch.no_grad():
        torch.testing.assert_close(sliced(x), linear(x), atol=1e-6, rtol=0)


def test_batched_passes_run_the_output_layer_in_slices(model3, monkeypatch):
    """Passes of several rows that :mod:`kvwire.hf.linears` leaves to ``F.linear`` (on Intel CPUs those of
    more than 32 rows; here a policy whose other products cover one row only) compute the logits slice by
    slice (the default model's 113 MB output layer in 2 MiB slices; here a tiny one in slices of 128 rows),
    then the model gets its own layer back."""
    from kvwire.hf import head, linears

    model, spec = model3
    monkeypatch.setattr(linears, "_forced", linears.Policy("one-row", thin_rows=1, onednn=False))
    monkeypatch.setattr(head, "SLICE_BYTES", 128 * model.config.hidden_size * 4)
    calls = []
    forward = head.SlicedLinear.forward
    monkeypatch.setattr(head.SlicedLinear, "forward", lambda self, x: calls.append(x.shape) or forward(self, x))
    original = model.get_output_embeddings()
    requests = [hf.Request(random_ids(n, 60 + n), max_new_tokens=4, eos_ids=NO_EOS, keep_logits=True) for n in (6, 9)]
    for result, request in zip(hf.Engine(model).run(requests), requests):
        assert_same(result, alone(model, request))
    assert calls and model.get_output_embeddings() is original
    single = len(calls)
    hf.Engine(model).run(requests[:1])  # one row: its output layer is a thin product, never sliced
    assert len(calls) == single


def test_rows_without_a_shared_prefix_equal_each_alone(model3):
    """A server's distinct prompts: no row reads a prefix, so every pass is fused sdpa over the rows'
    own parts (grouped KV heads read in place, prompts of different lengths padded in one prefill)."""
    model, spec = model3
    requests = [hf.Request(random_ids(n, 30 + n), max_new_tokens=m, eos_ids=NO_EOS, keep_logits=True)
                for n, m in ((7, 9), (19, 4), (12, 11), (3, 6))]
    engine = hf.Engine(model)
    results = engine.run(requests[:3])
    late = engine.run(requests[3:])  # the engine's buffers emptied and sized afresh
    for result, request in zip(results + late, requests):
        assert_same(result, alone(model, request))
    assert engine.stats.max_batch == 3


def test_rows_join_mid_decode_and_leave_early(model3):
    """Continuous batching as a server drives it: rows come and go between steps; stopping by eos,
    stop ids, length and cancel; each row still equals itself decoded alone."""
    model, spec = model3
    shared = random_ids(30, 1)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    first = hf.Request(shared + random_ids(6, 2), prefix=prefix, max_new_tokens=10, eos_ids=NO_EOS)
    probe = alone(model, first)  # learn a token the next row will produce, to stop on it
    engine = hf.Engine(model)
    a = engine.add(first)
    steps = [engine.step(), engine.step()]  # a's prefill, then one decode step alone
    later = hf.Request(shared + random_ids(6, 2), prefix=prefix, max_new_tokens=10, eos_ids=NO_EOS,
                       stop_ids=frozenset({probe.tokens[3]}))  # same ids as `first`, stops early
    b = engine.add(later)
    c = engine.add(hf.Request(random_ids(11, 3), max_new_tokens=10, eos_ids=frozenset({probe.tokens[0]})))
    d = engine.add(hf.Request(shared + random_ids(4, 4), prefix=prefix, max_new_tokens=10, eos_ids=NO_EOS))
    steps.append(engine.step())
    assert steps[-1].kind == "prefill" and steps[-1].batch == 3
    steps.append(engine.step())
    assert steps[-1].kind == "decode" and steps[-1].batch >= 3
    assert steps[-2].prefill_s.keys() == {b, c, d} and all(v > 0 for v in steps[-2].prefill_s.values())
    assert engine.cancel(d) and not engine.cancel(12345)
    while engine.busy:
        steps.append(engine.step())
    results = {r.id: r for s in steps for r in s.finished}
    assert results[a].tokens == probe.tokens and results[a].finish_reason == "length"
    stop = probe.tokens.index(probe.tokens[3]) + 1
    assert results[b].tokens == probe.tokens[:stop] and results[b].finish_reason == "stop"
    reference_c = alone(model, hf.Request(random_ids(11, 3), max_new_tokens=10, eos_ids=NO_EOS))
    if probe.tokens[0] in reference_c.tokens:
        assert results[c].finish_reason == "eos"
        assert results[c].tokens == reference_c.tokens[: reference_c.tokens.index(probe.tokens[0]) + 1]
    else:
        assert results[c].finish_reason == "length" and results[c].tokens == reference_c.tokens
    assert results[d].finish_reason == "cancelled" and len(results[d].tokens) in (1, 2)
    streamed = {}
    for s in steps:
        for rid, tokens in s.tokens.items():
            streamed.setdefault(rid, []).extend(tokens)
    assert all(streamed[rid] == results[rid].tokens for rid in (a, b, c, d))  # what a server streams
    assert all(r.ttft_s <= r.total_s and r.prefill_s > 0 for r in results.values())


def test_sampling_and_positions_are_per_row(model3):
    model, spec = model3
    shared = random_ids(20, 5)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    hot = [hf.Request(shared + random_ids(5, 6), prefix=prefix, max_new_tokens=8, eos_ids=NO_EOS,
                      sampling=hf.Sampling(temperature=0.9, top_p=0.9, seed=seed)) for seed in (1, 2)]
    greedy = hf.Request(shared + random_ids(5, 6), prefix=prefix, max_new_tokens=8, eos_ids=NO_EOS)
    jumped = hf.Request(random_ids(9, 9), cache=None, max_new_tokens=6, eos_ids=NO_EOS, first_position=50)
    results = hf.Engine(model).run([*hot, greedy, jumped])
    for result, request in zip(results[:3], [*hot, greedy]):
        assert result.tokens == alone(model, request).tokens
    positions = torch.arange(50, 59)[None]  # the whole context sits at 50.. (nothing cached)
    reference = hf.generate(model, jumped.input_ids, position_ids=positions, max_new_tokens=6, eos_ids=NO_EOS)
    assert results[3].tokens == reference.tokens
    assert results[0].tokens != results[1].tokens or results[0].tokens != results[2].tokens


def test_finished_rows_publish_as_packets(model3):
    """A finished row's cache continues its parent chain: extract() equals hf.extract on the full
    cache (same id, same tensors) without copying the shared prefix, and a receiver of it
    continues exactly."""
    model, spec = model3
    shared = random_ids(30, 10)
    cache = prefilled(model, shared)
    parent = codec.decode(codec.encode(hf.extract(cache, spec, torch.tensor([shared]), producer="reader")))
    prefix = hf.Prefix.from_packet(parent)
    (result,) = hf.Engine(model).run([hf.Request(shared + random_ids(6, 11), prefix=prefix, max_new_tokens=5,
                                                 eos_ids=NO_EOS)])
    packet = result.extract(spec, parent=parent, producer="critic")
    full = hf.extract(result.cache(model), spec, torch.tensor([result.covered_ids]), parent=parent,
                      producer="critic", created_at=packet.created_at)
    assert packet.id == full.id and packet.start == 30 and packet.length == 6 + 4
    for mine, theirs in zip(packet.keys + packet.values, full.keys + full.values):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
    assert packet.keys[0].data_ptr() != prefix.keys[0].data_ptr()
    context = join([parent, packet])
    follow = result.covered_ids + [result.tokens[-1]] + random_ids(3, 12)
    continued = hf.generate(model, follow, cache=hf.build_cache(context, model, spec), max_new_tokens=6,
                            eos_ids=NO_EOS)
    assert continued.tokens == hf.generate(model, follow, max_new_tokens=6, eos_ids=NO_EOS, use_cache=False).tokens


def test_a_caller_can_end_a_row_as_a_stop_and_still_publish_it(model3):
    """What a server does when the decoded text reaches a stop string: finish(row) ends the row
    before the next step with finish_reason "stop", its K/V kept for publishing."""
    model, spec = model3
    shared = random_ids(20, 30)
    request = hf.Request(shared + random_ids(5, 31), prefix=hf.Prefix.from_cache(prefilled(model, shared), shared),
                         max_new_tokens=10, eos_ids=NO_EOS)
    engine = hf.Engine(model)
    rid = engine.add(request)
    engine.step(), engine.step(), engine.step()  # prefill, two decode steps: three tokens
    assert engine.finish(rid) and not engine.finish(rid)
    (result,) = engine.step().finished
    assert result.finish_reason == "stop" and result.tokens == alone(model, request).tokens[:3]
    packet = result.extract(spec, start=20)  # the row's own tokens, as a segment
    assert packet.length == 5 + 2 and packet.token_ids[0].tolist() == result.covered_ids[20:]

    # a caller that must answer now takes the result at once instead of with the next step
    other = engine.add(hf.Request(shared + random_ids(5, 32), prefix=request.prefix, max_new_tokens=10,
                                  eos_ids=NO_EOS))
    engine.step(), engine.step()
    assert engine.finish(other)
    taken = engine.take_result(other)
    assert taken.finish_reason == "stop" and len(taken.tokens) == 2 and engine.take_result(other) is None
    assert not engine.busy and engine.step().finished == []  # the next step no longer reports it


def test_memory_budget_falls_back_to_smaller_batches(model3, caplog):
    model, spec = model3
    shared = random_ids(30, 13)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    requests = [hf.Request(shared + random_ids(5, 20 + i), prefix=prefix, max_new_tokens=6, eos_ids=NO_EOS)
                for i in range(4)]
    per_row = hf.Engine(model).rows_cache.nbytes_for(1, 64)
    engine = hf.Engine(model, memory_budget=2 * per_row)
    with caplog.at_level(logging.INFO, logger="kvwire.hf.engine"):
        results = engine.run(requests)
    assert engine.stats.max_batch == 2 and engine.stats.deferred > 0
    assert "memory budget" in caplog.text and "smaller batches" in caplog.text
    for result, request in zip(results, requests):
        assert result.tokens == alone(model, request).tokens
    # a long row waiting behind short ones gets its turn once they leave (the buffers are sized afresh)
    engine = hf.Engine(model, memory_budget=2 * per_row)
    mixed = requests[:2] + [hf.Request(random_ids(90, 40), max_new_tokens=30, eos_ids=NO_EOS)]
    assert [len(r.tokens) for r in engine.run(mixed)] == [6, 6, 30]
    with pytest.raises(EngineError, match="over the engine's memory budget"):
        hf.Engine(model, memory_budget=per_row).add(hf.Request(random_ids(100, 1), max_new_tokens=8))


def test_reserved_buffers_are_allocated_at_start_kept_and_never_grown_for_what_fits(model3):
    """reserve_slots: max_batch rows of that many slots from the start, kept while idle, so a long prompt
    joining running rows does not reallocate them; outputs equal an engine without a reservation; a
    row longer than the reservation still fits (the buffers grow) and they shrink back when idle."""
    model, _ = model3
    shared = random_ids(30, 15)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    requests = [hf.Request(shared + random_ids(5, 30 + i), prefix=prefix, max_new_tokens=6, eos_ids=NO_EOS)
                for i in range(2)] + [hf.Request(random_ids(100, 33), max_new_tokens=6, eos_ids=NO_EOS)]
    engine = hf.Engine(model, max_batch=3, reserve_slots=120)
    cache = engine.rows_cache
    assert (cache.rows, cache.capacity) == (3, 128)
    buffers = [layer.keys for layer in cache.layers]
    engine.add(requests[0])
    engine.add(requests[1])
    engine.step()
    engine.add(requests[2])  # joins the two running rows
    results = {}
    while engine.busy:
        results.update((r.id, r) for r in engine.step().finished)
    assert all(a is b for a, b in zip(buffers, (layer.keys for layer in cache.layers)))  # never reallocated
    assert (cache.rows, cache.capacity) == (3, 128)  # kept while idle
    plain = hf.Engine(model, max_batch=3).run(requests)
    assert [r.tokens for _, r in sorted(results.items())] == [r.tokens for r in plain]
    longer = hf.Request(random_ids(150, 34), max_new_tokens=4, eos_ids=NO_EOS)
    (result,) = engine.run([longer])
    assert result.tokens == alone(model, longer).tokens
    assert (cache.rows, cache.capacity) == (3, 128)  # back to the reservation
    with pytest.raises(ValueError, match="reserve_slots"):
        hf.Engine(model, reserve_slots=-1)
    with pytest.raises(EngineError, match="memory budget"):
        hf.Engine(model, max_batch=4, reserve_slots=120, memory_budget=cache.nbytes_for(4, 128) - 1)
    with pytest.raises(EngineError, match="context window"):
        hf.Engine(model, reserve_slots=10**7)


def test_bad_requests_are_refused(model3):
    model, spec = model3
    shared = random_ids(10, 14)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    engine = hf.Engine(model)
    with pytest.raises(PacketError, match="do not start with its prefix"):
        engine.add(hf.Request(random_ids(12, 15), prefix=prefix))
    with pytest.raises(PacketError, match="leave at least one context token uncached"):
        engine.add(hf.Request(shared, prefix=prefix))
    with pytest.raises(PacketError, match="not both"):
        engine.add(hf.Request(shared + [5], prefix=prefix, cache=prefilled(model, shared)))
    engine.add(hf.Request(shared + [5], prefix=prefix))
    with pytest.raises(EngineError, match="idle engine"):
        engine.run([hf.Request(shared + [6], prefix=prefix)])


def test_sliding_window_models_are_refused(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("gemma3", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    with pytest.raises(ModelError, match="sliding-window"):
        hf.Engine(model)


def test_the_model_is_left_as_it_was(model3):
    """The engine switches attention only for its own forward passes."""
    model, spec = model3
    before = model.config._attn_implementation
    hf.Engine(model).run([hf.Request(random_ids(8, 16), max_new_tokens=2)])
    assert model.config._attn_implementation == before
    model.set_attn_implementation("eager")  # a caller's own choice between engine runs is kept too
    try:
        request = hf.Request(random_ids(8, 17), max_new_tokens=3, eos_ids=NO_EOS, keep_logits=True)
        assert_same(hf.Engine(model).run([request])[0], alone(model, request))
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation(before)


@pytest.mark.real_model
def test_real_model_rows_equal_each_alone(real_model):
    """The default model: rows of different lengths sharing a prefix, two joining mid-decode, one
    stopping early on a stop id; each equals itself decoded alone."""
    model, tokenizer, spec = real_model
    document = tokenizer("The incident began at 09:12 when the checkout service started failing. " * 20,
                         add_special_tokens=False)["input_ids"]
    prefix = hf.Prefix.from_cache(prefilled(model, document), document)
    questions = ["Summarize it.", "List the numbers.", "What failed first?", "Who owns the fix?"]
    requests = [hf.Request(document + tokenizer(q, add_special_tokens=False)["input_ids"], prefix=prefix,
                           max_new_tokens=12, keep_logits=True, eos_ids=frozenset()) for q in questions]
    # no eos: every row runs its 12 tokens (the model's short answers would otherwise end rows before
    # the late ones join), except the one that stops on its own stop id
    references = [alone(model, request) for request in requests]
    requests[3].stop_ids = frozenset({references[3].tokens[4]})
    engine = hf.Engine(model)
    ids = [engine.add(requests[0]), engine.add(requests[1])]
    finished = [r for _ in range(3) for r in engine.step().finished]
    ids += [engine.add(requests[2]), engine.add(requests[3])]
    while engine.busy:
        finished += engine.step().finished
    results = {r.id: r for r in finished}
    for rid, reference in zip(ids[:3], references[:3]):
        assert_same(results[rid], reference, atol=2e-3)
    stopped = results[ids[3]]
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == reference_until(references[3].tokens, references[3].tokens[4])
    assert engine.stats.max_batch == 4


@pytest.mark.real_model
def test_real_model_distinct_prompts_equal_each_alone(real_model):
    """The default model (9 query heads on 3 KV heads) decoding prompts that share nothing, as
    ``kvwire serve --no-reuse`` batches concurrent requests."""
    model, tokenizer, spec = real_model
    texts = ["Write a haiku about a lighthouse keeper.", "List three prime numbers and explain why.",
             "The checkout service failed at 09:12 after a config push; the on-call engineer " * 6]
    requests = [hf.Request(tokenizer(t)["input_ids"], max_new_tokens=10, keep_logits=True, eos_ids=frozenset())
                for t in texts]
    for result, request in zip(hf.Engine(model).run(requests), requests):
        assert_same(result, alone(model, request), atol=2e-3)


def reference_until(tokens, stop):
    return tokens[: tokens.index(stop) + 1]


def test_sampling_settings_are_checked_when_made():
    """A seed a 64-bit generator cannot take, a NaN temperature or top_p 0: refused with the setting named."""
    for bad, name in ((dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"),
                      (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(ValueError, match=name):
            hf.Sampling(**bad)
    assert hf.Sampling(temperature=0.7, top_p=0.9, seed=2**64 - 1).seed == 2**64 - 1


def test_tiny_temperatures_pick_greedily_and_large_logits_sample(model3):
    """Temperatures down to the smallest float are greedy (under 1e-5, as vLLM treats them), never
    NaN probabilities; logits / T cannot overflow because the largest logit is moved to 0 first. In a
    batch, such a row decodes beside a greedy one and both equal themselves alone."""
    from kvwire.hf.generation import GREEDY_BELOW, pick

    logits = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 30
    for temperature in (5e-324, 1e-46, 1e-40, 1e-8, GREEDY_BELOW / 2):
        assert pick(logits, hf.Sampling(temperature=temperature), torch.Generator()) == int(logits.argmax())
    huge = torch.full((8,), 3e38)
    huge[5] = 3.4e38
    assert pick(huge, hf.Sampling(temperature=1e-3), torch.Generator().manual_seed(0)) == 5
    model, _ = model3
    ids = [random_ids(9, 40), random_ids(12, 41)]
    rows = hf.Engine(model).run([hf.Request(ids[0], max_new_tokens=5, sampling=hf.Sampling(temperature=1e-40)),
                                 hf.Request(ids[1], max_new_tokens=5)])
    for row, context in zip(rows, ids):
        assert row.tokens == hf.generate(model, context, max_new_tokens=5).tokens


def test_a_context_past_the_model_window_is_refused_before_any_prefill(tiny_tokenizer):
    """hf.generate and the engine check context + new tokens against max_position_embeddings up front."""
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    window = model.config.max_position_embeddings
    ids = torch.randint(3, 300, (window - 4,)).tolist()
    with pytest.raises(kvwire.ContextTooLong, match=f"context window of {window:,}"):
        hf.generate(model, ids, max_new_tokens=5)
    with pytest.raises(kvwire.ContextTooLong, match="plus 5 new tokens"):
        hf.Engine(model).add(hf.Request(ids, max_new_tokens=5))
    assert len(hf.generate(model, ids, max_new_tokens=4, eos_ids=frozenset()).tokens) == 4  # exactly fits


# -- one row's failure ends that row alone ----------------------------------------------------------


def _requests(shared_prefix):
    shared = random_ids(30, 1)
    prefix = hf.Prefix.from_cache(prefilled(shared_prefix, shared), shared)
    return [hf.Request(shared + random_ids(n, n), prefix=prefix, max_new_tokens=6, eos_ids=NO_EOS, tag=f"r{n}",
                       sampling=hf.Sampling(0.0, 1.0, n)) for n in (3, 5, 7, 9)]


def test_a_row_whose_sampling_raises_ends_alone_and_the_others_keep_their_tokens(model3, monkeypatch):
    model, _ = model3
    requests = _requests(model)
    clean = {r.tag: r.tokens for r in hf.Engine(model).run(requests)}
    real = kvwire.hf.engine.pick
    calls = {"n": 0}

    def pick(logits, sampling, generator):
        calls["n"] += 1
        if sampling.seed == 5 and calls["n"] > 6:  # request r5's third token, mid-decode
            raise ValueError("injected: this row's sampler failed")
        return real(logits, sampling, generator)

    monkeypatch.setattr(kvwire.hf.engine, "pick", pick)
    results = {r.tag: r for r in hf.Engine(model).run(requests)}
    bad = results.pop("r5")
    assert bad.finish_reason == "error" and "injected" in str(bad.error) and bad.own_keys == ()
    assert {tag: r.tokens for tag, r in results.items()} == {t: v for t, v in clean.items() if t != "r5"}
    assert all(r.finish_reason == "length" and r.error is None for r in results.values())


def test_a_failed_batched_pass_is_retried_row_by_row_and_changes_nothing(model3, monkeypatch, caplog):
    """A fault of the batched forward itself (not of one row): each row again alone, same tokens."""
    model, _ = model3
    requests = _requests(model)
    clean = [r.tokens for r in hf.Engine(model).run(requests)]
    real = hf.Engine._forward
    failures = {"left": 2}  # the prefill pass of all four, then the second decode step

    def forward(self, parts):
        ids = parts[0].ids
        if ids.shape[0] > 1 and failures["left"] and (failures["left"] == 2 or ids.shape[1] == 1):
            failures["left"] -= 1
            raise RuntimeError("injected: the batched pass failed")
        return real(self, parts)

    monkeypatch.setattr(hf.Engine, "_forward", forward)
    with caplog.at_level(logging.WARNING, logger="kvwire.hf.engine"):
        results = hf.Engine(model).run(requests)
    assert failures["left"] == 0 and "retrying row by row" in caplog.text
    assert [r.tokens for r in results] == clean and {r.finish_reason for r in results} == {"length"}


def test_a_row_that_fails_alone_too_is_the_culprit_and_ends(model3, monkeypatch):
    """A forward that fails whenever one request's context is in it (a crafted bad row): the batch is
    retried row by row, that row ends with its error, the others decode as if it had never come."""
    model, _ = model3
    requests = _requests(model)
    clean = {r.tag: r.tokens for r in hf.Engine(model).run(requests[:2] + requests[3:])}
    real = hf.Engine._forward

    def forward(self, parts):  # the buffer rows each part of the pass covers
        if any(row.request is requests[2] for part in parts
               for row in self._active[part.plan.first_row:part.plan.first_row + part.plan.batch]):
            raise RuntimeError("injected: this row's context breaks the model")
        return real(self, parts)

    monkeypatch.setattr(hf.Engine, "_forward", forward)
    results = {r.tag: r for r in hf.Engine(model).run(requests)}
    bad = results.pop(requests[2].tag)
    assert bad.finish_reason == "error" and bad.tokens == [] and "breaks the model" in str(bad.error)
    assert {tag: r.tokens for tag, r in results.items()} == clean


# -- chunked prefill: a long prompt joins without stalling the rows that decode ---------------------


def _join_long_prompt(model, chunk, long_ids, prefix, shared):
    """Three rows decoding, then a long prompt joins: every step's kind and who produced a token."""
    engine = hf.Engine(model, prefill_chunk=chunk)
    short = [engine.add(hf.Request(shared + random_ids(4, n), prefix=prefix, max_new_tokens=24, eos_ids=NO_EOS,
                                   keep_logits=True)) for n in (1, 2, 3)]
    engine.step()
    engine.step()  # the three decode
    long_id = engine.add(hf.Request(long_ids, max_new_tokens=6, eos_ids=NO_EOS, keep_logits=True))
    log = []
    results = {}
    while engine.busy:
        step = engine.step()
        log.append((step.kind, sorted(step.tokens)))
        results.update((r.id, r) for r in step.finished)
    return engine, short, long_id, results, log


def test_a_chunked_prefill_interleaves_decode_steps_and_changes_no_token(model3):
    model, _ = model3
    shared = random_ids(20, 5)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    long_ids = random_ids(100, 6)
    _, short, long_id, whole, whole_log = _join_long_prompt(model, None, long_ids, prefix, shared)
    engine, short_c, long_c, chunked, log = _join_long_prompt(model, 16, long_ids, prefix, shared)
    for a, b in zip(short + [long_id], short_c + [long_c]):  # the same rows, token for token, logits close
        assert chunked[b].tokens == whole[a].tokens
        torch.testing.assert_close(chunked[b].step_logits, whole[a].step_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(chunked[long_c].first_logits, whole[long_id].first_logits, atol=1e-4, rtol=0)
    assert_same(chunked[long_c], alone(model, hf.Request(long_ids, max_new_tokens=6, eos_ids=NO_EOS,
                                                          keep_logits=True)))
    # unchunked, the long prompt's one prefill is a step in which nobody decodes; chunked, each of its
    # chunks (100 tokens: 16 first, fewer as its context grows) rides in one pass with the decode step of
    # the three running rows
    assert whole_log[0] == ("prefill", [long_id])
    sizes = [16]
    while sum(sizes) < 100:
        sizes.append(min(hf.chunk_tokens(16, sum(sizes), engine.attention_reach), 100 - sum(sizes)))
    n = len(sizes)
    assert n > 100 // 16 + 1  # the tiny model's attention is dear next to its linears: chunks shrink
    assert [kind for kind, _ in log[:n + 1]] == ["mixed"] * n + ["decode"]
    assert all(produced == sorted(short_c) for _, produced in log[:n - 1])  # the three keep producing tokens
    assert log[n - 1][1] == sorted(short_c + [long_c])  # the last chunk gives the long row its first token
    assert chunked[long_c].prefilled == 100 and chunked[long_c].finish_reason == "length"


def test_chunks_shrink_as_the_context_grows_so_that_every_pass_costs_the_first_ones():
    """A chunk's cost: its tokens' linear layers plus their attention over the context so far. The default
    model's attention costs as much as its linear layers at ~3,100 tokens of context."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, num_hidden_layers=30)
    reach = hf.attention_reach(config)
    assert reach == (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536) / (2 * 9 * 64) == 3072

    def cost(n, context):
        return n * (1 + (context + n / 2) / reach)

    assert hf.chunk_tokens(192, 0, reach) == 192
    context, sizes = 0, []
    while context < 15000:
        sizes.append(hf.chunk_tokens(192, context, reach))
        assert cost(sizes[-1], context) <= cost(192, 0) < cost(sizes[-1] + 1, context) or sizes[-1] == 48
        context += sizes[-1]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 48  # never below a quarter of the first
    assert hf.chunk_tokens(192, 10**6, float("inf")) == 192  # no sizes in the config: a constant chunk


@pytest.mark.parametrize("attention", ["cascade", "copy"])
def test_decode_steps_packed_with_chunks_of_two_long_prompts_change_no_token(model3, attention):
    """Two long prompts join at once -- one reading the shared prefix, one a private cache of its own --
    while rows of different lengths decode: every pass packs the decode step with a chunk of each, and
    every row still equals the same request decoded alone."""
    model, _ = model3
    shared = random_ids(30, 11)
    prefix = hf.Prefix.from_cache(prefilled(model, shared), shared)
    engine = hf.Engine(model, prefill_chunk=12, attention=attention)
    requests = [hf.Request(shared + random_ids(n, n + 20), prefix=prefix, max_new_tokens=m, eos_ids=NO_EOS,
                           keep_logits=True) for n, m in ((3, 20), (7, 5), (2, 16))]
    ids = [engine.add(r) for r in requests]
    engine.step()
    own = random_ids(9, 31)
    late = [hf.Request(shared + random_ids(50, 32), prefix=prefix, max_new_tokens=4, eos_ids=NO_EOS, keep_logits=True),
            hf.Request(own + random_ids(41, 33), cache=prefilled(model, own), max_new_tokens=6, eos_ids=NO_EOS,
                       keep_logits=True)]
    ids += [engine.add(r) for r in late]
    kinds, results = [], {}
    while engine.busy:
        step = engine.step()
        kinds.append(step.kind)
        results.update((r.id, r) for r in step.finished)
    assert kinds.count("mixed") >= 4  # 50 and 41 tokens by 12: five and four chunks, each with a decode step
    for rid, request in zip(ids, requests + late):
        assert_same(results[rid], alone(model, request))
        assert results[rid].finish_reason == "length"


def test_a_fault_in_a_packed_pass_ends_only_the_row_that_caused_it(model3, monkeypatch, caplog):
    """A long prompt whose context breaks the model, joining rows that decode: the packed pass fails, its
    parts run apart to find the culprit, and only the long prompt ends; the others keep their tokens."""
    model, _ = model3
    requests = [hf.Request(random_ids(n, n + 40), max_new_tokens=10, eos_ids=NO_EOS) for n in (4, 6)]
    clean = [r.tokens for r in hf.Engine(model).run(requests)]
    poisoned = hf.Request(random_ids(40, 50), max_new_tokens=4, eos_ids=NO_EOS)
    real = hf.Engine._forward

    def forward(self, parts):
        if any(part.ids.shape[1] > 1 and self._active[part.plan.first_row].request is poisoned for part in parts):
            raise RuntimeError("injected: this prompt breaks the model")
        return real(self, parts)

    monkeypatch.setattr(hf.Engine, "_forward", forward)
    engine = hf.Engine(model, prefill_chunk=8)
    ids = [engine.add(r) for r in requests]
    engine.step()
    bad = engine.add(poisoned)
    results = {}
    with caplog.at_level(logging.WARNING, logger="kvwire.hf.engine"):
        while engine.busy:
            results.update((r.id, r) for r in engine.step().finished)
    assert "running them apart" in caplog.text
    assert results[bad].finish_reason == "error" and "breaks the model" in str(results[bad].error)
    assert [results[i].tokens for i in ids] == clean


def test_chunked_prefill_alone_and_rows_ending_mid_chunk(model3):
    """Chunks exist so that running rows keep decoding: a long prompt with nothing else running is prefilled in one
    pass. A row that leaves while another is mid-prefill moves that row's buffer place, which must keep its
    chunks; with no row left decoding, the rest of the prompt follows in one pass."""
    model, _ = model3
    long_ids = random_ids(70, 8)
    reference = alone(model, hf.Request(long_ids, max_new_tokens=5, eos_ids=NO_EOS, keep_logits=True))
    engine = hf.Engine(model, prefill_chunk=8)
    quick = engine.add(hf.Request(random_ids(5, 9), max_new_tokens=2, eos_ids=NO_EOS))
    engine.step()
    rid = engine.add(hf.Request(long_ids, max_new_tokens=5, eos_ids=NO_EOS, keep_logits=True))
    results, kinds = {}, []
    while engine.busy:
        step = engine.step()
        kinds.append((step.kind, sorted(step.tokens)))
        results.update((r.id, r) for r in step.finished)
    assert results[quick].finish_reason == "length"
    assert kinds[0] == ("mixed", [quick])  # quick's last token beside the long prompt's first chunk of 8
    assert kinds[1] == ("prefill", [rid])  # quick has left: the other 62 tokens in one pass, and a first token
    assert_same(results[rid], reference)
    lone = hf.Engine(model, prefill_chunk=8)
    rid = lone.add(hf.Request(long_ids, max_new_tokens=5, eos_ids=NO_EOS, keep_logits=True))
    assert [lone.step().kind for _ in range(3)] == ["prefill", "decode", "decode"]  # 70 tokens, one pass
    for bad in (0, -3, True, "half", 2.5):
        with pytest.raises(ValueError, match="prefill_chunk"):
            hf.Engine(model, prefill_chunk=bad)


def test_an_auto_prefill_chunk_is_what_a_pass_adds_in_a_decode_steps_time():
    """prefill_chunk="auto" (kvwire serve's default) times a decode step and a prefill of the model on the CPU:
    the first chunk is what the prefill's marginal rate adds in one more step's time, never under AUTO_FLOOR;
    whole prefills (None) where that covers the context window. On an accelerator it is whole prefills
    (tests/hf/test_devices.py)."""
    from kvwire.hf.passes import AUTO_FLOOR, chunk_for

    assert chunk_for(step_s=0.028, fill_s=0.30, tokens=256, window=8192) == AUTO_FLOOR  # 2 CPU cores: ~26 tokens
    assert chunk_for(step_s=0.020, fill_s=0.022, tokens=256, window=8192) == 2560  # a pass holds 2,560 a step
    assert chunk_for(step_s=0.035, fill_s=0.0351, tokens=256, window=8192) is None  # 89,600: the whole window
    assert chunk_for(step_s=0.035, fill_s=0.030, tokens=256, window=None) is None  # no marginal cost measured
    assert chunk_for(step_s=0.020, fill_s=0.022, tokens=256, window=None) == 2560
    from tests.support import tiny

    engine = hf.Engine(tiny.model("llama", 300, 2), prefill_chunk="auto")  # measured here, on this model
    assert engine.prefill_chunk is None or engine.prefill_chunk >= AUTO_FLOOR


@pytest.mark.real_model
def test_real_model_chunked_prefill_gives_the_same_tokens(real_model):
    model, tokenizer, _ = real_model
    text = "The checkout service failed at 09:12 after a config push; the on-call engineer rolled back. " * 25
    ids = tokenizer(text)["input_ids"]
    request = hf.Request(ids, max_new_tokens=16, eos_ids=frozenset(), keep_logits=True)
    busy = hf.Request(ids[:9], max_new_tokens=24, eos_ids=frozenset())  # decoding: the long prompt is chunked
    whole = hf.Engine(model).run([request])[0]
    engine = hf.Engine(model, prefill_chunk=128)
    chunked = engine.run([busy, request])[1]
    assert engine.stats.prefill_steps >= 5  # one pass for the short prompt, then chunks beside its decode steps
    assert len(ids) > 500 and chunked.tokens == whole.tokens
    torch.testing.assert_close(chunked.first_logits, whole.first_logits, atol=2e-3, rtol=0)
    assert_same(chunked, alone(model, request), atol=2e-3)
