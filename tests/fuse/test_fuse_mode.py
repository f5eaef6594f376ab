"""Fuse mode (kvwire.fuse.mode) on tiny models of two architectures, through a real file store.

The plumbing is exact where it can be: a projector with weight 0 returns the receiver's
own K/V, so generating from the "fused" cache -- after the sharer's packet went through
the codec and the store, was aligned, stripped and gathered -- must give the receiver
alone's tokens. With weight 1 the receiver reads the translated sharer cache instead.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import tiny
from kvwire.kv import chain
from kvwire.wire import codec
from kvwire import hf
from kvwire.errors import AlignmentError, CheckpointError, ModelMismatchError, NoFuserError, WorseThanAloneError
from kvwire.fuse import checkpoint, mode, ridge
from kvwire.fuse.train import Party
from tests.fuse.test_fuse_ridge import CONFIG, TEXTS

QUESTION = [{"role": "user", "content": "Summarize the incident report: checkout failed for 2 hours."}]


@pytest.fixture(scope="module")
def pair(tiny_tokenizer):
    parties = []
    for name, arch, seed in (("receiver", "llama", 0), ("sharer", "qwen2", 1), ("other", "qwen2", 2)):
        model = tiny.model(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=seed)
        parties.append(Party(model, tiny_tokenizer, hf.model_spec(model), name))
    receiver, sharer, other = parties
    fitted = ridge.fit(receiver, sharer, CONFIG, texts=TEXTS)
    config = checkpoint.CheckpointConfig("ridge", receiver.ref(), sharer.ref(), fitted.alignment,
                                         fitted.projector.layer_map)
    return receiver, sharer, other, fitted.projector, config


def runner(pair, tmp_path, weight=1.0, **kwargs):
    receiver, sharer, _, projector, config = pair
    projector = ridge.RidgeProjector(projector.layer_map, projector.weights, projector.receiver_kv_heads,
                                     projector.receiver_head_dim, weight)
    return mode.FuseRunner(receiver, sharer, projector, config, store=f"file://{tmp_path}/store",
                           options=mode.FuseOptions(max_new_tokens=12, hint_tokens=8), **kwargs)


def test_weight_zero_is_exactly_the_receiver_alone(pair, tmp_path):
    fuse = runner(pair, tmp_path, weight=0.0)
    alone, fused = fuse.run("receiver", QUESTION), fuse.run("fuse", QUESTION)
    assert fused.output_ids == alone.output_ids and fused.context_tokens == alone.context_tokens
    assert torch.allclose(fused.first_logits, alone.first_logits, atol=1e-4)
    assert fused.packet_bytes > 0 and fused.sharer_s > 0 and fused.transfer_s > 0


def test_the_sharer_packet_travels_through_the_store(pair, tmp_path):
    fuse = runner(pair, tmp_path)
    packet_id, _, _, nbytes = fuse.share(QUESTION, session="s1")
    stored = codec.decode(fuse.store.get(chain.packet_key(packet_id)))  # a real file, decoded and verified
    assert stored.spec == pair[1].spec and stored.nbytes == nbytes and stored.session == "s1"
    fused = fuse.fused_cache(QUESTION, packet_id)
    assert hf.cache_length(fused.cache) == len(fused.ids) - 1
    assert list(fused.alignment.sharer_ids) == stored.token_ids[0].tolist()
    alone = fuse.run("receiver", QUESTION)
    generated = hf.generate(pair[0].model, fused.ids, cache=fused.cache, max_new_tokens=12)
    assert not torch.allclose(generated.first_logits, alone.first_logits)  # weight 1: the sharer changed it


def test_a_context_past_either_window_is_refused_before_any_prefill(pair, tmp_path, monkeypatch):
    """The sharer's window is checked before it prefills (it was not checked at all), the receiver's
    before either model does (it came after both prefills)."""
    from kvwire import ContextTooLong

    fuse = runner(pair, tmp_path)
    prefills = []
    prefill = hf.prefill

    def counted(model, ids, *args, **kwargs):
        prefills.append(len(ids))
        return prefill(model, ids, *args, **kwargs)

    for party, what in ((pair[1], "the sharer's reading"), (pair[0], "the receiver's context")):
        monkeypatch.setattr(hf, "prefill", counted)
        monkeypatch.setattr(party.model.config, "max_position_embeddings", 12)
        with pytest.raises(ContextTooLong, match=what):
            fuse.run("fuse", QUESTION)
        monkeypatch.undo()
    assert prefills == []


def test_compare_runs_the_four_paths(pair, tmp_path):
    comparison = runner(pair, tmp_path).compare(QUESTION)
    assert list(comparison.paths) == ["receiver", "sharer", "text", "fuse"]
    text = comparison.paths["text"]
    assert text.hint and text.context_tokens > comparison.paths["receiver"].context_tokens
    payload = comparison.to_json()
    assert payload["speedup_fuse_vs_text"] > 0 and all(p["total_s"] > 0 for p in payload["paths"].values())
    assert mode.repeat_overlap("abc", "abc") == 1.0 and mode.repeat_overlap("abcd", "ab") == 0.5


def test_different_models_without_a_projector_are_refused(pair):
    receiver, sharer, *_ = pair
    with pytest.raises(NoFuserError, match="different models and no projector") as info:
        mode.FuseRunner(receiver, sharer, None, None)
    assert "fit-ridge --sharer sharer --receiver receiver" in info.value.hint
    with pytest.raises(NoFuserError, match="same model"):
        mode.FuseRunner(receiver, receiver, None, None)


def test_a_projector_for_another_pair_is_refused(pair, tmp_path):
    receiver, sharer, other, projector, config = pair
    with pytest.raises(CheckpointError, match="sharer given is another model"):
        mode.FuseRunner(receiver, other, projector, config)


def test_a_packet_from_another_sharer_or_context_is_refused(pair, tmp_path):
    receiver, sharer, other, projector, config = pair
    fuse = runner(pair, tmp_path)
    ids = fuse.alignment(QUESTION).sharer_ids  # the right tokens, read by another model of the same shape
    foreign = hf.extract(hf.prefill(other.model, list(ids)), other.spec, torch.tensor([list(ids)]), producer="other")
    with pytest.raises(ModelMismatchError, match="different weights"):
        fuse.fused_cache(QUESTION, chain.publish(fuse.store, foreign))
    other_context, *_ = fuse.share([{"role": "user", "content": "A different question."}])
    with pytest.raises(AlignmentError, match="not its reading of this context"):
        fuse.fused_cache(QUESTION, other_context)


def test_cli_fuse_with_a_saved_projector(tmp_path, monkeypatch, tiny_tokenizer):
    """kvwire fuse on two model folders and a ridge checkpoint fitted for them; without one it refuses."""
    from click.testing import CliRunner

    from kvwire.cli import cli

    folders = {}
    for name, arch, seed in (("receiver", "llama", 0), ("sharer", "qwen2", 1)):
        model = tiny.model(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=seed)
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
        loaded, tok = hf.load_model(tmp_path / name)
        folders[name] = Party(loaded, tok, hf.model_spec(loaded), str(tmp_path / name))
    monkeypatch.setenv("KVWIRE_HOME", str(tmp_path / "home"))
    args = ["fuse", "--sharer", folders["sharer"].name, "--receiver", folders["receiver"].name,
            "--paths", "receiver,fuse", "--max-new-tokens", "6", "Summarize the report.", "--json"]
    refused = CliRunner().invoke(cli, args)
    assert isinstance(refused.exception, NoFuserError)
    fitted = ridge.fit(folders["receiver"], folders["sharer"], CONFIG, texts=TEXTS)
    ridge.save(tmp_path / "home" / "fusers" / "ridge", fitted, folders["receiver"].ref(), folders["sharer"].ref())
    worse = CliRunner().invoke(cli, args)  # finds the checkpoint under $KVWIRE_HOME/fusers: a ridge has no gain
    assert isinstance(worse.exception, WorseThanAloneError) and "no validated gain" in str(worse.exception)
    result = CliRunner().invoke(cli, [*args, "--allow-worse"])
    assert result.exit_code == 0, result.output
    payload = __import__("json").loads(result.output.strip().splitlines()[-1])
    assert set(payload["paths"]) == {"receiver", "fuse"} and payload["projector"].startswith("ridge for sharer")
    assert payload["paths"]["fuse"]["packet_bytes"] > 0


def test_a_learned_fuser_plugs_into_the_same_call(pair, tmp_path):
    """The learned fuser satisfies the Projector call: an untrained one (its output layers start at
    zero) leaves the receiver's cache as it was, loaded from its checkpoint like the ridge."""
    from kvwire.fuse import projector
    from kvwire.fuse.fuser import Fuser, FuserConfig

    receiver, sharer, _, ridge_projector, ridge_config = pair
    config = FuserConfig(receiver.spec.num_kv_heads, receiver.spec.head_dim, sharer.spec.num_kv_heads,
                         sharer.spec.head_dim, ridge_projector.layer_map, hidden=8, blocks=0)
    fuser = Fuser(config).eval()
    saved = checkpoint.save(tmp_path / "fuser", checkpoint.CheckpointConfig(
        "fuser", receiver.ref(), sharer.ref(), ridge_config.alignment, config.layer_map, config.to_json()),
        fuser.state_dict())
    loaded, loaded_config = projector.load(saved, receiver.spec, sharer.spec, allow_worse=True)  # untrained
    assert isinstance(loaded, Fuser) and loaded_config.kind == "fuser"
    fuse = mode.FuseRunner(receiver, sharer, loaded, loaded_config, options=mode.FuseOptions(max_new_tokens=8))
    alone, fused = fuse.run("receiver", QUESTION), fuse.run("fuse", QUESTION)
    assert fused.output_ids == alone.output_ids
    assert torch.allclose(fused.first_logits, alone.first_logits, atol=1e-5)


def test_fuse_options_are_checked_when_made():
    from kvwire.errors import FuserError

    for bad in ({"max_new_tokens": 0}, {"hint_tokens": -1}, {"max_new_tokens": 2.5}):
        with pytest.raises(FuserError, match="must be a whole number >= 1"):
            mode.FuseOptions(**bad)
