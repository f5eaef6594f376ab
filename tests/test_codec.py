"""The codec: safetensors bytes and files, verified before any tensor is used."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from helpers import packet, spec
from kvwire import ChecksumError, CorruptPacketError, PacketError, codec


def assert_same(a, b):
    assert a.spec == b.spec and a.start == b.start and a.parent == b.parent
    assert (a.producer, a.session, a.round, a.version, a.created_at) == (b.producer, b.session, b.round, b.version,
                                                                        b.created_at)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.mask, b.mask)
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_bytes_round_trip(dtype):
    p = packet(spec(dtype=dtype, sliding=(1,), window=3), tokens=6, batch=2)
    data = codec.encode(p)
    q = codec.decode(data)
    assert_same(p, q)
    assert q.checksum == p.checksum and q.id == p.id


def test_file_round_trip_is_a_safetensors_file(tmp_path):
    p = packet(tokens=9)
    path = codec.save(p, tmp_path / "p.safetensors")
    assert_same(p, codec.load(path))
    with safe_open(path, framework="pt") as f:  # any safetensors reader can open a packet
        assert json.loads(f.metadata()["kvwire"])["format"] == "kvwire.packet"
        assert torch.equal(f.get_tensor("keys.1"), p.keys[1])


def test_decode_does_not_copy_tensors():
    p = packet(tokens=8)
    data = bytearray(codec.encode(p))
    q = codec.decode(data)
    before = q.keys[0].clone()
    data[-1 - q.mask.numel() - 4 * q.values[-1].numel() + 3] ^= 0xFF  # poke a byte inside values[-1]
    assert torch.equal(q.keys[0], before)
    assert not torch.equal(q.values[-1], p.values[-1])  # the tensor is a view of the buffer


def test_load_maps_the_file(tmp_path):
    p = packet(tokens=8)
    q = codec.load(codec.save(p, tmp_path / "p.kv"))
    # keys.0 and values.0 are adjacent views into one mapping, not separate allocations
    gap = q.values[0].data_ptr() - q.keys[0].data_ptr()
    assert gap == q.keys[0].numel() * q.keys[0].element_size()


def test_every_truncation_is_rejected():
    data = codec.encode(packet(tokens=3))
    for cut in range(len(data)):
        with pytest.raises(CorruptPacketError):
            codec.decode(data[:cut])


def test_flipped_data_byte_fails_the_checksum():
    data = bytearray(codec.encode(packet(tokens=3)))
    data[-10] ^= 0x01
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        codec.decode(bytes(data))


def _rewrite_header(data: bytes, edit) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def _edit_meta(field, value):
    def edit(header):
        meta = json.loads(header["__metadata__"]["kvwire"])
        meta[field] = value
        header["__metadata__"]["kvwire"] = json.dumps(meta)
    return edit


def test_tampered_metadata_fails_the_checksum():
    data = codec.encode(packet(tokens=3))
    with pytest.raises(ChecksumError):
        codec.decode(_rewrite_header(data, _edit_meta("start", 100)))
    with pytest.raises(ChecksumError):
        codec.decode(_rewrite_header(data, _edit_meta("producer", "mallory")))


@pytest.mark.parametrize("edit, message", [
    (_edit_meta("format_version", 99), "format version 99"),
    (_edit_meta("format", "other"), "not a kvwire packet"),
    (_edit_meta("start", "0"), "'start' has type str"),
    (_edit_meta("round", True), "'round' has type bool"),
    (lambda h: h["__metadata__"].pop("kvwire"), "without kvwire metadata"),
    (lambda h: h.pop("mask"), "missing \\['mask'\\]"),
    (lambda h: h.__setitem__("extra", {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}), "unexpected"),
    (lambda h: h["keys.0"].__setitem__("dtype", "F64"), "dtype 'F64' not allowed"),
    (lambda h: h["keys.0"].__setitem__("shape", [1, -2, 3, 4]), "bad shape"),
    (lambda h: h["keys.0"].__setitem__("data_offsets", [0, 10**12]), "truncated packet"),
    (lambda h: h["mask"].__setitem__("data_offsets", [0, h["mask"]["data_offsets"][1] - h["mask"]["data_offsets"][0]]),
     "hole or overlap"),
])
def test_malformed_headers_are_named(edit, message):
    data = codec.encode(packet(tokens=3))
    with pytest.raises(CorruptPacketError, match=message):
        codec.decode(_rewrite_header(data, edit))


def test_garbage_and_oversized_headers():
    with pytest.raises(CorruptPacketError, match="exceeds"):
        codec.decode((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(CorruptPacketError, match="not valid JSON"):
        codec.decode((4).to_bytes(8, "little") + b"{{{{")
    dup = b'{"a":1,"a":2}   '
    with pytest.raises(CorruptPacketError, match="duplicate"):
        codec.decode(len(dup).to_bytes(8, "little") + dup)


def test_trailing_bytes_are_rejected():
    with pytest.raises(CorruptPacketError, match="trailing"):
        codec.decode(codec.encode(packet(tokens=3)) + b"\0" * 8)


def test_a_plain_safetensors_file_is_not_a_packet(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, tmp_path / "plain.safetensors")
    with pytest.raises(CorruptPacketError, match="not a kvwire packet"):
        codec.load(tmp_path / "plain.safetensors")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(CorruptPacketError, match="empty"):
        codec.load(tmp_path / "empty")
    with pytest.raises(CorruptPacketError, match="no packet file"):
        codec.load(tmp_path / "missing")


def test_encode_refuses_an_invalid_packet():
    p = packet()
    p.keys = p.keys[:1]
    with pytest.raises(PacketError):
        codec.encode(p)


def test_no_pickle_anywhere():
    import pathlib

    import kvwire

    for source in pathlib.Path(kvwire.__file__).parent.rglob("*.py"):
        text = source.read_text()
        assert "import pickle" not in text and "torch.load(" not in text, source
