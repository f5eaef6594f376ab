"""Token embeddings kept as the 8-bit block codes they were made from, looked up to the very same fp32 values.

A model converted from a GGUF holds fp32 embeddings that are exactly ``s * q`` in every block of 16 values along a
row: ``q`` a small integer code, ``s`` one scale a block. A ``Q8_0`` table's codes are in [-127, 127] under an fp16
scale a block of 32 (two of our blocks); a ``Q6_K`` table's (Qwen2.5-Coder-0.5B's ``Q4_K_M`` GGUF) in [-32, 31]
under ``d * sc``, an fp16 scale times an int8 one, a signed scale a block of 16; both products are exact in fp32.
The compact formats (:mod:`.weights`) convert the linears and left the embeddings fp32: for Qwen2.5-Coder-0.5B
545 MB of its 1.1 GB in int8, where llama.cpp keeps the GGUF's codes. A lookup reads a row per token, so nothing is
gained by keeping the table widened.

:func:`code_embeddings` finds such a table and keeps its codes (int8) and scales (fp32) instead, 0.31x the bytes; a
lookup widens the rows it reads, ``codes * scale``, to the bits the table held. Nothing is approximated: the table
is replaced only when every block, recomputed from its codes, equals the table bit for bit (signed zeros and NaNs
included); any other table stays as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

BLOCK = 16  # values a scale covers (GGUF's K-quants' sub-blocks; Q8_0's blocks of 32 are two of them)
_ROWS = 4096  # rows checked at a time: one block of rows' temporaries, not the table's
_SAMPLE = 64  # rows checked first, so that a table of other values is refused at once
# the largest code of a block, tried in turn (Q6_K's: 32, 30, ..., most often; Q8_0's pairs come first)
_LARGEST = (*range(32, 0, -2), *range(31, 0, -2), *range(127, 32, -1))  # K-quants' first, evens first


class CodedEmbedding(torch.nn.Module):
    """An embedding table held as int8 ``codes [vocab, hidden]`` and fp32 ``scales [vocab, hidden / BLOCK]``; a
    lookup returns ``codes[ids] * scales[ids]`` block by block, in fp32."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.codes = torch.nn.Parameter(codes, requires_grad=False)
        self.scales = torch.nn.Parameter(scales, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes[ids]
        blocks = codes.view(*codes.shape[:-1], -1, BLOCK).float() * self.scales[ids].unsqueeze(-1)
        return blocks.flatten(-2)

    def dequantized(self) -> torch.Tensor:
        """The whole table in fp32 ``[vocab, hidden]``: the bits it was made from."""
        return self(torch.arange(self.num_embeddings, device=self.codes.device))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 codes in blocks of {BLOCK}"


def block_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes, scales)`` that give ``weight`` back bit for bit, or None where it is not such a table (not fp32, a
    row not a whole number of blocks, or a block that is not exactly a code in [-127, 127] times its scale)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.is_meta:
        return None
    return codes_by_rows(lambda start, stop: weight[start:stop].detach(), *weight.shape, device=weight.device)


def codes_by_rows(rows_of: Callable[[int, int], torch.Tensor], rows: int, hidden: int,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`block_codes` of an fp32 table ``[rows, hidden]`` read a block of rows at a time, ``rows_of(start,
    stop)`` (a loader reads them from the checkpoint: the fp32 table is never held whole)."""
    if hidden % BLOCK or rows < 1:
        return None
    sample = rows_of(0, min(rows, _SAMPLE))
    pairs = hidden % (2 * BLOCK) == 0 and _coded(sample, pairs=True, single=False) is not None
    if not pairs and _coded(sample, pairs=False) is None:
        return None
    codes = torch.empty(rows, hidden, dtype=torch.int8, device=device)
    scales = torch.empty(rows, hidden // BLOCK, dtype=torch.float32, device=device)
    for start in range(0, rows, _ROWS):
        found = _coded(rows_of(start, min(rows, start + _ROWS)), pairs=pairs)
        if found is None:
            return None
        codes[start:start + _ROWS], scales[start:start + _ROWS] = found
    return codes, scales


def _coded(part: torch.Tensor, pairs: bool, single: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`block_codes` of a few rows. A block's scale is its largest magnitude over its largest code, signed
    as its zeros are (``s * 0`` is -0.0 for a negative ``s``): exact in fp32 for the right largest code, since the
    table's product was exact. With ``pairs`` Q8_0's is tried first: 127 over a pair of blocks (a table is one
    kind or the other: :func:`block_codes` asks its first rows); then, with ``single``, each block still
    unexplained tries :data:`_LARGEST` in turn. A block of zeros has the scale +0.0 and the code -1 where its zero
    is -0.0."""
    blocks = part.reshape(-1, BLOCK)
    largest = blocks.abs().amax(dim=-1)
    if not bool(torch.isfinite(largest).all()):  # NaN or inf: no scale gives them back
        return None
    negative = ((blocks == 0) & torch.signbit(blocks)).any(dim=-1)
    codes = torch.zeros(blocks.shape, dtype=torch.int8, device=part.device)
    scales = torch.zeros(blocks.shape[0], dtype=torch.float32, device=part.device)
    left = torch.arange(blocks.shape[0], device=part.device)
    if pairs:  # Q8_0: 127 the largest code of a block of 32
        pair = largest.view(-1, 2).amax(dim=-1).repeat_interleave(2)
        left = _explain(blocks, left, pair / 127, negative.view(-1, 2).any(dim=-1).repeat_interleave(2), codes,
                        scales)
    for code in _LARGEST if single else ():
        if not len(left):
            break
        left = _explain(blocks, left, largest[left] / code, negative[left], codes, scales)
    if len(left):
        return None
    return codes.reshape(part.shape), scales.reshape(part.shape[0], -1)


def _explain(blocks: torch.Tensor, left: torch.Tensor, magnitude: torch.Tensor, negative: torch.Tensor,
             codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Try the scale ``magnitude`` (signed by ``negative``) on the blocks ``left`` (indices); record the codes and
    scales of those it gives back bit for bit, and return the indices of the others."""
    if len(magnitude) != len(left):
        magnitude, negative = magnitude[left], negative[left]
    scale = torch.where(negative & (magnitude > 0), -magnitude, magnitude)
    chosen = blocks[left]
    # times the reciprocal: within an ulp of the code where the scale is right, which rounding absorbs (and the
    # check below refuses any block it did not)
    q = (chosen * torch.where(scale == 0, 1.0, scale).reciprocal()[:, None]).round_().add_(0.0)  # -0.0 -> 0
    if bool((scale == 0).any()):
        q = torch.where(scale[:, None] == 0, torch.signbit(chosen) * -1.0 + 0.0, q)  # zero scale: -1 * 0 = -0.0
    # |q| <= the largest code <= 127, as every |value| <= the block's largest (and all are finite: _coded)
    exact = ((q * scale[:, None]).view(torch.int32) == chosen.view(torch.int32)).all(dim=-1)
    done = left[exact]
    codes[done], scales[done] = q[exact].to(torch.int8), scale[exact]
    return left[~exact]


def plain_table(model: Any) -> torch.nn.Embedding | None:
    """``model``'s input embeddings where they could be kept as codes: a plain ``torch.nn.Embedding`` without
    max_norm, not shared with the output layer (tied, the output layer multiplies by the table whole)."""
    try:
        table = model.get_input_embeddings()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except (AttributeError, NotImplementedError):  # not a transformers model, or one that names no embeddings
        return None
    if type(table) is not torch.nn.Embedding or table.max_norm is not None:
        return None
    if head is not None and getattr(head, "weight", None) is table.weight:
        return None
    return table


def code_embeddings(model: Any) -> bool:
    """Replace ``model``'s input embeddings (a :func:`plain_table`) by a :class:`CodedEmbedding` where they are
    exactly 8-bit block codes. Returns whether it did."""
    table = plain_table(model)
    found = None if table is None else block_codes(table.weight)
    if found is None:
        return False
    model.set_input_embeddings(CodedEmbedding(*found))
    log.debug("embeddings kept as 8-bit block codes: %d x %d", *found[0].shape)
    return True
