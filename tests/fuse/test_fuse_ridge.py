"""The ridge baseline (kvwire.fuse.ridge): fitted from streamed normal equations, saved, refused for another pair.

Tiny random models keep it fast. A sharer that *is* the receiver is the case with a known
answer: its K/V are the receiver's own, so the fitted map must be the identity (held-out
R^2 ~ 1) and fusing with weight 1 must leave the receiver's next-token logits unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import tiny
from kvwire import hf
from kvwire.errors import CheckpointError, FuserError, WorseThanAloneError
from kvwire.fuse import checkpoint, projector, ridge
from kvwire.fuse.align import align_chat
from kvwire.fuse.train import Party

TEXTS = [[{"role": "user", "content": text}] for text in (
    "The analyst reads the code and lists the bugs.",
    "def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)",
    "Incident report: checkout failed for 2 hours; 18,420 of 23,950 attempts failed.",
    "Summarize the document in three sentences. List the key numbers.",
    "You are the reviewer. Point out what is wrong or missing in the fixer's patch.",
    "The fixer suggests a fix for each bug and the reviewer checks it.",
    "Who owns each action? List them with the numbers from the report.",
    "def total(rows): return sum(r[1] for r in rows if r)",
)]
CONFIG = ridge.RidgeConfig(samples=len(TEXTS), holdout=0.25, alphas=(1e-8, 1e-4, 1e-1))


@pytest.fixture(scope="module")
def parties(tiny_tokenizer):
    made = {}
    for name, arch, seed in (("llama", "llama", 0), ("qwen2", "qwen2", 1), ("llama-other", "llama", 2)):
        model = tiny.model(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=seed)
        made[name] = Party(model, tiny_tokenizer, hf.model_spec(model), name)
    return made


def fused_logits(receiver, sharer, proj, messages):
    """The receiver's logits for the last prompt token after its cache of the rest was fused."""
    alignment = align_chat(receiver.tokenizer, sharer.tokenizer, messages)
    ids = torch.tensor([alignment.receiver_ids])
    own_k, own_v = hf.context_kv(receiver.model, ids[:, :-1])
    s_k, s_v = hf.context_kv(sharer.model, torch.tensor([alignment.sharer_ids]))
    tables = hf.rope_tables(sharer.model)
    index = alignment.index[:-1]
    shared = {s: (ridge.rope_math.strip(s_k[s], tables[s], torch.arange(len(alignment.sharer_ids)))[:, :, index],
                  s_v[s][:, :, index]) for s in range(len(s_k))}
    keys, values = proj(own_k, own_v, shared, torch.arange(ids.shape[1] - 1), hf.rope_tables(receiver.model)[0])
    fused = hf.continuation_logits(receiver.model, keys, values, ids[:, -1:])[0, -1]
    alone = hf.continuation_logits(receiver.model, own_k, own_v, ids[:, -1:])[0, -1]
    return fused, alone


def test_a_sharer_that_is_the_receiver_fits_the_identity(parties):
    me = parties["llama"]
    result = ridge.fit(me, me, CONFIG, texts=TEXTS)
    assert [f.sharer_layer for f in result.layers] == [0, 1, 2]  # terminal map, S == T
    for layer in result.layers:
        assert layer.key_r2 > 0.999 and layer.value_r2 > 0.999, layer
        assert layer.key_rel_error < 0.02 and layer.value_rel_error < 0.02
    assert result.held_out_tokens > 0 and result.tokens > result.held_out_tokens
    fused, alone = fused_logits(me, me, result.projector, TEXTS[0])
    assert torch.allclose(fused, alone, atol=1e-3), float((fused - alone).abs().max())


@pytest.mark.parametrize("count", [2, 3])
def test_a_few_texts_still_hold_one_out(parties, count):
    """Fewer texts than the hold-out period (every 4th): the last one is held out, never none."""
    result = ridge.fit(parties["llama"], parties["qwen2"], CONFIG, texts=TEXTS[:count])
    assert 0 < result.held_out_tokens < result.tokens
    assert all(math.isfinite(layer.key_r2) and math.isfinite(layer.value_r2) for layer in result.layers)


def test_one_text_is_refused(parties):
    with pytest.raises(FuserError, match="at least two texts"):
        ridge.fit(parties["llama"], parties["qwen2"], CONFIG, texts=TEXTS[:1])


def test_a_different_sharer_is_fitted_saved_and_loaded(parties, tmp_path):
    receiver, sharer = parties["llama"], parties["qwen2"]
    progress = []
    result = ridge.fit(receiver, sharer, CONFIG, texts=TEXTS, progress=lambda *a: progress.append(a))
    assert ("read", len(TEXTS), len(TEXTS)) in progress and progress[-1][0] == "solve"
    report = result.report()
    assert len(report["layers"]) == 3 and report["fit_s"] > 0 and report["alignment"] == "char-offsets-v1/chat/last"
    for layer in result.layers:  # a random other model explains only part of the receiver's K/V
        assert layer.key_r2 < 0.999 and layer.key_alpha in CONFIG.alphas
    path = ridge.save(tmp_path / "ridge", result, receiver.ref(), sharer.ref())
    with pytest.raises(WorseThanAloneError, match="no validated gain recorded") as refused:
        projector.load(path, receiver.spec, sharer.spec)  # a ridge fit measures no gain over the receiver alone
    assert "--allow-worse" in refused.value.hint
    loaded, config = projector.load(path, receiver.spec, sharer.spec, allow_worse=True)
    assert config.kind == "ridge" and config.layer_map == (0, 1, 2)
    assert config.receiver.spec.fingerprint == receiver.spec.fingerprint
    sample = (torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    for t in range(3):
        for a, b in zip(loaded.project(t, sample), result.projector.project(t, sample)):
            assert torch.equal(a, b)
    fused, alone = fused_logits(receiver, sharer, loaded, TEXTS[1])
    assert not torch.allclose(fused, alone)  # weight 1: the receiver reads the translated sharer cache


def test_a_checkpoint_for_another_pair_is_refused(parties, tmp_path):
    receiver, sharer, other = parties["llama"], parties["qwen2"], parties["llama-other"]
    path = ridge.save(tmp_path / "ridge", ridge.fit(receiver, sharer, CONFIG, texts=TEXTS), receiver.ref(),
                      sharer.ref())
    with pytest.raises(CheckpointError, match="receiver given is another model .*other weights") as info:
        projector.load(path, other.spec, sharer.spec)  # same architecture, other weights
    assert "train" in info.value.hint
    with pytest.raises(CheckpointError, match="sharer given is another model"):
        projector.load(path, receiver.spec, receiver.spec)
    weights = path / checkpoint.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="checksum"):
        projector.load(path, receiver.spec, sharer.spec)
