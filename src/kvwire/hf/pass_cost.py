"""What a forward pass of this model costs on this machine, in tokens prefilled: the figure that decides whether
splicing a few upstream tokens pays (:func:`kvwire.kv.splice.estimate`).

A pass streams every weight once whatever its rows, so on a CPU it costs a fixed part plus a part per row. How
the two compare depends on the model, its weight format and the machine: on a 2-core AMD EPYC (AVX2) SmolLM2-135M
pays 47 rows' worth a pass (2.1 ms a row), Qwen2.5-Coder-0.5B in int8 37 (6.5 ms a row), and splice's prior
(:data:`kvwire.kv.splice.FIXED_TOKENS`, 100, fitted when a splice ran four passes) reads them wrong: the server
with the coder in int8 prefilled every pasted completion of 100-165 tokens. So the fixed part is measured, once
per model, through :func:`.generation.generate` (each pass's rows pick their linear-layer product there, as in a
splice): 1.2 s for the default model, 3 s for the coder in int8.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

# the two prefill lengths the fit reads: beyond the rows int8's kernel takes (up to 48, weights.KERNEL_ROWS), so both
# time the product a splice's last pass and a prefill of a completion take, and under a chunk
SHORT, LONG = 64, 128


@dataclass(frozen=True)
class PassCost:
    """A forward pass costs ``fixed_tokens`` + its rows, in tokens prefilled at ``token_s`` seconds each."""

    fixed_tokens: float
    token_s: float

    def __post_init__(self) -> None:
        if not (0.0 <= self.fixed_tokens < float("inf")) or not (0.0 < self.token_s < float("inf")):
            raise ValueError(f"a pass cost needs a finite fixed_tokens >= 0 and token_s > 0, got {self}")

    def describe(self) -> str:
        return f"a pass costs {self.fixed_tokens:.0f} tokens + its rows, {1e3 * self.token_s:.1f} ms a token"


def fit(short_s: float, long_s: float, short: int = SHORT, long: int = LONG) -> PassCost:
    """The line through two prefill timings (``short`` and ``long`` tokens): its slope per token and its intercept
    in tokens (0 where noise put it below)."""
    if not long > short > 0:
        raise ValueError(f"fit needs 0 < short < long tokens, got {short} and {long}")
    token_s = max(long_s - short_s, 1e-9) / (long - short)
    return PassCost(max(0.0, short_s / token_s - short), token_s)


_MEASURED: weakref.WeakKeyDictionary[Any, PassCost] = weakref.WeakKeyDictionary()


@torch.inference_mode()
def measure_pass_cost(model: Any, repeats: int = 2) -> PassCost:
    """:func:`fit` on ``model``'s own prefills of :data:`SHORT` and :data:`LONG` tokens (each the fastest of
    ``repeats`` after a warm-up). Measured once per model object and remembered."""
    known = _MEASURED.get(model)
    if known is not None:
        return known
    from .generation import generate

    vocab = max(4, min(model.config.get_text_config(decoder=True).vocab_size, 10_000))
    ids = torch.randint(3, vocab, (LONG,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[int, list[float]] = {SHORT: [], LONG: []}
    for _ in range(repeats + 1):
        for n in times:
            times[n].append(generate(model, ids[:n], max_new_tokens=1, eos_ids=frozenset()).prefill_s)
    cost = fit(min(times[SHORT][1:]), min(times[LONG][1:]))
    _MEASURED[model] = cost
    return cost


def known_pass_cost(model: Any) -> PassCost | None:
    """The cost :func:`measure_pass_cost` measured for ``model``, if it has (nothing is measured here)."""
    return _MEASURED.get(model)

