"""Whose caches a request may read: tenants (API keys) and ``cache_salt``, as namespaces of the store.

A shared prefix cache is the server's speed and, between users, a leak: a request's time to
first token says whether someone recently sent the same prefix (the timing side channel vLLM
closes with a per-request ``cache_salt``), and with ``--splice`` another user's completion
could be spliced into my context. So caches are shared only inside a namespace:

- **a tenant** is one API key (``--api-key`` given several times, or ``--api-keys-file``):
  its requests never read another key's caches, in any store, Redis shared by several
  servers included (the tenant is a hash of the key, the same on every server);
- **a salt** (``cache_salt`` on a request, vLLM's name) narrows that further: requests
  share caches only with requests of the same tenant and the same salt; no salt is a
  namespace of its own.

The namespace (:func:`namespace`) is a hash of both. It seeds the prefix index's block
hashes and scopes every key the request reads or writes (:class:`kvwire.store.scoped.ScopedStore`),
so it is part of the key, not a filter applied to what was found. A server without keys
and a request without a salt use the store's root, as before tenants existed.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from pathlib import Path

import blake3

from ..errors import AuthenticationFailed, KvwireError, reason

MAX_SALT_CHARS = 256  # a cache_salt longer than this is refused (a salt needs no more)


def check_key(key: str, where: str = "an API key") -> str:
    """``key`` if usable as a bearer token, else ``ValueError`` saying why (never echoing it)."""
    if not key:
        raise ValueError(f"{where} is empty")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where} must be printable ASCII without spaces (clients send it in an HTTP header, "
                         "which carries ASCII)")
    return key


def check_keys(keys: Iterable[str], where: str = "--api-key") -> tuple[str, ...]:
    """The keys, each checked, with no duplicates (a duplicate would make two tenants one)."""
    out: list[str] = []
    for n, key in enumerate(keys, 1):
        check_key(key, f"{where} #{n}")
        if key in out:
            raise ValueError(f"{where} #{n} repeats key #{out.index(key) + 1}: each key is one tenant, give it once")
        out.append(key)
    return tuple(out)


def load_keys(path: str | Path) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and lines starting with ``#`` are skipped.
    :class:`KvwireError` if it cannot be read, holds no key, or repeats one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KvwireError(f"cannot read the API keys file {path}: {reason(err)}",
                          "give a readable UTF-8 file with one key per line") from None
    lines = [line.strip() for line in text.splitlines()]
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise KvwireError(f"the API keys file {path} holds no key", "write one key per line")
    try:
        return check_keys(keys, f"{path}: key")
    except ValueError as err:
        raise KvwireError(str(err), "fix the keys file") from None


def tenant_of(key: str) -> str:
    """The tenant a key names: a hash of it (the same on every server given that key; not the key)."""
    return blake3.blake3(b"kvwire-tenant-v1\0" + key.encode()).hexdigest()[:32]


def authenticate(keys: tuple[str, ...], header: str) -> str | None:
    """The tenant of the bearer token in an ``Authorization`` header; ``None`` when the server has no
    keys; :class:`AuthenticationFailed` when it has and the header carries none of them."""
    if not keys:
        return None
    scheme, _, token = header.partition(" ")
    given = token.strip().encode()
    found = None
    for key in keys:  # every key compared, in constant time each: which one matched does not show in timing
        if secrets.compare_digest(given, key.encode()) and scheme.lower() == "bearer":
            found = key
    if found is None:
        raise AuthenticationFailed("missing API key" if not header else "incorrect API key",
                                   "send Authorization: Bearer <one of the keys the server was started with>")
    return tenant_of(found)


def namespace(tenant: str | None, salt: str | None) -> str:
    """The store namespace of a request: ``""`` (the root) without tenant and salt, else a hash of both."""
    if tenant is None and salt is None:
        return ""
    text = f"kvwire-namespace-v1\0{tenant or ''}\0{'salt' if salt is not None else 'nosalt'}\0{salt or ''}"
    return blake3.blake3(text.encode()).hexdigest()[:32]
