"""How fast is the store from here? A probe whose cost is bounded, shared through the store, refined by real traffic.

Mode ``auto`` decides per hop between sending a cache and re-prefilling ids
(:mod:`kvwire.pipeline.cost`), and needs the store's latency and put and get rates
for that. Measuring them costs what it measures: bytes over the very link in
question. Three processes on three hosts each putting and getting 96 MiB of probe
data, all at once, moved 8.5 times the bytes of the pipeline they decided for, and
measured each other's contention rather than the link. This module keeps the
measurement cheaper than the decision it serves:

1. **Bounded** (:func:`probe_store_bounded`): a latency round of tiny values, then a
   64 KiB and a 640 KiB value put and got: 1.4 MB of traffic, so that three agents on
   three hosts stay under 5 MB together. The estimate is the *marginal* rate between
   the two rounds (the extra bytes over the extra seconds): latency, TCP warm-up and
   part of a shaper's burst bucket cancel out of it. It is taken for both directions
   from the slower one (a burst flatters the direction that drew on it). A round that
   would overrun the time budget (300 ms by default) is not started. Bytes, seconds and
   rounds are counted (:class:`ProbeCost`) and reported with every decision.
2. **Shared** (:func:`store_costs`): a result is published in the store itself, under
   ``kvwire-probe/v1/STORE/HOST`` (the host as the store sees it: the host name and
   the local address that reaches the store), with its time and a time-to-live.
   Agents on the same host read it instead of probing. Probes of one store are
   serialized through a lock key there (compare-and-set, with an expiry), so that
   no two probes share the link and measure each other. A stored result that is
   malformed, of another format, for another store or host, or expired is ignored
   and re-measured, never trusted.
3. **Passive** (:func:`refine`): a turn's real packet traffic of at least 256 KiB in
   a direction replaces the probe's rate in that direction. From the first real
   transfer on, decisions use measured traffic; the refined estimate is published
   for the host's other agents.
4. **Accounted**: the decision's :class:`ProbeCost` says what measuring cost.
   :func:`store_costs` does not probe at all when even a free, instant store could
   not make a cache beat re-prefilling (the codec alone costs more per token than
   prefill): the cheapest transfer is known to lose, ids are sent.

A store whose ACL refuses the probe's keys gets no probe: a warning names the
permission, and the estimate starts from a conservative prior
(:data:`PRIOR`: 1 ms, 12.5 MB/s each way) until passive measurement replaces it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import statistics
import time
import uuid
from dataclasses import replace
from typing import Any

from ..errors import StoreAccessDenied, VersionConflict
from ..store import Store
from ..store.metered import Traffic
from ..store.redis_common import redact
from .cost import CostModel, ModelCost, ProbeCost, StoreCost, put_get

log = logging.getLogger(__name__)

FORMAT = 1  # the stored result's format; any other is re-measured
PREFIX = f"kvwire-probe/v{FORMAT}"
SIZES = (64 << 10, 640 << 10)  # payloads of the bandwidth rounds: 1.4 MB each way in all, three agents under 5 MB
BUDGET_S = 0.3  # default time budget of one probe
TTL_S = 600.0  # how long a published result is trusted
PASSIVE_MIN = 256 << 10  # real traffic of at least this many bytes in a direction refines the estimate
PRIOR = StoreCost.from_rates(1e-3, 12.5e6, 12.5e6, "")  # without any measurement: a 100 Mbit link
NO_LINK = StoreCost.from_rates(0.0, 1e18, 1e18, "")  # what a decision assumes when the store was never needed


# -- 1. the bounded probe --------------------------------------------------------------------------


def probe_store_bounded(store: Store, budget_s: float = BUDGET_S, *,
                        sizes: tuple[int, ...] = SIZES) -> tuple[StoreCost, ProbeCost]:
    """Measure ``store``'s latency and its marginal rate within about ``budget_s`` seconds and a few
    hundred KiB of traffic.

    Keys under ``kvwire-probe/v1/tmp/`` are written and deleted. The latency is the median put +
    get of a 64-byte value (after one to open the connection); then a value of each of ``sizes``
    is put and got once, and each round's rates are its extra bytes over its extra seconds against
    the round before (the first round's against the latency). A round that would overrun the budget
    (predicted from the one before) is not started. The estimate is the slower direction's, for
    both: one link carries both ways, and a shaper's burst bucket flatters whichever direction
    drew on it more.
    """
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    key = f"{PREFIX}/tmp/{uuid.uuid4().hex}"
    start = time.perf_counter()
    moved, rounds = 0, 0
    try:
        put_get(store, key, os.urandom(64))  # the connection, the first reply's buffers
        latency = statistics.median(sum(put_get(store, key, os.urandom(64))) for _ in range(3))
        moved += 4 * 128
        previous = (0, latency / 2, latency / 2)  # (bytes, put s, get s) of the round before
        rate = 0.0
        for size in sizes:
            if rounds:
                predicted = latency + 2 * (size - previous[0]) / rate + previous[1] + previous[2]
                if time.perf_counter() - start + predicted > budget_s:
                    break
            put_s, get_s = put_get(store, key, os.urandom(size))
            moved, rounds = moved + 2 * size, rounds + 1
            extra = size - previous[0]
            rate = min(extra / max(put_s - previous[1], 1e-6), extra / max(get_s - previous[2], 1e-6))
            previous = (size, put_s, get_s)
    finally:
        try:
            store.delete(key)
        except StoreAccessDenied:
            pass
    seconds = time.perf_counter() - start
    cost = StoreCost.from_rates(latency, rate, rate, redact(store.url))
    note = "" if rounds == len(sizes) else f"stopped after {previous[0] >> 10} KiB by the budget"
    return cost, ProbeCost("probe", moved, seconds, rounds, note=note)


# -- 2. shared through the store -------------------------------------------------------------------


def store_id(url: str) -> str:
    """A key segment naming the store (its URL without credentials, hashed)."""
    return hashlib.blake2b(redact(url).encode(), digest_size=8).hexdigest()


def host_id(url: str) -> str:
    """This host as the store sees it: the host name and the local address routed to the store.

    Network namespaces on one machine share a host name but not their addresses, so agents in
    different namespaces measure their own links. No packet is sent to find the address.
    """
    name = socket.gethostname() or "host"
    address = "local"
    scheme, _, rest = url.partition("://")
    netloc = rest.split("/", 1)[0].rsplit("@", 1)[-1].split(",")[0]  # a cluster's first node
    target, _, port = netloc.rpartition(":") if netloc.count(":") == 1 or netloc.startswith("[") else (netloc, "", "")
    target = target.strip("[]")
    if scheme.startswith("redis") and target:
        try:
            with socket.socket(socket.AF_INET6 if ":" in target else socket.AF_INET, socket.SOCK_DGRAM) as udp:
                udp.connect((target, int(port) if port.isdigit() else 6379))
                address = udp.getsockname()[0]
        except (OSError, ValueError):
            address = "unrouted"
    clean = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{name}_{address}")
    return clean.lstrip(".")[:100] or "host"


def result_key(url: str, host: str) -> str:
    return f"{PREFIX}/{store_id(url)}/{host}"


def lock_key(url: str) -> str:
    return f"{PREFIX}/{store_id(url)}/lock"


def encode_result(cost: StoreCost, probe: ProbeCost, url: str, host: str, *, ttl_s: float = TTL_S,
                  now: float | None = None) -> bytes:
    return json.dumps({"format": FORMAT, "store": store_id(url), "host": host,
                       "measured_at": time.time() if now is None else now, "ttl_s": ttl_s,
                       "latency_s": cost.latency_s, "put_rate": cost.put_rate, "get_rate": cost.get_rate,
                       "source": probe.source}).encode()


def decode_result(data: Any, url: str, host: str, *, now: float | None = None) -> StoreCost | None:
    """The stored result in ``data`` if it is well-formed, of this format, for this store and host,
    and not expired; else ``None`` (and the caller measures again)."""
    try:
        found = json.loads(bytes(data))
        if not isinstance(found, dict) or found.get("format") != FORMAT:
            return None
        if found.get("store") != store_id(url) or found.get("host") != host:
            return None
        numbers = [found[k] for k in ("measured_at", "ttl_s", "latency_s", "put_rate", "get_rate")]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v != v for v in numbers):
            return None
        measured_at, ttl_s, latency, put_rate, get_rate = (float(v) for v in numbers)
        now = time.time() if now is None else now
        if not (latency >= 0 and put_rate > 0 and get_rate > 0 and 0 < ttl_s <= 86400):
            return None
        if not (measured_at - 5 <= now <= measured_at + ttl_s):  # expired, or from a clock far ahead
            return None
        return StoreCost.from_rates(latency, put_rate, get_rate, redact(url))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def read_shared(store: Store, url: str, host: str) -> StoreCost | None:
    found = store.get(result_key(url, host))
    return None if found is None else decode_result(found, url, host)


def publish(store: Store, cost: StoreCost, probe: ProbeCost, url: str, host: str, ttl_s: float = TTL_S) -> bool:
    """Publish this host's estimate for the others; ``False`` (and a log line) if the store refuses."""
    try:
        store.put(result_key(url, host), encode_result(cost, probe, url, host, ttl_s=ttl_s))
        return True
    except StoreAccessDenied as err:
        log.warning("could not publish the store estimate for other agents: %s", err)
        return False


def _take_lock(store: Store, key: str, hold_s: float) -> bool:
    """Take the probe lock (compare-and-set), also over an expired holder; ``False`` if someone holds it."""
    mine = json.dumps({"holder": uuid.uuid4().hex, "expires_at": time.time() + hold_s}).encode()
    try:
        store.put(key, mine, expect_version=0)
        return True
    except VersionConflict as held:
        found = store.get_versioned(key)
        if found is None:
            return False  # released meanwhile: the caller looks for a result, then tries again
        try:
            expires = float(json.loads(bytes(found[0]))["expires_at"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            expires = 0.0  # a malformed lock is as good as expired
        if expires > time.time():
            return False
        try:
            store.put(key, mine, expect_version=found[1] or held.actual)
            return True
        except VersionConflict:
            return False


def store_costs(store: Store, *, budget_s: float = BUDGET_S, ttl_s: float = TTL_S, wait_s: float | None = None,
                host: str | None = None) -> tuple[StoreCost, ProbeCost]:
    """This host's costs of ``store``: a valid shared result if there is one, else a bounded probe
    (serialized with other processes' probes of the store) whose result is then published.

    ``wait_s`` bounds the wait for another process's probe (default: 10x the budget plus 2 s);
    past it, this process probes anyway. A store that refuses the probe's keys gives
    :data:`PRIOR`, with a warning that names the permission to grant.
    """
    url = store.url
    host = host or host_id(url)
    start = time.perf_counter()
    deadline = start + (wait_s if wait_s is not None else 10 * budget_s + 2.0)
    pause = 0.02
    try:
        while True:
            shared = read_shared(store, url, host)
            if shared is not None:
                waited = time.perf_counter() - start
                return shared, ProbeCost("shared", 0, waited, 0, waited, host, "an agent on this host measured it")
            if _take_lock(store, lock_key(url), hold_s=4 * budget_s + 5.0) or time.perf_counter() > deadline:
                break
            time.sleep(pause)
            pause = min(pause * 1.5, 0.25)
        waited = time.perf_counter() - start
        try:
            shared = read_shared(store, url, host)  # published between our look and taking the lock
            if shared is not None:
                return shared, ProbeCost("shared", 0, waited, 0, waited, host, "an agent on this host measured it")
            cost, probe = probe_store_bounded(store, budget_s)
            probe = replace(probe, waited_s=waited, host=host)
            publish(store, cost, probe, url, host, ttl_s)
        finally:
            store.delete(lock_key(url))
        return cost, probe
    except StoreAccessDenied as err:
        log.warning("%s refuses the probe's keys %s/* (%s); to let agents measure the link and share the "
                    "result, grant this user read and write on them. Deciding from a prior of 12.5 MB/s each way "
                    "until real transfers are measured", redact(url), PREFIX, err)
        return replace(PRIOR, url=redact(url)), ProbeCost("prior", 0, time.perf_counter() - start, 0, 0.0, host,
                                                          f"no permission on {PREFIX}/*")


def cache_can_win(model: ModelCost) -> bool:
    """Whether sending a cache could beat re-prefilling on any store: the codec alone per token
    must cost less than prefilling a token (a free, instant store is the best any link can do)."""
    per_token_codec = model.bytes_per_token * (1 / model.encode_rate + 1 / model.decode_rate)  # type: ignore[operator]
    return per_token_codec < 1 / model.prefill_rate


def auto_costs(store: Store, model: ModelCost, *, budget_s: float = BUDGET_S, ttl_s: float = TTL_S,
               wait_s: float | None = None) -> CostModel:
    """The cost model of an agent in its own process: the model's measured costs, and the store's
    from :func:`store_costs` -- or no store measurement at all where a cache cannot win anyway."""
    if not cache_can_win(model):
        return CostModel(replace(NO_LINK, url=redact(store.url)), model,
                         ProbeCost("skipped", note="the codec alone costs more per token than prefill"))
    cost, probe = store_costs(store, budget_s=budget_s, ttl_s=ttl_s, wait_s=wait_s)
    return CostModel(cost, model, probe)


# -- 3. passive measurement ------------------------------------------------------------------------


def refine_prefill(cost: CostModel, tokens: int, seconds: float, *, minimum: int = 16) -> CostModel:
    """``cost`` with the model's prefill rate replaced by a real prefill's: ``tokens`` in ``seconds``
    (at least ``minimum`` tokens; unchanged otherwise, and for costs given explicitly).

    The start-up probe of the model runs while the other agents of a host load and probe theirs;
    on two cores it read prefill up to 25x slower than the turns then ran, and auto sent caches where ids
    were cheaper. The turn's own prefill, just done, is the rate the next agent would re-prefill at."""
    if cost.probe is None or cost.probe.source not in ("probe", "shared", "prior", "passive") \
            or tokens < minimum or seconds <= 0:
        return cost
    return replace(cost, model=replace(cost.model, prefill_rate=tokens / seconds))


def refine(cost: CostModel, traffic: Traffic, *, minimum: int = PASSIVE_MIN) -> CostModel:
    """``cost`` with its put and get rates replaced by those of real ``traffic`` where a direction
    moved at least ``minimum`` bytes (the latency per operation taken off); unchanged otherwise.

    Only measured estimates are refined: costs given explicitly (``probe`` ``None``: a ``--costs``
    file, a test's numbers) are the caller's decision, and ``skipped`` ones never matter."""
    store = cost.store
    if cost.probe is None or cost.probe.source not in ("probe", "shared", "prior", "passive"):
        return cost
    put_rate, get_rate = store.put_rate, store.get_rate
    if traffic.put_bytes >= minimum:
        put_rate = traffic.put_bytes / max(traffic.put_s - traffic.puts * store.latency_s / 2, 1e-6)
    if traffic.get_bytes >= minimum:
        get_rate = traffic.get_bytes / max(traffic.get_s - traffic.gets * store.latency_s / 2, 1e-6)
    if (put_rate, get_rate) == (store.put_rate, store.get_rate):
        return cost
    before = cost.probe
    probe = replace(before, source="passive", basis=before.basis or before.source,
                    note=f"refined from {traffic.nbytes / 1e6:.1f} MB of real packets")
    return replace(cost, store=StoreCost.from_rates(store.latency_s, put_rate, get_rate, store.url),  # type: ignore[arg-type]
                   probe=probe)
