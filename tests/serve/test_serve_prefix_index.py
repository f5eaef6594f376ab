"""The prefix index: content-addressed block keys, found by binary search, shared by every process."""

from __future__ import annotations

import struct

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.serve.prefix_index import COMPLETIONS_PER_KEY, IndexEntryError, PrefixIndex
from kvwire.store import MemoryStore

HEAD = "ab" * 32


def test_block_hashes_follow_the_documented_format():
    """Nothing but the fingerprint, the block size and the ids goes in: every process computes the same keys."""
    index = PrefixIndex("f" * 64, block_size=4)
    ids = list(range(100, 110))
    state = blake3.blake3(f"kvwire-serve-prefix-v1\0{'f' * 64}\0{4}".encode()).digest()
    expected = []
    for j in range(2):  # 10 ids: two full blocks
        state = blake3.blake3(state + struct.pack("<4q", *ids[4 * j:4 * j + 4])).digest()
        expected.append(state.hex())
    assert index.hashes(ids) == expected
    assert index.key(expected[1]) == f"serve/{'f' * 32}/prefix/{expected[1]}"
    assert PrefixIndex("e" * 64, 4).hashes(ids) != expected  # other weights never share a key
    assert PrefixIndex("f" * 64, 5).hashes(ids)[0] != expected[0]


def test_find_returns_the_longest_published_prefix_within_the_limit():
    store, index = MemoryStore(), PrefixIndex("f" * 64, block_size=4)
    published = list(range(40))
    assert index.publish(store, published, HEAD, covered=30) == 7  # blocks of ids[:28]
    assert index.find(store, published, limit=39) == (28, HEAD)
    assert index.find(store, published, limit=13) == (12, HEAD)  # never past the limit
    assert index.find(store, published[:10] + [999] * 30, limit=39) == (8, HEAD)  # diverges in block 3
    assert index.find(store, [999] + published, limit=40) is None
    assert index.find(MemoryStore(), published, limit=39) is None


def test_an_entry_that_is_not_a_packet_id_is_refused():
    store, index = MemoryStore(), PrefixIndex("f" * 64, block_size=4)
    index.publish(store, list(range(8)), HEAD, covered=8)
    store.put(index.key(index.hashes(list(range(8)))[1]), b"../../etc/passwd")
    with pytest.raises(IndexEntryError, match="not a packet id"):
        index.find(store, list(range(9)), limit=8)


@settings(max_examples=60, deadline=None)
@given(conversations=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=4),
       query=st.lists(st.integers(0, 3), min_size=1, max_size=24))
def test_find_agrees_with_a_scan_of_everything_published(conversations, query):
    """Binary search over the blocks finds what comparing the query with every published sequence finds."""
    store, index = MemoryStore(), PrefixIndex("f" * 64, block_size=3)
    for number, ids in enumerate(conversations):
        index.publish(store, ids, f"{number:064x}", covered=len(ids))

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    limit = len(query) - 1
    best = max((common(ids, query[:limit]) // 3 * 3 for ids in conversations), default=0)
    found = index.find(store, query, limit)
    assert (found[0] if found else 0) == best
    if found:  # and the chain it names does hold those tokens
        head = int(found[1], 16)
        assert conversations[head][:best] == query[:best]


def test_completions_are_listed_by_their_first_characters_and_checked_whole():
    store, index = MemoryStore(), PrefixIndex("f" * 64)
    text = "The root cause was an expired certificate on the payment gateway."
    index.add_completion(store, text, HEAD, [5, 6, 7])
    entries = index.parse_completions(store.get(index.completion_key(text)))
    assert [(e["packet"], e["ids"], e["chars"]) for e in entries] == [(HEAD, [5, 6, 7], len(text))]
    pasted = f"The analyst wrote:\n{text}\nFix it."
    assert index.completion_key(pasted[19:]) == index.completion_key(text)
    assert index.matches(entries[0], pasted, 19) and not index.matches(entries[0], pasted.replace("gateway", "x"), 19)
    assert index.completion_key("too short") is None
    for n in range(COMPLETIONS_PER_KEY + 3):  # same first characters, other endings: the newest are kept
        index.add_completion(store, f"{text} ({n})", f"{n:064x}", [n])
    kept = index.parse_completions(store.get(index.completion_key(text)))
    assert len(kept) == COMPLETIONS_PER_KEY and kept[-1]["ids"] == [COMPLETIONS_PER_KEY + 2]


@pytest.mark.parametrize("value", [b"not json", b"{}", b'[{"packet": "x", "ids": [], "chars": 40, "sha": "y"}]',
                                   b'[{"packet": "' + b"a" * 64 + b'", "ids": [-1], "chars": 40, "sha": "' + b"a" * 64
                                   + b'"}]'])
def test_malformed_completion_entries_are_refused(value):
    with pytest.raises(IndexEntryError):
        PrefixIndex.parse_completions(value)
