"""The one interface fuse mode needs from a projector, and loading one from a checkpoint.

A :class:`Projector` turns the receiver's own cache of a context plus the sharer's
aligned K/V into the fused cache the receiver generates from. Both projectors satisfy it:

- :class:`~kvwire.fuse.ridge.RidgeProjector` (closed form): ``own + weight x (ridge(sharer) - own)``;
- :class:`~kvwire.fuse.fuser.Fuser` (learned, C2C): ``own + gate x weight x projection(own, sharer)``.

The call, for a context of ``N`` receiver tokens::

    keys, values = projector(own_keys, own_values, sharer, positions, rope)

    own_keys[t], own_values[t]   [B, H_t, N, D_t]   the receiver's cache, every layer (keys rotated at positions)
    sharer[s]                    (k, v) [B, H_s, N, D_s]: sharer layer s, gathered at each receiver
                                 token's aligned sharer token; keys position-free (RoPE stripped)
    positions                    [N]  the receiver tokens' positions
    rope                         the receiver's RoPE table
    -> keys[t], values[t]        [B, H_t, N, D_t]   fused; layers the projector does not map are returned as given

Which sharer layers a projector reads, and how tokens were aligned when it was made, are
in its checkpoint's config (``layer_map``, ``alignment``): :func:`load` returns both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from ..errors import CheckpointError
from ..wire.rope import RopeTable
from ..wire.spec import ModelSpec
from . import checkpoint

KV = tuple[torch.Tensor, torch.Tensor]


class Projector(Protocol):
    """See the module docstring."""

    def __call__(self, own_keys: Sequence[torch.Tensor], own_values: Sequence[torch.Tensor],
                 sharer: Mapping[int, KV], positions: torch.Tensor,
                 rope: RopeTable | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...


def load(path: str | Path, receiver: ModelSpec, sharer: ModelSpec,
         allow_worse: bool = False) -> tuple[Projector, checkpoint.CheckpointConfig]:
    """The projector saved at ``path`` (a ridge or a learned fuser checkpoint), refused unless it was
    made for exactly this receiver and sharer (specs and weight fingerprints), and unless its
    recorded gain over the receiver alone is positive (:func:`kvwire.fuse.gain.check`;
    ``allow_worse=True`` takes it anyway, with a warning)."""
    from . import gain

    config, _ = checkpoint.read_config(path)
    loaded: tuple[Projector, checkpoint.CheckpointConfig]
    if config.kind == "ridge":
        from . import ridge

        loaded = ridge.load(path, receiver, sharer)
    elif config.kind == "fuser":
        from .trained import load_fuser

        loaded = load_fuser(path, receiver, sharer)
    else:
        raise CheckpointError(f"{path} holds a {config.kind} checkpoint, not a projector",
                              "pass a ridge or fuser checkpoint (a LoRA receiver is a model, not a projector)")
    gain.check(loaded[1], str(path), allow_worse)  # after the pair check: another pair's is refused as that
    return loaded
