"""Packets in a store: publish one, fetch and assemble a chain of them.

A growing transcript is sent as a chain: each agent publishes only the tokens it
appended, naming its parent by id (see :mod:`kvwire.packet`). Packets are stored
content-addressed under ``packets/<id>``; publishing a packet whose id is already
stored keeps the stored one (first writer wins) and adopts its checksum, so
children always pin the bytes that are actually in the store.

Data flow: packet -> :func:`publish` (codec.encode -> store.put) ... store.get ->
codec.decode -> :func:`fetch_chain` -> :func:`kvwire.packet.join` -> packet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import codec
from .errors import ChainError, CorruptPacketError
from .packet import Packet, join
from .spec import ModelSpec
from .store import Store

PACKETS = "packets/"
MAX_CHAIN = 100_000  # links; a real chain is one per agent turn


def packet_key(packet_id: str) -> str:
    return f"{PACKETS}{packet_id}"


def publish(store: Store, packet: Packet) -> str:
    """Store ``packet`` under ``packets/<id>``; return its id. Sets ``packet.checksum``."""
    key = packet_key(packet.id)
    stored = store.get(key)
    if stored is not None:
        packet.checksum = _stored_checksum(stored, key)
        return packet.id
    store.put(key, codec.encode(packet))
    return packet.id


def fetch_chain(store: Store, head: str) -> list[Packet]:
    """Load the packet ``head`` and all its ancestors, root first; every one is verified.

    Raises :class:`ChainError` if a link is missing or stored under the wrong id, and
    the codec's errors if one is corrupt.
    """
    chain: list[Packet] = []
    wanted: str | None = head
    child: Packet | None = None
    while wanted is not None:
        if len(chain) >= MAX_CHAIN:
            raise ChainError(f"chain from {head[:12]} is longer than {MAX_CHAIN} packets")
        data = store.get(packet_key(wanted))
        if data is None:
            whose = f" (parent of {child.id[:12]})" if child is not None else ""
            raise ChainError(
                f"packet {wanted[:12]}{whose} is not in {store.url}",
                "the chain is broken: the sender must publish every packet of it, or the receiver re-prefills",
            )
        packet = codec.decode(data)
        if packet.id != wanted:
            raise ChainError(f"{store.url} holds a packet under id {wanted[:12]} whose content hashes to "
                             f"{packet.id[:12]}")
        chain.append(packet)
        child, wanted = packet, packet.parent
    chain.reverse()
    return chain


@dataclass
class Received:
    """A fetched chain: ``context`` covers every token of it; ``head`` is its last link
    (the packet a continuation names as parent), ``first`` its root (its age is the chain's)."""

    context: Packet
    head: Packet
    links: int
    first: Packet


def receive(store: Store, head: str, spec: ModelSpec) -> Received:
    """Fetch the chain ending at ``head``, check it was made by the model ``spec`` describes,
    and join it into one packet covering the whole context."""
    chain = fetch_chain(store, head)
    for packet in chain:
        spec.check_same_model(packet.spec, what=f"packet {packet.id[:12]} from {packet.producer or 'an agent'}")
    return Received(join(chain), chain[-1], len(chain), chain[0])


def _stored_checksum(data: bytes | memoryview, key: str) -> str:
    """The checksum recorded in a stored packet's header (the header alone is parsed)."""
    view = memoryview(data)
    try:
        header_len = int.from_bytes(view[:8], "little")
        if header_len > codec.MAX_HEADER_BYTES or header_len + 8 > view.nbytes:
            raise ValueError("bad header length")
        header = json.loads(bytes(view[8 : 8 + header_len]))
        checksum = json.loads(header["__metadata__"]["kvwire"])["checksum"]
        if not isinstance(checksum, str):
            raise ValueError("checksum is not a string")
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptPacketError(f"stored packet {key} has an unreadable header: {err}",
                                 "delete it from the store and publish again") from None
    return checksum
