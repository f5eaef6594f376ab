"""One verified receive: a chain or a segment from a store comes back checked, or as a typed refusal.

Every reader (an agent, a merging agent, the server) gets the same answer for the same packet;
each refusal has one reason, and the pipeline keeps recording its 0.1 labels for them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.helpers import packet, spec
from kvwire import StoreConfigError, StoreUnavailable, open_store, publish
from kvwire.kv.chain import packet_key
from kvwire.kv.receive import Freshness, Reason, Received, Refusal, fetch_verified
from kvwire.wire import codec


@pytest.fixture
def store():
    return open_store("memory://")


def _chain(store, lengths=(6, 3)):
    links, parent = [], None
    for seed, n in enumerate(lengths):
        parent = packet(tokens=n, seed=seed, parent=parent)
        publish(store, parent)
        links.append(parent)
    return links


def test_a_good_chain_comes_back_whole_with_its_links(store):
    links = _chain(store)
    ids = torch.cat([p.token_ids for p in links], 1)[0].tolist()
    got = fetch_verified(store, links[-1].id, links[0].spec, ids=ids + [7, 8])  # a context that extends it
    assert isinstance(got, Received)
    assert [p.id for p in got.links] == [p.id for p in links]
    assert got.head.id == links[-1].id and got.first.id == links[0].id
    assert got.context.length == 9 and got.context.token_ids[0].tolist() == ids


def test_a_packet_from_other_weights_is_refused_as_foreign(store):
    links = _chain(store)
    other = dataclasses.replace(links[0].spec, fingerprint="0" * 64)  # the receiver's model was updated
    got = fetch_verified(store, links[-1].id, other)
    assert isinstance(got, Refusal) and got.reason is Reason.FOREIGN
    assert got.event.startswith("foreign: packet ")  # what the server records and counts
    assert got.pipeline_event.startswith("stale-fingerprint: ")  # what pipeline results have always recorded


def test_a_missing_link_a_damaged_one_and_other_tokens_are_refused_each_with_its_reason(store):
    links = _chain(store)
    ids = links[0].token_ids[0].tolist()
    assert fetch_verified(store, links[-1].id, links[0].spec, ids=[i + 1 for i in ids]).reason is Reason.MISMATCH
    data = bytearray(store.get(packet_key(links[1].id)))
    data[-3] ^= 1
    store.put(packet_key(links[1].id), bytes(data))
    damaged = fetch_verified(store, links[-1].id, links[0].spec)
    assert damaged.reason is Reason.CORRUPT and "checksum" in damaged.message
    store.delete(packet_key(links[0].id))  # evicted
    gone = fetch_verified(store, links[0].id, links[0].spec)
    assert gone.reason is Reason.BROKEN_CHAIN and gone.pipeline_event.startswith("broken-chain: packet ")


def test_an_old_chain_is_refused_as_expired(store):
    links = _chain(store)
    got = fetch_verified(store, links[-1].id, links[0].spec, freshness=Freshness(max_rounds=1), round=3)
    assert got == Refusal(Reason.EXPIRED, "chain started in round 0, now round 3 (max 1 rounds)")
    assert isinstance(fetch_verified(store, links[-1].id, links[0].spec, freshness=Freshness(max_rounds=3),
                                     round=3), Received)


def test_a_segment_is_one_packet_checked_against_its_tokens(store):
    links = _chain(store)
    segment = links[1]  # a segment is fetched alone: its parent is not followed
    got = fetch_verified(store, segment.id, segment.spec, kind="segment", ids=segment.token_ids[0].tolist())
    assert isinstance(got, Received) and got.links == [got.head] and got.head.id == segment.id
    other = fetch_verified(store, segment.id, segment.spec, kind="segment", ids=[0, 1, 2])
    assert other == Refusal(Reason.MISMATCH, f"segment {segment.id[:12]} holds other tokens than its completion")
    store.put(packet_key(segment.id), codec.encode(links[0]))  # another packet under its id
    assert "content hashes to" in fetch_verified(store, segment.id, segment.spec, kind="segment").message
    assert fetch_verified(store, "9" * 64, spec(), kind="segment").reason is Reason.BROKEN_CHAIN


def test_a_store_that_went_away_is_a_refusal_or_the_callers_fault_to_handle(tmp_path):
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        store = open_store(server.url("connect_timeout=1"))
        head = _chain(store)[-1]
    finally:
        server.stop()
    got = fetch_verified(store, head.id, head.spec)
    assert got.reason is Reason.STORE_UNREACHABLE and isinstance(got.error, StoreUnavailable)
    with pytest.raises(StoreUnavailable):  # the server's own store policy decides what a fault means
        fetch_verified(store, head.id, head.spec, store_faults="raise")


def test_a_misconfigured_store_is_never_a_refusal(store):
    class Misconfigured(type(store)):
        def get(self, key):
            raise StoreConfigError("wrong password")

    with pytest.raises(StoreConfigError):
        fetch_verified(Misconfigured(), "9" * 64, spec())
