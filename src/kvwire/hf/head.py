"""The output layer of a batched decode step, computed in cache-sized slices of the vocabulary.

Measured on this 2-core CPU (default model, 49,152 x 576 fp32 output layer, 113 MB): one
``F.linear`` of 8 rows takes 11-14 ms, four times one row's 3 ms, although the weights
are read once either way; the same product taken ~910 vocabulary rows at a time (2 MiB of
weights, which stay in cache while all 8 rows use them) takes 7.6 ms, with the same
values (each logit is the same dot product). At 8 rows of 400 tokens that is 9 % of a
decode step. GPUs and single rows gain nothing, so only CPU passes of several rows use it,
and only those :mod:`.linears` leaves to ``F.linear``: on Intel CPUs its products cover
passes of up to 32 rows faster still (8 rows: 6.1 ms), so only longer ones are sliced (48
rows: 20.7 ms against 24.0 ms ``F.linear``); on other CPUs oneDNN covers every pass.

Wired in by swapping the model's output embeddings (``set_output_embeddings``) for the
duration of the engine's forward pass (:func:`sliced_head`), only when they are a plain
``nn.Linear``; anything else is left as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

SLICE_BYTES = 2 << 20  # weights per slice: what stays in a core's share of cache while every row reads it


class SlicedLinear(torch.nn.Module):
    """``linear(x)`` computed over slices of its output features (the same values)."""

    def __init__(self, linear: torch.nn.Linear, slice_bytes: int | None = None, min_rows: int = 256) -> None:
        super().__init__()
        self.linear = linear
        weight = linear.weight
        self.rows = max(min_rows, (slice_bytes or SLICE_BYTES) // (weight.shape[1] * weight.element_size()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.linear.weight, self.linear.bias
        parts = [F.linear(x, weight[i:i + self.rows], None if bias is None else bias[i:i + self.rows])
                 for i in range(0, weight.shape[0], self.rows)]
        return torch.cat(parts, dim=-1)


@contextlib.contextmanager
def sliced_head(model: Any, rows: int) -> Iterator[None]:
    """Within the block, ``model``'s output layer runs in slices if that helps a pass of ``rows`` rows
    (several rows, on the CPU, a plain ``nn.Linear`` larger than one slice); otherwise nothing changes."""
    head = _plain_head(model)
    if head is None or rows < 2 or head.weight.device.type != "cpu" or \
            head.weight.shape[0] * head.weight.shape[1] * head.weight.element_size() <= SLICE_BYTES:
        yield
        return
    model.set_output_embeddings(SlicedLinear(head))
    try:
        yield
    finally:
        model.set_output_embeddings(head)


def _plain_head(model: Any) -> torch.nn.Linear | None:
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return head if type(head) is torch.nn.Linear else None
