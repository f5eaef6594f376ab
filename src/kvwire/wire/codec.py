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

**Encodings** (:mod:`kvwire.wire.quant`): ``fp32``, ``fp16``, ``bf16`` store K/V as that
float type; ``int8`` and ``int4`` store uint8 codes plus fp32 statistics
(``keys.L.scale``, ``keys.L.min``, ``values.L.scale``, ``values.L.min``). The default
is the spec's own dtype: lossless, and decoded without a copy. Decoding always
returns tensors of the spec's dtype; the metadata field ``encoding`` says which was
used, and the tensor table must be exactly the one that encoding, the spec and
``[B, T]`` imply (names, dtypes, shapes).

**Checksum**: the metadata holds ``checksum``, blake3 over the canonical JSON of
(metadata without the checksum, tensor table) followed by the encoded data bytes.

**Signature** (with a shared key, see :class:`CodecOptions` and :mod:`kvwire.wire.signing`):
HMAC-SHA256 over every byte of the packet, the MAC's own digits read as zeros, kept
first in ``__metadata__`` under ``kvwire.signature``. With a key configured, unsigned,
altered and foreign-key packets are refused; without one, signed packets decode and
a warning is logged.

Decoding treats the bytes as untrusted, in this order (each value checked for its
JSON type and its range before it is used; :mod:`kvwire.wire.checks` lists them):

1. total size <= ``max_bytes``; header length bounded and present;
2. header JSON (valid UTF-8, no duplicate keys, bounded nesting), an object whose
   ``__metadata__`` holds ``kvwire`` (a string) and at most ``kvwire.signature``;
3. signature: its form, its fixed offset and, when a key is configured, the MAC over
   the whole buffer -- before anything the metadata says is believed;
4. metadata: every field present, of its type and in its range (format, version,
   start, round, version, created_at, hex digests, attention, rotary, encoding);
5. model spec: field types and ranges (layers, heads, head size, vocabulary, layer
   kinds, sliding window, fingerprint);
6. tensor table: names, dtypes, shapes (rank and every dimension bounded) and offsets
   against the encoding, no holes, overlap or trailing bytes;
7. the size of the decoded tensors (<= ``max_bytes``, and at most 8x the input since
   every stored byte is checked to be present);
8. checksum;
9. tensors built -- zero-copy views of the buffer (an ``mmap`` for files) when the
   encoding is the spec's dtype, dequantized copies otherwise;
10. finiteness: every layer's keys and values, after dequantization, hold no NaN or
    Inf (:class:`~kvwire.errors.NonFiniteError` names the layer, tensor and element;
    one summing pass, skipped with ``CodecOptions(check_finite=False)`` or
    ``KVWIRE_CHECK_FINITE=0`` for trusted senders);
11. the packet validated against its spec.

Anything wrong raises a :class:`~kvwire.errors.PacketError` subclass naming the
problem -- never a builtin exception, whatever the bytes (``tests/wire/test_codec_fuzz.py``);
a packet is never returned from bad bytes.

Format version 2 added ``encoding`` and signatures; version-1 packets (always the
spec's dtype, unsigned) are still read.

**Partial-layer packets** (:mod:`kvwire.wire.layers`) are written as format version 3: the
metadata has one more field, ``"partial": {"layers": [l, ...], "hidden_size": H}``; the
table holds the K/V tensors of those layers only (``keys.l``, ``values.l``, or their
integer encoding) and ``hidden.l`` (the spec's dtype, ``[B, T, H]``, never quantized) for
each layer ``l`` that starts a run of layers the receiver recomputes. Both are checked
with the rest of the table (step 6), count toward the decoded size (step 7), and the
hidden states are checked for finiteness with the K/V (step 10). Ordinary packets are
still written as version 2, byte for byte as before.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from . import layers as partial, quant, signing
from .atomic import atomic_write
from .checks import (CHECKSUM_ALGORITHM, CODES, DTYPES, FORMAT, FORMAT_VERSION, check_finite, check_meta,
                           check_table, parse_json)
from .options import (ENV_CHECK_FINITE, ENV_ENCODING, ENV_MAX_PACKET_BYTES, ENV_REQUIRE_SIGNATURE,
                            MAX_PACKET_BYTES, CodecOptions, options_or_env)
from ..errors import ChecksumError, CorruptPacketError, PacketError, PacketTooLargeError, reason
from .packet import Packet
from .quant import Encoding
from .spec import ModelSpec

__all__ = ["CodecOptions", "Envelope", "FORMAT", "FORMAT_VERSION", "MAX_HEADER_BYTES", "MAX_PACKET_BYTES",
           "ENV_CHECK_FINITE", "ENV_ENCODING", "ENV_MAX_PACKET_BYTES", "ENV_REQUIRE_SIGNATURE", "atomic_write",
           "decode", "encode", "load", "map_file", "peek", "save"]


MAX_HEADER_BYTES = 64 * 1024 * 1024  # token ids live in tensors, so real headers are a few KB


_CHECKSUM_PREFIX = b"kvwire-packet-v1\0"

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
        table[name] = {"dtype": CODES[tensor.dtype], "shape": list(tensor.shape),
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
    check_finite: bool = True


def decode(data: bytes | bytearray | memoryview | mmap.mmap, *, key: bytes | str | None = None,
           require_signature: bool | None = None, max_bytes: int | None = None, check_finite: bool | None = None,
           options: CodecOptions | None = None) -> Packet:
    """Parse and verify untrusted bytes; return a packet with tensors of the spec's dtype.

    With the spec's own encoding the tensors are views of ``data`` (no copy). Keyword
    arguments override ``options`` (default: :meth:`CodecOptions.from_env`); see the
    module docstring for what is accepted with and without a key.
    """
    opened = _open(data, options_or_env(options, key=key, require_signature=require_signature, max_bytes=max_bytes,
                                        check_finite=check_finite), verify=True)
    return _build(opened)


def load(path: str | os.PathLike[str], *, key: bytes | str | None = None, require_signature: bool | None = None,
         max_bytes: int | None = None, check_finite: bool | None = None, options: CodecOptions | None = None) -> Packet:
    """Read a packet file through ``mmap``: with the spec's encoding, tensors are views of the file."""
    options = options_or_env(options, key=key, require_signature=require_signature, max_bytes=max_bytes,
                             check_finite=check_finite)
    return _build(_open(map_file(path, options.max_bytes), options, verify=True))


def peek(data: bytes | bytearray | memoryview | mmap.mmap, *, max_bytes: int = MAX_PACKET_BYTES) -> Envelope:
    """Read what a packet's header says (encoding, checksum, signer, sizes) without verifying
    the checksum or the signature and without building tensors. Structure is still checked."""
    return _open(data, CodecOptions(max_bytes=max_bytes), verify=False).envelope


def map_file(path: str | os.PathLike[str], max_bytes: int = MAX_PACKET_BYTES) -> mmap.mmap:
    """Map a packet file read-only (copy-on-write), refusing missing, non-regular, empty and oversized files."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise CorruptPacketError(f"{path} is a directory, not a packet file", "give the path of a packet file")
        if not stat.S_ISREG(mode):  # a FIFO would block, a device has no size
            raise CorruptPacketError(f"{path} is not a regular file", "give the path of a packet file")
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
    except (OSError, ValueError) as err:  # unreadable, a name too long, a NUL in the path, ...
        raise CorruptPacketError(f"cannot read the packet file {path}: {reason(err)}") from None


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
    header = parse_json(bytes(buf[8 : 8 + header_len]), "packet header")
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

    meta = parse_json(extra["kvwire"], "packet metadata")
    check_meta(meta)
    spec = ModelSpec.from_json(meta["spec"])
    encoding = meta.get("encoding") or quant.native_encoding(spec.torch_dtype)  # version 1: the spec's dtype
    data_start = 8 + header_len
    plan = partial.read_meta(meta[partial.META_FIELD], spec.num_layers) if partial.META_FIELD in meta else None
    batch, tokens = check_table(header, spec, encoding, total - data_start, plan)
    decoded = partial.decoded_bytes(spec, batch, tokens, plan)  # what dequantization allocates, from checked shapes
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
    return _Opened(buf, data_start, header, meta, spec, envelope, options.check_finite)


def _build(opened: _Opened) -> Packet:
    spec, meta, table = opened.spec, opened.meta, opened.table
    tensors = {name: _view(opened.buf, opened.data_start, entry) for name, entry in table.items()}
    tokens = int(tensors["token_ids"].shape[1])
    plan = partial.read_meta(meta[partial.META_FIELD], spec.num_layers) if partial.META_FIELD in meta else None
    keys, values = [], []
    for layer in (plan[0].reused if plan else range(spec.num_layers)):
        k, v = quant.decode_layer(opened.envelope.encoding, layer, tensors, spec.torch_dtype,
                                  spec.kept_tokens(layer, tokens))
        if opened.check_finite:
            check_finite(layer, "keys", k, opened.envelope.encoding)
            check_finite(layer, "values", v, opened.envelope.encoding)
        keys.append(k)
        values.append(v)
    hidden = {layer: tensors[partial.hidden_name(layer)] for layer in plan[0].hidden_layers} if plan else None
    for layer, h in (hidden or {}).items():
        if opened.check_finite:
            check_finite(layer, "hidden state entering", h, spec.dtype)
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
        created_at=float(meta["created_at"]),  # finite and bounded: checked
        checksum=opened.envelope.checksum,
        layers=plan[0].reused if plan else None,
        hidden=hidden,
    )
    try:
        return packet.validate()
    except CorruptPacketError:
        raise
    except Exception as err:  # a well-formed file that breaks the shape contract is still corrupt
        raise CorruptPacketError(str(err)) from None


def _view(buf: memoryview, data_start: int, entry: dict[str, Any]) -> torch.Tensor:
    dtype = DTYPES[entry["dtype"]]
    begin, stop = entry["data_offsets"]
    raw = np.frombuffer(buf, dtype=np.uint8, count=stop - begin, offset=data_start + begin)
    if raw.ctypes.data % dtype.itemsize:  # misaligned (foreign writer): copy once
        raw = raw.copy()
    with warnings.catch_warnings():
        # Tensors viewing read-only bytes are never written: caches grow by torch.cat.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return flat.view(dtype).reshape(entry["shape"])
