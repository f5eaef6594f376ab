"""What the Redis stores share: their URLs, the client's arguments, and how faults are classified.

:mod:`kvwire.store.redis` (one server) and :mod:`kvwire.store.cluster` (Redis Cluster)
parse their URLs here (:func:`parse_redis_url` -> :class:`RedisConfig`) and turn every
redis-py exception into one of kvwire's store errors (:func:`store_error`):

========================================================  =================================
what happened                                             raised as
========================================================  =================================
connection refused / reset / closed, a timeout,           :class:`StoreUnavailable`
``LOADING``, ``BUSY``, ``TRYAGAIN``, ``CLUSTERDOWN``,     (transient: ``kvwire agent``
``MASTERDOWN``, MOVED/ASK storms, an uncovered slot,      retries it)
a cluster's replica that was just promoted
wrong or missing password, unknown user, ``NOPERM``       :class:`StoreAccessDenied`
TLS certificate that does not verify, TLS to a plain      :class:`StoreConfigError`
port, ``ERR DB index is out of range``, a cluster URL     (permanent: fails at once,
for a single server or the reverse, ``OOM``,              the hint says what to fix)
``MISCONF``, a read-only replica behind ``redis://``,
an unknown or renamed command, a server in protected
mode (``DENIED``: no password, client on another host)
anything else                                             :class:`StoreError` (not retried)
========================================================  =================================
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import (StoreAccessDenied, StoreConfigError, StoreError, StoreUnavailable, UnknownStoreError)
from .base import Buffer, check_expect, check_fits, check_key, check_version, parse_budget, parse_bytes, parse_query

try:
    import redis
    from redis.exceptions import RedisClusterException
except ImportError:  # redis:// is optional at import time; the stores say what to install
    redis = None
    RedisClusterException = None  # type: ignore[assignment,misc]

DEFAULT_PORT = 6379
DEFAULT_CHUNK_SIZE = 128 << 20
MAX_CHUNK_SIZE = 512 << 20  # Redis's default proto-max-bulk-len: the largest string it accepts
STAGING_TTL_MS = 3_600_000  # staged chunks of a writer that never published expire after an hour
READ_ATTEMPTS = 8  # a get restarts when a concurrent put swapped the value between its two reads
PASSWORD_ENV = "KVWIRE_REDIS_PASSWORD"
SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")

PARAMS = ("budget", "prefix", "chunk_size", "connect_timeout", "timeout",
          "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_PREFIX = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class RedisConfig:
    """Everything a ``redis://`` or ``redis+cluster://`` URL says. Build it with :func:`parse_redis_url`."""

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
    cluster: bool = False  # redis+cluster://: ``nodes`` are the startup nodes, host:port the first of them
    nodes: tuple[tuple[str, int], ...] = ()

    @property
    def address(self) -> str:
        """``host:port`` (``[v6]:port``); for a cluster every startup node, comma-separated."""
        return ",".join(_address(host, port) for host, port in (self.nodes or ((self.host, self.port),)))

    @property
    def what(self) -> str:
        """How messages name the store: ``redis at HOST:PORT`` or ``redis cluster at H:P,H:P``."""
        return f"redis {'cluster ' if self.cluster else ''}at {self.address}"


def _address(host: str, port: int) -> str:
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def parse_redis_url(url: str, environ: dict[str, str] | None = None) -> RedisConfig:
    """Parse a Redis store URL without connecting.

    ``redis://`` -> localhost:6379 db 0; ``rediss://u:p@h:7000/2?budget=1GiB`` -> TLS to
    h:7000, db 2, user u, password p, a 1 GiB budget;
    ``redis+cluster://a:7000,b:7001`` -> a cluster found through a:7000 or b:7001
    (``rediss+cluster://`` with TLS; a cluster has only database 0). A password absent
    from the URL comes from ``environ[KVWIRE_REDIS_PASSWORD]`` (``environ`` defaults to
    ``os.environ``). Raises :class:`UnknownStoreError` saying what is wrong.
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise UnknownStoreError(f"not a redis URL: {url!r}",
                                "write redis://host:port/db, rediss://..., or redis+cluster://host:port,host:port")
    safe = redact(url)
    cluster = parts.scheme.endswith("+cluster")
    if parts.fragment:
        raise UnknownStoreError(f"redis URL {safe!r} has a fragment", "remove the '#...' part")
    (host, port), nodes = _servers(parts.netloc.rpartition("@")[2], safe, cluster)
    db = _database(parts.path, safe, cluster)
    params = parse_query(safe, parts.query, PARAMS)
    tls = parts.scheme.startswith("rediss")
    if not tls and any(name.startswith("ssl_") for name in params):
        raise UnknownStoreError(f"redis URL {safe!r} gives ssl_* parameters without TLS",
                                "write rediss:// (rediss+cluster:// for a cluster)")
    environ = os.environ if environ is None else environ
    password = unquote(parts.password) if parts.password is not None else environ.get(PASSWORD_ENV) or None
    config = RedisConfig(
        host=host,
        port=port,
        db=db,
        username=unquote(parts.username) if parts.username else None,
        password=password,
        tls=tls,
        prefix=params.get("prefix", RedisConfig.prefix),
        budget=parse_budget(params.get("budget")),
        chunk_size=chunk_size(params.get("chunk_size", DEFAULT_CHUNK_SIZE)),
        connect_timeout=seconds(params.get("connect_timeout", RedisConfig.connect_timeout), "connect_timeout"),
        timeout=seconds(params.get("timeout", RedisConfig.timeout), "timeout"),
        ssl_ca_certs=params.get("ssl_ca_certs"),
        ssl_certfile=params.get("ssl_certfile"),
        ssl_keyfile=params.get("ssl_keyfile"),
        ssl_cert_reqs=params.get("ssl_cert_reqs", "required"),  # type: ignore[arg-type]
        cluster=cluster,
        nodes=nodes,
    )
    _check_values(config, safe)
    return config


def _servers(hosts: str, safe: str, cluster: bool) -> tuple[tuple[str, int], tuple[tuple[str, int], ...]]:
    """The server to connect to, and (a cluster) every node listed: ``a:7000,b:7001`` -> (a, 7000), both."""
    if not cluster:
        if "," in hosts:
            raise UnknownStoreError(f"redis URL {safe!r} names several servers",
                                    "for a Redis Cluster write redis+cluster://host:port,host:port")
        return _host_port(hosts, safe, allow_empty=True), ()
    nodes = tuple(_host_port(item, safe) for item in hosts.split(","))
    return nodes[0], nodes


def _database(path: str, safe: str, cluster: bool) -> int:
    """The database number a URL's path names (``/2`` -> 2, none -> 0); a cluster has only 0."""
    db_text = path.strip("/") or "0"
    if not db_text.isdigit():
        raise UnknownStoreError(f"redis URL {safe!r} names database {db_text!r}",
                                "the path is the database number: redis://host:6379/0")
    if cluster and int(db_text) != 0:
        raise UnknownStoreError(f"redis URL {safe!r} names database {db_text} of a cluster",
                                "a Redis Cluster has only database 0: drop the /N, or use ?prefix= to separate "
                                "pipelines")
    return int(db_text)


def _check_values(config: RedisConfig, safe: str) -> None:
    if not _PREFIX.fullmatch(config.prefix):
        raise UnknownStoreError(f"redis URL {safe!r} has prefix {config.prefix!r}",
                                "a prefix is 1 to 64 letters, digits, '.', '_' or '-'")
    if config.ssl_cert_reqs not in ("required", "optional", "none"):
        raise UnknownStoreError(f"redis URL {safe!r} has ssl_cert_reqs={config.ssl_cert_reqs!r}",
                                "use required, optional or none")


def _host_port(item: str, safe: str, allow_empty: bool = False) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (port 6379 if omitted) from one entry of a URL's host list."""
    if not item and not allow_empty:
        raise UnknownStoreError(f"redis URL {safe!r} has an empty host in its list", "write host:port,host:port")
    parts = urlsplit("//" + item)
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise UnknownStoreError(f"redis URL {safe!r} has a bad port", "write host:port with 1 <= port <= 65535") \
            from None
    return parts.hostname or "localhost", port


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, for messages and ``Store.url``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def chunk_size(value: str | int) -> int:
    size = parse_bytes(value, "chunk_size")
    if not 1 <= size <= MAX_CHUNK_SIZE:
        raise UnknownStoreError(f"chunk_size must be between 1 byte and {MAX_CHUNK_SIZE} bytes (512MiB), got {size}")
    return size


def seconds(value: str | float, name: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise UnknownStoreError(f"{name} must be a number of seconds, got {value!r}") from None
    if not 0 < number < 1e6:
        raise UnknownStoreError(f"{name} must be a positive number of seconds, got {value!r}")
    return number


def client_kwargs(config: RedisConfig, url: str) -> dict[str, Any]:
    """Connection arguments shared by ``redis.Redis`` and ``RedisCluster`` (no host, port, db or retry).

    Checks that the ``ssl_*`` files are readable (:class:`StoreConfigError` if not).
    """
    if redis is None:
        raise StoreConfigError("redis stores need the redis package", "pip install 'redis==8.1.0'")
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = getattr(config, name)
        if path is not None and not os.access(path, os.R_OK):
            raise StoreConfigError(f"{name}={path} in {url} is not a readable file",
                                   "give the path of a PEM file on this machine")
    kwargs: dict[str, Any] = dict(username=config.username, password=config.password,
                                  socket_connect_timeout=config.connect_timeout, socket_timeout=config.timeout)
    if config.tls:
        kwargs.update(ssl=True, ssl_ca_certs=config.ssl_ca_certs, ssl_certfile=config.ssl_certfile,
                      ssl_keyfile=config.ssl_keyfile, ssl_cert_reqs=config.ssl_cert_reqs,
                      ssl_check_hostname=config.ssl_cert_reqs == "required")
    return kwargs


def glob_escape(text: str) -> str:
    """``text`` with Redis glob characters escaped, for SCAN MATCH: ``a*b`` -> ``a\\*b``."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


# -- reading a chunked value -----------------------------------------------------------------------

Manifest = tuple[int, str, int, int]  # version, generation, chunks, size


def read_value(key: str, url: str, manifest: Callable[[], Manifest | None],
               chunks: Callable[[str, int], list[bytes | None]]) -> tuple[bytes, int] | None:
    """A value read whole: its manifest, then the chunks it names (restarted if a put swapped them).

    Chunks of a generation never change, so a value read with every chunk present is
    exactly the value published under that generation. The same generation seen twice
    with chunks missing is damage, not a race: :class:`StoreError` saying so.
    """
    seen = None
    for _ in range(READ_ATTEMPTS):
        found = manifest()
        if found is None:
            return None
        version, gen, n, size = found
        parts = chunks(gen, n) if n else []
        if all(part is not None for part in parts):
            value = parts[0] if n == 1 else b"".join(parts)  # type: ignore[arg-type]
            if len(value) != size:
                raise damaged(key, url, f"{len(value)} of {size} bytes")
            return value, version
        if gen == seen:
            raise damaged(key, url, f"{parts.count(None)} of {n} chunks missing")
        seen = gen
    raise StoreUnavailable(f"{key!r} in {url} changed {READ_ATTEMPTS} times while being read",
                           "writers replace it faster than it can be read; retry later")


def begin_put(key: str, data: Buffer, expect_version: int | None, config: RedisConfig, budget: int | None,
              url: str) -> tuple[memoryview, str, int]:
    """A put's checks before any round trip, and what it uploads: the value's bytes, a fresh generation
    id for its chunks, and how many ``config.chunk_size`` chunks it takes."""
    check_key(key)
    check_expect(expect_version)
    view = memoryview(data).cast("B")
    check_fits(key, view.nbytes, budget, url)
    return view, secrets.token_hex(8), -(-view.nbytes // config.chunk_size)


def check_version_early(client: Any, manifest: str, key: str, expect_version: int | None, chunks: int) -> None:
    """A put of several chunks fails on a stale ``expect_version`` before uploading them (the commit
    checks again, atomically); a one-chunk put leaves it to the commit."""
    if expect_version is not None and chunks > 1:
        check_version(key, expect_version, int(client.hget(manifest, "v") or 0))


@contextmanager
def translated(config: RedisConfig, doing: str) -> Iterator[None]:
    """redis-py's errors inside the block (its cluster client's too) raised as the :class:`StoreError`
    :func:`store_error` makes of them, saying they happened while trying to ``doing``."""
    try:
        yield
    except redis.RedisError as err:
        raise store_error(err, config, doing) from None
    except RedisClusterException as err:
        raise store_error(err, config, doing) from None


def damaged(key: str, url: str, what: str) -> StoreError:
    return StoreError(f"the value of {key!r} in {url} is damaged ({what})",
                      "something other than kvwire removed its chunks (a maxmemory-policy other than "
                      "noeviction?): delete the key and put it again")


# -- classifying faults ----------------------------------------------------------------------------

_TRANSIENT_REPLIES = ("loading", "busy", "tryagain", "clusterdown", "masterdown", "moved", "ask ")


def store_error(err: Exception, config: RedisConfig, doing: str) -> StoreError:
    """Turn a redis-py exception into the :class:`StoreError` subclass it deserves, saying what to do.

    Transient faults become :class:`StoreUnavailable`, wrong credentials and ACL denials
    :class:`StoreAccessDenied`, other faults that retrying cannot fix :class:`StoreConfigError`
    (see the module docstring for the full table). Messages name the server, never the password.
    """
    if RedisClusterException is not None and isinstance(err, RedisClusterException):
        return _cluster_error(err, config, doing)
    text = str(err)
    for classify in (_access_error, _connection_error, _reply_error):
        found = classify(err, text, text.lower(), config, doing)
        if found is not None:
            return found
    return StoreError(f"{config.what} failed to {doing}: {text}")


def _access_error(err: Exception, text: str, low: str, config: RedisConfig, doing: str) -> StoreError | None:
    """Credentials and ACLs: a missing, unexpected or wrong password; a command the user may not run."""
    where = config.what
    if "noauth" in low or "authentication required" in low or (
            isinstance(err, redis.AuthenticationError) and config.password is None):
        return StoreAccessDenied(f"{where} requires a password and none was given",
                                 f"write {_example(config, 'PASSWORD')} (or USER:PASSWORD@), or set {PASSWORD_ENV}")
    if "without any password configured" in low:
        return StoreAccessDenied(f"{where} has no password set, but one was given",
                                 f"remove the password from the URL (and {PASSWORD_ENV}), or set requirepass on "
                                 "the server")
    if isinstance(err, redis.AuthenticationError) or "wrongpass" in low or "invalid username-password" in low:
        user = config.username or "default"
        return StoreAccessDenied(f"{where} refused the password for user {user!r}",
                                 f"check the user and password in the URL (or {PASSWORD_ENV}) against the server's "
                                 "requirepass or ACL")
    if isinstance(err, redis.exceptions.NoPermissionError) or low.startswith("noperm") or (
            "user executing the script" in low):  # an ACL denial inside a script comes as a plain error
        return StoreAccessDenied(f"the redis user {config.username or 'default'!r} at {config.address} may not "
                                 f"{doing}: {text}",
                                 f"grant it ~{config.prefix}:* +@read +@write +@keyspace +@scripting +@connection"
                                 + (" +cluster|slots" if config.cluster else ""))
    return None


def _connection_error(err: Exception, text: str, low: str, config: RedisConfig, doing: str) -> StoreError | None:
    """Reaching the server: protected mode, a database it lacks, refused or failed TLS connections,
    timeouts, a server still loading."""
    where = config.what
    if low.startswith("denied") and "protected mode" in low:
        return StoreConfigError(f"{where} runs in protected mode and accepts no password-less client from another "
                                "host", "start redis-server with --requirepass (or an ACL user) and put the password "
                                f"in the URL or {PASSWORD_ENV}; bind it only to the interfaces the agents use")
    if "db index is out of range" in low or "invalid db index" in low:
        return StoreConfigError(f"{where} has no database {config.db} (ERR DB index is out of range)",
                                "use a database the server has (its `databases` setting, 16 by default: /0 to /15)")
    if isinstance(err, redis.ConnectionError) and not isinstance(err, redis.BusyLoadingError):
        if "certificate" in low or "ssl" in low or "tls" in low:
            return StoreConfigError(f"TLS with {where} failed: {text}",
                                    "give the CA of the server's certificate as ?ssl_ca_certs=/path/ca.pem, and "
                                    "check that the port is the server's tls-port")
        # one server: "connection refused"; a cluster: redis-py's text, which names the node that failed
        reason = "connection refused" if "refused" in low and not config.cluster else text.rstrip(".")
        return StoreUnavailable(f"cannot connect to {where}: {reason} - is redis-server running?",
                                "start it, or fix host:port in the store URL")
    if isinstance(err, redis.TimeoutError):
        return StoreUnavailable(f"{where} did not answer within {config.timeout:g} s while trying to {doing}",
                                "check the server and the network, or raise ?timeout= / ?connect_timeout= in the URL")
    if isinstance(err, redis.BusyLoadingError):
        return StoreUnavailable(f"{where} is still loading its data set", "retry in a moment")
    return None


def _reply_error(err: Exception, text: str, low: str, config: RedisConfig, doing: str) -> StoreError | None:
    """What a reachable server refused: out of memory, a read-only replica, cluster redirections and
    failovers, a failing disk, a renamed command."""
    where = config.what
    if isinstance(err, redis.exceptions.OutOfMemoryError):
        return StoreConfigError(f"{where} is out of memory (its maxmemory) and refused to {doing}",
                                "raise the server's maxmemory, delete keys, or open the store with a smaller "
                                "?budget=")
    if isinstance(err, redis.ReadOnlyError):
        if config.cluster:  # a replica promoted, or a master demoted, mid-failover
            return StoreUnavailable(f"{where} is failing over: a node answered as a read-only replica",
                                    "retry once the failover is done")
        return StoreConfigError(f"redis at {config.address} is a read-only replica", "point the URL at the primary")
    cluster_reply = isinstance(err, (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                                     redis.exceptions.AskError, redis.exceptions.ClusterError))
    if cluster_reply and not config.cluster and isinstance(err, (redis.exceptions.AskError,
                                                                 redis.exceptions.ClusterDownError)):
        return StoreConfigError(f"redis at {config.address} is a Redis Cluster node",
                                f"open it as redis+cluster://{config.address} (with every node you know, "
                                "comma-separated)")
    if cluster_reply or low.startswith(_TRANSIENT_REPLIES):
        return StoreUnavailable(f"{where} cannot {doing} for now: {text}",
                                "the server is busy, or the cluster is failing over or resharding; retry in a moment")
    if low.startswith("misconf"):
        return StoreConfigError(f"{where} cannot persist its data and refuses writes: {text}",
                                "fix the server's disk or its dir / appendonly settings")
    if "unknown command" in low:
        return StoreConfigError(f"{where} does not know a command kvwire needs: {text}",
                                "kvwire needs EVALSHA/SCRIPT, SCAN, MGET, HMGET: do not rename or disable them")
    return None


def _cluster_error(err: Exception, config: RedisConfig, doing: str) -> StoreError:
    """redis-py's cluster client wraps some faults in ``RedisClusterException``: unwrap and classify them."""
    text, where = str(err), config.what
    inner = err.__cause__ or err.__context__
    if "cannot be connected" in text and isinstance(inner, Exception) and not isinstance(inner, type(err)):
        return store_error(inner, config, doing)
    if "cluster mode is not enabled" in text.lower():
        if isinstance(inner, redis.exceptions.NoPermissionError):
            return store_error(inner, config, doing)
        return StoreConfigError(f"redis at {config.address} is not a Redis Cluster node",
                                f"open a single server as redis://{config.nodes[0][0] if config.nodes else 'HOST'}:"
                                f"{config.port}/0")
    if isinstance(err, redis.exceptions.SlotNotCoveredError) or "not covered" in text:
        return StoreUnavailable(f"{where} serves no master for a slot needed to {doing}: {text}",
                                "a master is down without a replica to take over; retry once it is back")
    return StoreError(f"{where} failed to {doing}: {text}")


def _example(config: RedisConfig, secret: str) -> str:
    scheme = ("rediss" if config.tls else "redis") + ("+cluster" if config.cluster else "")
    return f"{scheme}://:{secret}@{config.address}/{config.db}"
