"""``redis+cluster://`` -- a Redis Cluster behind the same store contract as one server.

URL: ``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][/0][?name=value&...]``
(``rediss+cluster://`` for TLS). The hosts are startup nodes: any one that answers
is enough to find the others. A cluster has only database 0; the parameters are
those of :mod:`kvwire.store.redis` (``budget``, ``prefix``, ``chunk_size``,
``connect_timeout``, ``timeout``, ``ssl_*``). Uses redis-py's ``RedisCluster``.

Why not one server's layout. A Lua script runs atomically on one node and may
only touch keys of one hash slot (and must declare them: an undeclared key of
another slot is silently read from the wrong node). One server's put evicts,
accounts and publishes in one script; across a cluster that would force every
key into one slot, i.e. onto one master. Instead values are spread by key and
a small metadata slot keeps the budget::

    P:{P:KEY}:m              hash: v (version), gen, n (chunks), size      -- the key's own slot
    P:{P:KEY}:c:GEN:I        string: chunk I of generation GEN             -- same slot (hash tag)
    P:{P:KEY}:t:GEN          a staging ticket, expires with the staged chunks
    P:{P}:entry              hash: KEY -> "gen size version n"             -- the metadata slot
    P:{P}:lru                sorted set: KEY -> last use (logical clock P:{P}:clock)
    P:{P}:lock               hash: KEY -> "owner deadline_ms reserved_bytes": operations in flight
    P:{P}:used, P:{P}:held   integers: bytes of committed values; bytes reserved by puts in flight

Everything of one value (manifest, chunks, ticket) shares the hash tag ``{P:KEY}``,
so its publish and compare-and-set are one atomic script on one node, exactly
as on one server; different keys land on different masters. The global LRU
index and byte counters live in the one metadata slot ``{P}``.

A put: (1) stage the chunks and a ticket in the key's slot, with a one-hour
expiry; (2) in the metadata slot, one script takes the key's lock (a lease),
checks the expected version, and reserves the bytes the value adds
(``max(0, new - old)``); if they do not fit the budget it instead picks the
least recently used unlocked keys, locks them, and returns them; (3) the
client drops each victim from its own slot (only if it is still the
generation the metadata named) and then releases its bytes in the metadata
slot, and asks again; (4) one script in the key's slot checks the ticket,
the version and the staged bytes and swaps the manifest (the atomic publish);
(5) the metadata script records the new entry, turns the reservation into
used bytes and releases the lock. A delete locks, drops, records. A get
reads the manifest and its chunks from the key's slot, then marks the key
used in the metadata slot (best effort: if the metadata master is down, gets
still work).

Eviction of a value in another slot cannot be atomic with the accounting (two
slots may be two machines; Redis has no cross-node transaction). The order
of the steps makes the metadata an upper bound of what is stored, at every
moment: bytes are reserved before a value is published and released only
after a victim is dropped. Guarantees:

- **Atomic publish and compare-and-set** per key, exactly as on one server:
  readers see the old value or the new one, whole; of racing writers with the
  same expected version exactly one wins (the per-key lock serialises them, the
  publish script decides).
- **Budget**: the bytes of published values never exceed the budget (given
  every writer opens the store with the same budget); staged chunks of puts in
  flight are not counted, as on one server.
- **LRU**: eviction picks the least recently used keys across the whole
  cluster (one clock), skipping keys that another operation holds locked.
- **Crashes**: a client that dies mid-put leaves a lock that expires after
  its lease (``2 x timeout + 5 s``); the next client that meets it *fences*
  it (deletes its ticket, so a late publish of the dead writer fails) and
  records what the key's slot really holds. Until then its reserved bytes stay
  counted (the budget stays safe, possibly too strict). A victim dropped by a
  client that died before recording it is still counted and is dropped
  again, harmlessly, when next chosen.

Masters that die (see the README's Stores section): operations on slots
served by a dead master raise :class:`~kvwire.errors.StoreUnavailable` (agents
retry it) until a replica takes over or the master comes back; keys on live
masters keep working, if the cluster runs ``cluster-require-full-coverage no``
(with Redis's default ``yes`` the whole cluster answers CLUSTERDOWN, also
``StoreUnavailable``, until every slot is served again). While the master of the
metadata slot is down, puts and deletes fail with ``StoreUnavailable`` and gets
still succeed. No value is ever read partially: all of a value lives in one
slot. Run the masters with ``--appendonly yes`` (and replicas) so that a
restarted master keeps what it had.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from ..errors import StoreError, StoreUnavailable, VersionConflict
from .base import Buffer, Store, check_key, parse_budget
from .redis_common import (STAGING_TTL_MS, RedisConfig, begin_put, check_version_early, client_kwargs, glob_escape,
                           parse_redis_url, read_value, redact, redis, translated)
from .redis_common import chunk_size as parse_chunk_size

if redis is not None:
    from redis.backoff import ExponentialBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

log = logging.getLogger(__name__)

WAIT_FIRST_S, WAIT_MAX_S = 0.005, 0.2  # polling a key locked by another writer, or a budget held by puts in flight
MAX_VICTIMS = 64  # keys evicted per round trip

# -- the metadata slot's scripts. KEYS: entry, lru, lock, used, held, clock (all tagged {P}) ---------

_META = """
local entry, lru, lock, used, held, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function parse_entry(e)  -- gen, size, version, n
  if not e then return nil end
  local g, s, v, n = string.match(e, '^(%S+) (%d+) (%d+) (%d+)$')
  return g, tonumber(s), tonumber(v), tonumber(n)
end
local function parse_lock(l)  -- owner, deadline, reserved
  local o, d, r = string.match(l, '^(%S+) (%d+) (%d+)$')
  return o, tonumber(d), tonumber(r)
end
local function expired_locks(limit)  -- keys whose lock outlived its lease: the client settles them
  local out, all = {}, redis.call('HGETALL', lock)
  for i = 1, #all, 2 do
    local _, d = parse_lock(all[i + 1])
    if d <= now and #out < limit then out[#out + 1] = all[i] end
  end
  return out
end
local function record(key, g, s, v, n)  -- the key's entry becomes (g, s, v, n), or absent if g is ''
  local _, old = parse_entry(redis.call('HGET', entry, key))
  old = old or 0
  if g == '' then
    redis.call('HDEL', entry, key)
    redis.call('ZREM', lru, key)
    redis.call('DECRBY', used, old)
  else
    redis.call('HSET', entry, key, g .. ' ' .. s .. ' ' .. v .. ' ' .. n)
    redis.call('ZADD', lru, redis.call('INCR', clock), key)
    redis.call('INCRBY', used, s - old)
  end
end
local function unlock(key, owner)  -- release owner's lock and its reservation; false if owner holds none
  local l = redis.call('HGET', lock, key)
  if not l then return false end
  local o, _, r = parse_lock(l)
  if o ~= owner then return false end
  redis.call('HDEL', lock, key)
  redis.call('DECRBY', held, r)
  return true
end
"""

# ARGV: key, owner, size (-1: a delete), budget (-1: none), lease_ms, expect (-1: any), avoid...
# -> {'ok', gen, version, n, size} | {'busy'} | {'conflict', version} | {'evict', {key, gen, n, ...}}
#    | {'full'}; every reply ends with the list of expired locks to settle
_LOCK = _META + """
local key, owner, size, budget = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, expect = tonumber(ARGV[5]), tonumber(ARGV[6])
local avoid = {}
for i = 7, #ARGV do avoid[ARGV[i]] = true end
local stale = expired_locks(16)
local l = redis.call('HGET', lock, key)
if l then return {'busy', stale} end
local g, s, v, n = parse_entry(redis.call('HGET', entry, key))
local version, old = v or 0, s or 0
if expect >= 0 and expect ~= version then return {'conflict', version, stale} end
local extra = math.max(0, size - old)
if budget >= 0 and extra > 0 then
  local total = tonumber(redis.call('GET', used) or '0') + tonumber(redis.call('GET', held) or '0')
  if total + extra > budget then
    local need, freed, victims, offset = total + extra - budget, 0, {}, 0
    while freed < need and #victims < 3 * 64 do
      local batch = redis.call('ZRANGE', lru, offset, offset + 31)
      if #batch == 0 then break end
      for _, victim in ipairs(batch) do
        if freed < need and victim ~= key and not avoid[victim] and not redis.call('HGET', lock, victim) then
          local vg, vs, _, vn = parse_entry(redis.call('HGET', entry, victim))
          if vg then
            redis.call('HSET', lock, victim, owner .. ' ' .. (now + lease) .. ' 0')
            victims[#victims + 1] = victim
            victims[#victims + 1] = vg
            victims[#victims + 1] = vn
            freed = freed + vs
          end
        end
      end
      offset = offset + 32
    end
    if #victims == 0 then return {'full', stale} end
    return {'evict', victims, stale}
  end
end
redis.call('HSET', lock, key, owner .. ' ' .. (now + lease) .. ' ' .. extra)
redis.call('INCRBY', held, extra)
return {'ok', g or '', version, n or 0, old, stale}
"""

# ARGV: key, owner, gen ('' : absent, '-': unchanged), size, version, n -> 1 if owner held the lock
# (then the entry is recorded and the lock released), else 0 (a client settled the expired lock already)
_FINISH = _META + """
local key, owner = ARGV[1], ARGV[2]
if not unlock(key, owner) then return 0 end
if ARGV[3] ~= '-' then record(key, ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])) end
return 1
"""

# ARGV: key, owner, gen ('': absent), size, version, n: record what the key's slot holds and drop
# the expired lock of owner (fenced by the caller) -> 1, or 0 if that lock is gone already
_SETTLE = _META + """
local key, owner = ARGV[1], ARGV[2]
local l = redis.call('HGET', lock, key)
if not l then return 0 end
local o = parse_lock(l)
if o ~= owner then return 0 end
unlock(key, owner)
record(key, ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
return 1
"""

# ARGV: key -> marks the key used if it has an entry
_TOUCH = _META + """
if redis.call('ZSCORE', lru, ARGV[1]) then redis.call('ZADD', lru, redis.call('INCR', clock), ARGV[1]) end
return 1
"""

# -- a key's own slot. KEYS: manifest, ticket, ... (all tagged {P:KEY}) ------------------------------

# KEYS: manifest, ticket, n new chunks, m old chunks. ARGV: gen, n, size, expect, old gen ('' absent), m
# -> {'ok', version} | {'conflict', version} | {'missing'} | {'fenced'} | {'moved', gen, n}
_COMMIT = """
local manifest, ticket = KEYS[1], KEYS[2]
local gen, n, size, expect = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local old_gen, m = ARGV[5], tonumber(ARGV[6])
if redis.call('EXISTS', ticket) == 0 then return {'fenced'} end
local cur = redis.call('HMGET', manifest, 'v', 'gen', 'n')
local version = tonumber(cur[1]) or 0
if (cur[2] or '') ~= old_gen then return {'moved', cur[2] or '', tonumber(cur[3]) or 0} end
local function discard() for i = 0, n - 1 do redis.call('DEL', KEYS[3 + i]) end redis.call('DEL', ticket) end
if expect >= 0 and expect ~= version then discard() return {'conflict', version} end
local staged = 0
for i = 0, n - 1 do staged = staged + redis.call('STRLEN', KEYS[3 + i]) end
if staged ~= size then discard() return {'missing'} end
for i = 0, m - 1 do redis.call('DEL', KEYS[3 + n + i]) end
for i = 0, n - 1 do redis.call('PERSIST', KEYS[3 + i]) end
redis.call('DEL', ticket)
redis.call('HSET', manifest, 'v', version + 1, 'gen', gen, 'n', n, 'size', size)
return {'ok', version + 1}
"""

# KEYS: manifest, n chunks. ARGV: gen -> {1} if that generation was dropped, else {0, gen, n} (what is there)
_DROP = """
local cur = redis.call('HMGET', KEYS[1], 'gen', 'n')
if cur[1] ~= ARGV[1] then return {0, cur[1] or '', tonumber(cur[2]) or 0} end
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('DEL', KEYS[1])
return {1}
"""

# KEYS: manifest, ticket -> {gen, size, version, n} of what the slot holds ('' if nothing); the ticket
# is deleted first, so a publish by the fenced lock holder can no longer happen
_FENCE = """
redis.call('DEL', KEYS[2])
local cur = redis.call('HMGET', KEYS[1], 'gen', 'size', 'v', 'n')
return {cur[1] or '', tonumber(cur[2]) or 0, tonumber(cur[3]) or 0, tonumber(cur[4]) or 0}
"""


class _Script:
    """A Lua script run on the node of its first key: EVALSHA, falling back to EVAL (which caches it there).

    redis-py's own ``Script`` reloads a missing script on every master at once, which fails while any
    master is down, even for keys whose master is up.
    """

    def __init__(self, client: Any, body: str) -> None:
        self.client, self.body = client, body
        self.sha = hashlib.sha1(body.encode()).hexdigest()

    def __call__(self, keys: list[str], args: list[Any] | tuple[Any, ...] = ()) -> Any:
        try:
            return self.client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return self.client.eval(self.body, len(keys), *keys, *args)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisClusterStore(Store):
    """A store on a Redis Cluster (see the module docstring for URL, layout and guarantees).

    ``budget`` and ``chunk_size`` override the URL's. Connects at once and finds the
    cluster's masters: no reachable node raises :class:`StoreUnavailable`, a node that
    is not in cluster mode or refuses the credentials a permanent :class:`StoreError`.
    """

    def __init__(self, url: str, *, budget: int | str | None = None, chunk_size: int | str | None = None) -> None:
        config = parse_redis_url(url)
        if not config.cluster:
            raise StoreError(f"{redact(url)} is not a cluster URL", "write redis+cluster://host:port,host:port")
        if budget is not None:
            config = replace(config, budget=parse_budget(budget))
        if chunk_size is not None:
            config = replace(config, chunk_size=parse_chunk_size(chunk_size))
        self.config: RedisConfig = config
        self.url = redact(url)
        self.budget = config.budget
        self.evictions = 0
        self._lock = threading.Lock()
        # how long a lock may be held before another client may fence it; settable (tests shorten it)
        self.lease_ms = int(1000 * (2 * config.timeout + 5))
        kwargs = client_kwargs(config, self.url)
        with self._errors("connect"):
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in config.nodes],
                require_full_coverage=False,  # keys on live masters stay usable while one master is down
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),  # redirects and topology refreshes
                **kwargs,
            )
        p = config.prefix
        self._meta_keys = [f"{p}:{{{p}}}:{name}" for name in ("entry", "lru", "lock", "used", "held", "clock")]
        self._lock_script = _Script(self._client, _LOCK)
        self._finish = _Script(self._client, _FINISH)
        self._settle = _Script(self._client, _SETTLE)
        self._touch = _Script(self._client, _TOUCH)
        self._commit = _Script(self._client, _COMMIT)
        self._drop = _Script(self._client, _DROP)
        self._fence = _Script(self._client, _FENCE)

    # -- key names -------------------------------------------------------------------------------

    def _tag(self, key: str) -> str:
        p = self.config.prefix
        return f"{p}:{{{p}:{key}}}"

    def _manifest(self, key: str) -> str:
        return f"{self._tag(key)}:m"

    def _ticket(self, key: str, gen: str) -> str:
        return f"{self._tag(key)}:t:{gen}"

    def _chunks(self, key: str, gen: str, n: int) -> list[str]:
        tag = self._tag(key)
        return [f"{tag}:c:{gen}:{i}" for i in range(n)]

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return translated(self.config, doing)

    # -- put ---------------------------------------------------------------------------------------

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        view, gen, n = begin_put(key, data, expect_version, self.config, self.budget, self.url)
        size, step = view.nbytes, self.config.chunk_size
        chunks = self._chunks(key, gen, n)
        with self._errors(f"store {key!r}"):
            check_version_early(self._client, self._manifest(key), key, expect_version, n)
            pipe = self._client.pipeline()
            for i, name in enumerate(chunks):
                pipe.set(name, view[i * step : (i + 1) * step], px=STAGING_TTL_MS)
            pipe.set(self._ticket(key, gen), b"1", px=STAGING_TTL_MS)
            pipe.execute()
        try:
            old_gen, old_n = self._take(key, gen, size, expect_version)
        except VersionConflict:
            self._discard(key, gen, chunks)
            raise
        try:
            with self._errors(f"store {key!r}"):
                status, version = self._publish(key, gen, chunks, size, expect_version, old_gen, old_n)
        except StoreError:
            self._settle_own(key, gen)  # the publish may or may not have happened: record what did
            raise
        with self._errors(f"record {key!r}"):
            if status == "ok":
                self._finish(keys=self._meta_keys, args=[key, gen, gen, size, version, n])
            else:
                self._finish(keys=self._meta_keys, args=[key, gen, "-", 0, 0, 0])
        if status == "conflict":
            raise VersionConflict(key, expect_version, version)  # type: ignore[arg-type]
        if status != "ok":
            raise StoreUnavailable(
                f"the chunks staged for {key!r} in {self.url} vanished before they were published ({status})",
                "redis expired or evicted them, or this writer's lock outlived its lease: put again "
                "(keep the servers' maxmemory-policy at noeviction)")
        return version

    def _publish(self, key: str, gen: str, chunks: list[str], size: int, expect: int | None, old_gen: str,
                 old_n: int) -> tuple[str, int]:
        """The atomic publish in the key's slot; follows the slot if the metadata named another old value."""
        for _ in range(3):
            old = self._chunks(key, old_gen, old_n) if old_gen else []
            reply = self._commit(keys=[self._manifest(key), self._ticket(key, gen), *chunks, *old],
                                 args=[gen, len(chunks), size, -1 if expect is None else expect, old_gen, len(old)])
            status = _s(reply[0])
            if status != "moved":
                return status, int(reply[1]) if len(reply) > 1 else 0
            old_gen, old_n = _s(reply[1]), int(reply[2])  # the metadata was behind the slot: trust the slot
            log.warning("metadata of %s in %s named another value than its slot holds; using the slot's", key,
                        self.url)
        raise StoreUnavailable(f"{key!r} in {self.url} changed under its lock", "put again")

    def _take(self, key: str, owner: str, size: int, expect: int | None) -> tuple[str, int]:
        """Lock ``key`` for ``owner`` with ``size`` bytes reserved (evicting as needed); returns its old
        generation and chunk count. Raises :class:`VersionConflict`, or :class:`StoreUnavailable` if the
        key stays locked or the budget stays held by other puts for longer than a lease."""
        deadline = time.monotonic() + self.lease_ms / 1000 + 1
        wait, avoid = WAIT_FIRST_S, set()
        while True:
            with self._errors(f"lock {key!r}"):
                reply = self._lock_script(keys=self._meta_keys, args=[
                    key, owner, size, -1 if self.budget is None else self.budget, self.lease_ms,
                    -1 if expect is None else expect, *sorted(avoid)])
            status, stale = _s(reply[0]), [_s(k) for k in reply[-1]]
            for other in stale:
                try:
                    self._settle_expired(other)
                except StoreUnavailable as err:  # its slot's master is down: someone settles it later
                    log.debug("cannot settle the expired lock on %s in %s now: %s", other, self.url, err.message)
            if status == "ok":
                return _s(reply[1]), int(reply[3])
            if status == "conflict":
                raise VersionConflict(key, expect, int(reply[1]))  # type: ignore[arg-type]
            if status == "evict":
                victims = reply[1]
                avoid |= self._evict([(_s(victims[i]), _s(victims[i + 1]), int(victims[i + 2]))
                                      for i in range(0, len(victims), 3)], owner)
                continue
            if time.monotonic() > deadline:  # busy or full
                what = "is locked by another writer" if status == "busy" else "finds the budget held by puts in flight"
                raise StoreUnavailable(f"a put of {key!r} in {self.url} {what} for more than a lease "
                                       f"({self.lease_ms / 1000:g} s)", "retry later")
            time.sleep(wait)
            wait = min(WAIT_MAX_S, wait * 2)

    def _evict(self, victims: list[tuple[str, str, int]], owner: str) -> set[str]:
        """Drop locked victims from their slots, then release their bytes; returns the ones that could not
        be reached (a dead master), unlocked again and avoided next time."""
        unreachable, dead_nodes = set(), set()
        for victim, gen, n in victims:
            node = self._client.get_node_from_key(self._manifest(victim)).name
            try:
                if node in dead_nodes:
                    raise StoreUnavailable(f"node {node} did not answer")
                with self._errors(f"evict {victim!r}"):
                    reply = self._drop(keys=[self._manifest(victim), *self._chunks(victim, gen, n)], args=[gen])
            except StoreUnavailable as err:
                log.warning("cannot evict %s from %s now: %s", victim, self.url, err.message)
                unreachable.add(victim)
                dead_nodes.add(node)
                with self._errors(f"release {victim!r}"):
                    self._finish(keys=self._meta_keys, args=[victim, owner, "-", 0, 0, 0])
                continue
            with self._errors(f"record the eviction of {victim!r}"):
                if int(reply[0]) == 1:
                    if self._finish(keys=self._meta_keys, args=[victim, owner, "", 0, 0, 0]):
                        with self._lock:
                            self.evictions += 1
                        log.debug("evicted %s from %s", victim, self.url)
                else:  # the slot holds something else than the metadata said: record what it holds
                    state = self._fence(keys=[self._manifest(victim), self._ticket(victim, owner)])
                    self._settle(keys=self._meta_keys, args=[victim, owner, _s(state[0]), *state[1:]])
        return unreachable

    def _settle_expired(self, key: str) -> None:
        """Fence and record a lock that outlived its lease (its holder died or stalled)."""
        with self._errors(f"settle {key!r}"):
            lock = self._client.hget(self._meta_keys[2], key)
            if lock is None:
                return
            owner = _s(lock).split()[0]
            state = self._fence(keys=[self._manifest(key), self._ticket(key, owner)])
            if self._settle(keys=self._meta_keys, args=[key, owner, _s(state[0]), *state[1:]]):
                log.info("settled an expired lock on %s in %s (owner %s)", key, self.url, owner)

    def _settle_own(self, key: str, owner: str) -> None:
        """After a failed publish: fence our own attempt and record what the slot holds (best effort;
        if the slot or the metadata is unreachable the lock expires and another client settles it)."""
        try:
            with self._errors(f"settle {key!r}"):
                state = self._fence(keys=[self._manifest(key), self._ticket(key, owner)])
                self._settle(keys=self._meta_keys, args=[key, owner, _s(state[0]), *state[1:]])
        except StoreError as err:
            log.info("left the lock on %s in %s to expire: %s", key, self.url, err.message)

    def _discard(self, key: str, gen: str, chunks: list[str]) -> None:
        try:
            with self._errors(f"discard staged chunks of {key!r}"):
                self._client.delete(self._ticket(key, gen), *chunks)
        except StoreError as err:  # they expire by themselves
            log.debug("staged chunks of %s left to expire: %s", key, err.message)

    # -- reads -------------------------------------------------------------------------------------

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        check_key(key)

        def manifest() -> tuple[int, str, int, int] | None:
            v, gen, n, size = self._client.hmget(self._manifest(key), "v", "gen", "n", "size")
            return None if v is None else (int(v), gen.decode(), int(n), int(size))

        with self._errors(f"read {key!r}"):
            found = read_value(key, self.url, manifest, lambda gen, n: self._client.mget(self._chunks(key, gen, n)))
        if found is not None:
            self._mark_used(key)
        return found

    def _mark_used(self, key: str) -> None:
        try:
            with self._errors(f"mark {key!r} used"):
                self._touch(keys=self._meta_keys, args=[key])
        except StoreUnavailable as err:  # the metadata master is down: the value was read, LRU order waits
            log.debug("could not mark %s used in %s: %s", key, self.url, err.message)

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._errors(f"check {key!r}"):
            return bool(self._client.exists(self._manifest(key)))

    def delete(self, key: str) -> bool:
        check_key(key)
        owner = secrets.token_hex(8)
        self._take(key, owner, -1, None)
        try:
            with self._errors(f"delete {key!r}"):
                gen, n = self._client.hmget(self._manifest(key), "gen", "n")
                existed = gen is not None and bool(int(self._drop(
                    keys=[self._manifest(key), *self._chunks(key, gen.decode(), int(n))], args=[gen])[0]))
        except StoreError:
            self._settle_own(key, owner)
            raise
        with self._errors(f"record the deletion of {key!r}"):
            self._finish(keys=self._meta_keys, args=[key, owner, "", 0, 0, 0])
        return existed

    def keys(self, prefix: str = "") -> list[str]:
        if not isinstance(prefix, str):
            raise StoreError(f"key prefix must be a string, got {prefix!r}")
        p = self.config.prefix
        head, tail = f"{p}:{{{p}:", "}:m"
        with self._errors("list keys"):
            found = {name.decode()[len(head):-len(tail)]
                     for name in self._client.scan_iter(match=f"{head}{glob_escape(prefix)}*{tail}", count=1000)}
        return sorted(found)

    @property
    def used_bytes(self) -> int:
        with self._errors("read the byte count"):
            return int(self._client.get(self._meta_keys[3]) or 0)

    def close(self) -> None:
        self._client.close()

