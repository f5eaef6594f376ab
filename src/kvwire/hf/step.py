"""One decode step of a Llama-family model, written as the tensor operations it is (transformers side).

A decode step computes one token a row, so its tensors are tiny and a step through
transformers' modules is mostly overhead: module calls, mask and cache machinery, and the
dtype conversions each compact linear repeats. On the default model in int4 the weights'
kernels take ~8 ms of a 19 ms step; the rest was small operations and Python. This module
walks the same weights directly:

- the RMS norms as transformers writes them (the same operations, in the same order);
- q, k and v from one bf16 rounding of the normed input (compact formats), gate and up too;
- the rotary embedding as transformers applies it (``x * cos + rotate_half(x) * sin``, the
  table from the model's own ``rotary_emb``, its scaling types included), to q and k at once;
- the new K/V appended through the cache layer's own ``update`` (into room reserved by
  :func:`.cache.reserved`, or concatenated), so the cache is what transformers would hold;
- attention with each KV head's query heads as rows, no mask (one new token attends to every
  cached one), as two products and a softmax (:func:`_attention`: faster than torch's fused
  kernel for so few query rows);
- the linears with the product their format and :mod:`.linears` pick for the rows.

Numerics: fp32 results equal a transformers step within float rounding (~1e-5 on logits,
tested); compact formats round the same inputs to bf16, so now and then one input lands on
the other side of a bf16 step, as batching already does (tests bound the KL, and greedy
tokens agree). Only *plain* steps take this path -- every row at the same position, no
padding mask, no explicit positions -- of models it knows: ``LlamaForCausalLM`` and
``Qwen2ForCausalLM`` with full attention, unmodified linears (fp32 ``nn.Linear`` or
:mod:`.weights`' formats), no hooks, in eval mode. Anything else (adapters, sliding
windows, other architectures) runs through transformers as before. ``KVWIRE_STEP=off``
turns it off (checked when a model loads: another value is one clear error); :func:`disabled`
does so for a block (tests, before-and-after benchmarks).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelError
from . import linears
from .weights import GROUPS, _CompactLinear, groups_of

ENV = "KVWIRE_STEP"
_ON, _OFF = ("", "on", "auto", "1", "true"), ("off", "0", "false")
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
    qkv: Linear  # -> [B, q | k | v] side by side
    o: Linear
    norm2: _Norm
    gate_up: Linear  # -> [B, gate | up]
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    compact_in: tuple[bool, bool, bool, bool]  # q/k/v, o, gate/up, down: take a bf16 input (a compact format)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
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


def enabled() -> bool:
    """Whether ``KVWIRE_STEP`` leaves this step on (``on``, the default) or turns it off (``off``); any other
    value is one clear :class:`~kvwire.errors.ModelError`."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in _ON + _OFF:
        raise ModelError(f"{ENV}={os.environ[ENV]!r} is neither on nor off",
                         "set it to on or off, or unset it (on)")
    return value in _ON


def _linear(module: Any, rows: int) -> tuple[Linear, bool] | None:
    """(fp32 out of ``rows`` rows from the right input, whether that input is bf16), or None for a linear this
    step does not know."""
    if isinstance(module, _CompactLinear):
        small_rows, small = module.small()
        return _fp32_out(small if rows <= small_rows else module.product, module.bias), module.rounds_input
    if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
        return (lambda x: linears._forward(module, x)), False  # the policy's product, looked up per call
    return None


def _fp32_out(product: Linear, bias: torch.Tensor | None) -> Linear:
    """A compact product's bf16 output in fp32, its fp32 bias added (as :class:`.weights._CompactLinear` does)."""
    if bias is None:
        return lambda x: product(x).float()
    return lambda x: product(x).float() + bias


def _side_by_side(module: Any, names: tuple[str, ...], group: Any, rows: int) -> tuple[Linear, bool] | None:
    """The outputs of ``module``'s linears ``names`` side by side: one product where int4 grouped them
    (:class:`.weights.Int4Group`), else each layer's, concatenated."""
    if group is not None:
        small_rows, small = group.small()
        if rows <= small_rows:
            return _fp32_out(small, group.bias), True
    parts = [_linear(getattr(module, name, None), rows) for name in names]
    if any(part is None for part in parts) or len({compact for _, compact in parts}) != 1:  # type: ignore[misc]
        return None
    functions = [f for f, _ in parts]  # type: ignore[misc]
    return (lambda x: torch.cat([f(x) for f in functions], dim=-1)), parts[0][1]  # type: ignore[index]


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
    # not ``model`` itself: a plan is kept in a weak-keyed cache, and a value that held its key would keep
    # every model that ever decoded alive (plan_for checks the model's own hooks)
    plan_layers, modules = [], [decoder, decoder.embed_tokens, decoder.rotary_emb, decoder.norm]
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer).__name__ not in _LAYERS or attn is None or mlp is None \
                or getattr(attn, "sliding_window", None) is not None:
            return None
        groups = groups_of(layer)
        parts = [_side_by_side(attn, GROUPS["self_attn"], groups.get("self_attn"), rows),
                 _linear(getattr(attn, "o_proj", None), rows),
                 _side_by_side(mlp, GROUPS["mlp"], groups.get("mlp"), rows),
                 _linear(getattr(mlp, "down_proj", None), rows)]
        norms = (_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm))
        if any(part is None for part in parts) or None in norms:
            return None
        (qkv, c_qkv), (o, c_o), (gate_up, c_gate_up), (down, c_down) = parts  # type: ignore[misc]
        head_dim = int(attn.head_dim)
        inv_freq = getattr(decoder.rotary_emb, "inv_freq", None)
        if inv_freq is None or 2 * inv_freq.numel() != head_dim:  # a partial rotary: not this step's
            return None
        plan_layers.append(_Layer(
            norms[0], qkv, o, norms[1], gate_up, down, mlp.act_fn, (c_qkv, c_o, c_gate_up, c_down),  # type: ignore[arg-type]
            int(attn.q_proj.out_features) // head_dim, int(attn.k_proj.out_features) // head_dim, head_dim,
            int(mlp.gate_proj.out_features), float(attn.scaling)))
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
    if _off or not enabled() or model.training:
        return None
    key = _identity(model)
    by_rows = _plans.setdefault(model, {})
    known = by_rows.get(rows)
    if known is None or known[0] != key:
        known = by_rows[rows] = (key, _build(model, rows))
    plan = known[1]
    if plan is None or _hooked(plan) or _hooked_module(model):
        return None
    return plan


def _identity(model: Any) -> tuple[int, ...]:
    """What a plan depends on: the decoder layers' linears and the output layer, and the tensors their weights
    are in (a swapped linear -- an adapter, a format conversion -- or replaced weights change it)."""
    decoder = getattr(model, "model", None)
    linears = [model.get_output_embeddings()]
    out = []
    for layer in getattr(decoder, "layers", None) or ():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        out += [id(layer), id(attn), id(mlp)]
        linears += [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    for linear in linears:
        weight = getattr(linear, "packed", None)
        weight = getattr(linear, "weight", None) if weight is None else weight
        out += [id(linear), weight.data_ptr() if isinstance(weight, torch.Tensor) else 0]
    return tuple(out)


def _hooked_module(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _hooked(plan: _Plan) -> bool:
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(_hooked_module(m) for m in plan.modules)


def step(plan: _Plan, cache: Any, tokens: torch.Tensor, position: int | None = None) -> torch.Tensor:
    """fp32 logits ``[B, V]`` of one decode step: ``tokens`` [B] each follow their row's whole cached context
    (no padding), all at ``position`` (default: the cache's length). Appends their K/V to ``cache`` as a
    transformers step would."""
    position = int(cache.layers[0].keys.shape[-2]) if position is None else position

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        keys, values = cache.layers[index].update(k, v)
        B, H, _, D = q.shape
        q = q.reshape(B, keys.shape[1], H // keys.shape[1], D)  # each KV head's query heads as rows
        return _attention(q, keys, values, scale).reshape(B, -1)

    return step_rows(plan, tokens, torch.full((1,), position, dtype=torch.long), attend)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of a decode step's few query rows ``[B, H, G, D]`` over every cached key, unmasked, as
    two products and a softmax between them. For a handful of query rows this reads the cache at about
    1.4x the rate of torch's fused CPU kernel (``scaled_dot_product_attention``, whose blocks are made for
    long queries): 30 layers at 1,830 tokens of context on a 2-core AMD EPYC, 4.1 against 5.7-6.0 ms
    (BENCHMARKS section 10). The same sums, in another order: within fp32 rounding of it."""
    scores = torch.matmul(q * scale, keys.transpose(-1, -2))  # [B, H, G, N]
    return torch.matmul(torch.softmax(scores, dim=-1), values)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def step_rows(plan: _Plan, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
    """fp32 logits ``[B, V]`` of one decode step of ``tokens`` [B] at ``positions`` ([B], or [1] for all),
    with the attention left to ``attend(layer, q, k, v, scale)``: it gets the rotated queries ``[B, H, 1, D]``
    and the new token's keys and values ``[B, Hkv, 1, D]``, stores them where its cache keeps them, and returns
    the attention output ``[B, H * D]`` (the batched engine attends over its rows' slots and shared prefixes)."""
    B = tokens.shape[0]
    x = plan.embed(tokens)  # [B, hidden]
    cos, sin = plan.rotary(x[:, None], positions[:, None])  # [B or 1, 1, D]
    cos, sin = cos[:, 0, None], sin[:, 0, None]  # [B or 1, 1, D]: broadcast over heads
    bf16 = torch.bfloat16
    for index, layer in enumerate(plan.layers):
        qkv_bf16, o_bf16, mlp_bf16, down_bf16 = layer.compact_in
        D, H, Hkv, inner = layer.head_dim, layer.heads, layer.kv_heads, layer.intermediate
        h = layer.norm1(x)
        qkv = layer.qkv(h.to(bf16) if qkv_bf16 else h)  # [B, (H + 2 Hkv) D]
        qk = qkv[:, : (H + Hkv) * D].reshape(B, H + Hkv, D)
        qk = qk * cos + torch.cat([-qk[..., D // 2:], qk[..., : D // 2]], dim=-1) * sin  # q and k at once
        a = attend(index, qk[:, :H, None], qk[:, H:, None], qkv[:, (H + Hkv) * D:].reshape(B, Hkv, 1, D), layer.scale)
        x = x + layer.o(a.to(bf16) if o_bf16 else a)
        h = layer.norm2(x)
        gate_up = layer.gate_up(h.to(bf16) if mlp_bf16 else h)  # [B, 2 inner]
        h = layer.act(gate_up[:, :inner]) * gate_up[:, inner:]
        x = x + layer.down(h.to(bf16) if down_bf16 else h)
    x = plan.norm(x)
    return plan.head(x.to(bf16) if plan.head_compact else x)
