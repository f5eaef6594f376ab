"""Trained modules back from their checkpoints: the learned fuser and the LoRA-tuned receiver.

Each is refused (:class:`~kvwire.errors.CheckpointError`) unless its checkpoint was made for
exactly the models given (:mod:`kvwire.fuse.checkpoint` checks specs and weight fingerprints).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import hf
from ..errors import CheckpointError, FuserError
from ..wire.spec import ModelSpec
from . import checkpoint as ckpt
from .fuser import Fuser, FuserConfig


def load_fuser_weights(fuser: Fuser, weights: dict[str, torch.Tensor]) -> None:
    """Load checkpoint tensors into ``fuser``, refusing missing, unexpected or misshapen ones."""
    expected = fuser.state_dict()
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise CheckpointError(f"the checkpoint's tensors do not fit this fuser: missing {missing[:4]}, "
                              f"unexpected {extra[:4]}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape) or tensor.dtype != expected[name].dtype:
            raise CheckpointError(f"checkpoint tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, the fuser "
                                  f"expects {expected[name].dtype} {list(expected[name].shape)}")
    fuser.load_state_dict(weights)


def load_fuser(path: str | Path, receiver: ModelSpec, sharer: ModelSpec) -> tuple[Fuser, ckpt.CheckpointConfig]:
    """A trained fuser from its checkpoint, refused unless made for exactly this receiver and sharer."""
    loaded = ckpt.load(path, kind="fuser", receiver=receiver, sharer=sharer)
    try:
        config = FuserConfig.from_json(dict(loaded.config.module))
    except (FuserError, TypeError) as err:
        raise CheckpointError(f"{path}: the fuser settings in its config are invalid: {err}") from None
    if config.layer_map != loaded.config.layer_map:
        raise CheckpointError(f"{path}: the fuser's layer map disagrees with the checkpoint's")
    fuser = Fuser(config)
    load_fuser_weights(fuser, loaded.weights)
    return fuser.eval(), loaded.config


def load_lora(path: str | Path, receiver: ModelSpec, model: Any) -> Any:
    """The LoRA baseline: ``model`` (the receiver, wrapped in place; ``receiver`` its spec) with the
    adapter saved at ``path``, in eval mode; refused unless it was trained on exactly this receiver."""
    from ..hf import lora

    loaded = ckpt.load(path, kind="lora", receiver=receiver)
    if hf.model_spec(model) != receiver:
        raise CheckpointError("the model given is not the receiver whose spec was given")
    module = dict(loaded.config.module)
    try:
        settings = lora.LoraSettings(rank=int(module["rank"]), alpha=float(module["alpha"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the LoRA settings in its config are invalid: {err}") from None
    wrapped = lora.wrap(model, settings)
    hf.set_lora_state(wrapped, loaded.weights)
    return wrapped.eval()
