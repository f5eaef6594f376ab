"""Accuracy with a 95% confidence interval, and the difference between two systems.

- :func:`wilson`: the Wilson score interval for a binomial proportion. Unlike the normal
  approximation it stays inside [0, 1] and behaves at small n and near 0 or 1.
- :func:`paired_difference`: accuracy of A minus accuracy of B on the *same* items, with a
  percentile bootstrap interval over items (resampling items keeps the pairing, so the
  interval is much tighter than two separate Wilson intervals would suggest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile


@dataclass(frozen=True)
class Accuracy:
    correct: int
    total: int
    low: float  # 95% Wilson interval
    high: float

    @property
    def value(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def to_json(self) -> dict[str, float | int | str]:
        return {"accuracy": self.value, "correct": self.correct, "total": self.total, "ci95_low": self.low,
                "ci95_high": self.high, "ci_method": "wilson"}

    def __str__(self) -> str:
        return f"{100 * self.value:.1f}% [{100 * self.low:.1f}, {100 * self.high:.1f}] ({self.correct}/{self.total})"


def wilson(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval. Example: 80 of 100 -> (0.711, 0.867); 0 of 10 -> (0.0, 0.278)."""
    if total <= 0:
        raise ValueError("total must be positive")
    if not 0 <= correct <= total:
        raise ValueError(f"correct={correct} outside [0, total={total}]")
    p = correct / total
    denom = 1 + z * z / total
    center = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    low = 0.0 if correct == 0 else max(0.0, center - half)  # exact at the ends (rounding aside)
    high = 1.0 if correct == total else min(1.0, center + half)
    return low, high


def accuracy(correct: Sequence[bool]) -> Accuracy:
    """Accuracy of a list of per-item outcomes, with its 95% Wilson interval."""
    k, n = int(sum(bool(c) for c in correct)), len(correct)
    low, high = wilson(k, n)
    return Accuracy(k, n, low, high)


def paired_difference(a: Sequence[bool], b: Sequence[bool], resamples: int = 10_000,
                      seed: int = 0) -> tuple[float, float, float]:
    """``(acc(a) - acc(b), low, high)``: a 95% percentile bootstrap over items (same items, paired)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired outcomes must be non-empty and of equal length, got {len(a)} and {len(b)}")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)
