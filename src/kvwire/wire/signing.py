"""Signed packets: HMAC-SHA256 with a key the agents share.

A cache is a prompt: accepting a forged one lets an outsider steer an agent. With a
shared key configured (``KVWIRE_SIGNING_KEY`` or ``key=``, see
:class:`kvwire.wire.codec.CodecOptions`) the codec signs every packet it writes and
refuses, before any tensor is built, every packet it cannot verify.

The MAC covers every byte of the packet -- length prefix, header (metadata and tensor
table included) and data -- with the 64 hex digits of the MAC itself read as ``"0"``.
A signed header starts with::

    {"__metadata__":{"kvwire.signature":"hmac-sha256:<16 hex key id>:<64 hex MAC>", ...

so the MAC sits at a fixed offset (:data:`MAC_AT`) and a header rewritten in any other
order is refused. The *key id* is the first 16 hex digits of HMAC(key,
"kvwire-key-id-v1"): it names a key without revealing it, so a packet signed with
another key is reported as such rather than as tampered.

What decode accepts:

=====================  ===============  ==================================================
key configured?        packet           result
=====================  ===============  ==================================================
yes                    signed, our key  verified (``hmac.compare_digest``), decoded
yes                    signed, other    :class:`SignatureError` "signed with another key"
yes                    altered          :class:`SignatureError` "does not verify"
yes                    unsigned         :class:`SignatureError` "not signed"
no                     unsigned         decoded (the checksum still catches corruption)
no                     signed           decoded; a warning is logged once per key id
no, but required       any              :class:`CodecOptionsError` (nothing to verify with)
=====================  ===============  ==================================================

``require_signature=True`` (``KVWIRE_REQUIRE_SIGNATURE=1``) is the guard against a
missing key: with it, forgetting to set the key is an error instead of a silent
fallback to unsigned packets.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import SignatureError

log = logging.getLogger(__name__)

ALGORITHM = "hmac-sha256"
FIELD = "kvwire.signature"  # the __metadata__ entry holding the signature
ENV_SIGNING_KEY = "KVWIRE_SIGNING_KEY"
MIN_KEY_BYTES = 16

_MAC_PREFIX = b"kvwire-signature-v1\0"
_OPENING = b'{"__metadata__":{"' + FIELD.encode() + b'":"'
MAC_AT = 8 + len(_OPENING) + len(ALGORITHM) + 1 + 16 + 1  # byte offset of the MAC in a signed packet
_VALUE = re.compile(rf"{ALGORITHM}:([0-9a-f]{{16}}):([0-9a-f]{{64}})")
_warned_key_ids: set[str] = set()
_REMEMBER_AT_MOST = 64  # unverified key ids already warned about (then forgotten, and warned about again)


@dataclass(frozen=True)
class Signer:
    """The signature a packet claims: who (key id) and what (MAC, hex)."""

    key_id: str
    mac: str


def key_id(key: bytes) -> str:
    """The public name of a signing key: HMAC(key, "kvwire-key-id-v1"), first 16 hex digits."""
    return hmac.new(key, b"kvwire-key-id-v1", hashlib.sha256).hexdigest()[:16]


def placeholder(key: bytes) -> str:
    """The signature entry written before the MAC is known: the key id and 64 zeros."""
    return f"{ALGORITHM}:{key_id(key)}:{'0' * 64}"


def sign(prefix: bytes, data: Iterable[Any], key: bytes) -> bytes:
    """Return ``prefix`` (length + header holding :func:`placeholder` first) with the MAC
    of the packet ``prefix + data`` written in place of the zeros."""
    if not prefix[8:].startswith(_OPENING + placeholder(key).encode() + b'"'):
        raise ValueError("the header does not start with the signature placeholder")
    mac = _mac(key, [prefix, *data])
    return prefix[:MAC_AT] + mac.encode() + prefix[MAC_AT + 64 :]


def read_signer(buf: memoryview, value: Any) -> Signer | None:
    """The signature of a packet whose parsed ``__metadata__`` holds ``value`` under
    :data:`FIELD` (None: unsigned), checked to sit at its fixed offset in ``buf``."""
    if value is None:
        return None
    match = _VALUE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise SignatureError(f"malformed packet signature {str(value)[:100]!r}",
                             f"expected {ALGORITHM}:<16 hex key id>:<64 hex MAC>")
    opening = _OPENING + value.encode() + b'"'
    if bytes(buf[8 : 8 + len(opening)]) != opening:
        raise SignatureError("the packet signature is not where a signed header keeps it (header rewritten?)",
                             "re-create the packet with kvwire.codec.encode(..., key=...)")
    return Signer(match.group(1), match.group(2))


def check(buf: memoryview, signer: Signer | None, key: bytes | None) -> None:
    """Apply the table of the module docstring to a packet ``buf`` claiming ``signer``."""
    if key is None:
        if signer is not None and signer.key_id not in _warned_key_ids:
            if len(_warned_key_ids) >= _REMEMBER_AT_MOST:  # untrusted packets may claim any number of key ids
                _warned_key_ids.clear()
            _warned_key_ids.add(signer.key_id)
            log.warning("accepting packets signed with key %s without verifying them: no signing key is "
                        "configured (set %s to verify)", signer.key_id, ENV_SIGNING_KEY)
        return
    ours = key_id(key)
    if signer is None:
        raise SignatureError("packet is not signed, but a signing key is configured",
                             f"the producer must sign with the same key, {ENV_SIGNING_KEY}; unsigned packets are "
                             "refused because anyone with store access could have written them")
    if signer.key_id != ours:
        raise SignatureError(f"packet was signed with another key (key id {signer.key_id}; this agent's key "
                             f"is {ours})", f"give every agent the same {ENV_SIGNING_KEY}")
    expected = _mac(key, [buf[:MAC_AT], b"0" * 64, buf[MAC_AT + 64 :]])
    if not hmac.compare_digest(expected, signer.mac):
        raise SignatureError("packet signature does not verify: its bytes were altered after signing, or forged",
                             "discard it and fetch it again from a trusted producer")


def _mac(key: bytes, chunks: Iterable[Any]) -> str:
    mac = hmac.new(key, _MAC_PREFIX, hashlib.sha256)
    for chunk in chunks:
        mac.update(chunk)
    return mac.hexdigest()
