"""Decoding never crashes: whatever a forger writes, decode returns a valid packet or raises a PacketError.

Hypothesis takes valid packets of every encoding (fp32, fp16, bf16, int8, int4),
signed and unsigned, and mutates their header -- every metadata field, every model
spec field, every tensor-table entry, the signature, the ``__metadata__`` object --
to values of every JSON type (null, bools, ints small, negative and huge, floats
with NaN and infinities, strings such as "NaN" and "F32", lists, nested objects),
or deletes them, or adds unknown ones. It then recomputes the checksum and, where the
test holds the key, the signature, as a careful forger would; so the checks behind
the checksum are what is exercised. Other properties write random bytes into the
data (resealed: decode must refuse NaN/Inf K/V) and into the raw header (not resealed).

Every example must end in a packet that validates and holds only finite K/V, or a
``PacketError``; anything else (a ``TypeError``, a hang past the deadline) fails.

Examples per property: ``KVWIRE_FUZZ_EXAMPLES`` (default 150, deterministic). Run it
long, with fresh random examples and hypothesis' example database, with::

    make test-fuzz                                   # KVWIRE_FUZZ_EXAMPLES=20000
    KVWIRE_FUZZ_EXAMPLES=100000 pytest tests/wire/test_codec_fuzz.py
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import blake3
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.helpers import packet, spec
from kvwire import PacketError
from kvwire.wire import codec, quant, signing
from kvwire.wire.codec import CodecOptions

EXAMPLES = int(os.environ.get("KVWIRE_FUZZ_EXAMPLES", "150"))
LONG = "KVWIRE_FUZZ_EXAMPLES" in os.environ
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=10),  # a hang guard, not a speed target: a decode here takes about 1 ms
    derandomize=not LONG,  # the default suite tries the same examples every run
    database=None if not LONG else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
KEY = b"fuzz-key-0123456789abcdef"
SPEC = spec(num_layers=2, kv_heads=2, head_dim=4, sliding=(1,), window=3)


@pytest.fixture(autouse=True)
def no_codec_environment(monkeypatch):
    for name in ("KVWIRE_SIGNING_KEY", "KVWIRE_ENCODING", "KVWIRE_REQUIRE_SIGNATURE", "KVWIRE_MAX_PACKET_BYTES",
                 "KVWIRE_CHECK_FINITE"):
        monkeypatch.delenv(name, raising=False)


def _bases() -> dict[tuple[str, bool], bytes]:
    parent = packet(SPEC, tokens=3, batch=2)
    codec.encode(parent)  # gives it a checksum
    child = packet(SPEC, tokens=4, batch=2, parent=parent)  # parent fields are strings, not null
    return {(encoding, signed): codec.encode(child if signed else parent,
                                             options=CodecOptions(encoding=encoding, key=KEY if signed else None))
            for encoding in quant.ENCODINGS for signed in (False, True)}


BASES = _bases()


# -- JSON values of every type -------------------------------------------------------------------------

SPECIAL = st.sampled_from([
    0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**53 + 1, 2**62, 2**63, 2**64, 10**30, -10**30, 10**400, -(10**4000),
    float("nan"), float("inf"), float("-inf"), -0.0, 1e308, 5e-324, 1.5,
    "", "NaN", "nan", "inf", "-Infinity", "1e309", "0", "F32", "F16", "BF16", "I64", "U8", "F64", "fp32", "int8",
    "int4", "causal", "segment", "applied", "stripped", "full_attention", "sliding_attention", "float32", "0" * 64,
    "f" * 64, "F" * 64, "blake3", "kvwire.packet", "hmac-sha256:" + "0" * 16 + ":" + "0" * 64, "\x00", "é" * 3,
])
HUGE = st.sampled_from([2**63, 2**64, 10**30, -(10**30), 10**400, -(10**400), 10**4000, float("inf"), float("nan")])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**80), max_value=2**80)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | SPECIAL | HUGE)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=4),
                    max_leaves=8)


# -- where a header can be mutated -----------------------------------------------------------------------


def split(data: bytes) -> tuple[dict, dict, dict, bytes]:
    """(__metadata__ without kvwire, kvwire metadata, tensor table, data bytes) of an encoded packet."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    extra = header.pop("__metadata__")
    meta = json.loads(extra.pop("kvwire"))
    return extra, meta, header, data[8 + n :]


def paths(data: bytes) -> list[tuple]:
    """Every field of the header, as a path into {"extra", "meta", "table"} (plus new names to add)."""
    extra, meta, table, _ = split(data)
    out: list[tuple] = [("extra", name) for name in extra] + [("extra", "kvwire"), ("extra", "unknown")]
    out += [("meta",), ("meta", "unknown")] + [("meta", name) for name in meta]
    out += [("meta", "spec", name) for name in meta["spec"]] + [("meta", "spec", "unknown")]
    out += [("meta", "spec", "rope", name) for name in meta["spec"]["rope"]]
    out += [("meta", "spec", "layer_kinds", i) for i in range(len(meta["spec"]["layer_kinds"]))]
    out += [("table",), ("table", "unknown")]
    for name, entry in table.items():
        out += [("table", name), ("table", name, "unknown")] + [("table", name, field) for field in entry]
        out += [("table", name, "shape", i) for i in range(len(entry["shape"]))]
        out += [("table", name, "data_offsets", i) for i in range(2)]
    return out


def _areas() -> list[list[tuple]]:
    """Paths grouped by area (signature and metadata string, metadata, spec, tensor table), each area
    equally likely: the table has ten times more paths than the metadata but no more ways to fail."""
    every = sorted({path for data in BASES.values() for path in paths(data)}, key=repr)
    groups: dict[str, list[tuple]] = {}
    for path in every:
        area = "spec" if path[:2] == ("meta", "spec") else path[0]
        groups.setdefault(area, []).append(path)
    return list(groups.values())


PATH = st.sampled_from(_areas()).flatmap(st.sampled_from)


def mutate(parts: dict, path: tuple, delete: bool, value) -> None:
    """Set (or delete) ``path`` in ``parts``; a path whose parent a previous mutation replaced is skipped."""
    *parent_path, last = path
    node = parts
    for step in parent_path:
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and step < len(node):
            node = node[step]
        else:
            return
    if isinstance(node, dict) and isinstance(last, str):  # (a list index into what an edit made a dict: skipped)
        if delete and node is not parts:  # a whole header part is replaced, never removed
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        if delete:
            del node[last]
        else:
            node[last] = value


def assemble(extra, meta, table, data: bytes, *, reseal: bool, sign: bool, add_meta: bool = True) -> bytes:
    """Header + data as codec writes them: the metadata object serialized into ``extra["kvwire"]``
    (``add_meta``), the checksum recomputed (``reseal``) and the MAC too (``sign``)."""
    if reseal and isinstance(meta, dict):
        meta = dict(meta)
        meta.pop("checksum", None)
        hasher = blake3.blake3(codec._CHECKSUM_PREFIX)
        hasher.update(codec._canonical({"meta": meta, "tensors": table}))
        hasher.update(data)
        meta["checksum"] = hasher.hexdigest()
    sign = sign and signing.FIELD in extra and isinstance(table, dict)  # a header that is not an object: unsigned
    metadata = {signing.FIELD: signing.placeholder(KEY)} if sign else {}  # first, as a zero MAC
    metadata.update({k: v for k, v in extra.items() if not (sign and k == signing.FIELD)})
    if add_meta:
        metadata["kvwire"] = json.dumps(meta, sort_keys=True)
    header = {"__metadata__": metadata, **table} if isinstance(table, dict) else table
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = len(raw).to_bytes(8, "little") + raw
    if sign:
        prefix = signing.sign(prefix, [data], KEY)
    return prefix + data


def assert_valid_or_refused(data: bytes, options: CodecOptions) -> None:
    try:
        decoded = codec.decode(data, options=options)
    except PacketError:
        return
    decoded.validate()
    for tensor in (*decoded.keys, *decoded.values):
        assert bool(torch.isfinite(tensor).all()), "a packet with non-finite K/V was returned"


BASE_KEYS = sorted(BASES)


@FUZZ
@given(base=st.sampled_from(BASE_KEYS), edits=st.lists(st.tuples(PATH, st.booleans(), JSON),
                                                      min_size=1, max_size=3),
       verify=st.booleans())
def test_mutated_headers_decode_or_raise_packet_errors(base, edits, verify):
    encoding, signed = base
    extra, meta, table, data = split(BASES[base])
    parts = {"extra": extra, "meta": meta, "table": table}
    for path, delete, value in edits:
        mutate(parts, path, delete, value)
    edited = {path[:2] for path, _, _ in edits}
    forged = assemble(parts["extra"], parts["meta"], parts["table"], data,
                      reseal=("meta", "checksum") not in edited,  # an edited checksum stays as edited
                      sign=signed and ("extra", signing.FIELD) not in edited,
                      add_meta=("extra", "kvwire") not in edited)  # else the edit replaced the metadata string
    assert_valid_or_refused(forged, CodecOptions(key=KEY if signed and verify else None))


@FUZZ
@given(base=st.sampled_from(BASE_KEYS), at=st.integers(min_value=0), raw=st.binary(min_size=1, max_size=8),
       special=st.sampled_from([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff", b"\x00\x7e",
                                b"\x00\x7c", b"\xff\xff\x7f\x7f"]), use_special=st.booleans())
def test_poisoned_data_is_refused_or_finite(base, at, raw, special, use_special):
    """Bytes written into K/V, codes or quantization statistics (NaN, Inf, huge, random), resealed."""
    encoding, signed = base
    extra, meta, table, data = split(BASES[base])
    payload = special if use_special else raw
    at = at % max(1, len(data) - len(payload) + 1)
    data = data[:at] + payload + data[at + len(payload):]
    forged = assemble(extra, meta, table, data, reseal=True, sign=signed)
    assert_valid_or_refused(forged, CodecOptions(key=KEY if signed else None))


@FUZZ
@given(base=st.sampled_from(BASE_KEYS), at=st.integers(min_value=0), raw=st.binary(max_size=16),
       cut=st.booleans())
def test_raw_header_bytes_decode_or_raise_packet_errors(base, at, raw, cut):
    """Bytes overwritten (or the buffer cut) anywhere in the length prefix and header, not resealed."""
    data = BASES[base]
    n = 8 + int.from_bytes(data[:8], "little")
    at %= n
    forged = data[:at] + raw if cut else data[:at] + raw + data[at + len(raw):]
    assert_valid_or_refused(forged, CodecOptions(key=KEY if base[1] else None))


ONE_OF_EACH = [None, True, False, 0, -1, 2**64, 10**400, 1.5, float("nan"), float("-inf"), "", "NaN", "F32",
               "0" * 64, [], [1, "a"], {}, {"a": {"b": [None]}}]


def test_every_field_with_one_value_of_every_json_type():
    """Exhaustive and deterministic: each header path of each base packet set to each value above
    (or deleted), resealed and re-signed. What the random properties find by chance, this finds always."""
    failures = []
    for index, path in enumerate(sorted({p for data in BASES.values() for p in paths(data)}, key=repr)):
        base = BASE_KEYS[index % len(BASE_KEYS)]
        if path not in paths(BASES[base]):
            base = next(b for b in BASE_KEYS if path in paths(BASES[b]))
        for value in [*ONE_OF_EACH, "delete"]:
            extra, meta, table, data = split(BASES[base])
            parts = {"extra": extra, "meta": meta, "table": table}
            mutate(parts, path, value == "delete", value)
            forged = assemble(parts["extra"], parts["meta"], parts["table"], data,
                              reseal=path[:2] != ("meta", "checksum"),
                              sign=base[1] and path != ("extra", signing.FIELD), add_meta=path != ("extra", "kvwire"))
            try:
                assert_valid_or_refused(forged, CodecOptions(key=KEY if base[1] else None))
            except Exception as err:  # noqa: BLE001 - collected, reported together below
                failures.append(f"{base} {path} = {value!r}: {type(err).__name__}: {err}")
    assert failures == []


def test_the_fuzzer_reaches_past_the_checksum():
    """Resealed edits of harmless fields decode: the checks behind the checksum are what the fuzz tests."""
    for (encoding, signed), data in BASES.items():
        extra, meta, table, payload = split(data)
        meta["producer"] = "mallory"
        forged = assemble(extra, meta, table, payload, reseal=True, sign=signed)
        assert codec.decode(forged, options=CodecOptions(key=KEY if signed else None)).producer == "mallory"
