"""What agents leave each other in the store: a :class:`Handoff` (small JSON), under a known key."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ChainError


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

    def to_bytes(self) -> bytes:
        return json.dumps({"messages": self.messages, "generated": {str(k): v for k, v in self.generated.items()},
                           "producer": self.producer, "ids": self.ids, "packet": self.packet,
                           "segments": [[p, m] for p, m in self.segments]}).encode()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, key: str) -> Handoff:
        try:
            obj = json.loads(bytes(data))
            messages = obj["messages"]
            ok = (isinstance(messages, list)
                  and all(isinstance(m, dict) and set(m) == {"role", "content"}
                          and all(isinstance(v, str) for v in m.values()) for m in messages)
                  and _int_list(obj["ids"]) and isinstance(obj["generated"], dict)
                  and all(_int_list(v) for v in obj["generated"].values())
                  and isinstance(obj["packet"], (str, type(None))) and isinstance(obj["producer"], str)
                  and isinstance(obj["segments"], list)
                  and all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int
                          for s in obj["segments"]))
            if not ok:
                raise ValueError("fields have the wrong types")
            generated = {int(k): v for k, v in obj["generated"].items()}
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ChainError(f"malformed handoff at {key}: {err}") from None
        return cls(messages, generated, obj["producer"], obj["ids"], obj["packet"],
                   [(p, m) for p, m in obj["segments"]])


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(i) is int for i in value)
