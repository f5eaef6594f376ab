"""The linear layers of small CPU passes (decode steps) computed as ``W @ x^T``: a few columns.

A decode step multiplies every linear's weights by one vector per row; the weights, read
once per step, are most of its cost. ``F.linear(x, W)`` computes ``x @ W^T``, which MKL
runs on this 2-core Xeon at about 17 GB/s of weights for 1 to 8 rows (its matrix-vector
path for one row is no faster). The same products taken the other way round,
``(W @ x^T)^T`` -- a GEMM of a few *columns* -- read them at about 38 GB/s, near the
machine's memory bandwidth (42 GB/s by a plain sum over the weights). One row is given as
two columns (the row twice): a single column falls back to the slow matrix-vector path.

Measured on the default model (SmolLM2-135M, fp32), the 210 decoder linears of one pass of
M rows, F.linear against thin, ms: M=1 26.9 / 14.2, 2: 38.0 / 15.1, 4: 39.6 / 17.4,
8: 40.8 / 30.1, 16: 52.0 / 40.4, 32: 72.1 / 57.4, 48: 70.3 / 69.5, 64: 87.0 / 90.0; its
output layer (49,152 x 576) 1 row 7.0 / 2.6, 4 rows 12.2 / 3.2, 8: 12.6 / 6.1,
32: 18.7 / 16.1. So passes of up to :data:`MAX_ROWS` rows (tokens) use it: every decode
step of :func:`.generation.generate` and of the engine, and short prefills. Whole decode
steps over a 1,700-token context: one row 45 -> 28.5 ms, four rows sharing it 63.5 -> 40.1 ms.

The values are the same dot products summed in another blocked order: equal to
``F.linear`` within float rounding (~1e-6 relative), as batching rows already is. The
exactness tests compare decoding with it against recomputing without it
(``generate(use_cache=False)`` keeps ``F.linear``). Nothing is copied or kept: the
weights are read in place, so a weight changed or replaced is used as it is.

Only plain fp32 ``nn.Linear`` modules on the CPU, where torch has MKL, and only where no
gradient is wanted; anything else runs as before. :func:`disabled` turns it off for a block
(the benchmarks' before-and-after).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .cache import decoder_layers

MAX_ROWS = 32  # rows (tokens) of a pass up to which W @ x^T was measured faster (module docstring)

_enabled = True


def supported() -> bool:
    """torch runs CPU products on MKL (where W @ x^T was measured faster)."""
    return bool(torch.backends.mkl.is_available())


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every pass keeps ``F.linear`` (to measure what the thin products gain)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _eligible(m: Any) -> bool:
    return type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32


def _head(model: Any) -> torch.nn.Linear | None:
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return head if _eligible(head) else None


def _forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = linear.weight, linear.bias
    if x.dtype != weight.dtype or x.device != weight.device or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    columns = flat if rows > 1 else torch.cat([flat, flat])  # one column would take the slow matrix-vector path
    out = torch.mm(weight, columns.T).T[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def thin_linears(model: Any, rows: int, head_rows: int = 0) -> Iterator[bool]:
    """Within the block, ``model``'s decoder linears compute ``W @ x^T`` if a pass of ``rows`` rows (tokens)
    gains from it (1..:data:`MAX_ROWS`), and its output layer if the ``head_rows`` it computes do; otherwise
    nothing changes. Yields whether the output layer is thin for the pass."""
    layers = 1 <= rows <= MAX_ROWS
    head_on = 1 <= head_rows <= MAX_ROWS
    if not (_enabled and (layers or head_on) and supported()) or torch.is_grad_enabled():
        yield False
        return
    chosen = [m for layer in decoder_layers(model) for m in layer.modules() if _eligible(m)] if layers else []
    head = _head(model) if head_on else None
    if head is not None:
        chosen.append(head)
    for linear in chosen:  # an instance attribute: nn.Module.__call__ finds it before the class's forward
        linear.__dict__["forward"] = functools.partial(_forward, linear)
    try:
        yield head is not None
    finally:
        for linear in chosen:
            linear.__dict__.pop("forward", None)
