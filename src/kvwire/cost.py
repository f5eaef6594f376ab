"""When is sending a cache worth it? Measured costs, and the per-hop decision of ``--mode auto``.

A hop can pass the upstream context two ways:

- **cache**: the sender encodes and stores its new K/V (``delta_bytes``); the receiver
  fetches the whole chain (``chain_bytes`` in ``links`` packets), verifies and decodes
  it, and builds its cache::

      cache_s = links * latency + (delta_bytes + chain_bytes) / bandwidth   # store put + get
              + (delta_bytes + 2 * chain_bytes) / codec_rate                 # encode; decode + inject

- **ids**: the handoff carries token ids only; the receiver re-prefills them::

      ids_s = tokens / prefill_rate

The cache wins when ``cache_s < ids_s``. On one host (memory, /dev/shm, loopback
Redis) that holds from a few dozen tokens on; over a slow link, or for tiny
contexts, ids win. :func:`probe_store` and :func:`probe_model` measure the rates on
the real store and model (:func:`measure` does both, about a second); :class:`CostModel`
decides and says why. Agents in one process share one measurement
(:meth:`kvwire.pipeline.Pipeline.measure_costs`); an agent in its own process
(``kvwire agent --mode auto``) measures its own store and model at start, or reads a
measurement saved with ``kvwire probe --json`` (:meth:`CostModel.from_json`).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .errors import KvwireError
from .store import Store

Choice = Literal["cache", "ids"]


@dataclass(frozen=True)
class StoreCost:
    """A store's round trip: ``seconds(n) = latency_s + n / bandwidth`` for one put + get."""

    latency_s: float  # put + get of a tiny value
    bandwidth: float  # bytes per second for put + get of large values
    url: str = ""

    def seconds(self, nbytes: int, operations: int = 1) -> float:
        return operations * self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class ModelCost:
    """A model's prefill speed, and how fast this machine encodes/decodes packets."""

    prefill_rate: float  # tokens per second
    codec_rate: float  # packet bytes per second (checksum + copy)
    bytes_per_token: int  # K/V bytes per token of this model (spec.kv_bytes(1))


@dataclass(frozen=True)
class Decision:
    choice: Choice
    cache_s: float
    ids_s: float

    @property
    def reason(self) -> str:
        sign = "<" if self.choice == "cache" else ">="
        return (f"{self.choice}: sending the cache ~{self.cache_s * 1000:.0f} ms {sign} re-prefilling the ids "
                f"~{self.ids_s * 1000:.0f} ms")


@dataclass(frozen=True)
class CostModel:
    store: StoreCost
    model: ModelCost

    def decide(self, tokens: int, delta_tokens: int, links: int) -> Decision:
        """Cache or ids for a receiver whose context starts with ``tokens`` upstream tokens,
        of which the sender adds ``delta_tokens`` as one more link of a ``links``-long chain."""
        per_token = self.model.bytes_per_token
        chain_bytes, delta_bytes = tokens * per_token, delta_tokens * per_token
        cache_s = (self.store.seconds(delta_bytes + chain_bytes, operations=links + 1)
                   + (delta_bytes + 2 * chain_bytes) / self.model.codec_rate)
        ids_s = tokens / self.model.prefill_rate
        return Decision("cache" if cache_s < ids_s else "ids", cache_s, ids_s)

    def break_even_tokens(self) -> int | None:
        """Fewest upstream tokens for which sending the cache wins (one link), or None if it never does."""
        per_token_cache = self.model.bytes_per_token * (2 / self.store.bandwidth + 3 / self.model.codec_rate)
        per_token_ids = 1 / self.model.prefill_rate
        if per_token_cache >= per_token_ids:
            return None
        return max(1, int(2 * self.store.latency_s / (per_token_ids - per_token_cache)) + 1)

    def to_json(self) -> dict[str, Any]:
        return {"store": {"url": self.store.url, "latency_s": self.store.latency_s, "bandwidth": self.store.bandwidth},
                "model": {"prefill_rate": self.model.prefill_rate, "codec_rate": self.model.codec_rate,
                          "bytes_per_token": self.model.bytes_per_token},
                "break_even_tokens": self.break_even_tokens()}

    @classmethod
    def from_json(cls, data: Any, source: str = "cost model") -> CostModel:
        """The inverse of :meth:`to_json` (what ``kvwire probe --json`` prints); :class:`KvwireError`
        naming ``source`` if a field is missing or not a positive number."""
        def number(section: str, name: str, kind: type = float) -> Any:
            try:
                value = data[section][name]
            except (KeyError, TypeError):
                raise KvwireError(f"{source} has no {section}.{name}",
                                  "give the JSON line `kvwire probe URL --json` prints") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
                    kind is int and not float(value).is_integer()):
                raise KvwireError(f"{source}: {section}.{name} must be a positive number, got {value!r}")
            return kind(value)

        store = StoreCost(number("store", "latency_s"), number("store", "bandwidth"),
                          str(data["store"].get("url", "")))
        model = ModelCost(number("model", "prefill_rate"), number("model", "codec_rate"),
                          number("model", "bytes_per_token", int))
        return cls(store, model)


def measure(store: Store, model: Any, bytes_per_token: int, large: int = 16 << 20) -> CostModel:
    """Probe ``store`` and ``model`` (about a second): the costs behind mode ``auto``'s decisions."""
    return CostModel(probe_store(store, large=large), probe_model(model, bytes_per_token))


def probe_store(store: Store, large: int = 16 << 20, repeats: int = 5) -> StoreCost:
    """Measure a store's latency (64-byte put + get) and bandwidth (``large``-byte put + get).

    Uses keys under ``probe/`` and deletes them; medians over ``repeats``.
    """
    key = f"probe/{uuid.uuid4().hex}"
    small, big = os.urandom(64), os.urandom(large)
    try:
        latency = statistics.median(_round_trip(store, key, small) for _ in range(repeats))
        heavy = statistics.median(_round_trip(store, key, big) for _ in range(max(2, repeats // 2)))
    finally:
        store.delete(key)
    return StoreCost(latency, large / max(heavy - latency, 1e-9), store.url)


def probe_model(model: Any, bytes_per_token: int, tokens: int = 256) -> ModelCost:
    """Measure prefill tokens/s on ``tokens`` random tokens and this machine's codec rate."""
    from . import hf  # transformers only when a model is probed

    ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size, (1, tokens))
    with torch.inference_mode():
        model(input_ids=ids[:, :16], use_cache=False, logits_to_keep=1)  # warm-up
        start = time.perf_counter()
        model(input_ids=ids, past_key_values=hf.new_cache(model), use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - start
    return ModelCost(tokens / prefill, _codec_rate(), bytes_per_token)


def _round_trip(store: Store, key: str, data: bytes) -> float:
    start = time.perf_counter()
    store.put(key, data)
    got = store.get(key)
    if got is None or len(got) != len(data):
        raise RuntimeError(f"probe value under {key} did not come back whole from {store.url}")
    bytes(memoryview(got)[-1:])  # touch the value: a mapped file counts as read
    return time.perf_counter() - start


def _codec_rate(nbytes: int = 32 << 20) -> float:
    """Bytes per second to checksum and copy a packet's tensors (encode or decode)."""
    import blake3

    data = torch.ones(nbytes // 4, dtype=torch.float32).numpy().view("uint8")
    start = time.perf_counter()
    blake3.blake3(data).digest()
    data.copy()
    return nbytes / (time.perf_counter() - start)
