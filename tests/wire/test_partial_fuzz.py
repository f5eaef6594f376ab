"""Partial-layer packets are untrusted bytes too: the codec fuzz (tests/wire/test_codec_fuzz.py) applied to
version-3 packets. Every header field -- the ``partial`` metadata and its ``layers`` and
``hidden_size``, the ``hidden.l`` table entries -- set to values of every JSON type, deleted, or
joined by unknown ones, resealed and re-signed: each forged packet decodes to a valid packet
(finite K/V and hidden states) or raises a PacketError."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.wire import test_codec_fuzz as fuzz
from kvwire.wire import codec, quant, signing
from kvwire.wire.codec import CodecOptions


def _bases() -> dict[tuple[str, bool], bytes]:
    """Partial packets over the fuzz spec (2 layers, layer 1 sliding): layer 0 shipped, the hidden
    state entering layer 1 shipped (hidden size 5)."""
    full = fuzz.packet(fuzz.SPEC, tokens=4, batch=2)
    g = torch.Generator().manual_seed(1)
    partial = full.with_provenance(keys=full.keys[:1], values=full.values[:1], layers=(0,),
                                   hidden={1: torch.randn(2, 4, 5, generator=g)}).validate()
    return {(encoding, signed): codec.encode(partial, options=CodecOptions(encoding=encoding,
                                                                          key=fuzz.KEY if signed else None))
            for encoding in quant.ENCODINGS for signed in (False, True)}


BASES = _bases()
BASE_KEYS = sorted(BASES)


def paths(data: bytes) -> list[tuple]:
    out = fuzz.paths(data)
    out += [("meta", "partial", name) for name in ("layers", "hidden_size", "unknown")]
    out += [("meta", "partial", "layers", 0)]
    return out


PATHS = sorted({p for data in BASES.values() for p in paths(data)}, key=repr)


def assert_valid_or_refused(data: bytes, options: CodecOptions) -> None:
    fuzz.assert_valid_or_refused(data, options)
    try:
        decoded = codec.decode(data, options=options)
    except fuzz.PacketError:
        return
    for hidden in (decoded.hidden or {}).values():
        assert bool(torch.isfinite(hidden).all()), "a packet with non-finite hidden states was returned"


def forge(base, edits) -> bytes:
    extra, meta, table, data = fuzz.split(BASES[base])
    parts = {"extra": extra, "meta": meta, "table": table}
    for path, delete, value in edits:
        fuzz.mutate(parts, path, delete, value)
    edited = {path[:2] for path, _, _ in edits}
    return fuzz.assemble(parts["extra"], parts["meta"], parts["table"], data,
                         reseal=("meta", "checksum") not in edited,
                         sign=base[1] and ("extra", signing.FIELD) not in edited,
                         add_meta=("extra", "kvwire") not in edited)


def test_the_bases_are_partial_and_decode():
    for base, data in BASES.items():
        decoded = codec.decode(data, options=CodecOptions(key=fuzz.KEY if base[1] else None))
        assert decoded.layers == (0,) and sorted(decoded.hidden) == [1], base


def test_every_partial_field_with_one_value_of_every_json_type():
    failures = []
    for index, path in enumerate(PATHS):
        base = BASE_KEYS[index % len(BASE_KEYS)]
        for value in [*fuzz.ONE_OF_EACH, "delete"]:
            try:
                assert_valid_or_refused(forge(base, [(path, value == "delete", value)]),
                                        CodecOptions(key=fuzz.KEY if base[1] else None))
            except Exception as err:  # noqa: BLE001 - collected, reported together below
                failures.append(f"{base} {path} = {value!r}: {type(err).__name__}: {err}")
    assert failures == []


@fuzz.FUZZ
@given(base=st.sampled_from(BASE_KEYS), edits=st.lists(st.tuples(st.sampled_from(PATHS), st.booleans(), fuzz.JSON),
                                                      min_size=1, max_size=3))
def test_mutated_partial_headers_decode_or_raise_packet_errors(base, edits):
    assert_valid_or_refused(forge(base, edits), CodecOptions(key=fuzz.KEY if base[1] else None))


@fuzz.FUZZ
@given(base=st.sampled_from(BASE_KEYS), at=st.integers(min_value=0),
       special=st.sampled_from([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\x7f\x7f"]))
def test_poisoned_hidden_states_are_refused_or_finite(base, at, special):
    extra, meta, table, data = fuzz.split(BASES[base])
    begin, stop = table["hidden.1"]["data_offsets"]
    at = begin + (at % ((stop - begin) // 4)) * 4
    forged = fuzz.assemble(extra, meta, table, data[:at] + special + data[at + 4:], reseal=True, sign=base[1])
    assert_valid_or_refused(forged, CodecOptions(key=fuzz.KEY if base[1] else None))
