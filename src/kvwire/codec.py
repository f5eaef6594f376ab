"""Packet <-> bytes and files, in the safetensors format. No pickle anywhere.

A packet is one safetensors buffer (any safetensors reader can open it)::

    [8 bytes little-endian N][N bytes JSON header, space-padded to 8][data]

    header = {"__metadata__": {["kvwire.signature": "hmac-sha256:<key id>:<mac>",]
                               "kvwire": "<JSON metadata>"},
              "token_ids": {"dtype": "I64", "shape": [B, T],          "data_offsets": [a, b]},
              "keys.0":    {"dtype": "F32", "shape": [B, H, T_0, D],  "data_offsets": [b, c]},
              "values.0":  ...,  ... "keys.{L-1}", "values.{L-1}",
              "mask":      {"dtype": "U8",  "shape": [B, T],          "data_offsets": [y, z]}}

Tensors are laid out by item size (8, 4, 2, then 1 byte) so each starts aligned.

**Encodings** (:mod:`kvwire.quant`): ``fp32``, ``fp16``, ``bf16`` store K/V as that
float type; ``int8`` and ``int4`` store uint8 codes plus fp32 statistics
(``keys.L.scale``, ``keys.L.min``, ``values.L.scale``, ``values.L.min``). The default
is the spec's own dtype: lossless, and decoded without a copy. Decoding always
returns tensors of the spec's dtype; the metadata field ``encoding`` says which was
used, and the tensor table must be exactly the one that encoding, the spec and
``[B, T]`` imply (names, dtypes, shapes).

**Checksum**: the metadata holds ``checksum``, blake3 over the canonical JSON of
(metadata without the checksum, tensor table) followed by the encoded data bytes.

**Signature** (with a shared key, see :class:`CodecOptions` and :mod:`kvwire.signing`):
HMAC-SHA256 over every byte of the packet, the MAC's own digits read as zeros, kept
first in ``__metadata__`` under ``kvwire.signature``. With a key configured, unsigned,
altered and foreign-key packets are refused; without one, signed packets decode and
a warning is logged.

Decoding treats the bytes as untrusted, in this order: total size <= ``max_bytes``;
header length bounded; header JSON; signature checked (when a key is configured)
over the whole buffer; metadata field types; model spec; tensor table (names,
dtypes, shapes and offsets against the encoding, no holes, overlap or trailing
bytes); the size of the decoded tensors (<= ``max_bytes``, and at most 8x the input
since every stored byte is checked to be present); checksum. Only then are tensors
built -- zero-copy views of the buffer (an ``mmap`` for files) when the encoding is
the spec's dtype, dequantized copies otherwise -- and the packet validated against
its spec. Anything wrong raises a :class:`~kvwire.errors.PacketError` subclass
naming the problem; a packet is never returned from bad bytes.

Format version 2 added ``encoding`` and signatures; version-1 packets (always the
spec's dtype, unsigned) are still read.

**Partial-layer packets** (:mod:`kvwire.partial`) are written as format version 3: the
metadata has one more field, ``"partial": {"layers": [l, ...], "hidden_size": H}``; the
table holds the K/V tensors of those layers only (``keys.l``, ``values.l``, or their
integer encoding) and ``hidden.l`` (the spec's dtype, ``[B, T, H]``, never quantized) for
each layer ``l`` that starts a run of layers the receiver recomputes. Both are checked
with the rest of the table, and count toward the decoded size. Ordinary packets are
still written as version 2, byte for byte as before.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from . import partial, quant, signing
from .atomic import atomic_write
from .codec_options import (ENV_ENCODING, ENV_MAX_PACKET_BYTES, ENV_REQUIRE_SIGNATURE, MAX_PACKET_BYTES,
                            CodecOptions, options_or_env)
from .errors import ChecksumError, CorruptPacketError, PacketError, PacketTooLargeError
from .packet import Packet
from .quant import ENCODINGS, Encoding
from .spec import ModelSpec

__all__ = ["CodecOptions", "Envelope", "FORMAT", "FORMAT_VERSION", "MAX_HEADER_BYTES", "MAX_PACKET_BYTES",
           "ENV_ENCODING", "ENV_MAX_PACKET_BYTES", "ENV_REQUIRE_SIGNATURE", "atomic_write", "decode", "encode",
           "load", "map_file", "peek", "save"]


FORMAT = "kvwire.packet"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2, 3)  # 3: partial-layer packets
CHECKSUM_ALGORITHM = "blake3"
MAX_HEADER_BYTES = 64 * 1024 * 1024  # token ids live in tensors, so real headers are a few KB
MAX_SPEC_DEPTH = 8  # JSON nesting of a model spec (rope parameters by layer type need 3)


_CHECKSUM_PREFIX = b"kvwire-packet-v1\0"

# safetensors dtype codes <-> torch dtypes this format may carry
_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "U8": torch.uint8,
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

# metadata field -> accepted JSON types (checked before use); version 1 had no "encoding"
_META_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "format_version": (int,),
    "spec": (dict,),
    "start": (int,),
    "attention": (str,),
    "rotary": (str,),
    "parent": (str, type(None)),
    "parent_checksum": (str, type(None)),
    "producer": (str,),
    "session": (str,),
    "round": (int,),
    "version": (int,),
    "created_at": (float, int),
    "checksum_algorithm": (str,),
    "checksum": (str,),
    "encoding": (str,),
}


@dataclass(frozen=True)
class Envelope:
    """What a packet's header says about its bytes (see :func:`peek`)."""

    format_version: int
    encoding: str
    checksum: str
    key_id: str | None  # the signer's key id; None if unsigned
    encoded_bytes: int  # the whole packet
    decoded_bytes: int  # K/V bytes once decoded to the spec's dtype
    parent: str | None = None  # the id of the packet this one continues
    fingerprint: str = ""  # the weights that made it

    @property
    def signed(self) -> bool:
        return self.key_id is not None


# -- encoding ------------------------------------------------------------------------------------


def encode(packet: Packet, *, encoding: Encoding | None = None, key: bytes | str | None = None,
           options: CodecOptions | None = None) -> bytes:
    """Serialize a packet to safetensors bytes (one copy of the tensors, or their encoding).

    ``encoding`` and ``key`` override ``options`` (default: :meth:`CodecOptions.from_env`).
    Records the checksum on ``packet.checksum`` so a child packet can name it.
    """
    header, buffers = _layout(packet, options_or_env(options, encoding=encoding, key=key))
    return b"".join([header, *buffers])


def save(packet: Packet, path: str | os.PathLike[str], *, encoding: Encoding | None = None,
         key: bytes | str | None = None, options: CodecOptions | None = None) -> Path:
    """Write a packet to ``path`` atomically: a reader sees the old file or the whole new one."""
    header, buffers = _layout(packet, options_or_env(options, encoding=encoding, key=key))
    return atomic_write(Path(path), [header, *buffers])


def _layout(packet: Packet, options: CodecOptions) -> tuple[bytes, list[memoryview]]:
    devices = {t.device for t in (packet.token_ids, packet.mask, *packet.keys, *packet.values)}
    if devices != {torch.device("cpu")}:
        raise PacketError(f"packet tensors are on {sorted(map(str, devices))}; packets are encoded from CPU memory",
                          "move it explicitly with packet.to('cpu') (device copies are explicit and counted)")
    packet.validate()
    encoding = options.encoding or quant.native_encoding(packet.spec.torch_dtype)
    # 8-byte items first, then 4, 2, 1: every tensor starts aligned to its item size
    tensors = sorted(_encoded(packet, encoding), key=lambda item: -item[1].element_size())
    table: dict[str, dict[str, Any]] = {}
    buffers: list[memoryview] = []
    offset = 0
    for name, tensor in tensors:
        data = _as_bytes(tensor)
        table[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + data.nbytes]}
        buffers.append(data)
        offset += data.nbytes
    if 8 + offset > options.max_bytes:
        raise PacketTooLargeError(f"the encoded packet would be {8 + offset:,} bytes, over the "
                                  f"{options.max_bytes:,}-byte limit", "raise max_bytes, or use a smaller encoding")
    meta = _meta(packet, encoding)
    hasher = blake3.blake3(_CHECKSUM_PREFIX)
    hasher.update(_canonical({"meta": meta, "tensors": table}))
    for data in buffers:
        hasher.update(data)
    meta["checksum"] = packet.checksum = hasher.hexdigest()
    metadata = {}
    signing_key = options.key_bytes
    if signing_key is not None:  # first, so the MAC sits at a fixed offset; zeros until computed
        metadata[signing.FIELD] = signing.placeholder(signing_key)
    metadata["kvwire"] = json.dumps(meta, sort_keys=True)
    header = json.dumps({"__metadata__": metadata, **table}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # keep the data 8-byte aligned
    prefix = len(header).to_bytes(8, "little") + header
    if signing_key is not None:
        prefix = signing.sign(prefix, buffers, signing_key)
    return prefix, buffers


def _encoded(packet: Packet, encoding: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield "token_ids", packet.token_ids
    for layer, k, v in zip(packet.layer_indices, packet.keys, packet.values):
        try:
            yield from quant.encode_layer(encoding, layer, k, v).items()
        except ValueError as err:
            hint = ("use int8, which has no head_dim constraint" if "head_dim" in str(err) else
                    "use bf16 (fp32's range, half the bytes) or fp32" if encoding == "fp16" else
                    "use fp32 or bf16: integer codes need finite values in a finite range")
            raise PacketError(f"cannot encode layer {layer} as {encoding}: {err}", hint) from None
    yield "mask", packet.mask
    for layer, hidden in sorted((packet.hidden or {}).items()):
        yield partial.hidden_name(layer), hidden


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu":
        raise PacketError(f"a packet tensor is on {tensor.device}; packets are encoded from CPU memory",
                          "move it explicitly with packet.to('cpu') (device copies are explicit and counted)")
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _meta(packet: Packet, encoding: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "spec": packet.spec.to_json(),
        "start": packet.start,
        "attention": packet.attention,
        "rotary": packet.rotary,
        "parent": packet.parent,
        "parent_checksum": packet.parent_checksum,
        "producer": packet.producer,
        "session": packet.session,
        "round": packet.round,
        "version": packet.version,
        "created_at": float(packet.created_at),
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "encoding": encoding,
        **({"format_version": partial.FORMAT_VERSION, partial.META_FIELD: partial.meta(packet.layers, packet.hidden)}
           if packet.is_partial else {}),
    }


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# -- decoding ------------------------------------------------------------------------------------


@dataclass
class _Opened:
    """A packet whose header, table and (optionally) signature and checksum were checked."""

    buf: memoryview
    data_start: int
    table: dict[str, Any]
    meta: dict[str, Any]
    spec: ModelSpec
    envelope: Envelope


def decode(data: bytes | bytearray | memoryview | mmap.mmap, *, key: bytes | str | None = None,
           require_signature: bool | None = None, max_bytes: int | None = None,
           options: CodecOptions | None = None) -> Packet:
    """Parse and verify untrusted bytes; return a packet with tensors of the spec's dtype.

    With the spec's own encoding the tensors are views of ``data`` (no copy). Keyword
    arguments override ``options`` (default: :meth:`CodecOptions.from_env`); see the
    module docstring for what is accepted with and without a key.
    """
    opened = _open(data, options_or_env(options, key=key, require_signature=require_signature, max_bytes=max_bytes),
                   verify=True)
    return _build(opened)


def load(path: str | os.PathLike[str], *, key: bytes | str | None = None, require_signature: bool | None = None,
         max_bytes: int | None = None, options: CodecOptions | None = None) -> Packet:
    """Read a packet file through ``mmap``: with the spec's encoding, tensors are views of the file."""
    options = options_or_env(options, key=key, require_signature=require_signature, max_bytes=max_bytes)
    return _build(_open(map_file(path, options.max_bytes), options, verify=True))


def peek(data: bytes | bytearray | memoryview | mmap.mmap, *, max_bytes: int = MAX_PACKET_BYTES) -> Envelope:
    """Read what a packet's header says (encoding, checksum, signer, sizes) without verifying
    the checksum or the signature and without building tensors. Structure is still checked."""
    return _open(data, CodecOptions(max_bytes=max_bytes), verify=False).envelope


def map_file(path: str | os.PathLike[str], max_bytes: int = MAX_PACKET_BYTES) -> mmap.mmap:
    """Map a packet file read-only (copy-on-write), refusing empty, missing and oversized files."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise CorruptPacketError(f"{path} is empty")
            if size > max_bytes:
                raise PacketTooLargeError(f"{path} is {size:,} bytes, over the {max_bytes:,}-byte limit",
                                          "raise max_bytes (KVWIRE_MAX_PACKET_BYTES) if the packet is trusted")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise CorruptPacketError(f"no packet file at {path}", "check the path") from None


def _open(data: Any, options: CodecOptions, *, verify: bool) -> _Opened:
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    total = buf.nbytes
    if total > options.max_bytes:
        raise PacketTooLargeError(f"packet is {total:,} bytes, over the {options.max_bytes:,}-byte limit",
                                  "raise max_bytes (KVWIRE_MAX_PACKET_BYTES) if the sender is trusted")
    if total < 8:
        raise CorruptPacketError(f"truncated packet: {total} bytes, a packet is at least 8")
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise CorruptPacketError(f"not a kvwire packet, or a corrupt one: header length {header_len} exceeds "
                                 f"the {MAX_HEADER_BYTES}-byte limit")
    if 8 + header_len > total:
        raise CorruptPacketError(f"truncated packet: header needs {header_len} bytes, only {total - 8} follow")
    header = _json(bytes(buf[8 : 8 + header_len]), "packet header")
    if not isinstance(header, dict):
        raise CorruptPacketError("packet header is not a JSON object")
    extra = header.pop("__metadata__", None)
    if not isinstance(extra, dict) or not isinstance(extra.get("kvwire"), str):
        raise CorruptPacketError("not a kvwire packet: safetensors data without kvwire metadata")
    unexpected = sorted(set(extra) - {"kvwire", signing.FIELD})
    if unexpected:
        raise CorruptPacketError(f"unexpected packet metadata entries {unexpected}")
    signer = signing.read_signer(buf, extra.get(signing.FIELD))
    if verify:  # authenticate before interpreting anything the metadata says
        signing.check(buf, signer, options.key_bytes)

    meta = _json(extra["kvwire"], "packet metadata")
    _check_meta(meta)
    spec = ModelSpec.from_json(meta["spec"])
    encoding = meta.get("encoding") or quant.native_encoding(spec.torch_dtype)  # version 1: the spec's dtype
    data_start = 8 + header_len
    plan = partial.read_meta(meta[partial.META_FIELD], spec.num_layers) if partial.META_FIELD in meta else None
    batch, tokens = _check_table(header, spec, encoding, total - data_start, plan)
    decoded = _decoded_bytes(spec, batch, tokens, plan)  # what dequantization allocates, from checked shapes
    if decoded > options.max_bytes:
        raise PacketTooLargeError(f"packet decodes to {decoded:,} bytes of K/V, over the {options.max_bytes:,}-byte "
                                  "limit", "raise max_bytes (KVWIRE_MAX_PACKET_BYTES) if the sender is trusted")

    claimed = meta.pop("checksum")
    if verify:
        hasher = blake3.blake3(_CHECKSUM_PREFIX)
        hasher.update(_canonical({"meta": meta, "tensors": header}))
        hasher.update(buf[data_start:])
        if hasher.hexdigest() != claimed:
            raise ChecksumError(
                f"packet checksum mismatch: header says {claimed[:16]}..., content hashes to "
                f"{hasher.hexdigest()[:16]}...",
                "the packet was corrupted or altered after it was written; fetch or rebuild it",
            )
    envelope = Envelope(meta["format_version"], encoding, claimed, signer.key_id if signer else None, total, decoded,
                        meta["parent"], spec.fingerprint)
    return _Opened(buf, data_start, header, meta, spec, envelope)


def _json(raw: bytes | str, what: str) -> Any:
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise CorruptPacketError(f"{what} is not valid JSON: {err}") from None


def _build(opened: _Opened) -> Packet:
    spec, meta, table = opened.spec, opened.meta, opened.table
    tensors = {name: _view(opened.buf, opened.data_start, entry) for name, entry in table.items()}
    tokens = int(tensors["token_ids"].shape[1])
    plan = partial.read_meta(meta[partial.META_FIELD], spec.num_layers) if partial.META_FIELD in meta else None
    keys, values = [], []
    for layer in (plan[0].reused if plan else range(spec.num_layers)):
        k, v = quant.decode_layer(opened.envelope.encoding, layer, tensors, spec.torch_dtype,
                                  spec.kept_tokens(layer, tokens))
        keys.append(k)
        values.append(v)
    packet = Packet(
        spec=spec,
        keys=tuple(keys),
        values=tuple(values),
        token_ids=tensors["token_ids"],
        mask=tensors["mask"],
        start=meta["start"],
        attention=meta["attention"],
        rotary=meta["rotary"],
        parent=meta["parent"],
        parent_checksum=meta["parent_checksum"],
        producer=meta["producer"],
        session=meta["session"],
        round=meta["round"],
        version=meta["version"],
        created_at=float(meta["created_at"]),
        checksum=opened.envelope.checksum,
        layers=plan[0].reused if plan else None,
        hidden={layer: tensors[partial.hidden_name(layer)] for layer in plan[0].hidden_layers} if plan else None,
    )
    try:
        return packet.validate()
    except CorruptPacketError:
        raise
    except Exception as err:  # a well-formed file that breaks the shape contract is still corrupt
        raise CorruptPacketError(str(err)) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _check_meta(meta: Any) -> None:
    if not isinstance(meta, dict):
        raise CorruptPacketError("packet metadata is not a JSON object")
    if meta.get("format") != FORMAT:
        raise CorruptPacketError(f"not a kvwire packet: format {meta.get('format')!r}, expected {FORMAT!r}")
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise CorruptPacketError(
            f"packet format version {version!r} is not supported (this kvwire reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))})",
            "use the kvwire version that wrote it, or re-create the packet",
        )
    fields = {name: types for name, types in _META_FIELDS.items() if version >= 2 or name != "encoding"}
    if version >= partial.FORMAT_VERSION:
        fields[partial.META_FIELD] = (dict,)
    missing = sorted(set(fields) - set(meta))
    extra = sorted(set(meta) - set(fields))
    if missing or extra:
        raise CorruptPacketError(f"packet metadata fields: missing {missing}, unexpected {extra}")
    for name, types in fields.items():
        value = meta[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise CorruptPacketError(f"packet metadata field {name!r} has type {type(value).__name__}")
    if not _shallow(meta["spec"], MAX_SPEC_DEPTH):  # deep JSON would blow the stack of later deep copies
        raise CorruptPacketError(f"packet model spec is nested deeper than {MAX_SPEC_DEPTH} levels")
    if meta["checksum_algorithm"] != CHECKSUM_ALGORITHM:
        raise CorruptPacketError(f"unsupported checksum algorithm {meta['checksum_algorithm']!r}")
    if "encoding" in meta and meta["encoding"] not in ENCODINGS:
        raise CorruptPacketError(f"unknown packet encoding {meta['encoding']!r} (this kvwire reads "
                                 f"{', '.join(ENCODINGS)})", "upgrade kvwire, or re-encode the packet")


def _shallow(obj: Any, limit: int) -> bool:
    """Whether JSON ``obj`` nests at most ``limit`` containers deep (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def _check_table(table: dict[str, Any], spec: ModelSpec, encoding: str, data_len: int,
                 plan: tuple[partial.LayerPlan, int] | None = None) -> tuple[int, int]:
    """Check every entry against the encoding's layout (and a partial packet's plan); return ``(B, T)``."""
    layers = plan[0].reused if plan else range(spec.num_layers)
    hidden = plan[0].hidden_layers if plan else ()
    want_count = 2 + len(layers) * quant.tensors_per_layer(encoding) + len(hidden)
    if abs(len(table) - want_count) > 16:  # do not build a huge name set for a hostile spec
        raise CorruptPacketError(f"packet has {len(table)} tensors; {spec.num_layers} layers in {encoding} need "
                                 f"{want_count}")
    expected = {"token_ids", "mask"} | {name for layer in layers
                                        for name in quant.layer_layout(encoding, layer, (1, 1, 0, 2))}
    expected |= {partial.hidden_name(layer) for layer in hidden}
    if set(table) != expected:
        missing, extra = sorted(expected - set(table)), sorted(set(table) - expected)
        raise CorruptPacketError(f"packet tensors: missing {missing[:4]}, unexpected {extra[:4]}")
    spans = []
    for name, entry in table.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CorruptPacketError(f"tensor {name!r}: entry must have dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _DTYPES:
            raise CorruptPacketError(f"tensor {name!r}: dtype {dtype!r} not allowed (allowed: {sorted(_DTYPES)})")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CorruptPacketError(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CorruptPacketError(f"tensor {name!r}: bad data_offsets {offsets!r}")
        begin, stop = offsets
        size = math.prod(shape) * _DTYPES[dtype].itemsize  # exact: Python ints do not overflow
        if not 0 <= begin <= stop <= data_len:
            raise CorruptPacketError(
                f"truncated packet: tensor {name!r} spans bytes {begin}..{stop}, but the data has {data_len}")
        if stop - begin != size:
            raise CorruptPacketError(f"tensor {name!r}: shape {shape} {dtype} needs {size} bytes, offsets give "
                                     f"{stop - begin}")
        spans.append((begin, stop, name))
    position = 0
    for begin, stop, name in sorted(spans):
        if begin != position:
            raise CorruptPacketError(f"tensor {name!r} starts at byte {begin}, expected {position} (hole or overlap)")
        position = stop
    if position != data_len:
        raise CorruptPacketError(f"packet has {data_len - position} trailing bytes after its tensors")

    ids = table["token_ids"]
    if len(ids["shape"]) != 2:
        raise CorruptPacketError(f"tensor 'token_ids': expected shape [B, T], got {ids['shape']}")
    batch, tokens = ids["shape"]
    layout: quant.Layout = {"token_ids": (torch.int64, (batch, tokens)), "mask": (torch.uint8, (batch, tokens))}
    try:
        for layer in layers:
            shape = (batch, spec.num_kv_heads, spec.kept_tokens(layer, tokens), spec.head_dim)
            layout.update(quant.layer_layout(encoding, layer, shape))
    except ValueError as err:
        raise CorruptPacketError(f"packet cannot be {encoding}: {err}") from None
    for layer in hidden:
        layout[partial.hidden_name(layer)] = (spec.torch_dtype, (batch, tokens, plan[1]))  # type: ignore[index]
    for name, (dtype, shape) in layout.items():
        entry = table[name]
        if _DTYPES[entry["dtype"]] != dtype or tuple(entry["shape"]) != shape:
            raise CorruptPacketError(f"tensor {name!r}: expected {_CODES[dtype]} {list(shape)} for a {encoding} "
                                     f"packet of [B, T]=[{batch}, {tokens}], got {entry['dtype']} {entry['shape']}")
    return batch, tokens


def _decoded_bytes(spec: ModelSpec, batch: int, tokens: int, plan: tuple[partial.LayerPlan, int] | None) -> int:
    """Bytes of the decoded tensors: K/V of the carried layers, plus a partial packet's hidden states."""
    if plan is None:
        return spec.kv_bytes(tokens, batch)
    itemsize = spec.torch_dtype.itemsize
    kv = sum(2 * batch * spec.num_kv_heads * spec.head_dim * spec.kept_tokens(layer, tokens) * itemsize
             for layer in plan[0].reused)
    return kv + len(plan[0].hidden_layers) * batch * tokens * plan[1] * itemsize


def _view(buf: memoryview, data_start: int, entry: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    begin, stop = entry["data_offsets"]
    raw = np.frombuffer(buf, dtype=np.uint8, count=stop - begin, offset=data_start + begin)
    if raw.ctypes.data % dtype.itemsize:  # misaligned (foreign writer): copy once
        raw = raw.copy()
    with warnings.catch_warnings():
        # Tensors viewing read-only bytes are never written: caches grow by torch.cat.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return flat.view(dtype).reshape(entry["shape"])
