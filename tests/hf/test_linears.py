"""How inference passes compute their linear layers (kvwire.hf.linears): a policy picks, by the rows
(tokens) of a pass, one of three products that give the same fp32 dot products -- ``F.linear``, the
thin ``W @ x^T``, oneDNN's -- and whatever it picks, decoding equals the recomputation that keeps
``F.linear`` (greedy tokens identical, logits within float tolerance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvwire import ModelError, hf
from kvwire.hf import linears

NO_EOS = frozenset()
AVAILABLE = ["off"] + (["mkl"] if linears._has_mkl() else []) + (["onednn"] if linears._has_onednn() else [])


def random_ids(n, seed):
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_each_policy_names_the_product_for_a_pass_of_so_many_rows():
    mkl, onednn, off = (linears.POLICIES[name] for name in ("mkl", "onednn", "off"))
    assert [mkl.kernel(r) for r in (0, 1, 4, 32, 33, 1700)] == [None, "thin", "thin", "thin", None, None]
    assert [onednn.kernel(r) for r in (0, 1, 4, 5, 32, 1700)] == [None, "thin", "thin", "onednn", "onednn", "onednn"]
    assert {off.kernel(r) for r in (1, 4, 1700)} == {None}


@pytest.mark.parametrize("name", AVAILABLE)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 32, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_every_product_gives_the_values_of_f_linear(name, rows, bias):
    """Same dot products, float rounding apart, for one row (given as two columns) and many; with a
    gradient wanted it is ``F.linear`` itself."""
    linear = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 1, 96, generator=torch.Generator().manual_seed(rows))
    with linears.using(name), torch.no_grad():
        out = linears._forward(linear, x)
        assert out.shape == (rows, 1, 200) and out.is_contiguous()
        torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
    x.requires_grad_(True)
    with linears.using(name):
        assert torch.equal(linears._forward(linear, x), F.linear(x, linear.weight, linear.bias))


def test_a_non_contiguous_input_is_computed_as_given():
    linear = torch.nn.Linear(32, 48)
    x = torch.randn(8, 2, 32).transpose(0, 1)  # [2, 8, 32], not contiguous
    for name in AVAILABLE:
        with linears.using(name), torch.no_grad():
            torch.testing.assert_close(linears._forward(linear, x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", AVAILABLE)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_decoding_equals_the_recomputation_that_keeps_f_linear(name, arch, tiny_tokenizer):
    """The engine (prefill pass of 5 rows, then decode steps of 5, 4, ... rows) and ``hf.generate`` (a
    12-token prefill, then single-row steps) under each policy equal the reference without a cache, whose
    passes never leave ``F.linear``; the model's layers are their own again afterwards."""
    from tests.support import tiny

    model = tiny.model(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    requests = [hf.Request(random_ids(n, 80 + n), max_new_tokens=5, eos_ids=NO_EOS, keep_logits=True)
                for n in (4, 7, 9, 12, 5)]
    with linears.using(name):
        results = hf.Engine(model).run(requests)
        alone = [hf.generate(model, r.input_ids, max_new_tokens=5, eos_ids=NO_EOS, keep_logits=True) for r in requests]
    for result, single, request in zip(results, alone, requests):
        reference = hf.generate(model, request.input_ids, max_new_tokens=5, eos_ids=NO_EOS, keep_logits=True,
                                use_cache=False)
        assert result.tokens == single.tokens == reference.tokens
        torch.testing.assert_close(result.step_logits, reference.step_logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(single.step_logits, reference.step_logits, atol=1e-4, rtol=0)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_passes_take_the_product_their_rows_call_for(tiny_tokenizer, monkeypatch):
    """Under oneDNN's policy (thin up to 4 rows): the engine's 60-token prefill pass is oneDNN's, its
    5-row decode steps too, and single-row steps thin; under ``off`` nothing leaves ``F.linear``."""
    if not linears._has_onednn():
        pytest.skip("this torch has no working oneDNN fp32 linear")
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    head = model.get_output_embeddings()
    seen = []
    kernel = linears.Policy.kernel

    def counted(self, rows):
        picked = kernel(self, rows)
        seen.append((rows, picked))
        return picked
    monkeypatch.setattr(linears.Policy, "kernel", counted)
    calls = []
    forward = linears._forward
    monkeypatch.setattr(linears, "_forward", lambda linear, x: calls.append(linear is head) or forward(linear, x))
    requests = [hf.Request(random_ids(n, 80 + n), max_new_tokens=3, eos_ids=NO_EOS) for n in (4, 7, 9, 12, 5)]
    with linears.using("onednn"):
        hf.Engine(model).run(requests)
    used = {rows: picked for rows, picked in seen}
    assert used[60] == "onednn" and used[5] == "onednn"
    assert calls.count(True) == 4  # the output layer: every pass, the engine's routing probe too
    seen.clear()
    with linears.using("onednn"):
        hf.generate(model, requests[3].input_ids, max_new_tokens=3, eos_ids=NO_EOS)
    assert {rows: picked for rows, picked in seen}[1] == "thin"
    seen.clear()
    with linears.disabled():
        hf.Engine(model).run(requests)
        hf.generate(model, requests[3].input_ids, max_new_tokens=3, eos_ids=NO_EOS)
    assert seen and all(picked is None for _, picked in seen)  # every product F.linear's (the decode step asks too)


def test_prefills_outside_generation_use_the_policy_too(tiny_tokenizer, monkeypatch):
    """A plain prefill (fuse mode's sharer) and the cost probe (what ``kvwire probe`` says a prefill
    costs) compute their linears the way generation does."""
    if AVAILABLE[-1] == "off":
        pytest.skip("this torch has neither MKL nor oneDNN: every pass is F.linear")
    from tests.support import tiny
    from kvwire.pipeline import cost

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    rows = []
    forward = linears._forward
    monkeypatch.setattr(linears, "_forward",
                        lambda linear, x: rows.append(x.numel() // x.shape[-1]) or forward(linear, x))
    with linears.using(AVAILABLE[-1]):
        cache = hf.prefill(model, random_ids(20, 1))
        assert hf.cache_length(cache) == 20 and 20 in rows
        cost.probe_model(model, 1024, tokens=24)
        assert 24 in rows


def test_every_pass_patches_each_linear_once_however_many_passes_ran(tiny_tokenizer, monkeypatch):
    """A server's engine runs millions of passes: what a pass patches is the decoder's linears and the
    output layer, once each, at the thousandth pass as at the first, and nothing stays patched after."""
    if AVAILABLE[-1] == "off":
        pytest.skip("this torch has neither MKL nor oneDNN: every pass is F.linear")
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    expected = sum(1 for layer in hf.decoder_layers(model) for m in layer.modules() if type(m) is torch.nn.Linear)
    patched = []
    import functools
    import types

    counting = types.SimpleNamespace(partial=lambda f, linear: patched.append(linear) or functools.partial(f, linear))
    monkeypatch.setattr(linears, "functools", counting)
    with linears.using(AVAILABLE[-1]), torch.inference_mode():
        for n in range(1000):
            patched.clear()
            with linears.fast_linears(model, 1, 1) as head_handled:
                assert head_handled
            if n in (0, 999):
                assert len(patched) == len(set(map(id, patched))) == expected + 1
                assert model.get_output_embeddings() in patched
        patched.clear()
        with linears.fast_linears(model, 1, 0):  # a pass that leaves the output layer to F.linear
            pass
    assert model.get_output_embeddings() not in patched and len(patched) == expected
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_gradient_leaves_every_pass_to_f_linear(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    with torch.enable_grad(), linears.fast_linears(model, 1, 1) as head_handled:
        assert not head_handled and not any("forward" in m.__dict__ for m in model.modules())


def test_the_environment_chooses_and_a_bad_value_is_refused(monkeypatch):
    assert linears._from_env("off") is linears.POLICIES["off"]
    assert linears._from_env("") is linears._from_env("auto")
    with pytest.raises(ModelError, match=r"KVWIRE_LINEARS='fast' .*auto, mkl, onednn, off"):
        linears._from_env("fast")
    monkeypatch.setattr(linears, "_has_onednn", lambda: False)
    linears._from_env.cache_clear()
    try:
        with pytest.raises(ModelError, match="no working oneDNN"):
            linears._from_env("onednn")
    finally:
        linears._from_env.cache_clear()
    with pytest.raises(ValueError, match="unknown policy"):
        linears.using("fast").__enter__()


@pytest.mark.parametrize(("machine", "vendor", "onednn", "mkl", "expected"), [
    ("x86_64", "AuthenticAMD", True, True, "onednn"),  # MKL runs its AVX2 code here: oneDNN is twice as fast
    ("x86_64", "GenuineIntel", True, True, "mkl"),  # as measured on a Xeon
    ("x86_64", "AuthenticAMD", False, True, "mkl"),
    ("aarch64", "", True, False, "off"),
])
def test_auto_follows_the_cpu(monkeypatch, machine, vendor, onednn, mkl, expected):
    monkeypatch.setattr(linears.platform, "machine", lambda: machine)
    monkeypatch.setattr(linears, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(linears, "_has_onednn", lambda: onednn)
    monkeypatch.setattr(linears, "_has_mkl", lambda: mkl)
    assert linears._auto().name == expected


@pytest.mark.real_model
def test_real_model_decodes_the_same_whatever_the_products(real_model):
    """The default model: a 600-token prefill and 12 steps under each policy give the greedy tokens of
    ``F.linear`` throughout, first-token logits within float tolerance."""
    model, tokenizer, spec = real_model
    text = "Review the following design and list its risks.\n" + "The cache is sent between agents. " * 80
    ids = tokenizer(text)["input_ids"][:600]
    with linears.disabled():
        reference = hf.generate(model, ids, max_new_tokens=12, eos_ids=NO_EOS)
    for name in AVAILABLE[1:]:
        with linears.using(name):
            out = hf.generate(model, ids, max_new_tokens=12, eos_ids=NO_EOS)
        assert out.tokens == reference.tokens, name
        torch.testing.assert_close(out.first_logits, reference.first_logits, atol=2e-3, rtol=0)


def test_a_model_cast_after_a_pass_keeps_f_linear_for_other_dtypes(tiny_tokenizer):
    """The listed layers are checked at every call: cast to float64 later, the model computes as
    ``F.linear`` would (and still decodes)."""
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    ids = random_ids(6, 3)
    hf.generate(model, ids, max_new_tokens=2, eos_ids=NO_EOS)  # lists its linears
    model.double()
    try:
        linear = hf.decoder_layers(model)[0].self_attn.q_proj
        x = torch.randn(3, linear.in_features, dtype=torch.float64)
        for name in AVAILABLE:
            with linears.using(name), torch.no_grad():
                assert torch.equal(linears._forward(linear, x), F.linear(x, linear.weight, linear.bias))
        assert len(hf.generate(model, ids, max_new_tokens=3, eos_ids=NO_EOS).tokens) == 3
    finally:
        model.float()


def test_a_bad_choice_in_the_environment_fails_when_a_model_loads(tiny_folder, monkeypatch):
    """Not at the first forward pass deep inside a run or a server's model thread: at the load."""
    monkeypatch.setenv("KVWIRE_LINEARS", "fastest")
    with pytest.raises(ModelError, match="KVWIRE_LINEARS='fastest'"):
        hf.load_model(tiny_folder)
    monkeypatch.setenv("KVWIRE_LINEARS", "off")
    model, _ = hf.load_model(tiny_folder)
    assert linears.policy().name == "off"
