"""One decode step of a Llama-family model, written as the tensor operations it is (transformers side).

A decode step computes one token a row, so its tensors are tiny and a step through
transformers' modules is mostly overhead: module calls, mask and cache machinery, and the
dtype conversions each compact linear repeats. On the default model in int4 the weights'
kernels take ~8 ms of a 19 ms step; the rest was small operations and Python. This module
walks the same weights directly:

- the RMS norms as transformers writes them (the same operations, in the same order);
- q, k and v from one bf16 rounding of the normed input (compact formats), gate and up too;
- the rotary embedding as one small product with a rotation table built once a step from
  the model's own ``rotary_emb`` (its scaling types included): ``x @ R`` equals
  ``x * cos + rotate_half(x) * sin`` up to fp32 rounding;
- the new K/V appended through the cache layer's own ``update`` (into room reserved by
  :func:`.cache.reserved`, or concatenated), so the cache is what transformers would hold;
- attention with each KV head's query heads as rows of one call, no mask (one new token
  attends to every cached one);
- the linears with the product their format and :mod:`.linears` pick for the rows.

Numerics: fp32 results equal a transformers step within float rounding (~1e-5 on logits,
tested); compact formats round the same inputs to bf16, so now and then one input lands on
the other side of a bf16 step, as batching already does (tests bound the KL, and greedy
tokens agree). Only *plain* steps take this path -- every row at the same position, no
padding mask, no explicit positions -- of models it knows: ``LlamaForCausalLM`` and
``Qwen2ForCausalLM`` with full attention, unmodified linears (fp32 ``nn.Linear`` or
:mod:`.weights`' formats), no hooks, in eval mode. Anything else (adapters, sliding
windows, other architectures) runs through transformers as before. ``KVWIRE_STEP=off``
turns it off; :func:`disabled` does so for a block (tests, before-and-after benchmarks).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .linears import _forward as _fp32_linear
from .weights import _CompactLinear

ENV = "KVWIRE_STEP"
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
_off = 0  # depth of disabled() blocks

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # LlamaRMSNorm.forward, operation for operation
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@dataclass(frozen=True)
class _Layer:
    norm1: _Norm
    qkv: tuple[Linear, Linear, Linear]
    o: Linear
    norm2: _Norm
    gate_up: tuple[Linear, Linear]
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    compact_in: tuple[bool, bool, bool, bool]  # q/k/v, o, gate/up, down: take a bf16 input (a compact format)
    kv_heads: int
    head_dim: int
    scale: float


@dataclass(frozen=True)
class _Plan:
    modules: tuple[torch.nn.Module, ...]  # every module a step reads: hooks on any of them send a step back
    layers: tuple[_Layer, ...]
    embed: torch.nn.Module
    rotary: torch.nn.Module
    norm: _Norm
    head: Linear
    head_compact: bool


_plans: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, _Plan | None]]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every decode step runs through transformers' modules."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def _linear(module: Any, rows: int) -> tuple[Linear, bool] | None:
    """(fp32 out of ``rows`` rows from the right input, whether that input is bf16), or None for a linear this
    step does not know."""
    if isinstance(module, _CompactLinear):
        small_rows, small = module.small()
        product, bias = small if rows <= small_rows else module.product, module.bias
        if bias is None:
            return (lambda x: product(x).float()), True
        return (lambda x: product(x).float() + bias), True
    if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
        return (lambda x: _fp32_linear(module, x)), False
    return None


def _norm(module: Any) -> _Norm | None:
    if type(module).__name__ not in ("LlamaRMSNorm", "Qwen2RMSNorm") or module.weight.dtype != torch.float32:
        return None
    return _Norm(module.weight, float(module.variance_epsilon))


def _build(model: Any, rows: int) -> _Plan | None:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if type(model).__name__ not in ("LlamaForCausalLM", "Qwen2ForCausalLM") or not layers \
            or len(layers) != model.config.num_hidden_layers:
        return None
    if getattr(model.config, "final_logit_softcapping", None) or getattr(decoder, "rotary_emb", None) is None:
        return None
    plan_layers, modules = [], [model, decoder, decoder.embed_tokens, decoder.rotary_emb, decoder.norm]
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer).__name__ not in _LAYERS or attn is None or mlp is None \
                or getattr(attn, "sliding_window", None) is not None:
            return None
        parts = [_linear(getattr(attn, name, None), rows) for name in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                [_linear(getattr(mlp, name, None), rows) for name in ("gate_proj", "up_proj", "down_proj")]
        norms = (_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm))
        if any(part is None for part in parts) or None in norms:
            return None
        (q, cq), (k, ck), (v, cv), (o, co), (g, cg), (u, cu), (d, cd) = parts  # type: ignore[misc]
        if not (cq == ck == cv and cg == cu):
            return None
        head_dim = int(attn.head_dim)
        inv_freq = getattr(decoder.rotary_emb, "inv_freq", None)
        if inv_freq is None or 2 * inv_freq.numel() != head_dim:  # a partial rotary: not this step's
            return None
        kv_heads = int(attn.k_proj.out_features) // head_dim
        plan_layers.append(_Layer(norms[0], (q, k, v), o, norms[1], (g, u), d, mlp.act_fn, (cq, co, cg, cd),  # type: ignore[arg-type]
                                  kv_heads, head_dim, float(attn.scaling)))
        modules += [layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm, mlp.act_fn,
                    attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    head = _linear(model.get_output_embeddings(), rows)
    norm = _norm(decoder.norm)
    if head is None or norm is None:
        return None
    modules.append(model.get_output_embeddings())
    return _Plan(tuple(modules), tuple(plan_layers), decoder.embed_tokens, decoder.rotary_emb, norm, head[0], head[1])


def plan_for(model: Any, rows: int) -> _Plan | None:
    """The plan for steps of ``rows`` rows, or None where a step must run through transformers (see the module
    docstring). Built once per model and batch size, and again when any of its modules was replaced; checked
    for hooks each time."""
    if _off or os.environ.get(ENV, "").strip().lower() in ("off", "0", "false") or model.training:
        return None
    key = _identity(model)
    by_rows = _plans.setdefault(model, {})
    known = by_rows.get(rows)
    if known is None or known[0] != key:
        known = by_rows[rows] = (key, _build(model, rows))
    plan = known[1]
    if plan is None or _hooked(plan):
        return None
    return plan


def _identity(model: Any) -> tuple[int, ...]:
    """What a plan depends on: the ids of the decoder layers' linears and norms and of the output layer (a
    swapped linear -- an adapter, a format conversion -- changes it)."""
    decoder = getattr(model, "model", None)
    out = [id(model.get_output_embeddings())]
    for layer in getattr(decoder, "layers", None) or ():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        out += [id(layer), id(attn), id(mlp)]
        out += [id(getattr(attn, name, None)) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [id(getattr(mlp, name, None)) for name in ("gate_proj", "up_proj", "down_proj")]
    return tuple(out)


def _hooked(plan: _Plan) -> bool:
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in plan.modules)


def _rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``R`` [D, D] with ``x @ R == x * cos + rotate_half(x) * sin`` for one position's ``cos``, ``sin`` [D]."""
    D = cos.shape[0]
    half = D // 2
    R = torch.diag(cos)
    index = torch.arange(half)
    R[index + half, index] = -sin[:half]  # rotate_half(x)[:half] = -x[half:]
    R[index, index + half] = sin[half:]  # rotate_half(x)[half:] = x[:half]
    return R


def step(plan: _Plan, cache: Any, tokens: torch.Tensor, position: int | None = None) -> torch.Tensor:
    """fp32 logits ``[B, V]`` of one decode step: ``tokens`` [B] each follow their row's whole cached context
    (no padding), all at ``position`` (default: the cache's length). Appends their K/V to ``cache`` as a
    transformers step would."""
    B = tokens.shape[0]
    position = int(cache.layers[0].keys.shape[-2]) if position is None else position
    x = plan.embed(tokens)  # [B, hidden]
    cos, sin = plan.rotary(x[:, None], torch.full((1, 1), position, dtype=torch.long))
    R = _rotation(cos[0, 0], sin[0, 0])
    bf16 = torch.bfloat16
    for index, layer in enumerate(plan.layers):
        qkv_bf16, o_bf16, mlp_bf16, down_bf16 = layer.compact_in
        D, Hkv = layer.head_dim, layer.kv_heads
        h = layer.norm1(x)
        h = h.to(bf16) if qkv_bf16 else h
        q, k, v = (f(h) for f in layer.qkv)
        q = torch.mm(q.view(-1, D), R).view(B, Hkv, -1, D)  # each KV head's query heads as rows
        k = torch.mm(k.view(-1, D), R).view(B, Hkv, 1, D)
        keys, values = cache.layers[index].update(k, v.view(B, Hkv, 1, D))
        a = F.scaled_dot_product_attention(q, keys, values, scale=layer.scale).reshape(B, -1)
        x = x + layer.o(a.to(bf16) if o_bf16 else a)
        h = layer.norm2(x)
        h = h.to(bf16) if mlp_bf16 else h
        gate, up = (f(h) for f in layer.gate_up)
        h = layer.act(gate) * up
        x = x + layer.down(h.to(bf16) if down_bf16 else h)
    x = plan.norm(x)
    return plan.head(x.to(bf16) if plan.head_compact else x)

