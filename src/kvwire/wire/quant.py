"""Packet encodings: how K/V tensors are stored, and the integer quantization math.

An *encoding* names how a packet's K/V tensors are stored; decoding always returns
tensors of the model's own dtype (the spec's), so nothing downstream changes:

    ======  =====================================================  ===================
    name    stored per layer                                       bytes vs fp32 (KV)
    ======  =====================================================  ===================
    fp32    ``keys.L``, ``values.L`` as float32                     1
    fp16    ... as float16                                          1/2
    bf16    ... as bfloat16                                         1/2
    int8    ``keys.L`` uint8 codes + ``keys.L.scale``,              about 1/3.66 (D=64)
            ``keys.L.min`` (fp32), key statistics per group of
            :data:`INT8_KEY_GROUP` tokens; the same for ``values.L``
    int4    as int8, two codes per byte; key statistics per         about 1/5.8 (D=64)
            group of :data:`INT4_KEY_GROUP` tokens (lossier: opt in)
    ======  =====================================================  ===================

A float encoding equal to the spec's dtype is stored as-is and decodes without a
copy. Every conversion is computed in fp32.

All tensors here are in the packet layout ``[B, H, T, D]`` (batch, KV heads, tokens,
head_dim; see :mod:`kvwire.wire.packet`). Quantization is asymmetric min/max with
round-to-nearest, computed in fp32 whatever the input dtype::

    scale = (max - min) / (2**bits - 1)        # 1.0 where max == min (a constant run)
    q     = round((x - min) / scale)           # integers in [0, 2**bits - 1]
    x'    = q * scale + min                    # |x - x'| <= scale / 2

*Keys* have outlier channels (a few of the D channels are large for every token), so
their statistics are taken per (batch, head, channel) over tokens: ``min``/``scale``
have shape ``[B, H, G, D]`` where G is the number of token groups. ``group=None``
makes the whole packet one group (G = 1 when T > 0). A packet is quantized on its
own: a delta packet of a chain gets statistics from its own tokens only, so it can be
decoded without its parent, and a short link simply gets tight ranges (a single token
is stored exactly: max == min). The last group may be shorter than ``group``.

*Values* are mixed per token by attention, so their statistics are per (batch, head,
token) over the D channels: shape ``[B, H, T, 1]``.

4-bit codes are packed two per byte along D (even channel in the low nibble), so D
must be even; 8-bit codes are one byte each. Storage per (batch, head) of a layer with
T tokens, D channels and fp32 statistics: keys ``T*D*bits/8 + 8*G*D`` bytes, values
``T*D*bits/8 + 8*T`` bytes. Example (D = 64, int8, groups of 128): 136*T + 512*G
bytes against 512*T for fp32 -> 3.66x at 2048 tokens (G = 16), 1.9x for a 4-token
link, and for a single token larger than fp32 (648 vs 512 bytes): the per-channel
statistics dominate a tiny link, which is small in absolute terms anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Bits = Literal[4, 8]
Encoding = Literal["fp32", "fp16", "bf16", "int8", "int4"]
Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # tensor name -> (dtype, shape)

FLOAT_ENCODINGS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT4_KEY_GROUP = 32  # tokens per key-statistics group at 4 bits (16 levels cannot span a whole long packet)
# At 8 bits, one range per channel over a whole 1500-token packet let rare outlier tokens (the first
# ones, attention sinks) coarsen every other token's key: a 5-agent pipeline agreed with fp32 packets on
# 76% of greedy tokens. Groups of 128 tokens: 99.4%, for 3.66x instead of 3.76x smaller packets.
INT8_KEY_GROUP = 128


@dataclass(frozen=True)
class IntegerScheme:
    bits: Bits
    key_group: int | None  # tokens per group of key statistics; None = all the packet's tokens


INTEGER_ENCODINGS: dict[str, IntegerScheme] = {
    "int8": IntegerScheme(bits=8, key_group=INT8_KEY_GROUP),
    "int4": IntegerScheme(bits=4, key_group=INT4_KEY_GROUP),
}
ENCODINGS: tuple[str, ...] = (*FLOAT_ENCODINGS, *INTEGER_ENCODINGS)


@dataclass(frozen=True)
class Quantized:
    """Codes plus the statistics needed to dequantize them.

    ``codes`` is uint8 ``[B, H, T, D * bits / 8]``; ``scale`` and ``minimum`` are fp32,
    ``[B, H, G, D]`` for keys and ``[B, H, T, 1]`` for values.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor


def levels(bits: Bits) -> int:
    """Largest code: 255 for 8 bits, 15 for 4 bits."""
    return (1 << bits) - 1


def packed_dim(head_dim: int, bits: Bits) -> int:
    """Bytes per token and head of packed codes.

    Example: head_dim 64 -> 64 bytes at 8 bits, 32 bytes at 4 bits.
    """
    return head_dim * bits // 8


def group_count(tokens: int, group: int | None) -> int:
    """Number of token groups the key statistics cover.

    Example: tokens 300, group 128 -> 3 (128 + 128 + 44); group None -> 1; tokens 0 -> 0.
    """
    size = group or max(tokens, 1)
    return math.ceil(tokens / size)


def key_stats_shape(batch: int, heads: int, tokens: int, head_dim: int, group: int | None) -> tuple[int, ...]:
    """Shape of a key scale/minimum tensor: ``[B, H, G, D]``."""
    return (batch, heads, group_count(tokens, group), head_dim)


def value_stats_shape(batch: int, heads: int, tokens: int) -> tuple[int, ...]:
    """Shape of a value scale/minimum tensor: ``[B, H, T, 1]``."""
    return (batch, heads, tokens, 1)


def quantize_keys(x: torch.Tensor, bits: Bits, group: int | None = None) -> Quantized:
    """Quantize keys ``[B, H, T, D]`` per channel over groups of ``group`` tokens.

    Example (B = H = 1, D = 2, T = 3, 8 bits, one group): channel 0 holds
    ``[0, 1, 3]`` -> minimum 0, scale 3/255, codes ``[0, 85, 255]``; channel 1 holds
    ``[5, 5, 5]`` -> minimum 5, scale 1, codes ``[0, 0, 0]`` (stored exactly).
    """
    B, H, T, D = x.shape
    _check_finite(x, "keys")
    size = group or max(T, 1)
    n = group_count(T, group)
    xf = x.float()
    pad = n * size - T
    if pad:  # repeat the last token: min and max of the short last group are unchanged
        xf = torch.cat([xf, xf[:, :, -1:, :].expand(B, H, pad, D)], dim=2)
    grouped = xf.view(B, H, n, size, D)  # (B, H, G, group, D)
    minimum = grouped.amin(dim=3)  # (B, H, G, D)
    scale = _scale(minimum, grouped.amax(dim=3), bits)
    codes = ((grouped - minimum.unsqueeze(3)) / scale.unsqueeze(3)).round_().clamp_(0, levels(bits))
    codes = codes.view(B, H, n * size, D)[:, :, :T, :].to(torch.uint8)  # (B, H, T, D)
    return Quantized(_pack(codes, bits), scale, minimum)


def quantize_values(x: torch.Tensor, bits: Bits) -> Quantized:
    """Quantize values ``[B, H, T, D]`` per token over its D channels.

    Example (D = 4, 8 bits): a token ``[-1, 0, 1, 2]`` -> minimum -1, scale 3/255,
    codes ``[0, 85, 170, 255]``.
    """
    _check_finite(x, "values")
    xf = x.float()
    minimum = xf.amin(dim=3, keepdim=True)  # (B, H, T, 1)
    scale = _scale(minimum, xf.amax(dim=3, keepdim=True), bits)
    codes = ((xf - minimum) / scale).round_().clamp_(0, levels(bits)).to(torch.uint8)
    return Quantized(_pack(codes, bits), scale, minimum)


def dequantize_keys(q: Quantized, bits: Bits, group: int | None, tokens: int) -> torch.Tensor:
    """fp32 keys ``[B, H, T, D]`` from :func:`quantize_keys` output (``tokens`` = T)."""
    codes = _unpack(q.codes, bits).float()  # (B, H, T, D)
    size = group or max(tokens, 1)
    scale, minimum = q.scale, q.minimum  # (B, H, G, D)
    if scale.shape[2] > 1:  # one row of statistics per token
        scale = scale.repeat_interleave(size, dim=2)[:, :, :tokens, :]
        minimum = minimum.repeat_interleave(size, dim=2)[:, :, :tokens, :]
    return codes.mul_(scale).add_(minimum)


def dequantize_values(q: Quantized, bits: Bits) -> torch.Tensor:
    """fp32 values ``[B, H, T, D]`` from :func:`quantize_values` output."""
    return _unpack(q.codes, bits).float().mul_(q.scale).add_(q.minimum)


def _scale(minimum: torch.Tensor, maximum: torch.Tensor, bits: Bits) -> torch.Tensor:
    span = maximum - minimum
    if not bool(torch.isfinite(span).all()):
        raise ValueError("the value range overflows fp32; this packet cannot be quantized")
    return torch.where(span > 0, span / levels(bits), torch.ones_like(span))


def _check_finite(x: torch.Tensor, what: str) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} contain inf or nan, which integer codes cannot represent")


def _pack(codes: torch.Tensor, bits: Bits) -> torch.Tensor:
    """uint8 codes ``[..., D]`` -> ``[..., D * bits / 8]`` (two 4-bit codes per byte, even one low)."""
    if bits == 8:
        return codes.contiguous()
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit codes are packed in pairs; head_dim {codes.shape[-1]} is odd")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _unpack(packed: torch.Tensor, bits: Bits) -> torch.Tensor:
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).view(*packed.shape[:-1], 2 * packed.shape[-1])  # (..., D)


# -- encodings: which tensors a layer is stored as ------------------------------------------------


def native_encoding(dtype: torch.dtype) -> Encoding:
    """The lossless float encoding of a cache dtype: ``torch.float32`` -> ``"fp32"``."""
    for name, float_dtype in FLOAT_ENCODINGS.items():
        if float_dtype == dtype:
            return name  # type: ignore[return-value]
    raise ValueError(f"no float encoding for {dtype}")


def lossless(encoding: str | None, dtype: torch.dtype) -> bool:
    """Whether ``encoding`` (``None``: the cache's own) carries a ``dtype`` cache bit for bit: its own float
    encoding, or fp32 for any float dtype. ``int8``/``int4`` never; ``bf16`` for an fp32 cache neither."""
    if encoding is None or encoding == "fp32":
        return True
    return FLOAT_ENCODINGS.get(encoding) == dtype


def tensors_per_layer(encoding: str) -> int:
    """How many tensors one layer is stored as: 2 for float encodings, 6 for integer ones."""
    return 2 if encoding in FLOAT_ENCODINGS else 6


def layer_layout(encoding: str, layer: int, shape: tuple[int, int, int, int]) -> Layout:
    """Name -> (dtype, shape) of the tensors storing layer ``layer`` with K/V of ``shape``.

    Example (int8, layer 0, shape [1, 3, 10, 64])::

        keys.0        uint8    [1, 3, 10, 64]     values.0        uint8    [1, 3, 10, 64]
        keys.0.scale  float32  [1, 3, 1, 64]      values.0.scale  float32  [1, 3, 10, 1]
        keys.0.min    float32  [1, 3, 1, 64]      values.0.min    float32  [1, 3, 10, 1]
    """
    B, H, T, D = shape
    if encoding in FLOAT_ENCODINGS:
        dtype = FLOAT_ENCODINGS[encoding]
        return {f"keys.{layer}": (dtype, shape), f"values.{layer}": (dtype, shape)}
    scheme = INTEGER_ENCODINGS[encoding]
    if scheme.bits == 4 and D % 2:
        raise ValueError(f"{encoding} packs two codes per byte and needs an even head_dim, got {D}")
    codes = (B, H, T, packed_dim(D, scheme.bits))
    key_stats = key_stats_shape(B, H, T, D, scheme.key_group)
    value_stats = value_stats_shape(B, H, T)
    return {
        f"keys.{layer}": (torch.uint8, codes),
        f"keys.{layer}.scale": (torch.float32, key_stats),
        f"keys.{layer}.min": (torch.float32, key_stats),
        f"values.{layer}": (torch.uint8, codes),
        f"values.{layer}.scale": (torch.float32, value_stats),
        f"values.{layer}.min": (torch.float32, value_stats),
    }


def encode_layer(encoding: str, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of :func:`layer_layout` for one layer's K/V ``[B, H, T, D]``.

    Raises ``ValueError`` when the values cannot be represented: inf or nan for an
    integer encoding, or finite values beyond the fp16 range for ``fp16``.
    """
    if encoding in FLOAT_ENCODINGS:
        dtype = FLOAT_ENCODINGS[encoding]
        out = {f"keys.{layer}": keys.to(dtype), f"values.{layer}": values.to(dtype)}
        if dtype == torch.float16 and keys.dtype != torch.float16:
            for name, original in ((f"keys.{layer}", keys), (f"values.{layer}", values)):
                overflow = torch.isinf(out[name])
                if bool(overflow.any()) and bool((overflow & torch.isfinite(original)).any()):  # rare: 2nd pass
                    raise ValueError(f"{name} has values beyond the fp16 range (65504)")
        return out
    scheme = INTEGER_ENCODINGS[encoding]
    if scheme.bits == 4 and keys.shape[-1] % 2:
        raise ValueError(f"{encoding} packs two codes per byte and needs an even head_dim, got {keys.shape[-1]}")
    k = quantize_keys(keys, scheme.bits, scheme.key_group)
    v = quantize_values(values, scheme.bits)
    return {
        f"keys.{layer}": k.codes, f"keys.{layer}.scale": k.scale, f"keys.{layer}.min": k.minimum,
        f"values.{layer}": v.codes, f"values.{layer}.scale": v.scale, f"values.{layer}.min": v.minimum,
    }


def decode_layer(encoding: str, layer: int, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, H, T, D]`` of ``dtype`` from the stored tensors of one layer.

    A float encoding equal to ``dtype`` returns the stored tensors themselves (no copy).
    """
    if encoding in FLOAT_ENCODINGS:
        return tensors[f"keys.{layer}"].to(dtype), tensors[f"values.{layer}"].to(dtype)
    scheme = INTEGER_ENCODINGS[encoding]
    k = Quantized(tensors[f"keys.{layer}"], tensors[f"keys.{layer}.scale"], tensors[f"keys.{layer}.min"])
    v = Quantized(tensors[f"values.{layer}"], tensors[f"values.{layer}.scale"], tensors[f"values.{layer}.min"])
    keys = dequantize_keys(k, scheme.bits, scheme.key_group, tokens)
    values = dequantize_values(v, scheme.bits)
    return keys.to(dtype), values.to(dtype)
