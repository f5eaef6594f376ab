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
def context_kv(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               with_logits: bool = False) -> Any:
    """Per layer the keys (RoPE applied) and values ``[B, H, N, D]`` of ``input_ids`` ``[B, N]``;
    with ``with_logits`` also the logits ``[B, V]`` at the last position: ``(keys, values, logits)``.

    ``attention_mask`` ``[B, N]`` marks the real tokens (1) of padded rows, padded on the
    right or on the left: each row's tokens sit at positions ``0..N_b-1`` and never attend
    to its padding, so their K/V are those of the row alone (left padding keeps every
    row's last token last, for ``with_logits``). Computed under ``no_grad`` (not inference
    mode), so the tensors can feed a module that is being trained.
    """
    ids = _ids(input_ids)
    cache = new_cache(model)
    extra = {}
    if attention_mask is not None:
        mask = _mask(attention_mask, ids.shape)
        extra = {"attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
    if any(layer.is_sliding for layer in cache.layers):
        raise ModelError("training on caches of sliding-window models is not supported",
                         "use a receiver and sharer with full attention in every layer")
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    return (keys, values, out.logits[:, -1].float()) if with_logits else (keys, values)


def continuation_logits(model: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                        input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[B, n, V]`` of ``input_ids`` ``[B, n]`` read after a cache of ``keys``/``values``.

    The cache covers ``N`` slots (its tensors' length); by default the continuation sits at
    positions ``N..N+n-1``. For right-padded batches give ``attention_mask`` ``[B, N + n]``
    (cache slots then continuation; 0 = padding) and ``position_ids`` ``[B, n]`` (each row
    continuing its own length). Autograd flows into ``keys`` and ``values`` where they
    require it.
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
    if position_ids is None:
        position_ids = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    extra = {} if attention_mask is None else {
        "attention_mask": _mask(attention_mask, (ids.shape[0], start + ids.shape[1]))}
    return model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=position_ids, **extra).logits


def sequence_logits(model: Any, input_ids: torch.Tensor, keep: int = 0,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[B, n, V]`` of ``input_ids`` ``[B, n]`` with autograd (the last ``keep`` positions; 0: all);
    ``attention_mask`` ``[B, n]`` for right-padded rows."""
    ids = _ids(input_ids)
    extra = {} if attention_mask is None else {"attention_mask": _mask(attention_mask, ids.shape)}
    return model(input_ids=ids, use_cache=False, logits_to_keep=keep, **extra).logits


def _ids(input_ids: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ModelError(f"expected token ids [B, n] with n > 0, got {list(ids.shape)}")
    return ids


def _mask(mask: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    if tuple(mask.shape) != tuple(shape):
        raise ModelError(f"attention_mask must be {list(shape)}, got {list(mask.shape)}")
    return mask.to(torch.long)


def lora_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors (peft's adapter state dict), detached fp32 copies on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    return {name: t.detach().to("cpu", torch.float32).clone() for name, t in state.items()}


def tensors_misfit(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str | None:
    """``None`` when ``got`` holds exactly ``want``'s tensor names and shapes; else what differs
    (``"missing [...], unexpected [...], wrong shapes [...]"``, three names of each at most)."""
    want_shapes = {name: tuple(t.shape) for name, t in want.items()}
    got_shapes = {name: tuple(t.shape) for name, t in got.items()}
    if want_shapes == got_shapes:
        return None
    missing, extra = sorted(set(want_shapes) - set(got_shapes)), sorted(set(got_shapes) - set(want_shapes))
    wrong = sorted(n for n in set(want_shapes) & set(got_shapes) if want_shapes[n] != got_shapes[n])
    return f"missing {missing[:3]}, unexpected {extra[:3]}, wrong shapes {wrong[:3]}"


def set_lora_state(peft_model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors into a wrapped model, refusing missing, unexpected or misshapen ones."""
    from peft import set_peft_model_state_dict

    misfit = tensors_misfit(lora_state(peft_model), tensors)
    if misfit:
        raise ModelError(f"the LoRA tensors do not fit this model: {misfit}")
    set_peft_model_state_dict(peft_model, tensors)
