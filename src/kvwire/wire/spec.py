"""What a KV-cache is made of, independent of any framework: :class:`ModelSpec`.

A spec says how many layers a cache has, their kind (full or sliding-window
attention), the KV heads and head size of each, the dtype, the RoPE parameters the
keys were rotated with, and a *fingerprint* of the weights that produced it. Two
caches can be exchanged as-is only between models with equal specs; the
fingerprint catches the case where the architecture matches but the weights do
not (a fine-tune, an update, a different checkpoint).

Specs are read from a live model by :func:`kvwire.hf.model_spec`; this module
never imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import blake3
import torch

from ..errors import CorruptPacketError, ModelMismatchError

LayerKind = Literal["full_attention", "sliding_attention"]
LAYER_KINDS: tuple[str, ...] = ("full_attention", "sliding_attention")

# Bounds on the size fields of a spec read from untrusted JSON (far above any real model).
LIMITS = {"num_layers": 4096, "num_kv_heads": 4096, "head_dim": 65536, "vocab_size": 2**31 - 1}

# The formats a model's linear weights may be multiplied in (kvwire.hf.weights), the one list of them.
WEIGHT_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")

# Cache dtypes a packet may carry, by their torch name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def bounded_repr(value: Any, limit: int = 80) -> str:
    """A bounded repr for error messages (a hostile value can be megabytes long)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (sys.int_info.str_digits_check_threshold)
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_fields(data: dict[str, Any], fields: Mapping[str, type | tuple[type, ...]], what: str) -> None:
    """Raise :class:`CorruptPacketError` unless untrusted JSON ``data`` has exactly ``fields``, each of its
    type (a bool is never an int here): ``what`` names the object in the message."""
    missing = sorted(set(fields) - set(data))
    extra = sorted(set(data) - set(fields))
    if missing or extra:
        raise CorruptPacketError(f"{what} fields: missing {missing}, unexpected {bounded_repr(extra)}")
    for name, types in fields.items():
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise CorruptPacketError(f"{what} field {name!r} has type {type(value).__name__}")


@dataclass(frozen=True)
class ModelSpec:
    """The shape contract of one model's KV-cache.

    Per layer the cache holds keys and values of shape
    ``[batch, num_kv_heads, tokens, head_dim]``; a ``sliding_attention`` layer holds
    at most ``sliding_window - 1`` of the most recent tokens (what transformers'
    ``DynamicSlidingWindowLayer`` keeps), a ``full_attention`` layer holds all.
    """

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # cache dtype, a key of DTYPES
    vocab_size: int
    layer_kinds: tuple[str, ...]  # one of LAYER_KINDS per layer
    sliding_window: int | None = None  # only when some layer is sliding
    rope: Mapping[str, Any] = field(default_factory=dict)  # config.rope_parameters, as JSON
    fingerprint: str = ""  # blake3 of spec + weights; "" = unknown
    weights: str = "fp32"  # the format the linear weights are multiplied in (kvwire.hf.weights.FORMATS)

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries, expected num_layers={self.num_layers}")
        bad = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"unknown layer kinds {bad}; expected one of {LAYER_KINDS}")
        if self.has_sliding_window and not self.sliding_window:
            raise ValueError("a spec with sliding_attention layers needs sliding_window")
        if self.dtype not in DTYPES:
            raise ValueError(f"cache dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {self.weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def has_sliding_window(self) -> bool:
        """Whether some layer is ``sliding_attention`` (Gemma3, Mistral-style windows).

        Such a layer keeps only its last ``sliding_window - 1`` tokens: past the window, slot ``i``
        no longer holds the token at position ``i``. So its cache cannot be cut to a prefix, spliced or
        partly recomputed (that needs every slot), shared as one prefix by batched rows, or
        padded after a real token; it can still be passed whole and continued exactly
        (prefix and text modes). Full-attention layers keep every token.
        """
        return "sliding_attention" in self.layer_kinds

    def kept_tokens(self, layer: int, tokens: int) -> int:
        """How many of the last ``tokens`` tokens of a segment layer ``layer`` keeps.

        Example (sliding_window=512): full layer, 3000 tokens -> 3000; sliding layer,
        3000 tokens -> 511; sliding layer, 100 tokens -> 100.
        """
        if self.layer_kinds[layer] == "sliding_attention":
            assert self.sliding_window is not None  # guaranteed by __post_init__
            return min(tokens, self.sliding_window - 1)
        return tokens

    def kv_bytes(self, tokens: int, batch: int = 1) -> int:
        """Bytes of K and V for ``tokens`` tokens: 2 x layers x kv_heads x head_dim x tokens x itemsize,
        with sliding layers counting only the tokens they keep."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        kept = sum(self.kept_tokens(layer, tokens) for layer in range(self.num_layers))
        return 2 * batch * self.num_kv_heads * self.head_dim * kept * itemsize

    # -- compatibility -------------------------------------------------------------------------

    def differences(self, other: ModelSpec) -> list[str]:
        """Fields that differ, as ``"name: ours != theirs"`` strings (empty if equal)."""
        mine, theirs = asdict(self), asdict(other)
        return [_difference(name, mine[name], theirs[name]) for name in mine if mine[name] != theirs[name]]

    def check_same_model(self, other: ModelSpec, what: str = "packet") -> None:
        """Raise :class:`ModelMismatchError` unless ``other`` (the spec a cache was made with)
        equals this one (the spec of the model about to use it)."""
        diffs = other.differences(self)
        if not diffs:
            return
        if other.weights != self.weights:
            raise ModelMismatchError(
                f"{what} was made under {other.weights} weights, and this model runs {self.weights} weights "
                "(a cache depends on the format its weights were multiplied in)",
                f"run both agents with the same --weights (here: --weights {other.weights}), or re-prefill "
                "from the packet's token ids",
            )
        if diffs == [d for d in diffs if d.startswith("fingerprint:")]:
            raise ModelMismatchError(
                f"{what} was made by a model with the same architecture but different weights "
                f"(fingerprint {other.fingerprint[:12]} != {self.fingerprint[:12]})",
                "re-prefill from the packet's token ids, or send it to an agent running the same weights",
            )
        raise ModelMismatchError(
            f"{what} was made by another model: " + "; ".join(diffs) + " (packet != receiver)",
            "send packets only between agents that run the same model, or use an adapter",
        )

    # -- serialization -------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_kinds"] = list(self.layer_kinds)
        data["rope"] = dict(self.rope)
        if self.weights == "fp32":  # written only when not the default: fp32 specs (and fingerprints) as before
            del data["weights"]
        return data

    @classmethod
    def from_json(cls, data: Any) -> ModelSpec:
        """Build a spec from untrusted JSON, raising :class:`CorruptPacketError` on any mismatch."""
        if not isinstance(data, dict):
            raise CorruptPacketError(f"model spec must be a JSON object, got {type(data).__name__}")
        expected = {
            "architecture": str,
            "model_type": str,
            "num_layers": int,
            "num_kv_heads": int,
            "head_dim": int,
            "dtype": str,
            "vocab_size": int,
            "layer_kinds": list,
            "sliding_window": (int, type(None)),
            "rope": dict,
            "fingerprint": str,
        }
        data = dict(data)
        weights = data.pop("weights", "fp32")  # absent in packets written before weight formats
        if not isinstance(weights, str) or weights not in WEIGHT_FORMATS:
            raise CorruptPacketError(f"model spec field 'weights' must be one of {', '.join(WEIGHT_FORMATS)}")
        check_fields(data, expected, "model spec")
        for name, high in LIMITS.items():
            if not 1 <= data[name] <= high:
                raise CorruptPacketError(f"model spec field {name!r} must be in [1, {high}], got "
                                         f"{data[name] if abs(data[name]) < 10**30 else 'a huge number'}")
        window = data["sliding_window"]
        if window is not None and not 2 <= window <= LIMITS["vocab_size"]:
            raise CorruptPacketError("model spec field 'sliding_window' must be null or in [2, 2**31 - 1]")
        kinds = data["layer_kinds"]
        if not all(isinstance(kind, str) for kind in kinds):
            raise CorruptPacketError("model spec field 'layer_kinds' must be a list of strings")
        fingerprint = data["fingerprint"]
        if fingerprint and not (len(fingerprint) == 64 and all(c in "0123456789abcdef" for c in fingerprint)):
            raise CorruptPacketError("model spec field 'fingerprint' must be empty or 64 lowercase hex digits")
        try:
            return cls(**{**data, "layer_kinds": tuple(data["layer_kinds"]), "weights": weights})
        except ValueError as err:
            raise CorruptPacketError(f"model spec is inconsistent: {err}") from None


def fingerprint(spec_fields: Mapping[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hash of the spec's shape fields and every weight tensor (name, dtype, shape, bytes).

    Any change to any weight changes it; hashing runs at ~8 GB/s (blake3), about 70 ms
    for the 135M-parameter default model.
    """
    hasher = blake3.blake3()
    hasher.update(json.dumps(spec_fields, sort_keys=True, default=str).encode())
    for name, tensor in named_tensors:
        t = tensor.detach()
        hasher.update(f"\0{name}\0{dtype_name(t.dtype)}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            hasher.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def _difference(name: str, mine: Any, theirs: Any) -> str:
    """``"name: ours != theirs"``, kept to one readable line: a long sequence (a 30-layer ``layer_kinds``) is
    told by its length or its first differing entry, a fingerprint by its first 12 digits."""
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)) and max(len(mine), len(theirs)) > 6:
        if len(mine) != len(theirs):
            return f"{name}: {len(mine)} entries != {len(theirs)} entries"
        at = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        return f"{name}: entry {at} of {len(mine)}: {mine[at]!r} != {theirs[at]!r}"
    if name == "fingerprint" and isinstance(mine, str) and isinstance(theirs, str):
        return f"{name}: {mine[:12]} != {theirs[:12]}"
    return f"{name}: {mine!r} != {theirs!r}"
