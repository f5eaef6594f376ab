"""Partial-layer transfer: which layers' K/V travel, and which layers the receiver computes.

DroidSpeak's setting: sender and receiver run the same architecture, perhaps with other
weights (a fine-tuned variant). The sender ships the K/V of some layers and, for every run
of consecutive layers it does *not* ship, the hidden state entering the first layer of the
run; the receiver runs its own weights over each such run (from that hidden state) and
reuses the shipped K/V for the rest. With the same weights this is exact at every split:
the receiver computes what the sender would have.

A :class:`LayerPlan` says which layers are reused. The common case is a split at ``k``::

    LayerPlan.prefix(30, 24)  reuse layers 0..23; ship the hidden state entering layer 24;
                              the receiver computes layers 24..29
    LayerPlan.prefix(30, 0)   ship only the hidden state entering layer 0 (the embeddings)
    LayerPlan.prefix(30, 30)  ship every layer: an ordinary packet, nothing recomputed
    LayerPlan.recompute(30, [0, 1, 17])  reuse all but layers 0, 1 and 17: hidden states
                              entering layers 0 and 17 travel (runs [0, 2) and [17, 18))

**On the wire** a partial-layer packet is an ordinary kvwire packet (:mod:`kvwire.wire.codec`)
with format version 3, whose metadata has one more field,
``"partial": {"layers": [reused layer indices], "hidden_size": H}``, and whose tensor table
holds ``keys.l`` / ``values.l`` only for the reused layers ``l`` plus ``hidden.l`` (the
spec's dtype, ``[B, T, H]``, never quantized) for each layer ``l`` that starts a recomputed
run. The decoder checks the field and the table against the plan exactly like every other
field. Partial packets are standalone prefixes (start 0, no parent); chains refuse them.

The transformers side (capturing hidden states, running a run of layers) is
:mod:`kvwire.hf.partial`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptPacketError, PacketError

META_FIELD = "partial"
FORMAT_VERSION = 3  # the codec's format version for partial-layer packets
MAX_HIDDEN_SIZE = 1 << 20  # a hidden size larger than any model's


@dataclass(frozen=True)
class LayerPlan:
    """Which of a model's ``num_layers`` layers have their K/V reused (shipped); the rest are recomputed."""

    num_layers: int
    reused: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (isinstance(self.num_layers, int) and self.num_layers > 0):
            raise PacketError(f"a layer plan needs a positive layer count, got {self.num_layers!r}")
        reused = tuple(self.reused)
        bad = [i for i in reused if type(i) is not int or not 0 <= i < self.num_layers]
        if bad:
            raise PacketError(f"layers {bad} are out of range 0..{self.num_layers - 1} for a "
                              f"{self.num_layers}-layer model")
        if list(reused) != sorted(set(reused)):
            raise PacketError(f"reused layers must be ascending and unique, got {list(reused)}")
        object.__setattr__(self, "reused", reused)

    @classmethod
    def prefix(cls, num_layers: int, k: int) -> LayerPlan:
        """Reuse layers ``0..k-1``, recompute ``k..num_layers-1``; ``k`` in ``0..num_layers``."""
        if type(k) is not int or not 0 <= k <= num_layers:
            raise PacketError(f"k={k!r} is out of range: a {num_layers}-layer model splits at k in 0..{num_layers}",
                              f"k=0 recomputes every layer, k={num_layers} reuses every layer")
        return cls(num_layers, tuple(range(k)))

    @classmethod
    def recompute(cls, num_layers: int, layers: Iterable[int]) -> LayerPlan:
        """Reuse every layer except ``layers`` (DroidSpeak: recompute the sensitive ones)."""
        layers = sorted(set(layers))
        bad = [i for i in layers if type(i) is not int or not 0 <= i < num_layers]
        if bad:
            raise PacketError(f"layers {bad} are out of range 0..{num_layers - 1} for a {num_layers}-layer model")
        return cls(num_layers, tuple(i for i in range(num_layers) if i not in layers))

    @property
    def recomputed(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in set(self.reused))

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """Maximal runs ``[start, stop)`` of recomputed layers. Example (8 layers, reuse 2..5): ((0, 2), (6, 8))."""
        runs, start = [], None
        reused = set(self.reused)
        for layer in range(self.num_layers + 1):
            recompute = layer < self.num_layers and layer not in reused
            if recompute and start is None:
                start = layer
            elif not recompute and start is not None:
                runs.append((start, layer))
                start = None
        return tuple(runs)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Layers whose entering hidden state must travel: the first layer of each recomputed run."""
        return tuple(start for start, _ in self.runs)

    @property
    def is_full(self) -> bool:
        """Every layer reused: an ordinary packet, nothing for the receiver to compute."""
        return len(self.reused) == self.num_layers

    def describe(self) -> str:
        """Example: 'reuse 0-23, recompute 24-29'."""
        def spans(layers: tuple[int, ...]) -> str:
            out, run = [], []
            for i in layers:
                if run and i != run[-1] + 1:
                    out.append(run)
                    run = []
                run.append(i)
            if run:
                out.append(run)
            return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out) or "none"
        return f"reuse {spans(self.reused)}, recompute {spans(self.recomputed)}"


# -- codec hooks -----------------------------------------------------------------------------------


def hidden_name(layer: int) -> str:
    """The tensor name of the hidden state entering ``layer``: ``hidden.{layer}``."""
    return f"hidden.{layer}"


def meta(layers: tuple[int, ...], hidden: Mapping[int, Any]) -> dict[str, Any]:
    """The ``partial`` metadata field of a packet with these layers and hidden states."""
    size = int(next(iter(hidden.values())).shape[2])
    return {"layers": list(layers), "hidden_size": size}


def read_meta(value: Any, num_layers: int) -> tuple[LayerPlan, int]:
    """Check an untrusted ``partial`` metadata field; return the plan and the hidden size.

    Never echoes the untrusted values (a hostile integer can be too long to print)."""
    if not isinstance(value, dict) or set(value) != {"layers", "hidden_size"}:
        raise CorruptPacketError("packet metadata field 'partial' must be {\"layers\": [...], \"hidden_size\": H}")
    layers, size = value["layers"], value["hidden_size"]
    if not (isinstance(layers, list) and len(layers) < num_layers
            and all(type(i) is int and 0 <= i < num_layers for i in layers)):
        raise CorruptPacketError(f"partial packet layers must be a list of fewer than {num_layers} layer indices "
                                 f"in [0, {num_layers})")
    if layers != sorted(set(layers)):
        raise CorruptPacketError("partial packet layers must be ascending and unique")
    if type(size) is not int or not 0 < size <= MAX_HIDDEN_SIZE:
        raise CorruptPacketError(f"partial packet hidden_size must be an integer in [1, {MAX_HIDDEN_SIZE}]")
    return LayerPlan(num_layers, tuple(layers)), size


def decoded_bytes(spec: Any, batch: int, tokens: int, plan: tuple[LayerPlan, int] | None) -> int:
    """Bytes a packet decodes to: K/V of the carried layers, plus a partial packet's hidden states."""
    if plan is None:
        return int(spec.kv_bytes(tokens, batch))
    itemsize = spec.torch_dtype.itemsize
    kv = sum(2 * batch * spec.num_kv_heads * spec.head_dim * spec.kept_tokens(layer, tokens) * itemsize
             for layer in plan[0].reused)
    return kv + len(plan[0].hidden_layers) * batch * tokens * plan[1] * itemsize
