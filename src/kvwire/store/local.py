"""A process-local copy of content-addressed values, in front of a remote store.

Packets are content-addressed (``packets/<id>``; the id names the whole context up to
the packet's last token), so the bytes a process once put or got under a packet key
can be read again from its own memory instead of across the network: with agents
alternating between two servers on one Redis, each hop then fetches only the links
the *other* server added. Everything else (the prefix index, completions, versions,
deletes) goes to the store itself. Bytes read here are decoded and verified like
bytes from the store (checksum, signature, spec, ids); a copy that no longer matches
what its children pin is refused there as a broken chain and recomputed.

Worth it in front of ``redis://`` stores only: ``memory://`` and ``file://`` stores are this
host's memory or page cache already. ``kvwire serve`` puts one of 512 MiB in front of a ``redis://`` store
(``ServeConfig.local_packet_bytes``; 0 turns it off).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .base import Buffer, Store
from .forwarding import ForwardingStore

PACKETS = "packets/"  # the keys whose values never change once written (kvwire.kv.chain's packet keys)


class LocalPackets(ForwardingStore):
    """``store`` with its ``prefix`` (``packets/*``) values kept in this process, least recently used
    first out, within ``max_bytes``; ``hits`` counts the reads answered from here."""

    def __init__(self, store: Store, max_bytes: int, prefix: str = PACKETS) -> None:
        super().__init__(store)
        self.max_bytes = max_bytes
        self.prefix = prefix
        self._held: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def _keep(self, key: str, data: Buffer) -> None:
        if not key.startswith(self.prefix) or len(data) > self.max_bytes:
            return
        value = bytes(data)
        with self._lock:
            old = self._held.pop(key, None)
            self._bytes += len(value) - (len(old) if old is not None else 0)
            self._held[key] = value
            while self._bytes > self.max_bytes:
                _, dropped = self._held.popitem(last=False)
                self._bytes -= len(dropped)

    def _drop(self, key: str) -> None:
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._bytes -= len(old)

    def put(self, key: str, data: Buffer, *, expect_version: int | None = None) -> int:
        version = self.store.put(key, data, expect_version=expect_version)
        self._keep(key, data)
        return version

    def get_versioned(self, key: str) -> tuple[bytes | memoryview, int] | None:
        found = self.store.get_versioned(key)
        if found is not None:
            self._keep(key, found[0])
        return found

    def get(self, key: str) -> bytes | memoryview | None:
        if key.startswith(self.prefix):
            with self._lock:
                held = self._held.get(key)
                if held is not None:
                    self._held.move_to_end(key)
                    self.hits += 1
                    return held
        found = self.store.get(key)
        if found is not None:
            self._keep(key, found)
        return found

    def delete(self, key: str) -> bool:
        self._drop(key)
        return self.store.delete(key)

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            self._bytes = 0
        self.store.close()
