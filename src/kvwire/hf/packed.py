"""The model's linear layers in MKL's packed format, for batched CPU decode steps.

A decode step of a few rows multiplies each layer's weights by a handful of vectors.
``F.linear`` hands that to MKL's ``sgemm``, which re-packs the weight matrix into its
blocked layout on every call -- for four or eight rows, that re-packing costs more than
the product. MKL can pack a matrix once (``cblas_sgemm_pack``) and multiply by it many
times (``cblas_sgemm_compute``); torch exposes the pair as ``torch.ops.mkl`` (what its
compiler uses when it freezes CPU weights). Measured on this 2-core Xeon, default model,
whole model forward passes of M tokens: M = 4 11 % faster, 8: 15 %, 16: 10 %, 32: 4 %,
48: even, 64: 6 % slower, a 400-token prefill 11 % slower; a single row is better served
by MKL's own matrix-vector path, and 3 rows gained nothing. So only passes of
:data:`MIN_ROWS`..:data:`MAX_ROWS` rows use it. In the engine's decode: +7-16 % tokens/s at
4-8 rows.

The output layer (49,152 x 576, 113 MB) the same way, timed alone with the caches flushed:
3 rows 3.6 ms packed against 4.7 ms ``F.linear`` (5.0 ms in :mod:`.head`'s slices), 4 rows
5.1 / 8.5 / 8.8, 8 rows 5.5 / 10.0 / 8.4, 16 rows 6.9 / 8.1 / 9.3, 32 rows 11.4 / 10.5 / 12.7,
2 rows 4.6 / 3.9 / 4.4: it is packed for passes of :data:`HEAD_ROWS` rows, and sliced
otherwise.

The values are the same dot products, summed in MKL's blocked order: equal to ``F.linear``
within float rounding (bitwise at 16 rows and more, ~1e-6 relative at 4-12), which is what
batching rows already does (tests/test_engine.py compares rows with and without packing).

Cost: one packed copy of every linear's weights (about the model's size: 518 MB for the
default model, its tied output layer included), made once per model when an engine that uses it
is made (0.14 s here) and kept while the model lives. A weight changed in place (training,
a merged LoRA) or replaced is re-packed before its next use (its version counter moved):
never a stale copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .cache import decoder_layers
from .head import _plain_head

log = logging.getLogger(__name__)

MIN_ROWS, MAX_ROWS = 4, 32  # rows of a pass where packed weights were measured faster (module docstring)
HEAD_ROWS = (3, 16)  # the same for the output layer (module docstring)
PACK_ROWS = 8  # the row count MKL is told when packing (the packed layout does not depend on it)


def supported() -> bool:
    """torch was built with MKL and exposes its packed-GEMM ops."""
    mkl = getattr(torch.ops, "mkl", None)
    return bool(torch.backends.mkl.is_available() and mkl is not None
                and hasattr(mkl, "_mkl_reorder_linear_weight") and hasattr(mkl, "_mkl_linear"))


class _Packed:
    """One ``nn.Linear`` and its weight packed by MKL, re-packed when the weight changes."""

    __slots__ = ("linear", "packed", "key")

    def __init__(self, linear: torch.nn.Linear) -> None:
        self.linear, self.packed, self.key = linear, None, None

    def weight(self) -> Any:
        weight = self.linear.weight
        key = (id(weight), weight.data_ptr(), weight._version)
        if key != self.key:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        return torch.ops.mkl._mkl_linear(x, self.weight(), linear.weight, linear.bias, x.numel() // x.shape[-1])


class _ModelPacks:
    """A model's packed decoder linears and, apart, its packed output layer."""

    def __init__(self, layers: list[torch.nn.Linear], head: torch.nn.Linear | None) -> None:
        self.layers = [_Packed(m) for m in layers]
        self.head = _Packed(head) if head is not None else None


_PACKS: weakref.WeakKeyDictionary[Any, _ModelPacks] = weakref.WeakKeyDictionary()


def _eligible(m: Any) -> bool:
    return (type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
            and not m.weight.is_inference())


def _linears(model: Any) -> tuple[list[torch.nn.Linear], torch.nn.Linear | None]:
    """The decoder layers' packable linears, and the output layer if it is one too (and there are layers)."""
    if not supported():
        return [], None
    layers = [m for layer in decoder_layers(model) for m in layer.modules() if _eligible(m)]
    head = _plain_head(model)
    return layers, head if layers and head is not None and _eligible(head) else None


def packable(model: Any) -> list[torch.nn.Linear]:
    """The decoder layers' plain fp32 CPU ``nn.Linear`` modules, then the output layer if it is one.
    Weights made under ``torch.inference_mode`` are left out: they keep no version counter, so a change
    to them could not be seen."""
    layers, head = _linears(model)
    return layers + ([head] if head is not None else [])


def packed_bytes(model: Any) -> int:
    """Bytes a packed copy of ``model``'s linears takes (0 if it has none to pack)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in packable(model))


def worth_packing(model: Any) -> bool:
    """The automatic choice: the model has layers to pack and their copy takes at most a quarter of the
    memory available now (a large model on a small machine keeps its one copy)."""
    size = packed_bytes(model)
    if not size:
        return False
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return False
    return size * 4 <= available


def prepare(model: Any) -> _ModelPacks:
    """Pack ``model``'s linears now (once per model; a weight that changed since is packed again)."""
    packs = _PACKS.get(model)
    if packs is None:
        layers, head = _linears(model)
        packs = _PACKS[model] = _ModelPacks(layers, head)
        if layers:
            log.info("packing %d linear layers (%.0f MB) for batched CPU decode steps",
                     len(layers) + (head is not None), packed_bytes(model) / 2**20)
    for pack in packs.layers + ([packs.head] if packs.head is not None else []):
        pack.weight()
    return packs


@contextlib.contextmanager
def packed_linears(model: Any, rows: int, head_rows: int = 0) -> Iterator[bool]:
    """Within the block, ``model``'s decoder linears multiply by packed weights if a pass of ``rows``
    rows (tokens) gains from it (:data:`MIN_ROWS`..:data:`MAX_ROWS`), and its output layer if the
    ``head_rows`` it computes do (:data:`HEAD_ROWS`); otherwise nothing changes. Yields whether the
    output layer is packed for the pass (then :func:`.head.sliced_head` has nothing to do)."""
    layers = MIN_ROWS <= rows <= MAX_ROWS
    head = HEAD_ROWS[0] <= head_rows <= HEAD_ROWS[1]
    if not (layers or head):
        yield False
        return
    packs = prepare(model) if model not in _PACKS else _PACKS[model]
    chosen = (packs.layers if layers else []) + ([packs.head] if head and packs.head is not None else [])
    for pack in chosen:  # an instance attribute: nn.Module.__call__ finds it before the class's forward
        pack.linear.__dict__["forward"] = pack.forward
    try:
        yield head and packs.head is not None
    finally:
        for pack in chosen:
            pack.linear.__dict__.pop("forward", None)
