"""What :mod:`kvwire.wire.codec` checks in untrusted bytes before using them.

Every value a packet's header carries is checked here for its JSON type *and* its
range before anything reads it: the metadata fields (:func:`check_meta`), the tensor
table (:func:`check_table`; the model spec is checked by
:meth:`kvwire.wire.spec.ModelSpec.from_json`), and, once tensors are built, their values
(:func:`check_finite`). Every failure is a :class:`~kvwire.errors.PacketError`
subclass naming the field; nothing here raises a builtin exception on bad input.
``tests/wire/test_codec_fuzz.py`` holds this to account with mutated headers of every
JSON type.

Ranges (generous for any real model, small enough that no later arithmetic or
tensor allocation can overflow)::

    start                 0 .. MAX_POSITION             tensor dims   0 .. MAX_DIM, at most 8 of them
    round, version        0 / 1 .. MAX_COUNTER          created_at    finite, 0 .. MAX_TIMESTAMP
    checksum, parent,     64 lowercase hex digits       attention     "causal" | "segment"
    parent_checksum                                     rotary        "applied" | "stripped"
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from . import layers as partial, quant
from ..errors import CorruptPacketError, NonFiniteError
from .quant import ENCODINGS
from .spec import ModelSpec, bounded_repr as _show, check_fields

FORMAT = "kvwire.packet"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2, 3)  # 3: partial-layer packets (kvwire.partial)
CHECKSUM_ALGORITHM = "blake3"
MAX_SPEC_DEPTH = 8  # JSON nesting of a model spec (rope parameters by layer type need 3)
MAX_POSITION = 2**31 - 1  # a packet's start: two billion tokens
MAX_COUNTER = 2**62  # round and version stay int64 everywhere they go
MAX_TIMESTAMP = 1e12  # seconds since 1970: year ~33700
MAX_DIM = 2**31 - 1  # any tensor dimension
MAX_RANK = 8

# safetensors dtype codes <-> torch dtypes this format may carry
DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "U8": torch.uint8,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}

# metadata field -> accepted JSON types (checked before use); version 1 had no "encoding"
META_FIELDS: dict[str, tuple[type, ...]] = {
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
_HEX64 = re.compile(r"[0-9a-f]{64}")


def parse_json(raw: bytes | str, what: str) -> Any:
    """JSON from untrusted bytes: invalid, non-UTF-8, duplicate keys or too deep -> corrupt."""
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise CorruptPacketError(f"{what} is not valid JSON: {err}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def check_meta(meta: Any) -> None:
    """The kvwire metadata object: every field present, of its type and in its range."""
    if not isinstance(meta, dict):
        raise CorruptPacketError("packet metadata is not a JSON object")
    if meta.get("format") != FORMAT:
        raise CorruptPacketError(f"not a kvwire packet: format {_show(meta.get('format'))}, expected {FORMAT!r}")
    version = meta.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise CorruptPacketError(
            f"packet format version {_show(version)} is not supported (this kvwire reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))})",
            "use the kvwire version that wrote it, or re-create the packet",
        )
    fields = {name: types for name, types in META_FIELDS.items() if version >= 2 or name != "encoding"}
    if version >= partial.FORMAT_VERSION:
        fields[partial.META_FIELD] = (dict,)  # its content: partial.read_meta
    check_fields(meta, fields, "packet metadata")
    if not shallow(meta["spec"], MAX_SPEC_DEPTH):  # deep JSON would blow the stack of later deep copies
        raise CorruptPacketError(f"packet model spec is nested deeper than {MAX_SPEC_DEPTH} levels")
    if meta["checksum_algorithm"] != CHECKSUM_ALGORITHM:
        raise CorruptPacketError(f"unsupported checksum algorithm {_show(meta['checksum_algorithm'])}")
    if "encoding" in meta and meta["encoding"] not in ENCODINGS:
        raise CorruptPacketError(f"unknown packet encoding {_show(meta['encoding'])} (this kvwire reads "
                                 f"{', '.join(ENCODINGS)})", "upgrade kvwire, or re-encode the packet")
    _in_range(meta, "start", 0, MAX_POSITION)
    _in_range(meta, "round", 0, MAX_COUNTER)
    _in_range(meta, "version", 1, MAX_COUNTER)
    created = meta["created_at"]
    if not 0 <= created <= MAX_TIMESTAMP:  # nan compares false; a huge int compares without converting
        raise CorruptPacketError(f"packet metadata field 'created_at' is {_show(created)}, not a time in "
                                 f"[0, {MAX_TIMESTAMP:g}] seconds")
    for name, allowed in (("attention", ("causal", "segment")), ("rotary", ("applied", "stripped"))):
        if meta[name] not in allowed:
            raise CorruptPacketError(f"packet metadata field {name!r} is {_show(meta[name])}, expected one of "
                                     f"{allowed}")
    for name in ("checksum", "parent", "parent_checksum"):
        if meta[name] is not None and not _HEX64.fullmatch(meta[name]):
            raise CorruptPacketError(f"packet metadata field {name!r} is {_show(meta[name])}, not 64 lowercase "
                                     "hex digits")
    if (meta["parent"] is None) != (meta["parent_checksum"] is None):
        raise CorruptPacketError("packet metadata names a parent without its checksum, or the reverse")


def _in_range(meta: dict[str, Any], name: str, low: int, high: int) -> None:
    if not low <= meta[name] <= high:
        raise CorruptPacketError(f"packet metadata field {name!r} is {_show(meta[name])}, outside [{low}, {high}]")


def shallow(obj: Any, limit: int) -> bool:
    """Whether JSON ``obj`` nests at most ``limit`` containers deep (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def check_table(table: dict[str, Any], spec: ModelSpec, encoding: str, data_len: int,
                plan: tuple[partial.LayerPlan, int] | None = None) -> tuple[int, int]:
    """Check every tensor entry against the encoding's layout (and a partial packet's plan, with its
    hidden size: :func:`kvwire.wire.layers.read_meta`); return ``(B, T)``."""
    layers = plan[0].reused if plan else range(spec.num_layers)
    hidden = plan[0].hidden_layers if plan else ()
    _check_names(table, spec, encoding, layers, hidden)
    _check_spans(table, data_len)
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
        if DTYPES[entry["dtype"]] != dtype or tuple(entry["shape"]) != shape:
            raise CorruptPacketError(f"tensor {name!r}: expected {CODES[dtype]} {list(shape)} for a {encoding} "
                                     f"packet of [B, T]=[{batch}, {tokens}], got {entry['dtype']} {entry['shape']}")
    return batch, tokens


def _check_names(table: dict[str, Any], spec: ModelSpec, encoding: str, layers: Sequence[int],
                 hidden: Sequence[int]) -> None:
    """The table names exactly the tensors of ``layers`` in ``encoding``, the ``hidden`` states, ids and mask."""
    want_count = 2 + len(layers) * quant.tensors_per_layer(encoding) + len(hidden)
    if abs(len(table) - want_count) > 16:  # do not build a huge name set for a hostile spec
        raise CorruptPacketError(f"packet has {len(table)} tensors; {spec.num_layers} layers in {encoding} need "
                                 f"{want_count}")
    expected = {"token_ids", "mask"} | {name for layer in layers
                                        for name in quant.layer_layout(encoding, layer, (1, 1, 0, 2))}
    expected |= {partial.hidden_name(layer) for layer in hidden}
    if set(table) != expected:
        missing, extra = sorted(expected - set(table)), sorted(set(table) - expected)
        raise CorruptPacketError(f"packet tensors: missing {missing[:4]}, unexpected {_show(extra[:4])}")


def _check_spans(table: dict[str, Any], data_len: int) -> None:
    """Each entry is a well-formed safetensors entry whose bytes match its shape, and together they tile
    the ``data_len`` bytes of data exactly: no hole, no overlap, nothing after."""
    spans = []
    for name, entry in table.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CorruptPacketError(f"tensor {name!r}: entry must have dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CorruptPacketError(f"tensor {name!r}: dtype {_show(dtype)} not allowed (allowed: {sorted(DTYPES)})")
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK
                and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
            raise CorruptPacketError(f"tensor {name!r}: bad shape {_show(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CorruptPacketError(f"tensor {name!r}: bad data_offsets {_show(offsets)}")
        begin, stop = offsets
        size = math.prod(shape) * DTYPES[dtype].itemsize  # exact: Python ints do not overflow
        if not 0 <= begin <= stop <= data_len:
            raise CorruptPacketError(f"truncated packet: tensor {name!r} spans bytes {_show(begin)}..{_show(stop)}, "
                                     f"but the data has {data_len}")
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


def check_finite(layer: int, name: str, tensor: torch.Tensor, encoding: str) -> None:
    """Refuse NaN and Inf in one decoded K/V tensor (after dequantization), naming where.

    One pass: a float sum is finite only if every term is, so a finite sum clears the
    tensor (~0.2 ms/MB here); only a non-finite sum -- a NaN or Inf, or finite values
    whose sum overflows -- pays for the exact elementwise scan that locates the value.
    """
    # fp16 sums overflow at 65504: accumulate in fp32 (fp32 and bf16 already reach 3.4e38)
    total = tensor.sum(dtype=torch.float32) if tensor.dtype == torch.float16 else tensor.sum()
    if tensor.numel() == 0 or math.isfinite(float(total)):
        return
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    if count == 0:  # finite values whose sum overflowed
        return
    where = [int(i) for i in bad.nonzero()[0]]  # [b, h, t, d]
    value = float(tensor[tuple(where)])
    stored = (f" (after {encoding} dequantization: a scale or minimum is not finite, or too large)"
              if encoding in quant.INTEGER_ENCODINGS else "")
    raise NonFiniteError(
        f"packet layer {layer} {name} hold {count} non-finite value{'s' if count > 1 else ''}, the first {value} "
        f"at [batch, head, token, dim] = {where}{stored}; one NaN or Inf in a cache corrupts everything "
        "generated from it",
        "rebuild the context from its token ids and fix the producer; only for a trusted sender, "
        "KVWIRE_CHECK_FINITE=0 (CodecOptions(check_finite=False)) skips this scan",
    )
