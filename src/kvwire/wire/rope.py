"""Exact RoPE re-rotation of cached keys: move them to other positions, strip, re-apply.

A key ``k`` of head size ``D`` has rotary size ``R = 2 * len(inv_freq)`` (``R < D`` for
partial rotary, e.g. GPT-NeoX, GLM, GPT-J; the last ``D - R`` dims are not rotated).
At position ``p`` pair ``i`` (of ``R/2``) is turned by the angle::

    theta_i = fp32(p * inv_freq[i])

and every element scaled by ``s``, the attention scaling (1.0 except YaRN/longrope).
Models differ in *which* two dims form pair ``i`` -- the :data:`Convention`, named
by every :class:`RopeTable`:

- ``"half"`` (half-split; transformers' Llama family, Qwen, Gemma, GPT-NeoX): pair
  ``i`` is dims ``(i, i + R/2)``::

      cos, sin = cat(cos theta, cos theta) * s, cat(sin theta, sin theta) * s
      k_p      = k[:R] * cos + rotate_half(k[:R]) * sin     rotate_half(x) = cat(-x[R/2:], x[:R/2])

- ``"interleaved"`` (Cohere, GLM, GPT-J, CodeGen, DeepSeek-V2-style): pair ``i`` is
  dims ``(2i, 2i + 1)``::

      cos, sin = repeat_interleave(cos theta, 2) * s, ...
      k_p      = k[:R] * cos + rotate_every_two(k[:R]) * sin
                                              rotate_every_two(x) = [-x1, x0, -x3, x2, ...]

Worked example (R = D = 4, inv_freq = [1, 0.01], a key ``[a, b, c, d]`` turned by
theta = [t0, t1]): half-split turns ``(a, c)`` by t0 and ``(b, d)`` by t1, giving
``[a cos t0 - c sin t0, b cos t1 - d sin t1, c cos t0 + a sin t0, d cos t1 + b sin t1]``;
interleaved turns ``(a, b)`` by t0 and ``(c, d)`` by t1, giving
``[a cos t0 - b sin t0, b cos t0 + a sin t0, c cos t1 - d sin t1, d cos t1 + c sin t1]``.
Rotating with the wrong convention leaves keys about as far from the model's as
random ones (relative error near 1), so :func:`kvwire.hf.rope_tables` never trusts a
config: it measures which convention the model itself uses.

Rotations compose, so moving a key from ``p`` to ``q`` is one more rotation by
``theta_q - theta_p`` *without* ``s`` (the stored key already carries it once; applying
it again would scale twice). Angles reproduce transformers' fp32 products exactly and
the rotation runs in float64, so a moved key matches the key the model computes at
``q`` to float32 rounding (~1e-7 relative), not just to angle-rounding error.

Which RoPE variants can be moved exactly is decided per layer by
:class:`RopeTable` (see :func:`check_positions`): ``default``, ``linear``,
``llama3``, ``yarn`` and ``proportional`` have position-independent frequencies;
``dynamic`` and ``longrope`` only while every position involved stays below the
length at which their frequencies change, and are refused beyond it.

This module is pure torch; :func:`kvwire.hf.rope_tables` reads the tables from a model
and checks them on it (``RopeTable.probe_error``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import PacketError
from .packet import Packet

STATIC_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
BOUNDED_TYPES = frozenset({"dynamic", "longrope"})  # exact only below `limit`
Convention = Literal["half", "interleaved"]  # which dims form a rotated pair (module docstring)
CONVENTIONS: tuple[str, ...] = ("half", "interleaved")


@dataclass(frozen=True)
class RopeTable:
    """One layer's RoPE: frequencies, rotary size, and where moving keys stays exact."""

    inv_freq: torch.Tensor  # fp32 [R/2]
    head_dim: int  # D
    rope_type: str
    attention_scaling: float = 1.0  # already inside cached keys; never re-applied
    limit: int | None = None  # positions must stay < limit (dynamic / longrope)
    convention: Convention = "half"  # pairs (i, i + R/2) or (2i, 2i + 1)
    probe_error: float | None = None  # measured on the model by kvwire.hf.rope_tables; None = never checked

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.numel())

    def __post_init__(self) -> None:
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} exceeds head_dim {self.head_dim}")
        if self.rope_type not in STATIC_TYPES | BOUNDED_TYPES:
            raise PacketError(f"RoPE type {self.rope_type!r} cannot be moved exactly",
                              f"kvwire re-rotates {', '.join(sorted(STATIC_TYPES | BOUNDED_TYPES))}")
        if self.convention not in CONVENTIONS:
            raise ValueError(f"unknown RoPE convention {self.convention!r}; expected one of {CONVENTIONS}")
        if self.rope_type in BOUNDED_TYPES and self.limit is None:
            raise ValueError(f"{self.rope_type} RoPE needs the position limit below which it is static")

    def same_rotation(self, other: RopeTable) -> bool:
        return (self.rope_type == other.rope_type and self.head_dim == other.head_dim
                and self.convention == other.convention and torch.equal(self.inv_freq, other.inv_freq))

    @property
    def checked(self) -> bool:
        """Whether :func:`kvwire.hf.rope_tables` verified this table on the model itself."""
        return self.probe_error is not None


def check_positions(table: RopeTable, *positions: torch.Tensor) -> None:
    """Refuse positions at which ``table``'s frequencies are not the static ones.

    Example: ``dynamic`` with ``limit=2048``: moving keys 100 -> 1900 is exact; moving
    them to 3000 is refused, since the model would rotate position 3000 with stretched
    frequencies that depend on the sequence length at the time.
    """
    for pos in positions:
        if pos.numel() and int(pos.min()) < 0:
            raise PacketError(f"negative position {int(pos.min())}")
        if table.limit is not None and pos.numel() and int(pos.max()) >= table.limit:
            raise PacketError(
                f"{table.rope_type} RoPE changes its frequencies at {table.limit} positions; "
                f"position {int(pos.max())} cannot be re-rotated exactly",
                "keep spliced contexts shorter than that, or re-prefill",
            )


def angles(table: RopeTable, positions: torch.Tensor) -> torch.Tensor:
    """``fp32(positions * inv_freq)`` as transformers computes it, returned as float64 [..., R/2]."""
    inv_freq = table.inv_freq.to(positions.device, torch.float32)
    return (positions.to(torch.float32)[..., None] * inv_freq).to(torch.float64)


def rotate(keys: torch.Tensor, table: RopeTable, from_positions: torch.Tensor,
           to_positions: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, H, T, D]`` rotated at ``from_positions`` -> the same keys at ``to_positions``.

    Positions are ``[T]`` or ``[B, T]`` (per row, e.g. left-padded batches). Values are
    never rotated. Returns a new tensor of the keys' dtype.

    Example: ``rotate(k, table, arange(100, 110), arange(5, 15))`` moves ten keys
    computed at positions 100..109 to 5..14; ``rotate(k5, table, arange(5, 15), arange(100, 110))``
    moves them back (to float rounding).
    """
    B, H, T, D = keys.shape
    if D != table.head_dim:
        raise PacketError(f"keys have head_dim {D}, the RoPE table {table.head_dim}")
    check_positions(table, from_positions, to_positions)
    from_positions, to_positions = from_positions.to(keys.device), to_positions.to(keys.device)
    delta = angles(table, to_positions) - angles(table, from_positions)  # [T, R/2] or [B, T, R/2]
    if delta.shape[-2] != T:
        raise PacketError(f"{delta.shape[-2]} positions given for {T} keys")
    delta = delta if delta.dim() == 3 else delta.expand(B, T, -1)
    cos, sin = delta.cos()[:, None], delta.sin()[:, None]  # [B, 1, T, R/2]
    R = table.rotary_dim
    rot = keys[..., :R].to(torch.float64)
    if table.convention == "half":
        x, y = rot[..., : R // 2], rot[..., R // 2 :]  # pair i = (i, i + R/2)
        rotated = torch.cat([x * cos - y * sin, y * cos + x * sin], dim=-1)
    else:
        x, y = rot[..., 0::2], rot[..., 1::2]  # pair i = (2i, 2i + 1)
        rotated = torch.stack([x * cos - y * sin, y * cos + x * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.to(keys.dtype), keys[..., R:]], dim=-1)


def strip(keys: torch.Tensor, table: RopeTable, positions: torch.Tensor) -> torch.Tensor:
    """Remove the rotation: position-free keys (still carrying any attention scaling)."""
    return rotate(keys, table, positions, torch.zeros_like(positions))


def apply(keys: torch.Tensor, table: RopeTable, positions: torch.Tensor) -> torch.Tensor:
    """Rotate position-free keys (from :func:`strip`) to ``positions``."""
    return rotate(keys, table, torch.zeros_like(positions), positions)


# -- whole packets -----------------------------------------------------------------------------------


def _layer_positions(packet: Packet, layer: int) -> torch.Tensor:
    """Positions of the tokens layer ``layer`` holds: all, or a sliding layer's last ones. [B, T_l]"""
    kept = packet.spec.kept_tokens(layer, packet.length)
    return packet.positions()[:, packet.length - kept:]


def _check_tables(packet: Packet, tables: list[RopeTable]) -> None:
    if len(tables) != packet.spec.num_layers:
        raise PacketError(f"{len(tables)} RoPE tables for a packet of {packet.spec.num_layers} layers")
    if not all(table.checked for table in tables):
        raise PacketError("these RoPE tables were never checked on the model, so moved keys could be silently wrong",
                          "get them from kvwire.hf.rope_tables(model), which measures the model's convention")


def move(packet: Packet, tables: list[RopeTable], start: int) -> Packet:
    """The packet with its keys re-rotated so that its first real token sits at ``start``.

    Values, token ids and mask are shared, not copied. The result is a standalone
    segment (``attention="segment"``, no parent): it no longer continues its chain.
    """
    if packet.rotary != "applied":
        raise PacketError("packet keys are position-free (stripped); use rope.apply_at")
    _check_tables(packet, tables)
    shift = start - packet.start
    keys = tuple(k if shift == 0 else rotate(k, tables[i], _layer_positions(packet, i),
                                              _layer_positions(packet, i) + shift)
                 for i, k in enumerate(packet.keys))
    return packet.with_provenance(keys=keys, start=start, attention="segment", parent=None, parent_checksum=None)


def strip_packet(packet: Packet, tables: list[RopeTable]) -> Packet:
    """A position-free copy: keys un-rotated, to be placed anywhere later with :func:`apply_at`."""
    if packet.rotary != "applied":
        return packet
    _check_tables(packet, tables)
    keys = tuple(strip(k, tables[i], _layer_positions(packet, i)) for i, k in enumerate(packet.keys))
    return packet.with_provenance(keys=keys, rotary="stripped", attention="segment", parent=None,
                                  parent_checksum=None)


def apply_at(packet: Packet, tables: list[RopeTable], start: int) -> Packet:
    """Rotate a position-free packet's keys so that its first real token sits at ``start``."""
    if packet.rotary != "stripped":
        return move(packet, tables, start)
    _check_tables(packet, tables)
    placed = packet.with_provenance(start=start, rotary="applied")
    keys = tuple(apply(k, tables[i], _layer_positions(placed, i)) for i, k in enumerate(packet.keys))
    return placed.with_provenance(keys=keys)
