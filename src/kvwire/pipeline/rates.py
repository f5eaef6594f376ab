"""A model's speed on this host, for mode ``auto``: measured by the turns themselves, recognised when the machine
was busy, shared between the agent processes of a host, and nothing measured before a turn.

Mode ``auto`` decides per hop whether sending a cache beats re-prefilling ids (:mod:`.cost`): the ids side needs
the model's prefill rate, the cache side the codec's rates and the store's (:mod:`.probe`). An agent process used
to measure its model before its first turn -- two prefills and three codec rounds, then the store's probe -- while
the host's other agents loaded their models on the same cores. On a 2-core machine that put seconds on every
process's critical path and read prefill ~5x slow, so auto sent caches where ids were cheaper (issue 43). Now an
:class:`Estimator` assembles each decision's costs from what is known by then:

1. **The turn measures.** Every turn prefills something (its prompt, or what a received cache does not cover):
   that prefill, with the process's CPU time over it, is a :class:`Measurement`.
2. **A busy machine is recognised.** A prefill whose process got less than :data:`CLEAN` of its threads' CPU time
   shared the cores with other work. Its rate is not the host's: it is never published, and any clean figure --
   this process's later turn, or another agent's shared one -- wins over it. Where it is all there is, it is used
   as if the process had had its threads' CPU time (``tokens / (cpu_s / threads)``), and the decision says so.
3. **Shared per host** (:func:`publish` / :func:`read_shared`). A clean prefill rate, and the codec rates measured
   beside the model's loading, are published in the store under ``kvwire-rates/v1/STORE/HOST/MODEL`` (the host as
   :func:`.probe.host_id` names it; ``MODEL`` a hash of the weights' fingerprint, the device and the thread count)
   with the kvwire version, the fingerprint, the weight format, a time and a time-to-live, as the store's own
   estimate is (:mod:`.probe`). Another agent of the host reads it for its decisions. A value from another kvwire
   version, another model, another weight format, or with a rate that is not a finite positive number gets one
   warning line and is not used: the agent goes on with what it measures, or the priors.
4. **Beside, never before** (:class:`Background`). The store's bounded probe and the codec's rates are measured in
   a thread started with the process, beside the model's loading (the codec timed by that thread's own CPU time,
   so the loading does not slow its figure). A decision taken before the thread finishes uses priors for what it
   lacks, and says which.
5. **Priors that cannot lose much.** With no prefill rate at all (nothing shared, and this turn prefilled fewer
   than :data:`MINIMUM` tokens), a hop sends ids when its upstream is at most :data:`SHORT` tokens: re-prefilling
   that few costs a receiver on a CPU well under a second for the models kvwire runs (~0.3 s for the default model,
   ~1.5 s for a 0.5B one in int8 on 2 cores), while a cache over a link not yet measured can cost many times that
   (a 10 Mbit link took 32 s for the three-agent pipeline's caches against 5 s for ids). Past it, the decision uses
   :data:`PRIOR_PREFILL_RATE`, fast on purpose: a cache is sent only where the store makes it clearly cheaper.

Each decision's :attr:`CostModel.sources <kvwire.pipeline.cost.CostModel.sources>` says where every figure came from:
``measured`` (this process, alone), ``contended`` (this process, the machine busy), ``shared`` (another agent of
this host), ``prior``; the store's as :class:`~kvwire.pipeline.cost.ProbeCost` says.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..version import __version__
from ..errors import StoreAccessDenied, StoreError
from ..store import Store
from ..store.metered import Traffic
from ..store.redis_common import redact
from . import probe as probing
from .cost import CostModel, Decision, ModelCost, ProbeCost, StoreCost

if TYPE_CHECKING:
    from ..wire.options import CodecOptions
    from ..wire.spec import ModelSpec

log = logging.getLogger(__name__)

FORMAT = 1
PREFIX = f"kvwire-rates/v{FORMAT}"
TTL_S = 3600.0  # a model's speed on a host changes with the host's load, not by the minute
CLEAN = 0.75  # a prefill whose process got at least this share of its threads' CPU time had the cores to itself
MINIMUM = 16  # fewer prefilled tokens say too little about the rate (a pass's fixed cost dominates)
PUBLISH_MINIMUM = 64  # a rate published for the host's other agents comes from at least this many tokens
SHORT = 256  # with no prefill rate at all, upstreams up to this many tokens go as ids
PRIOR_PREFILL_RATE = 2000.0  # tokens/s when nothing is known: fast, so that only a clearly cheap cache is sent
PRIOR_ENCODE_RATE = 0.5e9  # K/V bytes/s when the codec was not measured (this 2-core CPU: 1.4-1.7 GB/s)
PRIOR_DECODE_RATE = 1.0e9  # (5.3-6.5 GB/s here): slow on purpose, like the prefill prior's speed


@dataclass(frozen=True)
class Measurement:
    """A prefill of ``tokens`` that took ``seconds``, during which this process used ``cpu_s`` of CPU time on
    ``threads`` threads (:func:`usable_threads`)."""

    tokens: int
    seconds: float
    cpu_s: float
    threads: int

    @property
    def utilization(self) -> float:
        """The share of its threads' time the process got: ~1 alone, ~0.5 beside another busy process."""
        return self.cpu_s / (self.seconds * self.threads) if self.seconds > 0 and self.threads > 0 else 0.0

    @property
    def clean(self) -> bool:
        return self.utilization >= CLEAN

    @property
    def rate(self) -> float:
        """Tokens per second: as measured when clean; else as if the process had had its threads' CPU time."""
        if self.clean or self.cpu_s <= 0:
            return self.tokens / self.seconds
        return self.tokens / (self.cpu_s / self.threads)

    def describe(self) -> str:
        busy = "" if self.clean else f", the machine busy: {self.utilization:.0%} of {self.threads} threads' time"
        return f"{self.tokens} tokens in {self.seconds * 1000:.0f} ms{busy}"


def usable_threads() -> int:
    """The threads a prefill of this process can keep busy: torch's, at most the cores it may run on."""
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores))


# -- shared per host --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostRates:
    """What one agent of a host measured of its model, for the others: a prefill rate (tokens/s, clean) and the
    codec's (K/V bytes/s, and packet bytes per token in ``encoding``); either part may be missing (0)."""

    fingerprint: str  # the weights' (ModelSpec.fingerprint)
    weights: str  # their format
    device: str
    threads: int
    prefill_rate: float = 0.0
    prefill_tokens: int = 0  # what the rate was measured on
    encode_rate: float = 0.0
    decode_rate: float = 0.0
    wire_bytes_per_token: float = 0.0
    encoding: str = ""


def model_key(url: str, host: str, fingerprint: str, device: str, threads: int) -> str:
    model = hashlib.blake2b(f"{fingerprint}|{device}|{threads}".encode(), digest_size=8).hexdigest()
    return f"{PREFIX}/{probing.store_id(url)}/{host}/{model}"


def encode(rates: HostRates, *, ttl_s: float = TTL_S, now: float | None = None) -> bytes:
    return json.dumps({"format": FORMAT, "kvwire": __version__, "measured_at": time.time() if now is None else now,
                       "ttl_s": ttl_s, **rates.__dict__}).encode()


def decode(data: Any, expect: HostRates, *, now: float | None = None) -> tuple[HostRates | None, str]:
    """The shared rates in ``data`` if they are for ``expect``'s model, weight format, device and threads, from this
    kvwire version and fresh, with finite positive rates: ``(rates, "")``; else ``(None, why)`` (``why`` empty for
    an expired value, which is merely old)."""
    try:
        found = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError, TypeError):
        return None, "it is not JSON"
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        return None, f"its format is {found.get('format') if isinstance(found, dict) else None!r}, not {FORMAT}"
    if found.get("kvwire") != __version__:
        return None, f"kvwire {found.get('kvwire')!r} wrote it, this is {__version__}"
    for name in ("fingerprint", "weights", "device"):
        if found.get(name) != getattr(expect, name):
            return None, (f"it is for {name} {str(found.get(name))[:16]!r}, this agent's is "
                          f"{str(getattr(expect, name))[:16]!r}")
    if found.get("threads") != expect.threads:
        return None, f"it was measured on {found.get('threads')!r} threads, this agent runs {expect.threads}"
    numbers = {}
    for name in ("measured_at", "ttl_s", "prefill_rate", "encode_rate", "decode_rate", "wire_bytes_per_token",
                 "prefill_tokens"):
        value = found.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return None, f"its {name} is {value!r}, not a finite number >= 0"
        numbers[name] = float(value)
    if not (numbers["prefill_rate"] > 0 or numbers["encode_rate"] > 0):
        return None, "it holds no rate above 0"
    if (numbers["encode_rate"] > 0) != (numbers["decode_rate"] > 0 and numbers["wire_bytes_per_token"] > 0):
        return None, "its codec rates are incomplete"
    now = time.time() if now is None else now
    if not 0 < numbers["ttl_s"] <= 86400 or not numbers["measured_at"] - 5 <= now <= numbers["measured_at"] + \
            numbers["ttl_s"]:
        return None, ""
    encoding = found.get("encoding", "")
    return replace(expect, prefill_rate=numbers["prefill_rate"], prefill_tokens=int(numbers["prefill_tokens"]),
                   encode_rate=numbers["encode_rate"], decode_rate=numbers["decode_rate"],
                   wire_bytes_per_token=numbers["wire_bytes_per_token"],
                   encoding=encoding if isinstance(encoding, str) else ""), ""


def read_shared(store: Store, key: str, expect: HostRates) -> HostRates | None:
    """The host's shared rates for ``expect``'s model, or None; a value that cannot be used is named in one warning
    line (an expired one quietly: it is merely old), and a store that cannot be read is None too."""
    try:
        data = store.get(key)
    except StoreError as err:
        log.warning("could not read the host's shared model rates from %s: %s; deciding from this process's own "
                    "figures and priors", redact(store.url), err)
        return None
    if data is None:
        return None
    rates, why = decode(data, expect)
    if rates is None and why:
        log.warning("ignoring the shared model rates at %s: %s; deciding from this process's own figures and priors",
                    key, why)
    return rates


def publish(store: Store, key: str, rates: HostRates, ttl_s: float = TTL_S) -> bool:
    try:
        store.put(key, encode(rates, ttl_s=ttl_s))
        return True
    except (StoreAccessDenied, StoreError) as err:
        log.warning("could not publish the model's rates for the host's other agents: %s", err)
        return False


# -- beside the model's loading ---------------------------------------------------------------------


class Background:
    """The store's costs (:func:`.probe.store_costs`: a host's shared figure, or the bounded probe) and the codec's
    rates (:func:`.cost.probe_codec` on ``spec``, timed by this thread's CPU time), measured in a thread started
    here, beside whatever the process does next (loading its model). :meth:`result` never waits unless told to."""

    def __init__(self, store: Store, spec: ModelSpec | None, options: CodecOptions | None = None, *,
                 budget_s: float = probing.BUDGET_S, start: bool = True) -> None:
        self.store, self.spec, self.options, self.budget_s = store, spec, options, budget_s
        self.store_cost: tuple[StoreCost, ProbeCost] | None = None
        self.codec: ModelCost | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwire-costs", daemon=True)
        if start:
            self._thread.start()

    def _run(self) -> None:
        begin = time.perf_counter()
        try:
            self.store_cost = probing.store_costs(self.store, budget_s=self.budget_s)
            if self.spec is not None:
                from .cost import probe_codec

                self.codec = probe_codec(self.spec, self.options, clock=time.thread_time)
        except Exception as err:  # noqa: BLE001 -- a probe that fails leaves priors, never a failed turn
            self.error = err
            log.warning("measuring the store and the codec beside the model's loading failed (%s: %s); deciding "
                        "from priors until real transfers are measured", type(err).__name__, err)
        finally:
            self.seconds = time.perf_counter() - begin
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


# -- the estimate a decision uses ------------------------------------------------------------------


class Estimator:
    """The costs an agent process decides with in mode ``auto`` (:meth:`costs`), from its turns' own prefills, the
    host's shared rates, the :class:`Background` measurement, real packet traffic and priors, in that order of
    trust for each figure (a later clean measurement wins over an earlier one)."""

    def __init__(self, store: Store, spec: ModelSpec, *, device: str = "cpu", background: Background | None = None,
                 threads: int | None = None, host: str | None = None) -> None:
        self.store, self.spec, self.background = store, spec, background
        self.threads = threads or usable_threads()
        self.host = host or probing.host_id(store.url)
        self.key = model_key(store.url, self.host, spec.fingerprint, device, self.threads)
        self.expect = HostRates(spec.fingerprint, spec.weights, device, self.threads)
        self.measured: Measurement | None = None  # the last clean prefill of this process
        self.contended: Measurement | None = None  # the last busy one, used only when nothing clean is known
        self.store_estimate: tuple[StoreCost, ProbeCost] | None = None
        self._published: HostRates | None = None

    def observe(self, measurement: Measurement) -> None:
        """A turn's prefill: a clean one replaces any earlier figure, a busy one is kept only as a fallback."""
        if measurement.tokens < MINIMUM or measurement.seconds <= 0:
            return
        if measurement.clean:  # a short prefill's rate is mostly the pass's fixed cost: it replaces only a shorter one
            if self.measured is None or measurement.tokens >= min(self.measured.tokens, PUBLISH_MINIMUM):
                self.measured = measurement
            self.contended = None
        elif self.measured is None:
            self.contended = measurement

    def costs(self, traffic: Traffic | None = None) -> CostModel:
        """The cost model for a decision now: every figure from the best source there is (:attr:`CostModel.sources`)."""
        shared = read_shared(self.store, self.key, self.expect)
        prefill_rate, prefill_source = self._prefill(shared)
        codec, codec_source = self._codec(shared)
        store_cost, probe = self._store()
        cost = CostModel(store_cost, replace(codec, prefill_rate=prefill_rate), probe,
                         (("prefill", prefill_source), ("codec", codec_source)))
        if traffic is not None:
            cost = probing.refine(cost, traffic)
            self.store_estimate = (cost.store, cost.probe) if cost.probe is not None else self.store_estimate
        return cost

    def decide(self, tokens: int, delta_tokens: int, links: int, traffic: Traffic | None = None
               ) -> tuple[CostModel, Decision]:
        """:meth:`costs`, and its :meth:`~kvwire.pipeline.cost.CostModel.decide` for the hop -- but ids, by the rule
        :data:`SHORT`, where the prefill rate is only the prior's and the upstream is short."""
        cost = self.costs(traffic)
        verdict = cost.decide(tokens, delta_tokens, links)
        if dict(cost.sources)["prefill"].startswith("prior") and tokens <= SHORT:
            verdict = replace(verdict, choice="ids", rule=f"the model's prefill rate is not known yet and the upstream "
                              f"is {tokens} tokens, at most {SHORT}: re-prefilling them costs little")
        return cost, verdict

    def _prefill(self, shared: HostRates | None) -> tuple[float, str]:
        mine = self.measured
        if mine is not None and (mine.tokens >= PUBLISH_MINIMUM or shared is None or not shared.prefill_rate > 0):
            return mine.rate, f"measured: {mine.describe()}"
        if shared is not None and shared.prefill_rate > 0:
            return shared.prefill_rate, (f"shared: an agent on this host, {shared.prefill_tokens} tokens at "
                                         f"{shared.prefill_rate:.0f} tokens/s")
        if self.contended is not None:
            return self.contended.rate, (f"contended: {self.contended.describe()}, taken as if it had had them "
                                         f"({self.contended.rate:.0f} tokens/s)")
        return PRIOR_PREFILL_RATE, f"prior: {PRIOR_PREFILL_RATE:.0f} tokens/s"

    def _codec(self, shared: HostRates | None) -> tuple[ModelCost, str]:
        bytes_per_token = self.spec.kv_bytes(1)
        measured = self.background.codec if self.background is not None and self.background.done() else None
        if measured is not None:
            return measured, "measured beside the model's loading"
        if shared is not None and shared.encode_rate > 0:
            return (ModelCost(1.0, shared.encode_rate, bytes_per_token, shared.wire_bytes_per_token,
                              shared.encode_rate, shared.decode_rate, shared.encoding), "shared: an agent on this host")
        return (ModelCost(1.0, PRIOR_ENCODE_RATE, bytes_per_token, None, PRIOR_ENCODE_RATE, PRIOR_DECODE_RATE),
                "prior: not measured yet")

    def _store(self) -> tuple[StoreCost, ProbeCost]:
        if self.store_estimate is not None:
            return self.store_estimate
        background = self.background
        if background is not None and background.done() and background.store_cost is not None:
            self.store_estimate = background.store_cost
            return self.store_estimate
        note = "the probe beside the model's loading has not finished" if background is not None and \
            not background.done() else "not measured"
        return replace(probing.PRIOR, url=redact(self.store.url)), ProbeCost("prior", note=note, host=self.host)

    def publish(self, cost: CostModel | None = None) -> bool:
        """Publish this process's clean figures for the host's other agents (once per change); False if none."""
        codec = self.background.codec if self.background is not None and self.background.done() else None
        measured = self.measured if self.measured is not None and self.measured.tokens >= PUBLISH_MINIMUM else None
        if measured is None and codec is None:
            return False
        rates = replace(self.expect, prefill_rate=measured.rate if measured else 0.0,
                        prefill_tokens=measured.tokens if measured else 0)
        if codec is not None:
            rates = replace(rates, encode_rate=codec.encode_rate, decode_rate=codec.decode_rate,
                            wire_bytes_per_token=codec.wire_bytes_per_token, encoding=codec.encoding)
        if rates == self._published:
            return False
        if publish(self.store, self.key, rates):
            self._published = rates
            return True
        return False
