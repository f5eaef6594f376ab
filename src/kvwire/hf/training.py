"""Forward passes for training things around a frozen model (transformers side).

The fuser trainer needs three passes and nothing else from transformers:

- :func:`context_kv`: the cache a model builds for a context, without autograd
  (the receiver's own K/V, the sharer's K/V to precompute);
- :func:`continuation_logits`: the model's logits over a continuation read
  *after* a cache given as plain tensors, with autograd flowing back into those
  tensors -- the receiver's loss on the answer, differentiated with respect to the
  fused cache (the model's weights stay frozen);
- :func:`sequence_logits`: plain logits with autograd, for fine-tuning baselines.

Tensors are in the cache layout ``[B, H_kv, N, D]``, one pair per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..errors import ModelError
from .cache import new_cache


def freeze(model: Any) -> Any:
    """No parameter of ``model`` takes gradients; eval mode (no dropout). Returns the model."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def context_kv(model: Any, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer the keys (RoPE applied) and values ``[1, H, N, D]`` of ``input_ids`` ``[1, N]``.

    Computed under ``no_grad`` (not inference mode), so the tensors can feed a module
    that is being trained.
    """
    ids = _ids(input_ids)
    cache = new_cache(model)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if any(layer.is_sliding for layer in cache.layers):
        raise ModelError("training on caches of sliding-window models is not supported",
                         "use a receiver and sharer with full attention in every layer")
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def continuation_logits(model: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                        input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[1, n, V]`` of ``input_ids`` ``[1, n]`` read after a cache of ``keys``/``values``.

    The cache covers positions ``0..N-1`` (its tensors' length); the continuation sits at
    ``N..N+n-1``. Autograd flows into ``keys`` and ``values`` where they require it.
    """
    ids = _ids(input_ids)
    if len(keys) != len(values) or not keys:
        raise ModelError(f"a cache needs one key and one value tensor per layer, got {len(keys)} and {len(values)}")
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != len(keys):
        raise ModelError(f"the model has {len(cache.layers)} layers, the cache {len(keys)}")
    for index, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, index)
    start = int(keys[0].shape[-2])
    positions = torch.arange(start, start + ids.shape[1])[None]
    return model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=positions).logits


def sequence_logits(model: Any, input_ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """Logits ``[1, n, V]`` of ``input_ids`` ``[1, n]`` with autograd (the last ``keep`` positions; 0: all)."""
    return model(input_ids=_ids(input_ids), use_cache=False, logits_to_keep=keep).logits


def _ids(input_ids: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ModelError(f"expected one non-empty sequence of token ids [1, n], got {list(ids.shape)}")
    return ids


def lora_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors (peft's adapter state dict), detached fp32 copies on the CPU."""
    from peft import get_peft_model_state_dict

    return {name: t.detach().to("cpu", torch.float32).clone() for name, t in get_peft_model_state_dict(peft_model).items()}


def set_lora_state(peft_model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors into a wrapped model, refusing missing, unexpected or misshapen ones."""
    from peft import set_peft_model_state_dict

    want = {name: tuple(t.shape) for name, t in lora_state(peft_model).items()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if want != got:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
        raise ModelError(f"the LoRA tensors do not fit this model: missing {missing[:3]}, unexpected {extra[:3]}, "
                         f"wrong shapes {wrong[:3]}")
    set_peft_model_state_dict(peft_model, tensors)
