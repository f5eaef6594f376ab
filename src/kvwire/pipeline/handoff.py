"""What agents leave each other in the store: a :class:`Handoff` (small JSON), under a known key.

A handoff carries the conversation itself -- the messages the next agent will read
-- so it is as much a prompt as a cache is. With a signing key (the same one packets
use, :class:`kvwire.wire.codec.CodecOptions`), handoffs are signed with HMAC-SHA256 over
their canonical JSON, and a receiver with the key refuses unsigned, altered or
foreign-key handoffs before reading any field::

    {"body": {"messages": [...], "generated": {...}, "producer": "A", "ids": [...],
              "packet": "3f2a...", "segments": [["9c0d...", 2], ...]},
     "signature": "hmac-sha256:<key id>:<64 hex>"}           # only when signed
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import ChainError, SignatureError
from ..wire.signing import key_id

MAX_HANDOFF_BYTES = 256 * 1024 * 1024  # a conversation of a few million tokens


def handoff_key(session: str, index: int, agent: str, round: int = 0) -> str:
    """Where agent ``index`` (named ``agent``) leaves its handoff in round ``round`` of ``session``."""
    return f"sessions/{session}/r{round}/handoff/{index}-{agent}"


@dataclass
class Handoff:
    """What an agent leaves in the store for the next one (small JSON).

    ``messages`` is the conversation without any system prompt; ``generated`` maps a
    message index to the ids the model generated for it; ``ids`` are the producer's
    exact context ids (its system prompt included) for prefix mode, covered up to some
    point by the chain ending at ``packet``; ``segments`` lists splice mode's segment
    packets, each with the index of the message it starts at.
    """

    messages: list[dict[str, str]]
    generated: dict[int, list[int]]
    producer: str
    ids: list[int] = field(default_factory=list)
    packet: str | None = None
    segments: list[tuple[str, int]] = field(default_factory=list)

    def to_bytes(self, signing_key: bytes | None = None) -> bytes:
        body = {"messages": self.messages, "generated": {str(k): v for k, v in self.generated.items()},
                "producer": self.producer, "ids": self.ids, "packet": self.packet,
                "segments": [[p, m] for p, m in self.segments]}
        wrapped: dict[str, Any] = {"body": body}
        if signing_key is not None:
            wrapped["signature"] = _signature(signing_key, body)
        return json.dumps(wrapped, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, where: str, signing_key: bytes | None = None) -> Handoff:
        """Parse and check a handoff read from ``where``; with a key, verify its signature first."""
        if len(data) > MAX_HANDOFF_BYTES:
            raise ChainError(f"handoff at {where} is {len(data):,} bytes, over the {MAX_HANDOFF_BYTES:,}-byte limit")
        try:
            wrapped = json.loads(bytes(data))
            if not isinstance(wrapped, dict) or not isinstance(wrapped.get("body"), dict):
                raise ValueError("not a handoff object")
            obj = wrapped["body"]
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: nested too deep
            raise ChainError(f"malformed handoff at {where}: {err}") from None
        _verify(where, obj, wrapped.get("signature"), signing_key)
        try:
            messages = obj["messages"]
            ok = (isinstance(messages, list)
                  and all(isinstance(m, dict) and set(m) == {"role", "content"}
                          and all(isinstance(v, str) for v in m.values()) for m in messages)
                  and _int_list(obj["ids"]) and isinstance(obj["generated"], dict)
                  and all(_int_list(v) for v in obj["generated"].values())
                  and isinstance(obj["packet"], (str, type(None))) and isinstance(obj["producer"], str)
                  and isinstance(obj["segments"], list)
                  and all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int
                          and 0 <= s[1] < len(messages) for s in obj["segments"]))
            if not ok:
                raise ValueError("fields have the wrong types, or an index outside the messages")
            generated = {int(k): v for k, v in obj["generated"].items()}
            if not all(0 <= k < len(messages) for k in generated):
                raise ValueError("'generated' names a message the handoff does not have")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ChainError(f"malformed handoff at {where}: {err}") from None
        return cls(messages, generated, obj["producer"], obj["ids"], obj["packet"],
                   [(p, m) for p, m in obj["segments"]])


def _signature(key: bytes, body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"hmac-sha256:{key_id(key)}:{hmac.new(key, b'kvwire-handoff-v1' + canonical, hashlib.sha256).hexdigest()}"


def _verify(where: str, body: Any, signature: Any, key: bytes | None) -> None:
    if key is None:
        return  # nothing to verify with (a required signature is refused earlier, by CodecOptions)
    if signature is None:
        raise SignatureError(f"handoff at {where} is not signed, and a signing key is configured",
                             "every agent must run with the same KVWIRE_SIGNING_KEY")
    if not isinstance(signature, str) or not isinstance(body, dict):
        raise SignatureError(f"handoff at {where} has a malformed signature")
    expected = _signature(key, body)
    if signature.split(":")[:2] != expected.split(":")[:2]:
        raise SignatureError(f"handoff at {where} was signed with another key ({signature.split(':')[1:2]} "
                             f"is not this agent's {key_id(key)})", "give every agent the same signing key")
    if not hmac.compare_digest(signature, expected):
        raise SignatureError(f"handoff at {where} does not verify: it was altered after it was signed",
                             "do not use it; the store may be compromised")


def _int_list(value: Any) -> bool:
    """A list of token ids: ints in [0, 2**31) (a larger one would overflow the int64 tensors built from it)."""
    return isinstance(value, list) and all(type(i) is int and 0 <= i < 2**31 for i in value)
