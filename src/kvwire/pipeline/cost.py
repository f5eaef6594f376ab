"""When is sending a cache worth it? Measured costs, and the per-hop decision of ``--mode auto``.

A hop can pass the upstream context two ways:

- **cache**: the sender encodes its new K/V (``delta_tokens``) and puts it in the store;
  the receiver gets the whole chain (``tokens``, in ``links`` packets), verifies and
  decodes it, and builds its cache. With ``w`` bytes per token on the wire (the packet
  encoding's: fp32 ~46 KB for the default model, int8 ~3.7x fewer) and ``b`` K/V bytes
  per token in the model's dtype::

      transfer_s = (1 + links) * latency_s / 2                        # one put, one get per link
                 + delta_tokens * w / put_rate + tokens * w / get_rate
      cache_s    = transfer_s + delta_tokens * b / encode_rate + tokens * b / decode_rate

- **ids**: the handoff carries token ids only; the receiver re-prefills them::

      ids_s = tokens / prefill_rate

The cache wins when ``cache_s < ids_s``. On one host (memory, /dev/shm, loopback
Redis) that holds from a few dozen tokens on; over a slow link, or for tiny
contexts, ids win. Puts and gets are measured apart because they are not alike: over
the same link a Redis get of a large value runs at a fraction of a put's rate here
(redis-py parses replies in Python). Every rate is a parameter (:class:`StoreCost`,
:class:`ModelCost`), so the same model answers for hardware this machine is not:
:mod:`kvwire.pipeline.breakeven` sweeps prefill rates and link speeds with it.

:func:`probe_store` and :func:`probe_model` measure the rates on the real store and
model (:func:`measure` does both, about a second): the store's latency and put and
get rates, the model's prefill speed, and the codec's encode and decode rates and
bytes per token on a real packet of the encoding the agent sends. :class:`CostModel`
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
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..errors import KvwireError
from ..store import Store

if TYPE_CHECKING:
    from ..wire.options import CodecOptions
    from ..wire.spec import ModelSpec

Choice = Literal["cache", "ids"]


@dataclass(frozen=True)
class StoreCost:
    """A store's costs: a put of ``n`` bytes takes ``latency_s / 2 + n / put_rate`` seconds, a get
    ``latency_s / 2 + n / get_rate``.

    ``bandwidth`` is the rate of a put and a get of the same bytes together
    (``n / (put_s + get_s)``); without ``put_rate`` / ``get_rate`` both are taken to be
    ``2 * bandwidth`` (a symmetric store).
    """

    latency_s: float  # put + get of a tiny value
    bandwidth: float  # bytes per second of put + get of large values together
    url: str = ""
    put_rate: float | None = None  # bytes per second of a put alone
    get_rate: float | None = None  # bytes per second of a get alone

    def __post_init__(self) -> None:
        if self.put_rate is None:
            object.__setattr__(self, "put_rate", 2 * self.bandwidth)
        if self.get_rate is None:
            object.__setattr__(self, "get_rate", 2 * self.bandwidth)

    @classmethod
    def from_rates(cls, latency_s: float, put_rate: float, get_rate: float, url: str = "") -> StoreCost:
        return cls(latency_s, 1 / (1 / put_rate + 1 / get_rate), url, put_rate, get_rate)

    def seconds(self, nbytes: int, operations: int = 1) -> float:
        """``operations`` puts and gets of tiny values, and a put and a get of ``nbytes``."""
        return operations * self.latency_s + nbytes / self.bandwidth

    def put_s(self, nbytes: int) -> float:
        return self.latency_s / 2 + nbytes / self.put_rate  # type: ignore[operator]

    def get_s(self, nbytes: int, operations: int = 1) -> float:
        return operations * self.latency_s / 2 + nbytes / self.get_rate  # type: ignore[operator]


@dataclass(frozen=True)
class ModelCost:
    """A model's prefill speed, and what its packets cost to encode, decode and carry.

    Rates are in K/V bytes of the model's dtype per second; ``wire_bytes_per_token`` is
    what one token takes in a packet of the encoding sent (default: ``bytes_per_token``,
    the lossless one). Without ``encode_rate`` / ``decode_rate`` they follow from
    ``codec_rate`` (one pass to encode; two to decode and build the cache).
    """

    prefill_rate: float  # tokens per second
    codec_rate: float  # K/V bytes per second of one checksum + copy pass
    bytes_per_token: int  # K/V bytes per token of this model (spec.kv_bytes(1))
    wire_bytes_per_token: float | None = None  # packet bytes per token in the encoding sent
    encode_rate: float | None = None  # K/V bytes per second: extract + quantize + checksum
    decode_rate: float | None = None  # K/V bytes per second: verify + dequantize + build the cache
    encoding: str = ""  # the encoding these were measured for ("" = the model's dtype)

    def __post_init__(self) -> None:
        if self.wire_bytes_per_token is None:
            object.__setattr__(self, "wire_bytes_per_token", float(self.bytes_per_token))
        if self.encode_rate is None:
            object.__setattr__(self, "encode_rate", self.codec_rate)
        if self.decode_rate is None:
            object.__setattr__(self, "decode_rate", self.codec_rate / 2)


@dataclass(frozen=True)
class ProbeCost:
    """Where this process's estimate of the store's costs came from, and what getting it cost.

    ``source``: ``probe`` (measured here), ``shared`` (another agent's on this host, read from
    the store), ``passive`` (refined from real transfers), ``prior`` (the store refused the
    probe's keys), or ``skipped`` (a cache could not win on any link: nothing measured). Costs given
    by the caller (``--costs FILE``, a test's numbers) have no ``ProbeCost``.
    """

    source: str
    bytes: int = 0  # probe payload moved by this process, put + get
    seconds: float = 0.0  # spent probing (or reading a shared result)
    rounds: int = 0
    waited_s: float = 0.0  # spent waiting for another process's probe of the same store
    host: str = ""
    note: str = ""
    basis: str = ""  # passive: the source of the estimate it refined

    def describe(self) -> str:
        if self.source in ("probe", "passive") and self.bytes:
            moved = f"{self.bytes / 1e6:.1f} MB in {self.seconds * 1000:.0f} ms, {self.rounds} rounds"
            first = f" (first: {self.basis})" if self.basis else ""
            return f"{self.source}{first}: {moved}" + (f"; {self.note}" if self.note else "")
        return self.source + (f": {self.note}" if self.note else "")

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "bytes": self.bytes, "seconds": self.seconds, "rounds": self.rounds,
                "waited_s": self.waited_s, "host": self.host, "note": self.note, "basis": self.basis}


@dataclass(frozen=True)
class Decision:
    choice: Choice
    cache_s: float  # predicted: transfer + codec
    ids_s: float  # predicted: re-prefill
    transfer_s: float = 0.0  # predicted: the store's part of cache_s (put of the delta, get of the chain)
    wire_bytes: int = 0  # predicted bytes put + got
    probe: ProbeCost | None = None  # what the store estimate cost to get (already paid; refining it further is free)
    sources: tuple[tuple[str, str], ...] = ()  # where the model's figures came from (CostModel.sources)
    rule: str = ""  # a prior's rule that decided instead of the costs (kvwire.pipeline.rates.SHORT)

    @property
    def reason(self) -> str:
        paid = f"store estimate: {self.probe.describe()}" if self.probe is not None else ""
        figures = "; ".join([paid] * bool(paid) + [f"{name}: {source}" for name, source in self.sources])
        figures = f" ({figures})" if figures else ""
        if self.rule:
            return f"{self.choice}: {self.rule}{figures}"
        sign = "<" if self.choice == "cache" else ">="
        return (f"{self.choice}: sending the cache ~{self.cache_s * 1000:.0f} ms {sign} re-prefilling the ids "
                f"~{self.ids_s * 1000:.0f} ms{figures}")

    def to_json(self) -> dict[str, Any]:
        return {"choice": self.choice, "cache_s": self.cache_s, "ids_s": self.ids_s, "transfer_s": self.transfer_s,
                "wire_bytes": self.wire_bytes, "probe": self.probe.to_json() if self.probe is not None else None,
                "sources": dict(self.sources), "rule": self.rule}


@dataclass(frozen=True)
class CostModel:
    store: StoreCost
    model: ModelCost
    probe: ProbeCost | None = None  # how the store's costs were found (kvwire.pipeline.probe), and what that cost
    # where the model's figures came from, e.g. (("prefill", "measured: 233 tokens in 260 ms"), ("codec", "shared:
    # ...")): measured, contended, shared or prior (kvwire.pipeline.rates); empty for costs measured together
    sources: tuple[tuple[str, str], ...] = ()

    def transfer_s(self, tokens: int, delta_tokens: int, links: int) -> float:
        """Predicted store time of a hop: put ``delta_tokens``, get ``tokens`` in ``links`` packets."""
        wire = self.model.wire_bytes_per_token
        return self.store.put_s(int(delta_tokens * wire)) + self.store.get_s(int(tokens * wire), operations=links)

    def decide(self, tokens: int, delta_tokens: int, links: int) -> Decision:
        """Cache or ids for a receiver whose context starts with ``tokens`` upstream tokens,
        of which the sender adds ``delta_tokens`` as one more link of a ``links``-long chain."""
        m = self.model
        transfer = self.transfer_s(tokens, delta_tokens, links)
        codec = (delta_tokens * m.bytes_per_token / m.encode_rate  # type: ignore[operator]
                 + tokens * m.bytes_per_token / m.decode_rate)  # type: ignore[operator]
        ids_s = tokens / m.prefill_rate
        cache_s = transfer + codec
        return Decision("cache" if cache_s < ids_s else "ids", cache_s, ids_s, transfer,
                        int((tokens + delta_tokens) * m.wire_bytes_per_token), self.probe,  # type: ignore[operator]
                        self.sources)

    def break_even_tokens(self) -> int | None:
        """Fewest upstream tokens for which sending the cache wins (one link), or None if it never does."""
        m, s = self.model, self.store
        per_token_cache = (m.wire_bytes_per_token * (1 / s.put_rate + 1 / s.get_rate)  # type: ignore[operator]
                           + m.bytes_per_token * (1 / m.encode_rate + 1 / m.decode_rate))  # type: ignore[operator]
        per_token_ids = 1 / m.prefill_rate
        if per_token_cache >= per_token_ids:
            return None
        return max(1, int(s.latency_s / (per_token_ids - per_token_cache)) + 1)

    def to_json(self) -> dict[str, Any]:
        s, m = self.store, self.model
        return {"store": {"url": s.url, "latency_s": s.latency_s, "bandwidth": s.bandwidth, "put_rate": s.put_rate,
                          "get_rate": s.get_rate},
                "model": {"prefill_rate": m.prefill_rate, "codec_rate": m.codec_rate,
                          "bytes_per_token": m.bytes_per_token, "wire_bytes_per_token": m.wire_bytes_per_token,
                          "encode_rate": m.encode_rate, "decode_rate": m.decode_rate, "encoding": m.encoding},
                "break_even_tokens": self.break_even_tokens(),
                **({"probe": self.probe.to_json()} if self.probe is not None else {}),
                **({"sources": dict(self.sources)} if self.sources else {})}

    @classmethod
    def from_json(cls, data: Any, source: str = "cost model") -> CostModel:
        """The inverse of :meth:`to_json` (what ``kvwire probe --json`` prints; the fields added since,
        ``put_rate`` to ``encoding``, may be missing); :class:`KvwireError` naming ``source`` if a field
        is missing or not a positive number."""
        def number(section: str, name: str, kind: type = float, optional: bool = False) -> Any:
            try:
                value = data[section][name]
            except (KeyError, TypeError):
                if optional and isinstance(data, dict) and isinstance(data.get(section), dict):
                    return None
                raise KvwireError(f"{source} has no {section}.{name}",
                                  "give the JSON line `kvwire probe URL --json` prints") from None
            if optional and value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
                    kind is int and not float(value).is_integer()):
                raise KvwireError(f"{source}: {section}.{name} must be a positive number, got {value!r}")
            return kind(value)

        store = StoreCost(number("store", "latency_s"), number("store", "bandwidth"),
                          str(data["store"].get("url", "")), number("store", "put_rate", optional=True),
                          number("store", "get_rate", optional=True))
        encoding = data["model"].get("encoding", "")
        model = ModelCost(number("model", "prefill_rate"), number("model", "codec_rate"),
                          number("model", "bytes_per_token", int),
                          number("model", "wire_bytes_per_token", optional=True),
                          number("model", "encode_rate", optional=True), number("model", "decode_rate", optional=True),
                          encoding if isinstance(encoding, str) else "")
        return cls(store, model)  # given costs: used as they are (kvwire.pipeline.probe.refine leaves them)


def measure(store: Store, model: Any, bytes_per_token: int, large: int = 16 << 20, *,
            spec: ModelSpec | None = None, options: CodecOptions | None = None) -> CostModel:
    """Probe ``store`` and ``model`` (about a second): the costs behind mode ``auto``'s decisions.
    With ``spec``, the codec is measured on a real packet in ``options``' encoding."""
    return CostModel(probe_store(store, large=large), probe_model(model, bytes_per_token, spec=spec, options=options))


def probe_store(store: Store, large: int = 16 << 20, repeats: int = 5) -> StoreCost:
    """Measure a store's latency (64-byte put + get) and its put and get rates (``large``-byte values).

    Uses keys under ``probe/`` and deletes them; medians over ``repeats`` after one untimed round
    of each size (a fresh process's first large reply runs at a fraction of the later ones' rate:
    its buffers are new memory).
    """
    key = f"probe/{uuid.uuid4().hex}"
    small, big = os.urandom(64), os.urandom(large)
    try:
        put_get(store, key, small), put_get(store, key, big)  # warm-up: connection, buffers, pages
        latency = statistics.median(sum(put_get(store, key, small)) for _ in range(repeats))
        heavy = [put_get(store, key, big) for _ in range(max(2, repeats // 2))]
    finally:
        store.delete(key)
    put = statistics.median(p for p, _ in heavy) - latency / 2
    get = statistics.median(g for _, g in heavy) - latency / 2
    return StoreCost.from_rates(latency, large / max(put, 1e-9), large / max(get, 1e-9), store.url)


def probe_model(model: Any, bytes_per_token: int, tokens: int = 256, *, spec: ModelSpec | None = None,
                options: CodecOptions | None = None) -> ModelCost:
    """Measure prefill tokens/s on ``tokens`` random tokens, and the codec: with ``spec``, encode and
    decode of a random packet of ``tokens`` tokens in ``options``' encoding (its real bytes per token);
    without, one checksum + copy pass of 32 MiB."""
    from .. import hf  # transformers only when a model is probed

    ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size, (1, tokens))
    ids = ids.to(hf.model_device(model))

    def fill() -> None:  # reading a logit waits for an accelerator to finish the pass
        out = model(input_ids=ids, past_key_values=hf.new_cache(model), use_cache=True, logits_to_keep=1)
        float(out.logits[0, 0, 0])

    with torch.inference_mode(), hf.fast_linears(model, tokens, 1):  # the products a real prefill uses
        # warm-up of the very shape timed: a fresh process's first pass of a shape builds its kernels
        # and touches its buffers, and read ~25x slower than the turns then ran (three agents at start)
        fill()
        start = time.perf_counter()
        fill()
        prefill = time.perf_counter() - start
    if spec is None:
        return ModelCost(tokens / prefill, _codec_rate(), bytes_per_token)
    return probe_codec(spec, options, tokens, prefill_rate=tokens / prefill)


def probe_codec(spec: ModelSpec, options: CodecOptions | None = None, tokens: int = 256, *,
                prefill_rate: float = 1.0, repeats: int = 3, clock: Any = time.perf_counter) -> ModelCost:
    """Encode and decode a random packet of ``tokens`` tokens of ``spec`` in ``options``' encoding
    (medians of ``repeats``): bytes per token on the wire and the encode and decode rates. ``clock``:
    ``time.thread_time`` times the codec by this thread's CPU time, so that work beside it (a model
    loading in another thread) does not slow its figure."""
    from ..wire import codec
    from ..wire.options import CodecOptions
    from ..wire.packet import Packet

    options = options if options is not None else CodecOptions.from_env()
    g = torch.Generator().manual_seed(0)
    shape = [(1, spec.num_kv_heads, spec.kept_tokens(layer, tokens), spec.head_dim) for layer in range(spec.num_layers)]
    packet = Packet(spec=spec, keys=tuple(torch.randn(s, generator=g).to(spec.torch_dtype) for s in shape),
                    values=tuple(torch.randn(s, generator=g).to(spec.torch_dtype) for s in shape),
                    token_ids=torch.zeros(1, tokens, dtype=torch.int64), mask=torch.ones(1, tokens, dtype=torch.uint8),
                    producer="probe")
    encode_s, decode_s, wire = [], [], 0
    for _ in range(repeats):
        start = clock()
        data = codec.encode(packet, options=options)
        encode_s.append(clock() - start)
        start = clock()
        decoded = codec.decode(data, options=options)
        for tensor in (*decoded.keys, *decoded.values):  # building the cache copies every tensor once
            tensor.clone()
        decode_s.append(clock() - start)
        wire = len(data)
    nbytes = spec.kv_bytes(tokens)
    return ModelCost(prefill_rate, _codec_rate(), spec.kv_bytes(1), wire / tokens,
                     nbytes / max(statistics.median(encode_s), 1e-6), nbytes / max(statistics.median(decode_s), 1e-6),
                     options.encoding or "")


def put_get(store: Store, key: str, data: bytes) -> tuple[float, float]:
    """Seconds to put ``data`` under ``key``, and to get it back (checked whole, and touched)."""
    start = time.perf_counter()
    store.put(key, data)
    put = time.perf_counter() - start
    start = time.perf_counter()
    got = store.get(key)
    if got is None or len(got) != len(data):
        raise RuntimeError(f"probe value under {key} did not come back whole from {store.url}")
    bytes(memoryview(got)[-1:])  # touch the value: a mapped file counts as read
    return put, time.perf_counter() - start


def _codec_rate(nbytes: int = 32 << 20) -> float:
    """Bytes per second to checksum and copy a packet's tensors (encode or decode)."""
    import blake3

    data = torch.ones(nbytes // 4, dtype=torch.float32).numpy().view("uint8")
    start = time.perf_counter()
    blake3.blake3(data).digest()
    data.copy()
    return nbytes / (time.perf_counter() - start)
