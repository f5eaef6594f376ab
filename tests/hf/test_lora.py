"""LoRA fine-tuning (kvwire.hf.lora) on tiny random models: the adapter learns, its merged
model computes what the adapter computes, runs repeat exactly, the loss counts only target
tokens, and adapter files round-trip and refuse what does not fit."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support import tiny
from kvwire.errors import TrainingError
from kvwire.hf import lora
from kvwire.hf.lora import Example, LoraSettings, TrainSettings

SETTINGS = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base(tiny_tokenizer):
    return tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)


def examples(n=6, length=12, seed=0):
    """Prompt/answer pairs of random tokens: the answer is only learnable by memorising."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 400, (length,), generator=g).tolist()
        out.append(Example.prompt_answer(ids[: length // 2], ids[length // 2:]))
    return out


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids[None]).logits[0]


def test_wrapping_changes_nothing_until_trained(base):
    ids = examples(1)[0].input_ids
    wrapped = lora.wrap(copy.deepcopy(base), SETTINGS)
    torch.testing.assert_close(logits(wrapped, ids), logits(base, ids), atol=0, rtol=0)


def test_training_lowers_the_loss_and_the_merged_model_is_the_adapter(base):
    data = examples()
    peft_model, result = lora.train(copy.deepcopy(base), data, SETTINGS, TrainSettings(steps=30, lr=1e-2))
    assert len(result.losses) == 30
    assert result.losses[-1] < 0.5 * result.losses[0]
    assert 0 < result.trainable_parameters < sum(p.numel() for p in base.parameters()) // 10
    assert result.target_tokens == 30 * 4 * 6  # 30 steps x 4 examples x 6 answer tokens
    ids = data[0].input_ids
    adapted = logits(peft_model, ids)
    merged = lora.merge(peft_model)
    assert "peft" not in type(merged).__module__ and not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), adapted, atol=1e-5, rtol=0)
    assert (logits(merged, ids) - logits(base, ids)).abs().max() > 1e-2


def test_runs_are_deterministic(base):
    def adapter(seed):
        peft_model, _ = lora.train(copy.deepcopy(base), examples(), SETTINGS,
                                   TrainSettings(steps=3, lr=1e-2, seed=seed))
        return {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}

    first, again, other = adapter(0), adapter(0), adapter(1)
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first)


def test_the_loss_counts_only_target_tokens():
    g = torch.Generator().manual_seed(0)
    logits_ = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.uint8)
    loss = lora.masked_loss(logits_, ids, mask)
    # targets: row 0 tokens 2, 3 (from positions 1, 2); row 1 token 1 (from position 0)
    picked = [(0, 1, 2), (0, 2, 3), (1, 0, 1)]
    want = torch.stack([torch.nn.functional.cross_entropy(logits_[b, p][None], ids[b, t][None])
                        for b, p, t in picked]).mean()
    torch.testing.assert_close(loss, want)
    loss.backward()
    used = torch.zeros(2, 5, dtype=torch.bool)
    for b, p, _ in picked:
        used[b, p] = True
    assert bool((logits_.grad.abs().sum(-1)[~used] == 0).all()) and bool((logits_.grad.abs().sum(-1)[used] > 0).all())


def test_an_adapter_file_round_trips_and_refuses_other_weights(base, tiny_tokenizer, tmp_path):
    peft_model, _ = lora.train(copy.deepcopy(base), examples(), SETTINGS, TrainSettings(steps=5, lr=1e-2))
    path = lora.save_adapter(peft_model, tmp_path / "adapter.safetensors")
    assert path.read_bytes()[8:9] == b"{"  # a safetensors header, not a pickle
    ids = examples(1)[0].input_ids
    loaded = lora.load_adapter(copy.deepcopy(base), path)
    torch.testing.assert_close(logits(loaded, ids), logits(peft_model, ids), atol=0, rtol=0)

    other = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=1)
    with pytest.raises(TrainingError, match="trained on other weights"):
        lora.load_adapter(other, path)
    (tmp_path / "junk.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(TrainingError, match="not a safetensors file"):
        lora.load_adapter(copy.deepcopy(base), tmp_path / "junk.safetensors")
    with pytest.raises(TrainingError, match="no adapter file"):
        lora.load_adapter(copy.deepcopy(base), tmp_path / "missing.safetensors")


def test_bad_settings_and_examples_are_refused(base):
    with pytest.raises(TrainingError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(TrainingError, match="no linear modules named"):
        lora.wrap(copy.deepcopy(base), LoraSettings(target_modules=("c_attn",)))
    with pytest.raises(TrainingError, match="no target tokens"):
        Example(torch.arange(3, 8), torch.zeros(5, dtype=torch.uint8)).check()
    with pytest.raises(TrainingError, match="loss_mask must be"):
        Example(torch.arange(3, 8), torch.ones(4, dtype=torch.uint8)).check()
    with pytest.raises(TrainingError, match="first token"):
        Example(torch.arange(3, 8), torch.ones(5, dtype=torch.uint8)).check()
    with pytest.raises(TrainingError, match="token ids must lie"):
        lora.train(copy.deepcopy(base), [Example.lm([5, 6, 10_000])], SETTINGS, TrainSettings(steps=1))
    with pytest.raises(TrainingError, match="steps"):
        TrainSettings(steps=0)
