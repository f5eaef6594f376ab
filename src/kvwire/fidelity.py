"""How far an approximate mode's output is from the text-mode reference.

- *token agreement*: share of positions where the candidate's greedy tokens equal the
  reference's (missing tokens count as different), and the first position where
  they differ;
- *KL*: mean over the reference's tokens of KL(reference || candidate) between the
  next-token distributions, both teacher forced on the reference output -- how far
  the candidate's beliefs are, even where its argmax agrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fidelity:
    agreement: float  # in [0, 1]
    first_divergence: int | None  # None: identical
    kl: float | None  # nats per token; None when not measured

    def to_json(self) -> dict[str, float | int | None]:
        return {"agreement": self.agreement, "first_divergence": self.first_divergence, "kl": self.kl}


def token_agreement(reference: list[int], candidate: list[int]) -> tuple[float, int | None]:
    """Example: ref [1, 2, 3, 4], cand [1, 2, 9, 4, 5] -> (3/5, 2)."""
    longest = max(len(reference), len(candidate))
    if longest == 0:
        return 1.0, None
    same = sum(a == b for a, b in zip(reference, candidate))
    first = next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b), None)
    if first is None and len(reference) != len(candidate):
        first = min(len(reference), len(candidate))
    return same / longest, first


def mean_kl(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> float:
    """Mean KL(P_ref || P_cand) over positions; logits [n, V], computed in float64."""
    if reference_logits.shape != candidate_logits.shape:
        raise ValueError(f"logits shapes differ: {list(reference_logits.shape)} vs {list(candidate_logits.shape)}")
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    cand = torch.log_softmax(candidate_logits.double(), dim=-1)
    return float((ref.exp() * (ref - cand)).sum(-1).mean())


def measure(reference: list[int], candidate: list[int], reference_logits: torch.Tensor | None = None,
            candidate_logits: torch.Tensor | None = None) -> Fidelity:
    agreement, first = token_agreement(reference, candidate)
    kl = None
    if reference_logits is not None and candidate_logits is not None:
        kl = mean_kl(reference_logits, candidate_logits)
    return Fidelity(agreement, first, kl)
