"""Packet <-> bytes and files, in the safetensors format. No pickle anywhere.

A packet is one safetensors buffer (any safetensors reader can open it)::

    [8 bytes little-endian N][N bytes JSON header, space-padded to 8][data]

    header = {"__metadata__": {"kvwire": "<JSON metadata>"},
              "token_ids": {"dtype": "I64", "shape": [B, T],          "data_offsets": [a, b]},
              "keys.0":    {"dtype": "F32", "shape": [B, H, T_0, D],  "data_offsets": [b, c]},
              "values.0":  ...,  ... "keys.{L-1}", "values.{L-1}",
              "mask":      {"dtype": "U8",  "shape": [B, T],          "data_offsets": [y, z]}}

The metadata holds the format name and version, the model spec, positions and
provenance, and ``checksum``: blake3 over the canonical JSON of (metadata without
the checksum, tensor table) followed by the data bytes. Decoding treats the
bytes as untrusted: it bounds the header size before reading it, checks every
tensor entry (dtype, shape, offsets, no holes, no overlap, no trailing bytes),
checks every metadata field's type, verifies the checksum and only then builds
tensors -- as zero-copy views of the buffer (an ``mmap`` for files) -- and
validates the packet against its spec. Anything wrong raises a
:class:`~kvwire.errors.PacketError` subclass naming the problem; a packet is
never returned from bad bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from .errors import ChecksumError, CorruptPacketError
from .packet import Packet
from .spec import ModelSpec

FORMAT = "kvwire.packet"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "blake3"
MAX_HEADER_BYTES = 64 * 1024 * 1024  # token ids live in tensors, so real headers are a few KB

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

# metadata field -> accepted JSON types (checked before use)
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
}


# -- encoding ------------------------------------------------------------------------------------


def encode(packet: Packet) -> bytes:
    """Serialize a packet to safetensors bytes (one copy of the tensors).

    Records the checksum on ``packet.checksum`` so a child packet can name it.
    """
    header, buffers = _layout(packet)
    return b"".join([header, *buffers])


def save(packet: Packet, path: str | os.PathLike[str]) -> Path:
    """Write a packet to ``path`` atomically: a reader sees the old file or the whole new one."""
    header, buffers = _layout(packet)
    return atomic_write(Path(path), [header, *buffers])


def atomic_write(path: Path, chunks: list[Any]) -> Path:
    """Write ``chunks`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _layout(packet: Packet) -> tuple[bytes, list[memoryview]]:
    packet.validate()
    table: dict[str, dict[str, Any]] = {}
    buffers: list[memoryview] = []
    offset = 0
    for name, tensor in _tensors(packet):
        data = _as_bytes(tensor)
        table[name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        buffers.append(data)
        offset += data.nbytes
    meta = _meta(packet)
    hasher = blake3.blake3(_CHECKSUM_PREFIX)
    hasher.update(_canonical({"meta": meta, "tensors": table}))
    for data in buffers:
        hasher.update(data)
    meta["checksum"] = packet.checksum = hasher.hexdigest()
    header = json.dumps({"__metadata__": {"kvwire": json.dumps(meta, sort_keys=True)}, **table},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # keep the data 8-byte aligned
    return len(header).to_bytes(8, "little") + header, buffers


def _tensors(packet: Packet) -> Iterator[tuple[str, torch.Tensor]]:
    # int64 first, then K/V, then uint8: every tensor starts aligned to its item size
    yield "token_ids", packet.token_ids
    for layer, (k, v) in enumerate(zip(packet.keys, packet.values)):
        yield f"keys.{layer}", k
        yield f"values.{layer}", v
    yield "mask", packet.mask


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _meta(packet: Packet) -> dict[str, Any]:
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
    }


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# -- decoding ------------------------------------------------------------------------------------


def decode(data: bytes | bytearray | memoryview | mmap.mmap) -> Packet:
    """Parse and verify untrusted bytes; return a packet whose tensors view ``data`` (no copy)."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    total = buf.nbytes
    if total < 8:
        raise CorruptPacketError(f"truncated packet: {total} bytes, a packet is at least 8")
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise CorruptPacketError(f"not a kvwire packet, or a corrupt one: header length {header_len} exceeds "
                                 f"the {MAX_HEADER_BYTES}-byte limit")
    if 8 + header_len > total:
        raise CorruptPacketError(f"truncated packet: header needs {header_len} bytes, only {total - 8} follow")
    try:
        header = json.loads(bytes(buf[8 : 8 + header_len]), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
        raise CorruptPacketError(f"packet header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise CorruptPacketError("packet header is not a JSON object")
    extra = header.pop("__metadata__", None)
    if not isinstance(extra, dict) or not isinstance(extra.get("kvwire"), str):
        raise CorruptPacketError("not a kvwire packet: safetensors data without kvwire metadata")
    try:
        meta = json.loads(extra["kvwire"], object_pairs_hook=_no_duplicates)
    except (json.JSONDecodeError, ValueError) as err:
        raise CorruptPacketError(f"packet metadata is not valid JSON: {err}") from None
    _check_meta(meta)
    spec = ModelSpec.from_json(meta["spec"])
    data_start = 8 + header_len
    _check_table(header, spec, total - data_start)

    claimed = meta.pop("checksum")
    hasher = blake3.blake3(_CHECKSUM_PREFIX)
    hasher.update(_canonical({"meta": meta, "tensors": header}))
    hasher.update(buf[data_start:])
    if hasher.hexdigest() != claimed:
        raise ChecksumError(
            f"packet checksum mismatch: header says {claimed[:16]}..., content hashes to {hasher.hexdigest()[:16]}...",
            "the packet was corrupted or altered after it was written; fetch or rebuild it",
        )

    tensors = {name: _view(buf, data_start, entry) for name, entry in header.items()}
    packet = Packet(
        spec=spec,
        keys=tuple(tensors[f"keys.{i}"] for i in range(spec.num_layers)),
        values=tuple(tensors[f"values.{i}"] for i in range(spec.num_layers)),
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
        checksum=claimed,
    )
    try:
        return packet.validate()
    except CorruptPacketError:
        raise
    except Exception as err:  # a well-formed file that breaks the shape contract is still corrupt
        raise CorruptPacketError(str(err)) from None


def load(path: str | os.PathLike[str]) -> Packet:
    """Read a packet file through ``mmap``: tensors are views of the mapped file, not copies."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise CorruptPacketError(f"{path} is empty")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise CorruptPacketError(f"no packet file at {path}", "check the path") from None
    return decode(mapped)


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
    if version != FORMAT_VERSION:
        raise CorruptPacketError(
            f"packet format version {version!r} is not supported (this kvwire reads version {FORMAT_VERSION})",
            "use the kvwire version that wrote it, or re-create the packet",
        )
    missing = sorted(set(_META_FIELDS) - set(meta))
    extra = sorted(set(meta) - set(_META_FIELDS))
    if missing or extra:
        raise CorruptPacketError(f"packet metadata fields: missing {missing}, unexpected {extra}")
    for name, types in _META_FIELDS.items():
        value = meta[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise CorruptPacketError(f"packet metadata field {name!r} has type {type(value).__name__}")
    if meta["checksum_algorithm"] != CHECKSUM_ALGORITHM:
        raise CorruptPacketError(f"unsupported checksum algorithm {meta['checksum_algorithm']!r}")


def _check_table(table: dict[str, Any], spec: ModelSpec, data_len: int) -> None:
    expected = {"token_ids", "mask"} | {f"{kind}.{i}" for kind in ("keys", "values") for i in range(spec.num_layers)}
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
        size = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
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
