"""Packets in a store: publish one, fetch and assemble a chain of them.

A growing transcript is sent as a chain: each agent publishes only the tokens it
appended, naming its parent by id (see :mod:`kvwire.wire.packet`). Packets are stored
content-addressed under ``packets/<id>``; publishing a packet whose id is already
stored keeps the stored one (first writer wins) and adopts its checksum, so
children always pin the bytes that are actually in the store -- provided those
bytes decode under the publisher's options: a stored copy that is corrupt, unsigned
or signed with another key while this agent signs, stored under the wrong id, or
pinning parent bytes that are no longer the parent's, could never be received, so
it is replaced (and a warning logged). A stored copy in
another encoding is kept: it is the same context, and receivers decode any encoding.

Every function takes ``options`` (:class:`kvwire.wire.codec.CodecOptions`: encoding,
signing key, size limit); ``None`` reads them from the environment
(:meth:`~kvwire.wire.codec.CodecOptions.from_env`).

Data flow: packet -> :func:`publish` (codec.encode -> store.put) ... store.get ->
codec.decode -> :func:`fetch_chain` -> :func:`kvwire.wire.packet.join` -> packet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..wire import codec
from ..wire.options import CodecOptions
from ..errors import ChainError, PacketError
from ..wire.packet import Packet, join
from ..wire.spec import ModelSpec
from ..store import Store

log = logging.getLogger(__name__)

PACKETS = "packets/"
MAX_CHAIN = 100_000  # links; a real chain is one per agent turn


def packet_key(packet_id: str) -> str:
    return f"{PACKETS}{packet_id}"


def publish(store: Store, packet: Packet, *, options: CodecOptions | None = None) -> str:
    """Store ``packet`` under ``packets/<id>``; return its id. Sets ``packet.checksum``.

    If the id is already stored and that copy decodes under ``options``, it is kept
    and its checksum adopted; otherwise it is replaced (see the module docstring).
    """
    options = options if options is not None else CodecOptions.from_env()
    key = packet_key(packet.id)
    stored = store.get(key)
    if stored is not None:
        try:
            existing = codec.decode(stored, options=options)
        except PacketError as err:
            log.warning("replacing %s in %s: the stored copy cannot be received (%s)", key, store.url, err)
        else:
            if existing.id == packet.id and existing.parent_checksum == packet.parent_checksum:
                packet.checksum = existing.checksum
                return packet.id
            why = (f"it holds a packet whose content hashes to {existing.id[:12]}" if existing.id != packet.id else
                   f"it pins other parent bytes ({str(existing.parent_checksum)[:12]}, now "
                   f"{str(packet.parent_checksum)[:12]})")
            log.warning("replacing %s in %s: %s", key, store.url, why)
    store.put(key, codec.encode(packet, options=options))
    return packet.id


def fetch_chain(store: Store, head: str, *, options: CodecOptions | None = None) -> list[Packet]:
    """Load the packet ``head`` and all its ancestors, root first; every one is verified.

    Raises :class:`ChainError` if a link is missing or stored under the wrong id, and
    the codec's errors (naming the link) if one is corrupt, unsigned, signed with
    another key or too large for ``options``.
    """
    options = options if options is not None else CodecOptions.from_env()
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
        try:
            packet = codec.decode(data, options=options)
        except PacketError as err:
            raise type(err)(f"packet {wanted[:12]} in {store.url}: {err.message}", err.hint) from None
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


def receive(store: Store, head: str, spec: ModelSpec, *, options: CodecOptions | None = None) -> Received:
    """Fetch the chain ending at ``head``, check it was made by the model ``spec`` describes,
    and join it into one packet covering the whole context (in the spec's dtype, whatever
    the links' encodings)."""
    chain = fetch_chain(store, head, options=options)
    for packet in chain:
        spec.check_same_model(packet.spec, what=f"packet {packet.id[:12]} from {packet.producer or 'an agent'}")
    return Received(join(chain), chain[-1], len(chain), chain[0])


def release(store: Store, head: str) -> int:
    """Delete the packet ``head`` and its ancestors from ``store``; returns how many were deleted.

    Headers alone are read (to follow ``parent``); a missing link ends the walk. Packets
    are content-addressed, so release only chains no one else still reads.
    """
    removed, wanted = 0, head
    while wanted is not None:
        key = packet_key(wanted)
        data = store.get(key)
        if data is None:
            break
        wanted = codec.peek(data).parent
        removed += store.delete(key)
    return removed
