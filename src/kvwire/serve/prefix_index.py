"""Finding the longest published prefix of a prompt without scanning the store.

Keys are content-addressed, as in paged prefix caches: the ids are cut into blocks
of ``block_size`` tokens and each block gets a hash chained over every block
before it, seeded by the model's weight fingerprint and the block size::

    h_0 = blake3("kvwire-serve-prefix-v1" | fingerprint | block_size)
    h_j = blake3(h_{j-1} | token ids of block j as int64 little-endian)   (j = 1, 2, ...)
    key = serve/<fingerprint[:32]>/prefix/<h_j>   ->   the id of a chain head covering blocks 1..j

The hash names the whole prefix up to block j, depends on nothing but the model
and the tokens (never Python's ``hash`` or a per-process seed), so every process
and every restart computes the same keys and finds what the others published.
A prompt of n blocks is looked up by binary search over j (published prefixes are
downward closed: publishing block j publishes 1..j-1 too), about log2(n) ``exists``
calls and one ``get``. The value is only a pointer: the chain it names is fetched,
verified and compared token by token before a single cached token is used
(:mod:`kvwire.serve.reuse`).

Completions (for ``--splice``) are found by their text::

    serve/<fingerprint[:32]>/completions/<blake3(text)>  ->  {"packet": segment id, "ids": generated ids}
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from ..store import Store

_ID = re.compile(r"[0-9a-f]{64}")


class IndexEntryError(ValueError):
    """An index value that is not what kvwire writes (corrupt or foreign)."""


@dataclass(frozen=True)
class PrefixIndex:
    """Block keys for one model (``fingerprint``) and one ``block_size``."""

    fingerprint: str
    block_size: int = 16

    @property
    def namespace(self) -> str:
        return f"serve/{self.fingerprint[:32] or 'unknown'}"

    def hashes(self, ids: Sequence[int], blocks: int | None = None) -> list[str]:
        """The chained hash of each of the first ``blocks`` full blocks of ``ids`` (default: all).

        Example (block_size=4): 10 ids -> 2 hashes (ids[0:4], then ids[0:8]); the last 2 ids
        are not a full block.
        """
        full = len(ids) // self.block_size
        blocks = full if blocks is None else min(blocks, full)
        state = blake3.blake3(f"kvwire-serve-prefix-v1\0{self.fingerprint}\0{self.block_size}".encode()).digest()
        out = []
        for j in range(blocks):
            block = ids[j * self.block_size:(j + 1) * self.block_size]
            state = blake3.blake3(state + struct.pack(f"<{len(block)}q", *block)).digest()
            out.append(state.hex())
        return out

    def key(self, block_hash: str) -> str:
        return f"{self.namespace}/prefix/{block_hash}"

    def find(self, store: Store, ids: Sequence[int], limit: int) -> tuple[int, str] | None:
        """``(tokens, head id)`` for the longest published prefix of ``ids[:limit]`` in whole blocks,
        or ``None``. Raises :class:`IndexEntryError` for a value kvwire did not write."""
        hashes = self.hashes(ids[:limit])
        lo, hi = 0, len(hashes)  # invariant: blocks 1..lo are published (lo=0: none known), hi+1.. are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if store.exists(self.key(hashes[mid - 1])):
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        value = store.get(self.key(hashes[lo - 1]))
        if value is None:  # evicted between the two calls
            return None
        head = bytes(value).decode("ascii", errors="replace")
        if not _ID.fullmatch(head):
            raise IndexEntryError(f"prefix index entry {self.key(hashes[lo - 1])} holds {head[:40]!r}, not a packet id")
        return lo * self.block_size, head

    def publish(self, store: Store, ids: Sequence[int], head: str, *, covered: int, known: int = 0) -> int:
        """Point every block of ``ids[:covered]`` past the first ``known`` tokens at chain ``head``;
        returns how many keys were written. Blocks already published keep their value (any chain
        that covers a block serves it)."""
        written = 0
        hashes = self.hashes(ids[:covered])
        for j in range(known // self.block_size, len(hashes)):
            store.put(self.key(hashes[j]), head.encode("ascii"))
            written += 1
        return written

    # -- completions, for splicing -----------------------------------------------------------------

    def completion_key(self, text: str) -> str:
        return f"{self.namespace}/completions/{blake3.blake3(text.encode()).hexdigest()}"

    @staticmethod
    def completion_value(packet_id: str, ids: Sequence[int]) -> bytes:
        return json.dumps({"packet": packet_id, "ids": [int(t) for t in ids]}, separators=(",", ":")).encode()

    @staticmethod
    def parse_completion(value: bytes | memoryview) -> tuple[str, list[int]]:
        """``(segment packet id, generated ids)``; :class:`IndexEntryError` for anything else."""
        try:
            data = json.loads(bytes(value))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise IndexEntryError("completion index entry is not JSON") from None
        if not isinstance(data, dict) or set(data) != {"packet", "ids"} or not isinstance(data["packet"], str) \
                or not _ID.fullmatch(data["packet"]) or not isinstance(data["ids"], list) \
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in data["ids"]):
            raise IndexEntryError("completion index entry is not {packet: id, ids: [int]}")
        return data["packet"], data["ids"]
