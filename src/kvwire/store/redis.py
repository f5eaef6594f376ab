"""``redis://`` and ``rediss://`` -- one Redis server shared by agents on several hosts.

URL: ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?name=value&...]`` (``rediss://``
for TLS). Port 6379 and db 0 by default; a password missing from the URL is taken
from the environment variable ``KVWIRE_REDIS_PASSWORD`` (keeps it out of
command lines). Parameters:

===================  =========  ===============================================================
``budget``           none       byte budget with LRU eviction (``64MiB``, ``2GB``); see :mod:`.base`
``prefix``           kvwire     namespace of every Redis key this store uses; pipelines that
                                share one server and db but not their packets use different ones
``chunk_size``       128MiB     largest Redis string written; larger values are split
                                (at most 512MiB, Redis's default ``proto-max-bulk-len``)
``connect_timeout``  5          seconds to wait for a connection
``timeout``          30         seconds to wait for any one reply
``ssl_ca_certs``     system     ``rediss://`` only: PEM file of the CA that signed the server's cert
``ssl_certfile``,    none       ``rediss://`` only: client certificate and key, for servers
``ssl_keyfile``                 that require them (``tls-auth-clients yes``)
``ssl_cert_reqs``    required   ``rediss://`` only: ``required``, ``optional`` or ``none`` (no
                                verification: for tests, never across a network)
===================  =========  ===============================================================

Layout in Redis (``P`` is the prefix), values as raw bytes, no base64, no pickle::

    P:m:KEY              hash: v (version), gen (random id), n (chunks), size (bytes)
    P:c:KEY:GEN:I        string: chunk I of the value published as generation GEN
    P:lru                sorted set: KEY -> last use (a logical clock, P:clock)
    P:used               integer: bytes of all values

A put writes its chunks under a fresh generation, each with a one-hour expiry,
then one Lua script -- atomic on the server -- checks the expected version,
checks every staged chunk is there, evicts least recently used keys if a budget
asks, removes the old chunks, makes the new ones permanent and swaps the
manifest. A reader reads the manifest (and marks the key used) then the chunks
it names; chunks of a generation never change, so if a swap removed them in
between, the reader starts again and never sees a mix. A writer or server that
dies before the swap leaves only staged chunks, invisible to readers, that
expire by themselves. Let kvwire's budget do the evicting: the server's
``maxmemory-policy`` must stay ``noeviction`` (the default), since Redis evicting
chunks on its own would damage values (reads then raise :class:`StoreError`).

Agents on several machines: run one ``redis-server`` reachable from all of
them and give every agent the same URL. On the server host::

    redis-server --bind 0.0.0.0 --port 6379 --requirepass 'LONG-SECRET' \\
        --appendonly yes --appendfsync everysec

or, instead of ``--requirepass``, an ACL user that may touch only kvwire's keys::

    --user kvwire on '>SECRET' '~kvwire:*' +@read +@write +@keyspace +@scripting +@connection -@dangerous

(bind only the interfaces your agents use; Redis without a password on an open
address lets anyone read and forge caches). Agents then use
``redis://:LONG-SECRET@server:6379/0`` or ``redis://kvwire:SECRET@server:6379/0``,
better with the password in ``KVWIRE_REDIS_PASSWORD``. Across untrusted
networks enable TLS on the server (``--tls-port 6380 --port 0 --tls-cert-file
... --tls-key-file ... --tls-ca-cert-file ...``) and use
``rediss://:SECRET@server:6380/0?ssl_ca_certs=/path/ca.pem``.

Faults are classified (:mod:`kvwire.store.redis_common`): a server that is down,
restarting or loading raises :class:`~kvwire.errors.StoreUnavailable`, which agents
retry; a wrong password or an ACL denial :class:`~kvwire.errors.StoreAccessDenied`,
a TLS certificate that does not verify or a database the server lacks
:class:`~kvwire.errors.StoreConfigError`, which fail at once.

For Redis Cluster (``redis+cluster://``) see :mod:`kvwire.store.cluster`.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager
from dataclasses import replace

from ..errors import StoreConfigError, StoreError, StoreUnavailable, VersionConflict
from .base import Buffer, Store, check_key, parse_budget
from .redis_common import (DEFAULT_CHUNK_SIZE, DEFAULT_PORT, MAX_CHUNK_SIZE, PASSWORD_ENV, STAGING_TTL_MS,
                           RedisConfig, begin_put, check_version_early, client_kwargs, glob_escape,
                           parse_redis_url, read_value, redact, redis, store_error, translated)
from .redis_common import chunk_size as parse_chunk_size

if redis is not None:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

__all__ = ["RedisStore", "RedisConfig", "parse_redis_url", "redact", "store_error", "DEFAULT_CHUNK_SIZE",
           "DEFAULT_PORT", "MAX_CHUNK_SIZE", "PASSWORD_ENV"]

log = logging.getLogger(__name__)


# One Lua prelude shared by the scripts: key names and how a key's value is dropped.
# ARGV[1] is always the prefix. Scripts run atomically: no client sees them half done.
_PRELUDE = """
local prefix = ARGV[1]
local function manifest(key) return prefix .. ':m:' .. key end
local function chunk(key, gen, i) return prefix .. ':c:' .. key .. ':' .. gen .. ':' .. i end
local function drop(key)  -- remove a key's manifest, chunks and LRU entry; its size, or false if absent
  redis.call('ZREM', prefix .. ':lru', key)
  local m = redis.call('HMGET', manifest(key), 'gen', 'n', 'size')
  if not m[1] then return false end
  for i = 0, tonumber(m[2]) - 1 do redis.call('DEL', chunk(key, m[1], i)) end
  redis.call('DEL', manifest(key))
  redis.call('DECRBY', prefix .. ':used', tonumber(m[3]))
  return tonumber(m[3])
end
"""

# ARGV: prefix, key, gen, n chunks, size, expected version (-1: any), budget (-1: none)
# -> {status, version, evicted}: ok | done (a retried commit that already happened) | conflict | missing
_COMMIT = _PRELUDE + """
local key, gen, n, size = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local expect, budget = tonumber(ARGV[6]), tonumber(ARGV[7])
local cur = redis.call('HMGET', manifest(key), 'v', 'gen')
local version = tonumber(cur[1]) or 0
if cur[2] == gen then return {'done', version, 0} end
local function discard() for i = 0, n - 1 do redis.call('DEL', chunk(key, gen, i)) end end
if expect >= 0 and expect ~= version then discard() return {'conflict', version, 0} end
local staged = 0
for i = 0, n - 1 do staged = staged + redis.call('STRLEN', chunk(key, gen, i)) end
if staged ~= size then discard() return {'missing', version, 0} end
drop(key)
local evicted = 0
if budget >= 0 then
  local used = tonumber(redis.call('GET', prefix .. ':used') or '0')
  while used + size > budget do
    local victim = redis.call('ZRANGE', prefix .. ':lru', 0, 0)[1]
    if not victim then break end
    local freed = drop(victim)
    if freed then used = used - freed evicted = evicted + 1 end
  end
end
for i = 0, n - 1 do redis.call('PERSIST', chunk(key, gen, i)) end
redis.call('HSET', manifest(key), 'v', version + 1, 'gen', gen, 'n', n, 'size', size)
redis.call('ZADD', prefix .. ':lru', redis.call('INCR', prefix .. ':clock'), key)
redis.call('INCRBY', prefix .. ':used', size)
return {'ok', version + 1, evicted}
"""

# ARGV: prefix, key -> {version, gen, n, size} or nil; marks the key used
_TOUCH = _PRELUDE + """
local m = redis.call('HMGET', manifest(ARGV[2]), 'v', 'gen', 'n', 'size')
if not m[1] then return false end
redis.call('ZADD', prefix .. ':lru', redis.call('INCR', prefix .. ':clock'), ARGV[2])
return m
"""

# ARGV: prefix, key -> 1 if it existed, else 0
_DELETE = _PRELUDE + """
if drop(ARGV[2]) then return 1 end
return 0
"""


class RedisStore(Store):
    """A store on a Redis server (see the module docstring for URL, layout and guarantees).

    ``budget`` and ``chunk_size`` (bytes, or strings such as ``"64MiB"``) override the
    URL's. Connects at once: a server that is down or refuses the credentials raises
    :class:`StoreError` here, not at the first put.
    """

    def __init__(self, url: str = "redis://localhost:6379/0", *, budget: int | str | None = None,
                 chunk_size: int | str | None = None) -> None:
        config = parse_redis_url(url)
        if config.cluster:
            raise StoreError(f"{redact(url)} is a cluster URL", "open it with open_store() or RedisClusterStore")
        if budget is not None:
            config = replace(config, budget=parse_budget(budget))
        if chunk_size is not None:
            config = replace(config, chunk_size=parse_chunk_size(chunk_size))
        self.config = config
        self.url = redact(url)
        self.budget = config.budget
        self.evictions = 0
        self._evictions_lock = threading.Lock()
        self._client = redis.Redis(
            host=config.host, port=config.port, db=config.db,
            # one immediate retry for a dropped connection (a server restarted since the last call); a reply
            # that does not come is not retried here: that would double every timeout (kvwire's worker decides)
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            **client_kwargs(config, self.url),
        )
        self._commit = self._client.register_script(_COMMIT)
        self._touch = self._client.register_script(_TOUCH)
        self._delete = self._client.register_script(_DELETE)
        try:
            with self._errors("connect"):
                self._client.ping()
                self._refuse_cluster_node()
        except StoreError:
            self._client.close()
            raise

    def _refuse_cluster_node(self) -> None:
        """A cluster node behind ``redis://`` would serve only its own slots: refuse it at once."""
        try:
            info = self._client.info("cluster")
        except redis.ResponseError:  # INFO denied by an ACL (-@dangerous): kvwire's first command would tell
            return
        if info.get("cluster_enabled"):
            raise StoreConfigError(f"redis at {self.config.address} is a Redis Cluster node",
                                   f"open it as redis+cluster://{self.config.address} (with every node you know, "
                                   "comma-separated)")

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return translated(self.config, doing)

    def _chunk(self, key: str, gen: str, i: int) -> str:
        return f"{self.config.prefix}:c:{key}:{gen}:{i}"

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        view, gen, n = begin_put(key, data, expect_version, self.config, self.budget, self.url)
        size, step = view.nbytes, self.config.chunk_size
        with self._errors(f"store {key!r}"):
            check_version_early(self._client, f"{self.config.prefix}:m:{key}", key, expect_version, n)
            if n:
                pipe = self._client.pipeline(transaction=False)
                for i in range(n):
                    pipe.set(self._chunk(key, gen, i), view[i * step : (i + 1) * step], px=STAGING_TTL_MS)
                pipe.execute()
            status, version, evicted = self._commit(args=[
                self.config.prefix, key, gen, n, size,
                -1 if expect_version is None else expect_version, -1 if self.budget is None else self.budget,
            ])
        if status == b"conflict":
            raise VersionConflict(key, expect_version, version)
        if status == b"missing":
            raise StoreUnavailable(
                f"the chunks staged for {key!r} in {self.url} vanished before they were published",
                "redis evicted or expired them: keep the server's maxmemory-policy at noeviction and put again",
            )
        if evicted:
            with self._evictions_lock:
                self.evictions += evicted
            log.debug("evicted %d keys from %s to store %s", evicted, self.url, key)
        return int(version)

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        check_key(key)
        prefix = self.config.prefix

        def manifest() -> tuple[int, str, int, int] | None:
            found = self._touch(args=[prefix, key])
            return None if found is None else (int(found[0]), found[1].decode(), int(found[2]), int(found[3]))

        with self._errors(f"read {key!r}"):
            return read_value(key, self.url, manifest,
                              lambda gen, n: self._client.mget([self._chunk(key, gen, i) for i in range(n)]))

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._errors(f"check {key!r}"):
            return bool(self._client.exists(f"{self.config.prefix}:m:{key}"))

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._errors(f"delete {key!r}"):
            return bool(self._delete(args=[self.config.prefix, key]))

    def keys(self, prefix: str = "") -> list[str]:
        if not isinstance(prefix, str):
            raise StoreError(f"key prefix must be a string, got {prefix!r}")
        head = f"{self.config.prefix}:m:"
        with self._errors("list keys"):
            found = {name.decode()[len(head):]
                     for name in self._client.scan_iter(match=head + glob_escape(prefix) + "*", count=1000)}
        return sorted(found)

    @property
    def used_bytes(self) -> int:
        with self._errors("read the byte count"):
            return int(self._client.get(f"{self.config.prefix}:used") or 0)

    def close(self) -> None:
        self._client.close()

