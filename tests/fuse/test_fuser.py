"""The learned fuser on a tiny pair of different models: shapes, gates, training, checkpoints, resume.

The receiver is a tiny Llama (3 layers, 2 KV heads of 16); the sharer a tiny Qwen2 with
another tokenizer (2 layers, 1 KV head of 32), so the layer map leaves the receiver's
first layer unfused and every receiver token is aligned to a sharer token by characters.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.support import tiny
from kvwire import hf
from kvwire.wire import rope as rope_math
from kvwire.errors import CheckpointError, FuserError
from kvwire.fuse import checkpoint
from kvwire.fuse.data import SharerStore, chat_aligner, encode, end_of_turn_id
from kvwire.fuse.fuser import Fuser, FuserConfig, gather_sharer
from kvwire.fuse.stdlib_qa import Example
from kvwire.fuse.train import Party, TrainConfig, Trainer, load_fuser, load_lora

EXAMPLES = [Example(f"The analyst reads the code and lists {n} bugs. Which option?", "AB"[n % 2], "text")
            for n in range(10)]


def tiny_sharer(vocab_size: int, eos_token_id: int, seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         eos_token_id=eos_token_id, bos_token_id=1, pad_token_id=0, initializer_range=0.1)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def pair():
    """(receiver, sharer) parties: different architectures, sizes and tokenizers."""
    r_tok, s_tok = tiny.tokenizer(), tiny.tokenizer(300)
    receiver = tiny.model("llama", len(r_tok), r_tok.eos_token_id, seed=0)
    sharer = tiny_sharer(len(s_tok), s_tok.eos_token_id)
    return (Party(receiver, r_tok, hf.model_spec(receiver), "tiny-llama"),
            Party(sharer, s_tok, hf.model_spec(sharer), "tiny-qwen2"))


def trainer(pair, tmp_path, out="run", examples=None, **overrides) -> Trainer:
    receiver, sharer = pair
    settings = dict(steps=6, batch=2, lr=1e-2, warmup=1, eval_every=3, checkpoint_every=3, eval_examples=3,
                    hidden=16, blocks=1, calibration_examples=4)
    settings.update(overrides)
    aligner, method = chat_aligner(receiver.tokenizer, sharer.tokenizer)
    return Trainer(TrainConfig(**settings), receiver, sharer if settings.get("method", "fuser") == "fuser" else None,
                   (examples or EXAMPLES)[:7], (examples or EXAMPLES)[7:], tmp_path / out, aligner=aligner,
                   alignment=method, store=tmp_path / "sharer-kv")


def fuser_inputs(pair, example: Example = EXAMPLES[0]):
    """The receiver's own cache, the aligned position-free sharer K/V, positions, RoPE, record."""
    receiver, sharer = pair
    aligner, _ = chat_aligner(receiver.tokenizer, sharer.tokenizer)
    record = encode(example, receiver.tokenizer, end_of_turn_id(receiver.tokenizer, hf.eos_token_ids(receiver.model)),
                    aligner)
    own_k, own_v = hf.context_kv(receiver.model, record.context_ids)
    s_keys, s_values = hf.context_kv(sharer.model, record.sharer_ids)
    sharer_kv = gather_sharer(s_keys, s_values, record.index, range(len(s_keys)), hf.rope_tables(sharer.model))
    return own_k, own_v, sharer_kv, torch.arange(record.context_ids.numel()), hf.rope_tables(receiver.model)[0], record


def make_fuser(pair, **overrides) -> Fuser:
    receiver, sharer = pair
    r, s = receiver.spec, sharer.spec
    config = dict(receiver_kv_heads=r.num_kv_heads, receiver_head_dim=r.head_dim, sharer_kv_heads=s.num_kv_heads,
                  sharer_head_dim=s.head_dim, layer_map=(None, 0, 1), hidden=16, blocks=1)
    config.update(overrides)
    return Fuser(FuserConfig(**config))


def randomize_outputs(fuser: Fuser, seed: int = 0) -> None:
    """Give the (zero-initialized) output layers weights, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in fuser.layers.values():
            for linear in (layer.key_out, layer.value_out):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.3)


# -- the module ------------------------------------------------------------------------------------


def test_fuser_outputs_the_receivers_cache_shapes_and_counts_its_parameters(pair):
    own_k, own_v, sharer_kv, positions, table, _ = fuser_inputs(pair)
    fuser = make_fuser(pair, hidden=16, blocks=1).eval()
    keys, values = fuser(own_k, own_v, sharer_kv, positions, table)
    assert [tuple(k.shape) for k in keys] == [tuple(k.shape) for k in own_k]
    assert [tuple(v.shape) for v in values] == [tuple(v.shape) for v in own_v]
    # per fused layer: input F -> hidden, one block (norm, hidden -> 2 hidden -> hidden), K and V outputs,
    # a weight per head for K and V, two gate logits
    F = 2 * (1 * 32 + 2 * 16)
    h, out = 16, 2 * 16
    per_layer = (F * h + h) + (h + h * 2 * h + 2 * h + 2 * h * h + h) + 2 * (h * out + out) + (h * 4 + 4) + 2
    assert fuser.parameter_count() == 2 * per_layer  # receiver layers 1 and 2 are fused, layer 0 is not
    buffers = 2 * (2 * F + 2 * out)  # input mean and std, output scales, per fused layer
    assert fuser.nbytes() == 4 * (2 * per_layer + buffers)


def test_an_untrained_fuser_changes_nothing(pair):
    own_k, own_v, sharer_kv, positions, table, _ = fuser_inputs(pair)
    fuser = make_fuser(pair).eval()
    assert fuser.gates() == {1: (True, True), 2: (True, True)}  # on, but the output layers start at zero
    keys, values = fuser(own_k, own_v, sharer_kv, positions, table)
    assert all(torch.equal(a, b) for a, b in zip(keys, own_k))
    assert all(torch.equal(a, b) for a, b in zip(values, own_v))


def test_gates_off_is_the_receiver_alone_exactly_and_on_is_not(pair):
    receiver, _ = pair
    own_k, own_v, sharer_kv, positions, table, record = fuser_inputs(pair)
    fuser = make_fuser(pair)
    randomize_outputs(fuser)
    fuser.eval()
    alone = hf.continuation_logits(receiver.model, own_k, own_v, record.tail_ids)

    keys, values = fuser(own_k, own_v, sharer_kv, positions, table)
    assert not torch.equal(keys[1], own_k[1]) and not torch.equal(values[2], own_v[2])
    assert not torch.allclose(hf.continuation_logits(receiver.model, keys, values, record.tail_ids), alone)

    with torch.no_grad():
        for layer in fuser.layers.values():
            layer.gate_logits.fill_(-1.0)
    assert fuser.gates() == {1: (False, False), 2: (False, False)}
    keys, values = fuser(own_k, own_v, sharer_kv, positions, table)
    assert all(a is b for a, b in zip(keys, own_k)) and all(a is b for a, b in zip(values, own_v))
    assert torch.equal(hf.continuation_logits(receiver.model, keys, values, record.tail_ids), alone)


def test_training_gates_are_sampled_or_annealed_and_hard_at_inference(pair):
    own_k, own_v, sharer_kv, positions, table, _ = fuser_inputs(pair)
    fuser = make_fuser(pair)
    randomize_outputs(fuser)
    fuser.train()
    generator = torch.Generator().manual_seed(0)
    sampled = [fuser(own_k, own_v, sharer_kv, positions, table, generator)[1][2] for _ in range(2)]
    assert not torch.equal(*sampled)  # Gumbel noise: another draw, another gate
    fuser.gate_noise, fuser.temperature = False, 1e-4
    annealed = fuser(own_k, own_v, sharer_kv, positions, table, generator)[1][2]
    fuser.eval()  # a cold annealed sigmoid is the hard gate
    torch.testing.assert_close(annealed, fuser(own_k, own_v, sharer_kv, positions, table)[1][2])


def test_keys_are_projected_without_rope_then_rotated_to_the_receiver_positions(pair):
    """The same content at other positions gets the same fused keys, moved there: the projector
    never sees a rotation (C2C's projector reads rotated keys and would not pass this)."""
    own_k, own_v, sharer_kv, positions, table, _ = fuser_inputs(pair)
    fuser = make_fuser(pair)
    randomize_outputs(fuser)
    fuser.eval()
    keys, _ = fuser(own_k, own_v, sharer_kv, positions, table)
    shifted = positions + 37
    moved_own = [rope_math.rotate(k, table, positions, shifted) for k in own_k]
    moved_keys, _ = fuser(moved_own, own_v, sharer_kv, shifted, table)
    for t in (1, 2):
        expected = rope_math.rotate(keys[t], table, positions, shifted)
        torch.testing.assert_close(moved_keys[t], expected, rtol=1e-5, atol=1e-5)


def test_the_fuser_refuses_caches_of_another_shape(pair):
    own_k, own_v, sharer_kv, positions, table, _ = fuser_inputs(pair)
    fuser = make_fuser(pair).eval()
    with pytest.raises(FuserError, match="3 layers"):
        fuser(own_k[:2], own_v[:2], sharer_kv, positions, table)
    with pytest.raises(FuserError, match="sharer K/V"):
        fuser(own_k, own_v, {s: (k[:, :, :-1], v[:, :, :-1]) for s, (k, v) in sharer_kv.items()}, positions, table)
    with pytest.raises(FuserError, match="sharer layer 1"):
        fuser(own_k, own_v, {0: sharer_kv[0]}, positions, table)
    with pytest.raises(FuserError, match="fuses no layer"):
        make_fuser(pair, layer_map=(None, None, None))


# -- training ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["answer", "sharer"])
def test_a_few_steps_reduce_the_held_out_loss(pair, tmp_path, targets):
    run = trainer(pair, tmp_path, steps=12, eval_every=12, checkpoint_every=12, targets=targets)
    result = run.run()
    first, last = result.evals[0], result.evals[-1]
    assert first.loss == pytest.approx(first.baseline_loss)  # an untrained fuser is the receiver alone
    assert last.loss < 0.8 * first.baseline_loss
    assert 0 <= last.agreement <= 1 and 0 <= last.sharer_accuracy <= 1
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval" not in line] == list(range(1, 13))


def test_soft_targets_are_the_sharers_letter_distribution(pair, tmp_path):
    """With targets="sharer" the first answer token is trained towards what the sharer would answer."""
    receiver, sharer = pair
    run = trainer(pair, tmp_path, targets="sharer")
    record = run.train[0]
    ids = record.sharer_ids[None]
    logits = sharer.model(ids).logits[0, -1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = []
    for letter in "ABCD":
        variants = {tuple(sharer.tokenizer.encode(v, add_special_tokens=False)) for v in (letter, " " + letter)}
        expected.append(torch.logsumexp(log_probs[[v[0] for v in variants if len(v) == 1]], dim=0))
    stored = run._sharer_kv(record).letters
    torch.testing.assert_close(stored, torch.stack(expected), rtol=1e-4, atol=1e-4)
    top = run._soft_targets(record)  # sharer_temperature 0: the sharer's top letter
    assert top.tolist() == [float(i == int(stored.argmax())) for i in range(4)]
    soft = trainer(pair, tmp_path, targets="sharer", sharer_temperature=0.5)._soft_targets(record)
    torch.testing.assert_close(soft, torch.softmax(stored / 0.5, dim=0))
    assert trainer(pair, tmp_path)._soft_targets(record) is None  # targets="answer"


def test_resume_continues_exactly(pair, tmp_path):
    straight = trainer(pair, tmp_path, out="straight").run()

    trainer(pair, tmp_path, out="resumed").run(stop_after=3)  # stops after its first checkpoint
    resumed = trainer(pair, tmp_path, out="resumed")
    assert resumed.resume() == 3
    result = resumed.run()
    assert [r.loss for r in result.steps] == [r.loss for r in straight.steps]
    assert [e.loss for e in result.evals] == [e.loss for e in straight.evals]


def test_resume_refuses_other_settings(pair, tmp_path):
    trainer(pair, tmp_path).run(stop_after=3)
    with pytest.raises(CheckpointError, match="hidden"):
        trainer(pair, tmp_path, hidden=8).resume()


def test_a_new_run_never_writes_over_an_earlier_one(pair, tmp_path):
    """The same --out again without --resume is refused before anything is touched (it replaced the
    final module, and its keep-2 pruning deleted its own checkpoints in favour of the old run's)."""
    trainer(pair, tmp_path, steps=3, eval_every=3, checkpoint_every=3).run()
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=r"already holds a training run \(checkpoints/, fuser/\).*--resume"):
        trainer(pair, tmp_path, steps=2).run()
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def test_resume_refuses_other_examples(pair, tmp_path):
    """A checkpoint records a fingerprint of the examples it trained and was scored on: resuming on
    others would report the old baseline against new data."""
    trainer(pair, tmp_path).run(stop_after=3)
    with pytest.raises(CheckpointError, match="other examples"):
        trainer(pair, tmp_path, examples=EXAMPLES[1:] + EXAMPLES[:1]).resume()
    assert trainer(pair, tmp_path).resume() == 3


def test_a_diverging_run_stops_with_an_error_and_saves_no_nan(pair, tmp_path):
    """A learning rate that blows the weights up: the first non-finite loss stops training with an error
    naming the step, and no checkpoint or final module holding NaN is written; NaN settings are refused."""
    run = trainer(pair, tmp_path, lr=1e30, min_lr=0.0, steps=6, checkpoint_every=100, eval_every=100)
    with pytest.raises(FuserError, match=r"training diverged at step \d+: the loss is nan"):
        run.run()
    assert not (tmp_path / "run" / "fuser").exists() and not list((tmp_path / "run").glob("checkpoints/step-*"))
    for bad in ({"lr": float("nan")}, {"min_lr": float("inf")}, {"sharer_temperature": float("nan")}):
        with pytest.raises(FuserError, match="must be a finite number"):
            trainer(pair, tmp_path, **bad)


def test_the_lora_baseline_trains_on_the_same_data(pair, tmp_path):
    receiver, _ = pair
    fresh = Party(tiny.model("llama", len(receiver.tokenizer), receiver.tokenizer.eos_token_id, seed=0),
                  receiver.tokenizer, receiver.spec, receiver.name)  # peft wraps the model in place
    run = trainer((fresh, pair[1]), tmp_path, method="lora", steps=12, eval_every=12, checkpoint_every=12, lr=3e-2)
    result = run.run()
    assert result.evals[-1].loss < result.evals[0].baseline_loss
    loaded = checkpoint.load(result.checkpoint, kind="lora", receiver=receiver.spec)
    assert loaded.config.sharer is None and loaded.config.module == {"rank": 8, "alpha": 16.0}
    again = load_lora(result.checkpoint, receiver.spec, tiny.model("llama", len(receiver.tokenizer),
                                                                   receiver.tokenizer.eos_token_id, seed=0))
    record = run.val[0]
    with torch.no_grad():
        assert torch.equal(hf.sequence_logits(again, record.ids), hf.sequence_logits(run.module.eval(), record.ids))
    other = tiny.model("llama", len(receiver.tokenizer), receiver.tokenizer.eos_token_id, seed=3)
    with pytest.raises(CheckpointError, match="same architecture, other weights"):
        load_lora(result.checkpoint, hf.model_spec(other), other)


# -- checkpoints -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(pair, tmp_path_factory):
    """A fuser trained for a few steps, and its checkpoint folder."""
    run = trainer(pair, tmp_path_factory.mktemp("trained"), steps=4, eval_every=4, checkpoint_every=4)
    result = run.run()
    return run, result.checkpoint


def test_a_checkpoint_round_trips_and_names_both_models(pair, trained):
    receiver, sharer = pair
    run, path = trained
    fuser, config = load_fuser(path, receiver.spec, sharer.spec)
    assert config.receiver.spec == receiver.spec and config.sharer.spec == sharer.spec
    assert config.layer_map == (None, 0, 1) and config.alignment.endswith("/last")
    original = run.module.eval()
    for name, tensor in original.state_dict().items():
        assert torch.equal(fuser.state_dict()[name], tensor), name
    own_k, own_v, sharer_kv, positions, table, _ = fuser_inputs(pair)
    assert all(torch.equal(a, b) for a, b in zip(fuser(own_k, own_v, sharer_kv, positions, table)[0],
                                                    original(own_k, own_v, sharer_kv, positions, table)[0]))
    document = json.loads((path / "config.json").read_text())
    assert document["training"]["config"]["steps"] == 4 and document["state"] is None


def test_a_trained_checkpoint_runs_in_fuse_mode(pair, trained):
    """What train-fuser saves, fuse mode (and so kvwire fuse and benchmarks/fuse.py) loads and runs:
    the alignment it records is one fuse mode knows."""
    from kvwire.fuse import mode, projector

    receiver, sharer = pair
    _, path = trained
    loaded, config = projector.load(path, receiver.spec, sharer.spec, allow_worse=True)
    assert config.alignment == "char-offsets-v1/chat/last"
    fuse = mode.FuseRunner(receiver, sharer, loaded, config, options=mode.FuseOptions(max_new_tokens=4))
    out = fuse.run("fuse", [{"role": "user", "content": EXAMPLES[0].prompt}])
    assert 1 <= len(out.output_ids) <= 4


def test_a_checkpoint_for_another_pair_is_refused(pair, trained):
    receiver, sharer = pair
    _, path = trained
    with pytest.raises(CheckpointError, match="the receiver given is another model"):
        load_fuser(path, sharer.spec, sharer.spec)
    other = tiny.model("llama", len(receiver.tokenizer), receiver.tokenizer.eos_token_id, seed=5)
    with pytest.raises(CheckpointError, match="same architecture, other weights"):
        load_fuser(path, hf.model_spec(other), sharer.spec)
    with pytest.raises(CheckpointError, match="the sharer given is another model"):
        load_fuser(path, receiver.spec, receiver.spec)


def copy_checkpoint(path, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(path, target)
    return target


@pytest.mark.parametrize("damage, message", [
    ("flip", "does not match the checksum"),
    ("truncate", "truncated or replaced"),
    ("config", "not valid JSON"),
    ("format", "not a kvwire fuse checkpoint"),
    ("missing", "weights.safetensors is missing"),
    ("extra-file", "file list"),
    ("tensor-shape", "the fuser expects"),
    ("layer-map", "does not match its recorded digest"),
])
def test_a_damaged_checkpoint_is_refused_before_use(pair, trained, tmp_path, damage, message):
    """Each layer of checks, from the outside in. The config's own digest catches any edit of it (a
    sharer layer changed in the layer map is a silent wrong fuse otherwise); the edits below it are
    re-sealed with a fresh digest, as a forged config would be, to reach the checks past it."""
    from kvwire.fuse import checkpoint

    receiver, sharer = pair
    path = copy_checkpoint(trained[1], tmp_path)
    weights, config = path / "weights.safetensors", path / "config.json"
    document = json.loads(config.read_text())

    def sealed(document):
        return json.dumps({**document, checkpoint.CONFIG_DIGEST: checkpoint._config_digest(document)})
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x40
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "config":
        config.write_text(config.read_text()[:-10])
    elif damage == "format":
        document["format"] = "pickle"
        config.write_text(json.dumps(document))
    elif damage == "missing":
        weights.unlink()
    elif damage == "extra-file":
        document["files"]["model.pt"] = {"bytes": 1, "blake3": "00"}
        config.write_text(sealed(document))
    elif damage == "tensor-shape":  # consistent checksums, but the tensors do not fit the declared fuser
        document["module"]["hidden"] = 8
        config.write_text(sealed(document))
    elif damage == "layer-map":  # one digit changed: the layer reads another sharer layer
        mapped = next(i for i, s in enumerate(document["layer_map"]) if s)
        document["layer_map"][mapped] -= 1
        config.write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=message):
        load_fuser(path, receiver.spec, sharer.spec)


def test_a_checkpoint_replaces_only_an_earlier_checkpoint_and_never_saves_nan(trained, tmp_path):
    """``--out`` pointed at a user's folder or file is refused, not emptied; a diverged module (NaN or
    inf) is not saved; an earlier checkpoint at the path is replaced, and an empty folder filled."""
    from kvwire.fuse import checkpoint

    saved = checkpoint.load(trained[1])
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("important")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for target in (project, notes):
        with pytest.raises(CheckpointError, match="not replacing it"):
            checkpoint.save(target, saved.config, saved.weights)
    assert (project / "README.md").read_text() == "important" and notes.read_text() == "mine"
    assert not list(tmp_path.glob(".*"))  # nothing moved aside either
    broken = {name: t.clone() for name, t in saved.weights.items()}
    name = next(n for n, t in broken.items() if t.is_floating_point())
    broken[name].view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError, match=f"tensor '{name}' holds NaN or infinite values"):
        checkpoint.save(tmp_path / "diverged", saved.config, broken)
    assert not (tmp_path / "diverged").exists()
    (tmp_path / "out" / "fuser").mkdir(parents=True)  # train-fuser's --out, given where its checkpoint is wanted
    checkpoint.save(tmp_path / "out" / "fuser", saved.config, saved.weights)
    with pytest.raises(CheckpointError, match=r"the checkpoint train-fuser wrote there is .*out/fuser"):
        checkpoint.read_config(tmp_path / "out")
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "empty"):  # an empty folder, then the checkpoint it now holds
        checkpoint.save(target, saved.config, saved.weights)
        assert checkpoint.load(target).weights.keys() == saved.weights.keys()


# -- data ------------------------------------------------------------------------------------------


def test_records_split_the_prompt_into_fused_context_and_trained_tail(pair):
    receiver, sharer = pair
    aligner, _ = chat_aligner(receiver.tokenizer, sharer.tokenizer)
    end = end_of_turn_id(receiver.tokenizer, hf.eos_token_ids(receiver.model))
    record = encode(Example("Which option?", "B"), receiver.tokenizer, end, aligner)
    prompt = receiver.tokenizer.apply_chat_template([{"role": "user", "content": "Which option?"}], tokenize=False,
                                                    add_generation_prompt=True)
    prompt_ids = receiver.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert record.context_ids.tolist() == prompt_ids[:-1]
    assert record.tail_ids.tolist() == [prompt_ids[-1], *receiver.tokenizer("B")["input_ids"], end]
    assert record.index.numel() == record.context_ids.numel()
    assert int(record.index.max()) < record.sharer_ids.numel()
    assert record.choices is not None and record.answer == 1


def test_the_last_fused_token_can_read_the_sharers_last_prompt_token(pair, tmp_path):
    aligned, last = trainer(pair, tmp_path), trainer(pair, tmp_path, final_token="sharer-last")
    record = aligned.train[0]
    assert torch.equal(aligned._index(record), record.index)
    assert last._index(record)[:-1].tolist() == record.index[:-1].tolist()
    assert int(last._index(record)[-1]) == record.sharer_ids.numel() - 1 > int(record.index[-1])
    assert last.alignment_name == f"{aligned.alignment_name}+sharer-last"


def test_the_sharer_store_recomputes_what_it_cannot_read(pair, tmp_path):
    run = trainer(pair, tmp_path)
    record = max(run.train, key=lambda r: -r.sharer_ids.numel())  # the shortest: padded in its batch
    assert run.prepare_sharer() == len(run.train) + len(run.val)  # in left-padded batches of 2
    assert run.prepare_sharer() == 0  # all stored
    stored = run._sharer_kv(record)
    keys, values, logits = hf.context_kv(pair[1].model, record.sharer_ids, with_logits=True)  # alone
    for s, (k, v) in stored.kv.items():
        torch.testing.assert_close(k, keys[s], rtol=2e-3, atol=2e-3)  # stored as fp16
        torch.testing.assert_close(v, values[s], rtol=2e-3, atol=2e-3)
    run.store.path(record).write_bytes(b"not safetensors")
    assert run.store.get(record) is None
    again = run._sharer_kv(record)  # recomputed alone: the same up to float rounding
    for s in stored.kv:
        torch.testing.assert_close(stored.kv[s][0], again.kv[s][0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(stored.letters, again.letters, rtol=1e-4, atol=1e-4)
    assert isinstance(run.store, SharerStore)


# -- what makes a fuser worth using: controls, the best checkpoint, its recorded gain ---------------------


def test_control_rows_read_another_examples_sharer_and_cost_nothing_untrained(pair, tmp_path):
    """A control row reads another example's sharer K/V and is trained towards the receiver alone: an
    untrained fuser (the receiver alone) has a KL of exactly zero there."""
    from kvwire.fuse import gain

    run = trainer(pair, tmp_path, control_share=0.5)
    controls = [run._is_control(p) for p in range(400)]
    assert 0.4 < sum(controls) / len(controls) < 0.6  # about control_share of the rows, by a stable hash
    assert controls == [run._is_control(p) for p in range(400)]
    records = run.train[:2]
    other = run._other(run.train, 0)
    assert other is not records[0]
    fused, alone = run._forward(records, others=[other, None], with_alone=True)
    assert torch.equal(fused[0], alone[0])
    assert float(gain.kl_sum(fused[0], alone[0]).detach()) == 0.0
    assert gain.control_index(4, 2).tolist() == [0, 0, 1, 1] and gain.control_index(2, 4).tolist() == [0, 2]


def test_training_keeps_the_best_checkpoint_and_records_its_gain(pair, tmp_path):
    run = trainer(pair, tmp_path, steps=12, eval_every=4, checkpoint_every=12, control_share=0.25)
    result = run.run()
    best = min(result.evals, key=lambda e: e.loss)
    assert run.best == best
    document = json.loads((result.checkpoint / "config.json").read_text())
    recorded = document["training"]["gain"]
    assert recorded["step"] == best.step
    assert recorded["heldout_nats_per_token"] == pytest.approx(best.baseline_loss - best.loss)
    assert recorded["heldout_relative"] == pytest.approx(
        (best.baseline_loss_per_char - best.loss_per_char) / best.baseline_loss_per_char)
    assert best.control_loss is not None  # the other-context control is measured at every evaluation
    best_weights = checkpoint.load(tmp_path / "run" / "best", kind="fuser", receiver=pair[0].spec,
                                   sharer=pair[1].spec).weights
    final = checkpoint.load(result.checkpoint, kind="fuser", receiver=pair[0].spec, sharer=pair[1].spec).weights
    assert all(torch.equal(best_weights[k], final[k]) for k in final)  # the final checkpoint is the best one


def test_a_fuser_that_does_not_help_is_refused_unless_allowed(pair, tmp_path, caplog):
    """A checkpoint whose recorded gain is not positive is refused by fuse mode's loader, with the figures."""
    from kvwire.errors import WorseThanAloneError
    from kvwire.fuse import projector

    receiver, sharer = pair
    run = trainer(pair, tmp_path, steps=2, eval_every=2, checkpoint_every=2, lr=1e-9, warmup=1, min_lr=1e-9)
    run.run()
    path = tmp_path / "run" / "fuser"
    gain = json.loads((path / "config.json").read_text())["training"]["gain"]
    assert abs(gain["heldout_nats_per_token"]) < 1e-6  # nothing learned: no better than the receiver alone
    with pytest.raises(WorseThanAloneError, match=r"does not make the receiver better: held-out loss [+-]0\.000"):
        projector.load(path, receiver.spec, sharer.spec)
    loaded, _ = projector.load(path, receiver.spec, sharer.spec, allow_worse=True)
    assert "does not help the receiver" in caplog.text


def test_too_many_steps_for_the_data_and_too_little_time_are_refused(pair, tmp_path):
    import time

    with pytest.raises(FuserError, match="read each of the 7 training examples 286 times"):
        trainer(pair, tmp_path, steps=1000).run()
    run = trainer(pair, tmp_path, out="budget", steps=6)
    with pytest.raises(FuserError, match="the time budget leaves no room for training"):
        run.run(deadline=time.monotonic() - 1)


def test_the_gap_filter_keeps_examples_where_the_sharer_is_ahead(pair, tmp_path):
    """Both models' loss on every training response, measured once and kept; --min-gap keeps the
    examples where the sharer's is lower by at least that many nats per character."""
    from kvwire.errors import FuserDataError

    run = trainer(pair, tmp_path, min_gap=-1e9)
    run.prepare_sharer()
    gaps = run.gaps()
    assert set(gaps) == {r.key for r in run.train} and all(isinstance(g, float) for g in gaps.values())
    assert (run.store.root / f"receiver-{pair[0].spec.fingerprint[:16]}.json").is_file()  # kept for the next run
    assert run.gaps() == gaps
    # the sharer's loss is read alone from its file, and is the one the whole entry holds
    assert all(run.store.response_nats(r) == run.store.get(r).response_nats is not None for r in run.train)
    kept = run.filter_by_gap(gaps)
    assert kept["kept"] == kept["of"] == 7 and len(run.examples["train"]) == 7
    strict = trainer(pair, tmp_path, out="strict", min_gap=1e9)
    strict.prepare_sharer()
    with pytest.raises(FuserDataError, match="only 0 of 7 training examples"):
        strict.filter_by_gap(strict.gaps())
