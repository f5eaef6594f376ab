"""The decode step without transformers' modules (``kvwire.hf.step``): what takes it, and that it decodes
what a step through the modules decodes.

``hf.generate`` uses it by itself for every plain decode step of a Llama or Qwen2 model (rows with no
padding, all at one position); ``step.disabled()`` sends steps through transformers, the reference here.
fp32 agrees within float rounding; the compact formats round the same inputs to bf16, so a rare input
lands on the other side of a bf16 step: greedy tokens agree and the KL stays small.
"""

from __future__ import annotations

import pytest
import torch

from kvwire import hf
from kvwire.errors import ModelError
from kvwire.hf import step, weights
from tests.support import tiny

LEAN = ("llama", "qwen2")


def _ids(n: int, seed: int, vocab: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(5, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _both(model, ids, **kwargs):
    """(this step's generation, transformers' generation) of the same request, keeping every step's logits."""
    kwargs = {"max_new_tokens": 12, "eos_ids": frozenset(), "keep_logits": True, **kwargs}
    lean = hf.generate(model, ids, **kwargs)
    with step.disabled():
        reference = hf.generate(model, ids, **kwargs)
    return lean, reference


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.fixture(scope="module")
def tiny_models(tiny_tokenizer):
    return {arch: tiny.model(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id) for arch in tiny.ARCHS}


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_which_models_take_the_step(tiny_models, arch):
    plan = step.plan_for(tiny_models[arch], 1)
    assert (plan is not None) == (arch in LEAN)  # neox (partial rotary) and gemma3 (sliding windows) do not


@pytest.mark.parametrize("arch", LEAN)
def test_fp32_steps_equal_transformers_steps(tiny_models, tiny_tokenizer, arch):
    model = tiny_models[arch]
    lean, reference = _both(model, _ids(20, 0, len(tiny_tokenizer)))
    assert lean.tokens == reference.tokens
    torch.testing.assert_close(lean.step_logits, reference.step_logits, rtol=1e-4, atol=1e-4)
    # the cache it leaves is the one transformers leaves: its K/V go on into packets
    for mine, theirs in zip(lean.cache.layers, reference.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", LEAN)
def test_batched_rows_and_placed_positions(tiny_models, tiny_tokenizer, arch):
    model = tiny_models[arch]
    vocab = len(tiny_tokenizer)
    lean, reference = _both(model, _ids(16, 1, vocab, batch=3))  # three rows, no padding: one position
    assert lean.batch_tokens == reference.batch_tokens
    torch.testing.assert_close(lean.step_logits, reference.step_logits, rtol=1e-4, atol=1e-4)
    # a spliced context: positions jump past the slots (a mask of ones, positions given)
    ids = _ids(16, 2, vocab)
    positions = torch.arange(16)[None] + torch.tensor([[0] * 8 + [30] * 8])
    lean, reference = _both(model, ids, position_ids=positions, attention_mask=torch.ones(1, 16))
    assert lean.tokens == reference.tokens
    torch.testing.assert_close(lean.step_logits, reference.step_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_compact_formats_agree(tiny_tokenizer, fmt):
    model = weights.convert(tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id), fmt)
    assert step.plan_for(model, 1) is not None
    lean, reference = _both(model, _ids(20, 3, len(tiny_tokenizer)))
    assert lean.tokens == reference.tokens
    assert _kl(reference.step_logits[0], lean.step_logits[0]) < 1e-3


def test_int4_groups_are_one_product_with_the_same_bits(tiny_tokenizer):
    """int4 groups q/k/v and gate/up (one product each); a step with the groups and one with each linear
    alone give the same bits, and a layer whose codes were replaced is left out of its group."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(  # heads of 32: q/k/v fill the kernel's row blocks, so they group
        vocab_size=len(tiny_tokenizer), hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, initializer_range=0.1)).eval()
    model = weights.convert(model, "int4")
    assert all(set(weights.groups_of(layer)) == {"self_attn", "mlp"} for layer in model.model.layers)
    ids = _ids(20, 5, len(tiny_tokenizer))
    grouped, modules = _both(model, ids, max_new_tokens=8)
    assert grouped.tokens == modules.tokens and _kl(modules.step_logits[0], grouped.step_logits[0]) < 1e-3
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.v_proj.packed = torch.nn.Parameter(attention.v_proj.packed.clone(), requires_grad=False)
        layer.mlp.up_proj.packed = torch.nn.Parameter(layer.mlp.up_proj.packed.clone(), requires_grad=False)
        assert weights.groups_of(layer) == {}
    alone = hf.generate(model, ids, max_new_tokens=8, eos_ids=frozenset(), keep_logits=True)
    assert grouped.tokens == alone.tokens
    assert torch.equal(grouped.step_logits, alone.step_logits)


def test_padded_rows_go_through_transformers(tiny_models, tiny_tokenizer, monkeypatch):
    model = tiny_models["llama"]
    calls = []
    monkeypatch.setattr("kvwire.hf.generation.lean_step", lambda *a, **k: calls.append(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding: rows at different positions
    hf.generate(model, _ids(12, 4, len(tiny_tokenizer), batch=2), attention_mask=mask, max_new_tokens=4,
                eos_ids=frozenset())
    assert calls == []


def test_anything_it_does_not_know_is_left_to_transformers(tiny_tokenizer, monkeypatch):
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    assert step.plan_for(model, 1) is not None
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert step.plan_for(model, 1) is None  # a hook must see its module run
    handle.remove()
    assert step.plan_for(model, 1) is not None
    with step.disabled():
        assert step.plan_for(model, 1) is None
    monkeypatch.setenv(step.ENV, "off")
    assert step.plan_for(model, 1) is None
    monkeypatch.setenv(step.ENV, "of")  # a typo is an error, not a silent "on"
    with pytest.raises(ModelError, match="KVWIRE_STEP"):
        step.plan_for(model, 1)
    monkeypatch.delenv(step.ENV)
    model.train()
    assert step.plan_for(model, 1) is None
    model.eval()
    handle = model.register_forward_pre_hook(lambda *args: None)  # on the model itself too
    assert step.plan_for(model, 1) is None
    handle.remove()
    attention = model.model.layers[0].self_attn
    attention.q_proj = torch.nn.Sequential(attention.q_proj)  # a wrapped linear (an adapter): unknown
    assert step.plan_for(model, 1) is None


def test_a_plan_does_not_keep_its_model_alive(tiny_tokenizer):
    import gc
    import weakref

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    hf.generate(model, _ids(8, 6, len(tiny_tokenizer)), max_new_tokens=3, eos_ids=frozenset())
    assert step.plan_for(model, 1) is not None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def _forced(model, ids, tokens, lean: bool) -> torch.Tensor:
    """fp32 logits [n, V] of decode steps fed ``tokens`` one by one after ``ids`` (teacher forcing: both paths
    see the same tokens, so a near-tie decided the other way does not send them down different texts)."""
    cache = hf.generate(model, ids, max_new_tokens=1, eos_ids=frozenset()).cache
    plan = step.plan_for(model, 1)
    out = []
    with torch.inference_mode(), hf.reserved(cache, len(tokens)):
        for token in tokens:
            if lean:
                out.append(step.step(plan, cache, torch.tensor([token])))
            else:
                out.append(model(input_ids=torch.tensor([[token]]), past_key_values=cache).logits[:, -1].float())
    return torch.cat(out)


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_real_model_steps_agree(real_model, fmt):
    """The default model, 32 tokens from a chat prompt. fp32: the same greedy tokens, logits within float
    rounding. int4: fed the same tokens, every step's distribution within a small KL of the modules' and the
    same top token on nearly all (bf16 roundings that land the other way; greedy runs of int4 part at a
    near-tie now and then, whichever of two equally valid roundings a path takes)."""
    from kvwire import models

    model, tokenizer, _ = real_model
    if fmt != "fp32":
        model, tokenizer = hf.load_model(models.resolve(), weights=fmt)
    assert step.plan_for(model, 1) is not None
    chat = [{"role": "user", "content": "Explain in two sentences why a hash map lookup is fast."}]
    ids = tokenizer(hf.render_chat(tokenizer, chat), return_tensors="pt", add_special_tokens=False)["input_ids"]
    if fmt == "fp32":
        lean, reference = _both(model, ids, max_new_tokens=32)
        assert lean.tokens == reference.tokens
        torch.testing.assert_close(lean.step_logits, reference.step_logits, rtol=1e-3, atol=1e-3)
        return
    tokens = hf.generate(model, ids, max_new_tokens=32, eos_ids=frozenset()).tokens
    lean, modules = _forced(model, ids, tokens, True), _forced(model, ids, tokens, False)
    per_step = [_kl(modules[i:i + 1], lean[i:i + 1]) for i in range(len(tokens))]
    assert max(per_step) < 2e-2 and sum(per_step) / len(per_step) < 3e-3, per_step
    assert (lean.argmax(-1) == modules.argmax(-1)).float().mean() >= 0.9
