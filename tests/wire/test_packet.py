"""The packet: its shape contract, its chain ids, joining a chain, and its size."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import packet, spec
from kvwire import ChainError, ModelMismatchError, PacketError, join
from kvwire.wire.spec import ModelSpec
from kvwire.wire import codec


def test_valid_packet_describes_itself():
    p = packet(tokens=7, batch=2).validate()
    assert (p.batch_size, p.length, p.start, p.end) == (2, 7, 0, 7)
    info = p.describe()
    assert info["length"] == 7 and info["layer_shapes"] == ["[2, 2, 7, 4]"]
    assert info["kv_bytes"] == p.nbytes == p.spec.kv_bytes(7, batch=2)


@pytest.mark.parametrize("breakage, expected", [
    (lambda p: p.keys[0].unsqueeze(0), "layer 0 keys"),
    (lambda p: p.keys[0][:, :, :-1], "layer 0 keys"),
    (lambda p: p.keys[0].half(), "float32"),
    (lambda p: p.keys[0][:, :1], "layer 0 keys"),
])
def test_validate_names_expected_and_got(breakage, expected):
    p = packet()
    p.keys = (breakage(p), *p.keys[1:])
    with pytest.raises(PacketError, match=expected) as info:
        p.validate()
    assert "expected" in str(info.value) and "got" in str(info.value)


def test_validate_rejects_wrong_layer_count_mask_and_ids():
    p = packet()
    p.values = p.values[:1]
    with pytest.raises(PacketError, match="2 layers"):
        p.validate()
    p = packet()
    p.mask = torch.full_like(p.mask, 2)
    with pytest.raises(PacketError, match="mask values"):
        p.validate()
    p = packet()
    p.token_ids = p.token_ids + 10_000
    with pytest.raises(PacketError, match="token ids"):
        p.validate()


def test_sliding_layers_hold_only_the_window():
    s = spec(num_layers=3, sliding=(0, 2), window=4)
    assert [s.kept_tokens(layer, 10) for layer in range(3)] == [3, 10, 3]
    p = packet(s, tokens=10).validate()
    assert [k.shape[2] for k in p.keys] == [3, 10, 3]
    assert p.nbytes == s.kv_bytes(10)



def test_a_spec_says_whether_any_layer_slides():
    assert not spec().has_sliding_window
    assert spec(num_layers=3, sliding=(1,), window=4).has_sliding_window  # one sliding layer is enough
    restored = ModelSpec.from_json(spec(sliding=(0,), window=4).to_json())
    assert restored.has_sliding_window and "has_sliding_window" not in restored.to_json()  # derived, not sent

def test_chain_ids_name_the_whole_prefix():
    root = packet(tokens=4, seed=1)
    codec.encode(root)  # records root.checksum, which the child pins
    child = packet(tokens=3, seed=2, parent=root)
    assert child.parent == root.id and child.start == root.end == 4
    # same tokens under another parent -> another id
    other_root = packet(tokens=4, seed=9)
    codec.encode(other_root)
    twin = packet(tokens=3, seed=2, parent=other_root)
    assert torch.equal(twin.token_ids, child.token_ids) and twin.id != child.id


def test_join_rebuilds_the_full_context():
    s = spec(num_layers=2, sliding=(1,), window=4)
    root = packet(s, tokens=5, seed=1)
    codec.encode(root)
    child = packet(s, tokens=2, seed=2, parent=root)
    codec.encode(child)
    whole = join([root, child]).validate()
    assert whole.length == 7 and whole.start == 0 and whole.parent is None
    assert torch.equal(whole.token_ids, torch.cat([root.token_ids, child.token_ids], 1))
    assert torch.equal(whole.keys[0], torch.cat([root.keys[0], child.keys[0]], 2))  # full layer: everything
    # sliding layer: the last window-1 = 3 tokens of root(3 kept) + child(2) -> last 1 of root, both of child
    assert torch.equal(whole.keys[1], torch.cat([root.keys[1][:, :, -1:], child.keys[1]], 2))


def test_join_refuses_broken_chains():
    root = packet(tokens=4, seed=1)
    codec.encode(root)
    child = packet(tokens=2, seed=2, parent=root)
    stranger = packet(tokens=4, seed=3)
    codec.encode(stranger)
    with pytest.raises(ChainError, match="names parent"):
        join([stranger, child])
    replaced = packet(tokens=4, seed=1)
    replaced.created_at += 1  # same id, other bytes
    codec.encode(replaced)
    with pytest.raises(ChainError, match="expects parent bytes"):
        join([replaced, child])
    with pytest.raises(ChainError, match="empty"):
        join([])


def test_join_refuses_other_models():
    root = packet(tokens=4, seed=1)
    codec.encode(root)
    child = packet(spec(fingerprint="0" * 64), tokens=2, seed=2, parent=root)
    with pytest.raises(ModelMismatchError, match="different weights"):
        join([root, child])


def test_kv_bytes_formula():
    s = spec(num_layers=30, kv_heads=3, head_dim=64)
    assert s.kv_bytes(1000) == 2 * 30 * 3 * 64 * 1000 * 4
    assert spec(num_layers=30, kv_heads=3, head_dim=64, dtype="bfloat16").kv_bytes(1000) == 2 * 30 * 3 * 64 * 1000 * 2


def test_a_mask_of_the_wrong_shape_is_refused():
    p = packet(tokens=5, batch=2)
    p.mask = torch.ones(2, 4, dtype=torch.uint8)
    with pytest.raises(PacketError, match=r"mask must be a uint8 tensor \[B, T\]=\[2, 5\]"):
        p.validate()


def test_a_model_mismatch_is_told_in_one_readable_line():
    """A 30-layer spec against one whose layer kinds differ names the first differing layer, not two 30-item
    tuples; a fingerprint shows its first 12 digits."""
    ours = spec(num_layers=30, window=8, sliding=tuple(range(0, 30, 2)))
    theirs = spec(num_layers=30, window=8, sliding=tuple(range(1, 30, 2)), fingerprint="a" * 64, kv_heads=4)
    with pytest.raises(ModelMismatchError) as refused:
        ours.check_same_model(theirs)
    message = str(refused.value)
    assert "layer_kinds: entry 0 of 30: 'full_attention' != 'sliding_attention'" in message  # packet != receiver
    assert "num_kv_heads: 4 != 2" in message and "fingerprint: aaaaaaaaaaaa != ffffffffffff" in message
    assert "full_attention', 'sliding_attention'" not in message and len(message) < 400
    assert spec(num_layers=8).differences(spec(num_layers=9)) == ["num_layers: 8 != 9",
                                                                  "layer_kinds: 8 entries != 9 entries"]
