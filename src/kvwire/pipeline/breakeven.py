"""Which wins where: an fp32 cache, an int8 cache or the token ids, beyond this machine's hardware.

Whether sending a cache beats re-prefilling depends on two rates this CPU fixes:
how fast the receiver prefills (~300 tokens/s here, tens of thousands on a datacenter
GPU) and how fast the link moves bytes. This module runs :class:`kvwire.pipeline.cost.CostModel`
over a grid of both, for a model's KV shape, and says per point which choice is
cheapest for one hop.

In: a :class:`KVShape` (or one of :data:`MODELS`), prefill rates (tokens/s), link
rates (bits/s), the codec rates of each encoding (K/V bytes/s, as
:func:`kvwire.pipeline.cost.probe_codec` measures them) and the hop (tokens carried).
Out: :class:`Point` rows (predicted seconds per choice, the winner), which
:func:`kvwire.plots.break_even_map` draws.

A link of ``rate`` bits/s moves ``rate * efficiency / 8`` bytes/s each way (TCP over a
``tbf``-shaped veth carried 94-95 % of its rate here); a put crosses the sender's link
and a get the receiver's, one after the other, so for a hop of ``T`` tokens::

    cache_s(encoding) = latency + T * wire(encoding) * 2 / link + T * kv * (1/encode + 1/decode)
    ids_s             = T / prefill_rate

Example (Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, fp32 cache 256 KiB per token;
int8 about 3.8x fewer bytes): at 10 Gbit/s a token's fp32 K/V crosses two links in
~0.44 ms, so against a GPU prefilling 20,000 tokens/s (0.05 ms a token) the ids win,
while against this CPU's ~300 tokens/s (3.3 ms a token) the cache wins even in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .cost import CostModel, ModelCost, StoreCost
from ..wire.quant import layer_layout

CHOICES = ("ids", "fp32", "int8")  # what a hop can send: token ids, or the cache in one of two encodings
LINK_EFFICIENCY = 0.95  # TCP payload per bit of a tbf-shaped veth, measured here (95 Mbit/s at 100 Mbit)


@dataclass(frozen=True)
class KVShape:
    """A model's cache shape: K/V bytes per token follow from it for every encoding."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4  # fp32 cache (the model's dtype here)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in the model's dtype: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def wire_bytes_per_token(self, encoding: str, tokens: int = 2048) -> float:
        """Packet bytes per token of K/V in ``encoding`` (statistics of int8/int4 amortized over ``tokens``).

        Example: head_dim 64, int8, per layer and KV head: keys 64 codes + 64 x 8 / 128 bytes of statistics,
        values 64 + 8: 140 bytes against 512 in fp32 (3.66x fewer).
        """
        if encoding == "fp32" and self.dtype_bytes == 4:
            return float(self.bytes_per_token)
        layout = layer_layout(encoding, 0, (1, self.kv_heads, tokens, self.head_dim))
        per_layer = sum(torch.empty((), dtype=dtype).element_size() * _numel(shape) for dtype, shape in layout.values())
        return per_layer * self.layers / tokens


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


MODELS: dict[str, KVShape] = {
    "smollm2-135m": KVShape("SmolLM2-135M (the default)", layers=30, kv_heads=3, head_dim=64),
    "llama-3-8b": KVShape("Llama-3-8B", layers=32, kv_heads=8, head_dim=128),
}


@dataclass(frozen=True)
class Codec:
    """Encode and decode rates of one encoding, in K/V bytes (model dtype) per second."""

    encode_rate: float
    decode_rate: float


def link_store(rate_bits: float, latency_s: float = 1e-3, efficiency: float = LINK_EFFICIENCY) -> StoreCost:
    """A store reached over links of ``rate_bits`` bits/s: puts and gets at the link's payload rate,
    ``latency_s`` for a put and a get of a tiny value."""
    rate = rate_bits * efficiency / 8
    return StoreCost.from_rates(latency_s, rate, rate, f"{rate_bits / 1e9:g} Gbit/s link")


@dataclass(frozen=True)
class Point:
    """One grid point: the predicted seconds of each choice for the hop, and the cheapest."""

    model: str
    link_bits: float
    prefill_rate: float
    tokens: int
    seconds: dict[str, float]  # choice -> predicted seconds

    @property
    def winner(self) -> str:
        return min(self.seconds, key=self.seconds.__getitem__)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "link_bits": self.link_bits, "prefill_rate": self.prefill_rate,
                "tokens": self.tokens, "seconds": self.seconds, "winner": self.winner}


def hop_costs(shape: KVShape, store: StoreCost, prefill_rate: float, codecs: dict[str, Codec], tokens: int,
              delta_tokens: int | None = None, links: int = 1) -> dict[str, float]:
    """Predicted seconds of each choice for a hop carrying ``tokens`` tokens, ``delta_tokens`` of them
    new (default: all, the first hop); ``codecs`` names the encodings to consider."""
    delta = tokens if delta_tokens is None else delta_tokens
    seconds = {"ids": tokens / prefill_rate}
    for encoding, rates in codecs.items():
        model = ModelCost(prefill_rate, rates.encode_rate, shape.bytes_per_token,
                          shape.wire_bytes_per_token(encoding), rates.encode_rate, rates.decode_rate, encoding)
        seconds[encoding] = CostModel(store, model).decide(tokens, delta, links).cache_s
    return seconds


def sweep(shape: KVShape, link_rates_bits: list[float], prefill_rates: list[float], codecs: dict[str, Codec],
          tokens: int = 2000, latency_s: float = 1e-3) -> list[Point]:
    """:func:`hop_costs` at every (link rate, prefill rate) of the grid, for a first hop of ``tokens`` tokens."""
    return [Point(shape.name, link, prefill, tokens,
                  hop_costs(shape, link_store(link, latency_s), prefill, codecs, tokens))
            for link in link_rates_bits for prefill in prefill_rates]


def geometric(low: float, high: float, n: int) -> list[float]:
    """``n`` values from ``low`` to ``high`` evenly spaced on a log scale."""
    return [low * (high / low) ** (i / (n - 1)) for i in range(n)]
