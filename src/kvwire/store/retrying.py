"""What kvwire does when a store fails: one policy, for the agent processes and the server alike.

What counts as what. Every store error is a :class:`~kvwire.errors.StoreError`; three kinds matter:

- a *transient* fault, :class:`~kvwire.errors.StoreUnavailable` (:func:`is_transient`): the server
  is down or restarting, a timeout, a cluster failing over -- the same call may succeed later;
- an *answer*, :class:`~kvwire.errors.VersionConflict` or :class:`~kvwire.errors.OverBudget`
  (:func:`is_answer`): the store is reachable and said no; never a fault, never retried;
- any other :class:`~kvwire.errors.StoreError` is a *permanent* fault
  (:class:`~kvwire.errors.StoreAccessDenied`: a wrong password, an ACL denial;
  :class:`~kvwire.errors.StoreConfigError`: a TLS certificate that does not verify, a database the
  server lacks, a bad URL; a full disk): trying again will not help until someone changes something.

What is done about it, by who can wait:

- An agent in its own process (``kvwire agent``) can wait for its store. :class:`RetryingStore`
  retries each call that failed with a transient fault, ``Retry.retries`` more times after an
  exponential :class:`Backoff`, logging the store, what the agent was doing and ``attempt k of n``
  each time (:func:`retrying`); when the attempts run out it raises one ``StoreUnavailable``
  saying all of that. A permanent fault or an answer is raised at once, on the first attempt.
  A put whose reply was lost although the write landed is recognised on retry by its bytes.
- A server (``kvwire serve``) cannot make a request wait for a store: it serves without reuse.
  :class:`Breaker` runs each store operation once; a fault of either kind (anything but an answer)
  puts the store aside (:class:`StoreDown` for every call, one warning, ``state`` ``"degraded"``)
  for ``retry_s``; the next call after that tries the store again (reopening it if it never
  opened) and, on success, logs that the store is back.

Nothing stored is ever half-written (every backend publishes a value atomically), so a call that
failed either changed nothing or changed everything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from ..errors import OverBudget, StoreError, StoreUnavailable, VersionConflict
from .base import Buffer, Store, check_key
from .forwarding import ForwardingStore
from .local import PACKETS

log = logging.getLogger(__name__)

T = TypeVar("T")

StoreState = Literal["ok", "degraded", "off"]


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` is a store fault that the same call may not meet again later (worth a retry)."""
    return isinstance(err, StoreUnavailable)


def is_answer(err: BaseException) -> bool:
    """Whether ``err`` is the store's answer rather than a fault: it was reached and refused the call."""
    return isinstance(err, (VersionConflict, OverBudget))


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: the ``n``-th wait (from 0) is ``min(max_s, first_s * factor**n)`` seconds."""

    first_s: float = 0.25
    factor: float = 2.0
    max_s: float = 8.0

    def __post_init__(self) -> None:
        if not (self.first_s > 0 and self.factor >= 1 and self.max_s >= self.first_s):
            raise ValueError(f"bad backoff {self}: need first_s > 0, factor >= 1, max_s >= first_s")

    def delay(self, n: int) -> float:
        return min(self.max_s, self.first_s * self.factor ** min(n, 64))


@dataclass(frozen=True)
class Retry:
    """How a store call that failed with a transient fault is retried: ``retries`` more
    attempts, waiting ``backoff`` in between. The defaults (5, 0.25 s doubling) give the
    store about 8 s to come back."""

    retries: int = 5
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    @property
    def window_s(self) -> float:
        """The longest the waits between attempts add up to (each attempt's own time not counted)."""
        return sum(self.backoff.delay(n) for n in range(self.retries))


def retrying(url: str, doing: str, retry: Retry, call: Callable[[], T],
             on_retry: Callable[[StoreUnavailable], None] | None = None) -> T:
    """``call()``, retried per ``retry`` while it raises a transient fault (:class:`StoreUnavailable`).

    Each transient failure is logged (store ``url``, ``doing``, ``attempt k of n``, the
    wait) and passed to ``on_retry`` before the retry. After the last attempt one
    :class:`StoreUnavailable` names all of that and the last fault. Any other error,
    permanent faults included, is raised at once.
    """
    start = time.monotonic()
    attempt = 1
    while True:
        try:
            return call()
        except StoreUnavailable as err:
            if attempt >= retry.attempts:
                raise StoreUnavailable(
                    f"store {url} unreachable while {doing}: gave up after {retry.attempts} attempt"
                    f"{'s' if retry.attempts > 1 else ''} in {time.monotonic() - start:.1f} s: {err.message}",
                    err.hint or "check the store, then start the agent again",
                ) from err
            wait = retry.backoff.delay(attempt - 1)
            log.warning("store %s unreachable while %s (attempt %d of %d): %s - retrying in %.2g s",
                        url, doing, attempt, retry.attempts, err.message, wait)
            if on_retry is not None:
                on_retry(err)
            time.sleep(wait)
            attempt += 1


def _what(key: str) -> str:
    if key.startswith(PACKETS):
        return f"packet {key}"
    if "/handoff/" in key:
        return f"handoff {key}"
    return f"key {key}"


class RetryingStore(ForwardingStore):
    """``store`` with every call retried on a transient fault (see the module docstring).

    ``retried`` counts the retries made (0 while every call succeeded, or failed permanently
    on its first attempt). Keys are checked before the first attempt, so a bad key fails at once. A put that
    raises :class:`VersionConflict` after an earlier attempt of it failed is checked
    against the store: if the key holds exactly these bytes at the version that put
    would have made, the earlier attempt landed and its version is returned.
    """

    def __init__(self, store: Store, retry: Retry | None = None) -> None:
        super().__init__(store)
        self.retry = retry or Retry()
        self.retried = 0

    def call(self, doing: str, call: Callable[[], T]) -> T:
        """``call()`` under this store's retry policy; ``doing`` names it in messages."""
        return retrying(self.url, doing, self.retry, call, self._count)

    def _count(self, _: StoreUnavailable) -> None:
        self.retried += 1

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        check_key(key)
        failed = False

        def put_once() -> int:
            nonlocal failed
            try:
                return self.store.put(key, data, expect_version=expect_version)
            except VersionConflict:
                if failed and expect_version is not None and self._landed(key, data, expect_version + 1):
                    return expect_version + 1
                raise
            except StoreUnavailable:
                failed = True
                raise

        return self.call(f"publishing {_what(key)}", put_once)

    def _landed(self, key: str, data: Buffer, version: int) -> bool:
        """Whether ``key`` holds exactly ``data`` at ``version``: an earlier attempt's put whose reply was lost."""
        found = self.store.get_versioned(key)
        if found is not None and found[1] == version and bytes(found[0]) == bytes(data):
            log.info("%s in %s was written by an attempt whose reply was lost", key, self.url)
            return True
        return False

    def get(self, key: str) -> bytes | memoryview | None:
        check_key(key)
        return self.call(f"reading {_what(key)}", lambda: self.store.get(key))

    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        check_key(key)
        return self.call(f"reading {_what(key)}", lambda: self.store.get_versioned(key))

    def exists(self, key: str) -> bool:
        check_key(key)
        return self.call(f"checking {_what(key)}", lambda: self.store.exists(key))

    def delete(self, key: str) -> bool:
        check_key(key)
        return self.call(f"deleting {_what(key)}", lambda: self.store.delete(key))

    def keys(self, prefix: str = "") -> list[str]:
        return self.call(f"listing keys {prefix}*", lambda: self.store.keys(prefix))

    @property
    def used_bytes(self) -> int:
        return self.call("reading the byte count", lambda: self.store.used_bytes)


class StoreDown(Exception):
    """A :class:`Breaker`'s store is unreachable (or was, less than ``retry_s`` ago); ``str()`` says why.

    Not a :class:`StoreError`: nothing failed *now*, the call was not made."""


class Breaker:
    """A store that is put aside while it fails: the server's side of the policy (module docstring).

    ``opener()`` opens the store, on the first :meth:`call` or :meth:`open`. ``shown_url`` names it
    in log lines (credentials redacted). ``on_state`` hears ``"degraded"`` at each fault and
    ``"ok"`` when a call succeeds again. ``error`` is what failed last (``None`` while the store is fine).
    """

    def __init__(self, shown_url: str, opener: Callable[[], Store], retry_s: float,
                 on_state: Callable[[StoreState], None] = lambda state: None) -> None:
        self.shown_url = shown_url
        self.opener = opener
        self.retry_s = retry_s
        self.on_state = on_state
        self.store: Store | None = None
        self.error: str | None = None
        self._down_since: float | None = None
        self._lock = threading.Lock()

    @property
    def state(self) -> StoreState:
        return "degraded" if self.error is not None else "ok"

    def open(self, raising: type[StoreError] | tuple[type[StoreError], ...] = ()) -> None:
        """Open the store now; a fault of a ``raising`` class is raised, any other only degrades it."""
        with self._lock:
            try:
                self.store = self.opener()
            except raising:
                raise
            except StoreError as err:
                self._degrade("opening the store", err)

    def call(self, doing: str, operation: Callable[[Store], T]) -> T:
        """``operation(store)``, or :class:`StoreDown` while the store is put aside or when this call
        meets a fault (``doing`` names it in the log and in ``error``). Answers are raised as they are."""
        with self._lock:
            if self._down_since is not None and time.monotonic() - self._down_since < self.retry_s:
                raise StoreDown(self.error)
            try:
                if self.store is None:
                    self.store = self.opener()
                result = operation(self.store)
            except StoreError as err:
                if is_answer(err):
                    raise  # the store answered: it is reachable
                self._degrade(doing, err)
                raise StoreDown(self.error) from None
            if self.error is not None:
                log.warning("store %s reachable again: serving with reuse", self.shown_url)
                self.error, self._down_since = None, None
                self.on_state("ok")
            return result

    def _degrade(self, doing: str, err: StoreError) -> None:
        """Put the store aside (warn once) until ``retry_s`` has passed; call with the lock held."""
        if self.error is None:
            log.warning("store %s unreachable while %s: serving without reuse, retrying every %g s (%s)",
                        self.shown_url, doing, self.retry_s, err)
        self.error, self._down_since = f"{doing}: {err}", time.monotonic()
        self.on_state("degraded")

    def probe(self) -> None:
        """Try a degraded store again (once its cool-off has passed): health checks call this."""
        if self.error is not None:
            try:
                self.call("checking the store", lambda store: store.exists("serve/probe"))
            except StoreDown:
                pass

    def used_bytes(self) -> int | None:
        """The store's byte count, or ``None`` while it is down."""
        try:
            return self.call("reading its size", lambda store: store.used_bytes)
        except StoreDown:
            return None

    def close(self) -> None:
        with self._lock:
            if self.store is not None:
                self.store.close()
                self.store = None
