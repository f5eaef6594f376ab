"""Structural adapters: pure functions mapping one model's cache structure onto another's.

Nothing here is learned or loads a model. Tensors are in the packet layout
``[B, H, T, D]`` (batch, KV heads, tokens, head_dim; see :mod:`kvwire.wire.packet`).

- layers: :func:`layer_map_terminal` (C2C's: the receiver's last layers read the sharer's
  last layers) and :func:`layer_map_proportional` (spread evenly over depth);
- heads: :func:`repeat_heads` (GQA: more receiver heads than sharer heads) and
  :func:`group_mean_heads` (fewer);
- head size: :func:`project_head_dim` by a caller-given matrix.

A layer map is a tuple with one entry per receiver layer: the sharer layer it reads, or
``None`` for a receiver layer that reads nothing (it keeps its own K/V).
"""

from __future__ import annotations

from typing import Literal

import torch

LayerMap = tuple["int | None", ...]
LayerStrategy = Literal["terminal", "proportional"]


def layer_map_terminal(sharer_layers: int, receiver_layers: int) -> LayerMap:
    """Align the last layers of both models, as C2C does: receiver layer ``t`` reads sharer
    layer ``(S - T) + t``.

    With ``S >= T`` every receiver layer reads one of the sharer's last ``T`` layers; with
    ``S < T`` the receiver's first ``T - S`` layers read nothing (``None``) and its last ``S``
    layers read the sharer's layers ``0 .. S-1`` in order (the deepest with the deepest).

    Example (S=6, T=4): ``(2, 3, 4, 5)``. Example (S=3, T=5): ``(None, None, 0, 1, 2)``.
    Example (S=24 Qwen2.5-0.5B, T=30 SmolLM2-135M): layers 0..5 read nothing, layer t >= 6 reads t - 6.
    """
    _check_counts(sharer_layers, receiver_layers)
    shift = sharer_layers - receiver_layers
    return tuple(t + shift if t + shift >= 0 else None for t in range(receiver_layers))


def layer_map_proportional(sharer_layers: int, receiver_layers: int) -> LayerMap:
    """Spread the receiver's layers evenly over the sharer's depth: ``t -> round(t * (S-1) / (T-1))``
    (first with first, last with last; every receiver layer reads one).

    Example (S=6, T=4): ``(0, 2, 3, 5)``. Example (S=3, T=5): ``(0, 0, 1, 2, 2)``
    (``round`` is Python's: halves go to the even neighbour, 0.5 -> 0, 1.5 -> 2).
    """
    _check_counts(sharer_layers, receiver_layers)
    if receiver_layers == 1:
        return (sharer_layers - 1,)
    return tuple(round(t * (sharer_layers - 1) / (receiver_layers - 1)) for t in range(receiver_layers))


def layer_map(strategy: LayerStrategy, sharer_layers: int, receiver_layers: int) -> LayerMap:
    """The layer map of ``strategy`` ("terminal" or "proportional")."""
    if strategy == "terminal":
        return layer_map_terminal(sharer_layers, receiver_layers)
    if strategy == "proportional":
        return layer_map_proportional(sharer_layers, receiver_layers)
    raise ValueError(f"unknown layer strategy {strategy!r}; expected 'terminal' or 'proportional'")


def repeat_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, H, T, D] -> [B, heads, T, D]`` by repeating each head ``heads // H`` times in place
    (as grouped-query attention shares one KV head among a group of query heads).

    Example (H=2 -> 6): heads ``(a, b)`` become ``(a, a, a, b, b, b)``.
    ``heads`` must be a multiple of ``H``; otherwise use a projection (ridge or a fuser).
    """
    B, H, T, D = kv.shape
    if heads % H:
        raise ValueError(f"cannot repeat {H} KV heads into {heads}: {heads} is not a multiple of {H} "
                         "(map them with a projection instead)")
    return kv.repeat_interleave(heads // H, dim=1)  # [B, heads, T, D]


def group_mean_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, H, T, D] -> [B, heads, T, D]`` by averaging consecutive groups of ``H // heads`` heads
    (the inverse of :func:`repeat_heads` on repeated heads; GQA's "mean pooling" conversion).

    Example (H=6 -> 2): heads ``(a, b, c, d, e, f)`` become ``((a+b+c)/3, (d+e+f)/3)``.
    ``H`` must be a multiple of ``heads``.
    """
    B, H, T, D = kv.shape
    if H % heads:
        raise ValueError(f"cannot average {H} KV heads into {heads}: {H} is not a multiple of {heads} "
                         "(map them with a projection instead)")
    return kv.reshape(B, heads, H // heads, T, D).mean(dim=2)  # [B, heads, T, D]


def match_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat or average heads so that there are ``heads`` of them (identity when equal)."""
    H = kv.shape[1]
    if heads == H:
        return kv
    return repeat_heads(kv, heads) if heads > H else group_mean_heads(kv, heads)


def project_head_dim(kv: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D_in] -> [B, H, T, D_out]``: every head's vector times ``matrix`` ``[D_in, D_out]``.

    The caller chooses the matrix: a fitted projection, or a fixed one. Example: ``D_in=4``,
    ``D_out=2``, ``matrix = [[1, 0], [0, 1], [0, 0], [0, 0]]`` keeps the first two dims;
    ``eye(D)`` is the identity. Keys must be position-free (RoPE stripped) for a projection
    to mean the same at every position: rotations act on pairs of dims.
    """
    D_in = kv.shape[-1]
    if matrix.dim() != 2 or matrix.shape[0] != D_in:
        raise ValueError(f"head_dim projection must be [D_in={D_in}, D_out], got {list(matrix.shape)}")
    return kv @ matrix.to(kv.dtype)  # [B, H, T, D_out]


def _check_counts(sharer_layers: int, receiver_layers: int) -> None:
    if sharer_layers < 1 or receiver_layers < 1:
        raise ValueError(f"layer counts must be >= 1, got sharer {sharer_layers}, receiver {receiver_layers}")
