"""Delta packets in a store: publish, fetch, and refuse broken chains."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import packet, spec
from kvwire import ChainError, ChecksumError, ModelMismatchError, fetch_chain, open_store, publish, receive
from kvwire.wire import codec
from kvwire.kv.chain import packet_key


@pytest.fixture
def store():
    return open_store("memory://")


def _chain(store, lengths=(6, 3, 2)):
    links, parent = [], None
    for seed, n in enumerate(lengths):
        p = packet(tokens=n, seed=seed, parent=parent)
        publish(store, p)
        links.append(p)
        parent = p
    return links


def test_a_chain_is_sent_as_deltas_and_received_whole(store):
    links = _chain(store)
    assert store.keys("packets/") == sorted(packet_key(p.id) for p in links)
    got = receive(store, links[-1].id, links[0].spec)
    assert got.links == 3 and got.head.id == links[-1].id
    assert got.context.length == 11 and got.context.start == 0
    assert torch.equal(got.context.token_ids, torch.cat([p.token_ids for p in links], 1))
    assert torch.equal(got.context.values[1], torch.cat([p.values[1] for p in links], 2))


def test_publishing_twice_keeps_the_first_bytes(store):
    p = packet(tokens=4)
    publish(store, p)
    first = bytes(store.get(packet_key(p.id)))
    again = packet(tokens=4)
    again.created_at += 5
    publish(store, again)
    assert bytes(store.get(packet_key(p.id))) == first and again.checksum == p.checksum


def test_missing_parent_breaks_the_chain(store):
    links = _chain(store)
    store.delete(packet_key(links[1].id))
    with pytest.raises(ChainError, match=f"packet {links[1].id[:12]} \\(parent of {links[2].id[:12]}\\) is not in"):
        fetch_chain(store, links[-1].id)


def test_a_packet_under_the_wrong_key_is_refused(store):
    links = _chain(store)
    store.put(packet_key(links[1].id), codec.encode(links[0]))
    with pytest.raises(ChainError, match="content hashes to"):
        fetch_chain(store, links[-1].id)


def test_a_corrupt_link_is_refused(store):
    links = _chain(store)
    data = bytearray(store.get(packet_key(links[0].id)))
    data[-3] ^= 0x40
    store.put(packet_key(links[0].id), bytes(data))
    with pytest.raises(ChecksumError):
        receive(store, links[-1].id, links[0].spec)


def test_a_replaced_parent_is_detected(store):
    links = _chain(store)
    replacement = packet(tokens=6, seed=0)  # same tokens and id as the root, other bytes
    replacement.created_at += 1
    store.put(packet_key(links[0].id), codec.encode(replacement))
    with pytest.raises(ChainError, match="expects parent bytes"):
        receive(store, links[-1].id, links[0].spec)


def test_a_chain_from_another_model_is_refused(store):
    links = _chain(store)
    with pytest.raises(ModelMismatchError, match="different weights"):
        receive(store, links[-1].id, spec(fingerprint="0" * 64))
    with pytest.raises(ModelMismatchError, match="num_kv_heads"):
        receive(store, links[-1].id, spec(kv_heads=8))
