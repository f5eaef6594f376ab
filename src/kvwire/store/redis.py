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

Redis Cluster is not supported: a value's manifest and chunks and the store's
LRU set and byte counter must be updated by one atomic script, which a cluster
only allows within one hash slot, i.e. on one node.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import StoreError, UnknownStoreError, VersionConflict
from .base import (Buffer, Store, check_expect, check_fits, check_key, check_version, parse_budget, parse_bytes,
                   parse_query)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # redis:// is optional at import time; open_store says what to install
    redis = None

log = logging.getLogger(__name__)

DEFAULT_PORT = 6379
DEFAULT_CHUNK_SIZE = 128 << 20
MAX_CHUNK_SIZE = 512 << 20  # Redis's default proto-max-bulk-len: the largest string it accepts
STAGING_TTL_MS = 3_600_000  # staged chunks of a writer that never published expire after an hour
READ_ATTEMPTS = 8  # a get restarts when a concurrent put swapped the value between its two reads
PASSWORD_ENV = "KVWIRE_REDIS_PASSWORD"

_PARAMS = ("budget", "prefix", "chunk_size", "connect_timeout", "timeout",
           "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_PREFIX = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class RedisConfig:
    """Everything a ``redis://`` URL says. Build it with :func:`parse_redis_url`."""

    host: str = "localhost"
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    prefix: str = "kvwire"
    budget: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE  # bytes per Redis string; larger values are split
    connect_timeout: float = 5.0  # seconds
    timeout: float = 30.0  # seconds per reply
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_redis_url(url: str, environ: dict[str, str] | None = None) -> RedisConfig:
    """Parse a ``redis://`` or ``rediss://`` URL (see the module docstring) without connecting.

    ``redis://`` -> localhost:6379 db 0; ``rediss://u:p@h:7000/2?budget=1GiB`` -> TLS to
    h:7000, db 2, user u, password p, a 1 GiB budget. A password absent from the URL
    comes from ``environ[KVWIRE_REDIS_PASSWORD]`` (``environ`` defaults to ``os.environ``).
    Raises :class:`UnknownStoreError` saying what is wrong.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise UnknownStoreError(f"not a redis URL: {url!r}", "write redis://host:port/db or rediss://...")
    safe = redact(url)
    if parts.fragment:
        raise UnknownStoreError(f"redis URL {safe!r} has a fragment", "remove the '#...' part")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise UnknownStoreError(f"redis URL {safe!r} has a bad port", "write host:port with 1 <= port <= 65535") \
            from None
    db_text = parts.path.strip("/") or "0"
    if not db_text.isdigit():
        raise UnknownStoreError(f"redis URL {safe!r} names database {db_text!r}",
                                "the path is the database number: redis://host:6379/0")
    params = parse_query(safe, parts.query, _PARAMS)
    tls = parts.scheme == "rediss"
    if not tls and any(name.startswith("ssl_") for name in params):
        raise UnknownStoreError(f"redis URL {safe!r} gives ssl_* parameters without TLS", "write rediss://")
    environ = os.environ if environ is None else environ
    password = unquote(parts.password) if parts.password is not None else environ.get(PASSWORD_ENV) or None
    config = RedisConfig(
        host=parts.hostname or "localhost",
        port=port,
        db=int(db_text),
        username=unquote(parts.username) if parts.username else None,
        password=password,
        tls=tls,
        prefix=params.get("prefix", RedisConfig.prefix),
        budget=parse_budget(params.get("budget")),
        chunk_size=_chunk_size(params.get("chunk_size", DEFAULT_CHUNK_SIZE)),
        connect_timeout=_seconds(params.get("connect_timeout", RedisConfig.connect_timeout), "connect_timeout"),
        timeout=_seconds(params.get("timeout", RedisConfig.timeout), "timeout"),
        ssl_ca_certs=params.get("ssl_ca_certs"),
        ssl_certfile=params.get("ssl_certfile"),
        ssl_keyfile=params.get("ssl_keyfile"),
        ssl_cert_reqs=params.get("ssl_cert_reqs", "required"),  # type: ignore[arg-type]
    )
    if not _PREFIX.fullmatch(config.prefix):
        raise UnknownStoreError(f"redis URL {safe!r} has prefix {config.prefix!r}",
                                "a prefix is 1 to 64 letters, digits, '.', '_' or '-'")
    if config.ssl_cert_reqs not in ("required", "optional", "none"):
        raise UnknownStoreError(f"redis URL {safe!r} has ssl_cert_reqs={config.ssl_cert_reqs!r}",
                                "use required, optional or none")
    return config


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, for messages and ``Store.url``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _chunk_size(value: str | int) -> int:
    size = parse_bytes(value, "chunk_size")
    if not 1 <= size <= MAX_CHUNK_SIZE:
        raise UnknownStoreError(f"chunk_size must be between 1 byte and {MAX_CHUNK_SIZE} bytes (512MiB), got {size}")
    return size


def _seconds(value: str | float, name: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise UnknownStoreError(f"{name} must be a number of seconds, got {value!r}") from None
    if not 0 < seconds < 1e6:
        raise UnknownStoreError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


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
        if redis is None:
            raise StoreError("redis:// stores need the redis package", "pip install 'redis==8.1.0'")
        config = parse_redis_url(url)
        if budget is not None:
            config = replace(config, budget=parse_budget(budget))
        if chunk_size is not None:
            config = replace(config, chunk_size=_chunk_size(chunk_size))
        self.config = config
        self.url = redact(url)
        self.budget = config.budget
        self.evictions = 0
        self._evictions_lock = threading.Lock()
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            path = getattr(config, name)
            if path is not None and not os.access(path, os.R_OK):
                raise StoreError(f"{name}={path} in {self.url} is not a readable file",
                                 "give the path of a PEM file on this machine")
        tls = {}
        if config.tls:
            tls = dict(ssl=True, ssl_ca_certs=config.ssl_ca_certs, ssl_certfile=config.ssl_certfile,
                       ssl_keyfile=config.ssl_keyfile, ssl_cert_reqs=config.ssl_cert_reqs,
                       ssl_check_hostname=config.ssl_cert_reqs == "required")
        self._client = redis.Redis(
            host=config.host, port=config.port, db=config.db, username=config.username, password=config.password,
            socket_connect_timeout=config.connect_timeout, socket_timeout=config.timeout,
            retry=Retry(NoBackoff(), 1),  # one immediate retry: a server restarted since the last call
            **tls,
        )
        self._commit = self._client.register_script(_COMMIT)
        self._touch = self._client.register_script(_TOUCH)
        self._delete = self._client.register_script(_DELETE)
        try:
            with self._errors("connect"):
                self._client.ping()
        except StoreError:
            self._client.close()
            raise

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as err:
            raise store_error(err, self.config, doing) from None

    def _chunk(self, key: str, gen: str, i: int) -> str:
        return f"{self.config.prefix}:c:{key}:{gen}:{i}"

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        check_key(key)
        check_expect(expect_version)
        view = memoryview(data).cast("B")
        size, step = view.nbytes, self.config.chunk_size
        check_fits(key, size, self.budget, self.url)
        gen = secrets.token_hex(8)
        n = -(-size // step)
        with self._errors(f"store {key!r}"):
            if expect_version is not None and n > 1:  # fail before uploading; the commit checks again, atomically
                current = int(self._client.hget(f"{self.config.prefix}:m:{key}", "v") or 0)
                check_version(key, expect_version, current)
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
            raise StoreError(
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
        prefix, seen = self.config.prefix, None
        for _ in range(READ_ATTEMPTS):
            with self._errors(f"read {key!r}"):
                manifest = self._touch(args=[prefix, key])
                if manifest is None:
                    return None
                version, gen, n, size = int(manifest[0]), manifest[1].decode(), int(manifest[2]), int(manifest[3])
                chunks = self._client.mget([self._chunk(key, gen, i) for i in range(n)]) if n else []
            if all(chunk is not None for chunk in chunks):
                value = chunks[0] if n == 1 else b"".join(chunks)
                if len(value) != size:
                    raise self._damaged(key, f"{len(value)} of {size} bytes")
                return value, version
            if gen == seen:  # the same generation twice with chunks missing: not a concurrent swap
                raise self._damaged(key, f"{chunks.count(None)} of {n} chunks missing")
            seen = gen
        raise StoreError(f"{key!r} in {self.url} changed {READ_ATTEMPTS} times while being read",
                         "writers replace it faster than it can be read; retry later")

    def _damaged(self, key: str, what: str) -> StoreError:
        return StoreError(f"the value of {key!r} in {self.url} is damaged ({what})",
                          "something other than kvwire removed its chunks (a maxmemory-policy other than "
                          "noeviction?): delete the key and put it again")

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
                     for name in self._client.scan_iter(match=head + _glob_escape(prefix) + "*", count=1000)}
        return sorted(found)

    @property
    def used_bytes(self) -> int:
        with self._errors("read the byte count"):
            return int(self._client.get(f"{self.config.prefix}:used") or 0)

    def close(self) -> None:
        self._client.close()


def _glob_escape(text: str) -> str:
    """``text`` with Redis glob characters escaped, for SCAN MATCH: ``a*b`` -> ``a\\*b``."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def store_error(err: Exception, config: RedisConfig, doing: str) -> StoreError:
    """Turn a redis-py exception into a :class:`StoreError` that says what to do."""
    addr, text = config.address, str(err)
    low = text.lower()
    if "noauth" in low or "authentication required" in low or (
            isinstance(err, redis.AuthenticationError) and config.password is None):
        return StoreError(f"redis at {addr} requires a password and none was given",
                          f"write redis://:PASSWORD@{addr}/{config.db} (or USER:PASSWORD@), or set {PASSWORD_ENV}")
    if "without any password configured" in low:
        return StoreError(f"redis at {addr} has no password set, but one was given",
                          f"remove the password from the URL (and {PASSWORD_ENV}), or set requirepass on the server")
    if isinstance(err, redis.AuthenticationError) or "wrongpass" in low or "invalid username-password" in low:
        user = config.username or "default"
        return StoreError(f"redis at {addr} refused the password for user {user!r}",
                          f"check the user and password in the URL (or {PASSWORD_ENV}) against the server's "
                          "requirepass or ACL")
    if isinstance(err, redis.exceptions.NoPermissionError):
        return StoreError(f"the redis user {config.username or 'default'!r} at {addr} may not {doing}: {text}",
                          f"grant it ~{config.prefix}:* +@read +@write +@keyspace +@scripting +@connection")
    if isinstance(err, redis.BusyLoadingError):
        return StoreError(f"redis at {addr} is still loading its data set", "retry in a moment")
    if isinstance(err, redis.TimeoutError):
        return StoreError(f"redis at {addr} did not answer within {config.timeout:g} s while trying to {doing}",
                          "check the server and the network, or raise ?timeout= / ?connect_timeout= in the URL")
    if isinstance(err, redis.ConnectionError):
        if "certificate" in low or "ssl" in low or "tls" in low:
            return StoreError(f"TLS with redis at {addr} failed: {text}",
                              "give the CA of the server's certificate as ?ssl_ca_certs=/path/ca.pem, and check "
                              "that the port is the server's tls-port")
        reason = "connection refused" if "refused" in low else text.rstrip(".")
        return StoreError(f"cannot connect to redis at {addr}: {reason} - is redis-server running?",
                          "start it, or fix host:port in the store URL")
    if isinstance(err, redis.exceptions.OutOfMemoryError):
        return StoreError(f"redis at {addr} is out of memory (its maxmemory) and refused to {doing}",
                          "raise the server's maxmemory, delete keys, or open the store with a smaller ?budget=")
    if isinstance(err, redis.ReadOnlyError):
        return StoreError(f"redis at {addr} is a read-only replica", "point the URL at the primary")
    return StoreError(f"redis at {addr} failed to {doing}: {text}")
