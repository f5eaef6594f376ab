"""The learned fuser on the real pair: SmolLM2-135M reads Qwen2.5-Coder-0.5B's cache.

Marked ``second_model`` (``make test-fuse``): needs both real models. Training runs only a
couple of steps here; the recipe itself is ``make fuser`` (see README, BENCHMARKS.md).
"""

from __future__ import annotations

import pytest
import torch

from kvwire.errors import CheckpointError
from kvwire.fuse.data import chat_aligner
from kvwire.fuse.fuser import Fuser
from kvwire.fuse.stdlib_qa import dataset
from kvwire.fuse.train import Party, TrainConfig, Trainer, load_fuser

pytestmark = [pytest.mark.second_model, pytest.mark.real_model]


@pytest.fixture(scope="module")
def parties(real_model, second_model):
    (r_model, r_tok, r_spec), (s_model, s_tok, s_spec) = real_model, second_model
    return Party(r_model, r_tok, r_spec, "smollm2-135m-instruct"), Party(s_model, s_tok, s_spec, "qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def trained(parties, tmp_path_factory):
    receiver, sharer = parties
    train, val = dataset(0)
    aligner, method = chat_aligner(receiver.tokenizer, sharer.tokenizer)
    out = tmp_path_factory.mktemp("fuser")
    run = Trainer(TrainConfig(steps=2, batch=2, eval_examples=4, eval_every=2, checkpoint_every=2,
                              calibration_examples=4), receiver, sharer, train[:6], val, out / "run",
                  aligner=aligner, alignment=method, store=out / "sharer-kv")
    return run, run.run()


def test_the_default_fuser_for_the_real_pair_is_small(trained):
    run, result = trained
    fuser = run.module
    assert isinstance(fuser, Fuser)
    # receiver layers 6..29 read sharer layers 0..23 (terminal alignment); layers 0..5 keep their own K/V
    assert run.layer_map == (None,) * 6 + tuple(range(24))
    assert result.parameters == fuser.parameter_count() < 0.1 * 134_515_008  # under a tenth of SmolLM2-135M
    assert result.nbytes == fuser.nbytes()
    print(f"fuser: {result.parameters:,} parameters, {result.nbytes / 2**20:.1f} MiB")


def test_training_steps_run_and_the_untrained_fuser_was_the_receiver_alone(trained):
    _, result = trained
    assert len(result.steps) == 2 and all(torch.isfinite(torch.tensor(r.loss)) for r in result.steps)
    first = result.evals[0]  # before any step: zero-initialized projections
    assert first.loss == pytest.approx(first.baseline_loss, rel=1e-6)


def test_the_checkpoint_loads_for_this_pair_only(parties, trained):
    receiver, sharer = parties
    _, result = trained
    fuser, config = load_fuser(result.checkpoint, receiver.spec, sharer.spec)
    assert config.sharer.name == "qwen2.5-coder-0.5b" and config.alignment == "char-offsets-v1/chat/last"
    assert fuser.gates() == {t: (True, True) for t in range(6, 30)}
    with pytest.raises(CheckpointError, match="receiver given is another model"):
        load_fuser(result.checkpoint, sharer.spec, receiver.spec)
