"""The scheduler's one view of the model: a set of sequences decoded together (:class:`Decoder`).

Sequences join (their uncached prompt tokens prefilled) and leave between decode
steps; each has its own sampling. The scheduler decides when a sequence stops (eos,
max_tokens, stop strings, a client gone) and removes it; removing hands back the
sequence's cache (the K/V of its prompt and every generated token but the last),
which the server publishes.

:class:`OneByOne` is the placeholder until the batched-decode engine of
``kvwire/hf`` lands: it decodes every sequence on its own, one forward per sequence
per step.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import hf


class Decoder(Protocol):
    def add(self, key: Hashable, ids: list[int], cache: Any | None, sampling: hf.Sampling) -> int:
        """Prefill ``ids`` after ``cache`` (which covers their first tokens, or None) and join; return the first
        generated token."""

    def step(self) -> dict[Hashable, int]:
        """One decode step for every sequence: key -> its next token."""

    def remove(self, key: Hashable) -> Any | None:
        """Leave; return the sequence's cache (prompt + generated tokens but the last), or None if unknown."""

    def __len__(self) -> int: ...


@dataclass
class _Row:
    cache: Any
    last: int
    sampling: hf.Sampling
    generator: torch.Generator | None


class OneByOne:
    """Every sequence decoded on its own (a forward per sequence per step): correct, not batched."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: dict[Hashable, _Row] = {}
        self.prefill_s = 0.0

    @torch.inference_mode()
    def add(self, key: Hashable, ids: list[int], cache: Any | None, sampling: hf.Sampling) -> int:
        cache = cache if cache is not None else hf.new_cache(self.model)
        cached = hf.cache_length(cache)
        start = time.perf_counter()
        out = self.model(input_ids=torch.tensor([ids[cached:]]), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
        token = _pick(out.logits[0, -1].float(), sampling, generator)
        self.prefill_s = time.perf_counter() - start
        self.rows[key] = _Row(cache, token, sampling, generator)
        return token

    @torch.inference_mode()
    def step(self) -> dict[Hashable, int]:
        tokens = {}
        for key, row in self.rows.items():
            out = self.model(input_ids=torch.tensor([[row.last]]), past_key_values=row.cache, use_cache=True)
            row.last = _pick(out.logits[0, -1].float(), row.sampling, row.generator)
            tokens[key] = row.last
        return tokens

    def remove(self, key: Hashable) -> Any | None:
        row = self.rows.pop(key, None)
        return None if row is None else row.cache

    def __len__(self) -> int:
        return len(self.rows)


def _pick(logits: torch.Tensor, sampling: hf.Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
