"""A plain prefill: a model reads ids and keeps its cache, nothing generated (transformers side).

Fuse mode's sharer agent does exactly this: it reads the context so that its cache can
be extracted into a packet (:func:`kvwire.hf.extract`), and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..errors import ModelError
from .cache import new_cache
from .linears import fast_linears
from .loading import model_device


@torch.inference_mode()
def prefill(model: Any, input_ids: torch.Tensor | Sequence[int]) -> DynamicCache:
    """The cache of ``model`` after reading ``input_ids`` (``[1, N]`` or a list) from position 0.

    Only the last position's logits are computed (``logits_to_keep=1``): a 150k-token
    vocabulary head over every position would cost more than the layers.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).to(model_device(model))
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ModelError(f"prefill needs ids [B, N] with N >= 1, got {list(ids.shape)}")
    cache = new_cache(model)
    with fast_linears(model, ids.numel(), ids.shape[0]):
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache
