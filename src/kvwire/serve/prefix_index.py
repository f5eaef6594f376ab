"""Finding the longest published prefix of a prompt without scanning the store.

Keys are content-addressed, as in paged prefix caches: the ids are cut into blocks
of ``block_size`` tokens and each block gets a hash chained over every block
before it, seeded by the model's weight fingerprint and the block size::

    h_0 = blake3("kvwire-serve-prefix-v1" | fingerprint | block_size [| scope])
    h_j = blake3(h_{j-1} | token ids of block j as int64 little-endian)   (j = 1, 2, ...)
    key = serve/<fingerprint[:32]>/prefix/<h_j>   ->   the id of a chain head covering blocks 1..j

A tenant's requests (``scope``: its namespace, see :mod:`kvwire.serve.tenancy`) hash
with the scope in ``h_0`` and are stored in a :class:`~kvwire.store.scoped.ScopedStore`, so
the scope is in every key they can name. The hash names the whole prefix up to block j,
depends on nothing but the model, the scope and the tokens (never Python's ``hash``
or a per-process seed), so every process and every restart computes the same keys and finds what the others published.
A prompt of n blocks is looked up by binary search over j (published prefixes are
downward closed: publishing block j publishes 1..j-1 too), about log2(n) ``exists``
calls and one ``get``. The value is only a pointer: the chain it names is fetched,
verified and compared token by token before a single cached token is used
(:mod:`kvwire.serve.reuse`).

Completions (for ``--splice``) are found by their first characters, at the start of a
message or of any line in it (frameworks paste answers into larger messages, and join
consecutive messages with newlines)::

    serve/<fingerprint[:32]>/completions/<blake3(first 32 characters)>
        ->  [{"packet": segment id, "ids": generated ids, "chars": length, "sha": blake3(text)}, ...]

A candidate is used only where the whole text at that place hashes to ``sha``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from ..errors import VersionConflict
from ..store import Store

_ID = re.compile(r"[0-9a-f]{64}")
COMPLETION_KEY_CHARS = 32  # completions are found by this many leading characters (shorter ones are not indexed)
COMPLETIONS_PER_KEY = 8  # most recent completions kept under one key


class IndexEntryError(ValueError):
    """An index value that is not what kvwire writes (corrupt or foreign)."""


@dataclass(frozen=True)
class PrefixIndex:
    """Block keys for one model (``fingerprint``) and one ``block_size``."""

    fingerprint: str
    block_size: int = 16
    scope: str = ""  # a tenant's namespace (kvwire.serve.tenancy): part of every hash, so of every key

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
        seed = f"kvwire-serve-prefix-v1\0{self.fingerprint}\0{self.block_size}"
        seed += f"\0{self.scope}" if self.scope else ""
        state = blake3.blake3(seed.encode()).digest()
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

    def completion_key(self, text: str) -> str | None:
        """The key of completions starting with ``text[:COMPLETION_KEY_CHARS]``; None for shorter text."""
        if len(text) < COMPLETION_KEY_CHARS:
            return None
        head = (f"{self.scope}\0" if self.scope else "").encode() + text[:COMPLETION_KEY_CHARS].encode()
        return f"{self.namespace}/completions/{blake3.blake3(head).hexdigest()}"

    def add_completion(self, store: Store, text: str, packet_id: str, ids: Sequence[int]) -> None:
        """Record that ``text`` was generated as ``ids``, whose K/V are the segment ``packet_id``.

        Appended with compare-and-set to the list under the key of the text's first characters
        (kept to the :data:`COMPLETIONS_PER_KEY` most recent), so concurrent servers lose nothing.
        """
        key = self.completion_key(text)
        if key is None:
            return
        entry = {"packet": packet_id, "ids": [int(t) for t in ids], "chars": len(text),
                 "sha": blake3.blake3(text.encode()).hexdigest()}
        for _ in range(8):
            found = store.get_versioned(key)
            try:
                entries, version = (self.parse_completions(found[0]), found[1]) if found else ([], 0)
            except IndexEntryError:
                entries, version = [], found[1] if found else 0  # a damaged list is replaced
            entries = [e for e in entries if e["sha"] != entry["sha"]][-(COMPLETIONS_PER_KEY - 1):] + [entry]
            try:
                store.put(key, json.dumps(entries, separators=(",", ":")).encode(), expect_version=version)
                return
            except VersionConflict:
                continue  # another server appended at the same time: read again

    @staticmethod
    def parse_completions(value: bytes | memoryview) -> list[dict]:
        """The entries of a completions key; :class:`IndexEntryError` for anything kvwire does not write."""
        try:
            entries = json.loads(bytes(value))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise IndexEntryError("completion index entry is not JSON") from None
        if not isinstance(entries, list):
            raise IndexEntryError("completion index entry is not a list")
        for e in entries:
            if not isinstance(e, dict) or set(e) != {"packet", "ids", "chars", "sha"} \
                    or not isinstance(e["packet"], str) or not _ID.fullmatch(e["packet"]) \
                    or not isinstance(e["sha"], str) or not _ID.fullmatch(e["sha"]) \
                    or not isinstance(e["chars"], int) or e["chars"] < COMPLETION_KEY_CHARS \
                    or not isinstance(e["ids"], list) \
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in e["ids"]):
                raise IndexEntryError("completion index entry is not a list of {packet, ids, chars, sha}")
        return entries

    @staticmethod
    def matches(entry: dict, text: str, start: int) -> bool:
        """Whether the completion ``entry`` stands in ``text`` at character ``start``."""
        stop = start + entry["chars"]
        return stop <= len(text) and blake3.blake3(text[start:stop].encode()).hexdigest() == entry["sha"]
