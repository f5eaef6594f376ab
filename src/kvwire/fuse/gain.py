"""A projector's validated gain over the receiver alone: measured in training, recorded, enforced.

A fuser (or the ridge projector) is worth using only if the receiver reads better with it
than without it. Training measures that on what it never trained on, and the checkpoint
records it under ``training["gain"]``::

    {"step": 450,                           the evaluation the checkpoint comes from
     "heldout_nats_per_token": 0.041,       receiver alone - fused, held-out responses (validation modules)
     "heldout_nats_per_char": 0.012,        the same per character (compares across tokenizers)
     "heldout_relative": 0.036,             (alone - fused) / alone, per character
     "control_relative": 0.011,             (control - fused) / alone: the fuser fed another text's sharer
                                            K/V is the control; this much of the gain needs *this* sharer cache
     "mc_points": 2.7, "mc_ci95": [-1.3, 6.7], "mc_items": 150,   bundled multiple choice, fused - alone
     "mc_control_points": 0.7}              fused - control

:func:`check` refuses a projector whose gain is not positive -- held-out loss not at least
:data:`MIN_GAIN` below the receiver's alone, or no more multiple-choice points, or either one not
measured -- or that records none (a ridge fit,
a checkpoint from before gains were recorded), with the figures, unless ``allow_worse``.
Multiple-choice records for the bundled questions come from :func:`question_examples`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import WorseThanAloneError
from .stdlib_qa import Example

log = logging.getLogger(__name__)

ALLOW_HINT = "pass --allow-worse (allow_worse=True) to use it anyway, e.g. to measure it"
MIN_GAIN = 1e-3  # nats per held-out token: a smaller difference is rounding, not a gain


@dataclass(frozen=True)
class Question:
    """A bundled question as training examples: one per option, all with the same prompt."""

    id: str
    examples: tuple[Example, ...]  # option i's text as the response to the question
    answer: int  # index of the right option


def question_examples(count: int, seed: int = 0) -> list[Question]:
    """The first ``count`` bundled questions in the benchmark's fixed shuffle (``benchmarks/fuse.py``
    scores the same ones), each option as a response: scored by its mean log-likelihood per token."""
    from ..evals import load
    from ..hf.scoring import LAYOUTS

    questions = load()
    order = torch.randperm(len(questions), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for i in order[:count]:
        q = questions[i]
        prompt = q.layout(LAYOUTS["loglik_mean"])
        out.append(Question(q.id, tuple(Example(prompt, option, "question", q.topic) for option in q.options),
                            int(q.answer)))
    return out


def figures(best: Any) -> dict[str, Any]:
    """The ``training["gain"]`` entry from the evaluation record ``best`` (an :class:`EvalRecord`)."""
    from ..evals import paired_difference

    out: dict[str, Any] = {"step": best.step,
                           "heldout_nats_per_token": best.baseline_loss - best.loss,
                           "heldout_examples": best.examples}
    if best.loss_per_char is not None and best.baseline_loss_per_char:
        out["heldout_nats_per_char"] = best.baseline_loss_per_char - best.loss_per_char
        out["heldout_relative"] = out["heldout_nats_per_char"] / best.baseline_loss_per_char
        if best.control_loss_per_char is not None:
            out["control_relative"] = (best.control_loss_per_char - best.loss_per_char) / best.baseline_loss_per_char
    if best.control_accuracy is not None and best.accuracy is not None:  # the choice objective, held out
        out.update(heldout_choice_accuracy=best.accuracy, heldout_choice_alone=best.baseline_accuracy,
                   heldout_choice_control=best.control_accuracy)
    if best.mc_outcomes:
        fused, alone = best.mc_outcomes["fused"], best.mc_outcomes["alone"]
        diff, low, high = paired_difference(fused, alone)
        out.update(mc_points=100 * diff, mc_ci95=[100 * low, 100 * high], mc_items=len(fused),
                   mc_accuracy=sum(fused) / len(fused), mc_alone_accuracy=sum(alone) / len(alone))
        if best.mc_outcomes.get("control"):
            control = best.mc_outcomes["control"]
            out["mc_control_points"] = 100 * (sum(fused) - sum(control)) / len(fused)
    return out


def is_positive(gain: Mapping[str, Any] | None) -> bool:
    """Held-out loss at least :data:`MIN_GAIN` below the receiver alone's, *and* more of the bundled
    questions right: both must be measured (a run with ``eval_questions=0`` records no questions, and
    a lower held-out loss alone is what a plain adapter also gets)."""
    if not gain or not isinstance(gain.get("heldout_nats_per_token"), (int, float)):
        return False
    if not gain["heldout_nats_per_token"] >= MIN_GAIN:
        return False
    points = gain.get("mc_points")
    return isinstance(points, (int, float)) and points > 0


def describe(gain: Mapping[str, Any] | None) -> str:
    """One line of figures: ``held-out -0.041 nats/token (3.6 % per char), questions +2.7 points [-1.3, +6.7]``."""
    if not gain:
        return "no validated gain recorded"
    parts = []
    if isinstance(gain.get("heldout_nats_per_token"), (int, float)):
        parts.append(f"held-out loss {-gain['heldout_nats_per_token']:+.3f} nats/token against the receiver alone")
    if isinstance(gain.get("heldout_relative"), (int, float)):
        parts[-1] += f" ({-100 * gain['heldout_relative']:+.1f} % per character)"
    if isinstance(gain.get("control_relative"), (int, float)):
        parts.append(f"{100 * gain['control_relative']:+.1f} % below the other-context control")
    if isinstance(gain.get("mc_points"), (int, float)):
        low, high = (gain.get("mc_ci95") or [float("nan")] * 2)[:2]
        parts.append(f"questions {gain['mc_points']:+.1f} points [{low:+.1f}, {high:+.1f}] over "
                     f"{gain.get('mc_items', '?')} items")
    elif parts:
        parts.append("the bundled questions not measured (train with --eval-questions)")
    return "; ".join(parts) or "no validated gain recorded"


def check(config: Any, where: str, allow_worse: bool = False) -> None:
    """Refuse the projector of checkpoint ``config`` unless its recorded gain is positive."""
    gain = dict(config.training or {}).get("gain")
    if is_positive(gain):
        return
    figures_line = describe(gain)
    if allow_worse:
        log.warning("using %s although it does not help the receiver: %s", where, figures_line)
        return
    raise WorseThanAloneError(
        f"{where} ({config.kind}) does not make the receiver better: {figures_line}",
        ("train a better one (kvwire train-fuser), or " if config.kind == "fuser" else "") + ALLOW_HINT)


def control_index(n: int, other: int) -> torch.Tensor:
    """For a context of ``n`` receiver tokens read against another context of ``other`` tokens:
    which of the other's tokens each one reads, spread proportionally.

    Example: ``control_index(4, 2)`` -> ``[0, 0, 1, 1]``; ``control_index(2, 4)`` -> ``[0, 2]``.
    """
    return (torch.arange(n) * other // max(n, 1)).clamp(max=max(other - 1, 0))


def kl_sum(fused: torch.Tensor, alone: torch.Tensor) -> torch.Tensor:
    """``sum_t KL(alone_t || fused_t)`` over rows of logits ``[n, V]``: what a control row is trained on."""
    target = torch.log_softmax(alone.float(), dim=-1)
    return torch.nn.functional.kl_div(torch.log_softmax(fused, dim=-1), target, log_target=True, reduction="sum")


def option_means(logits: Sequence[torch.Tensor], tails: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each option's mean log-likelihood per token ``[K]`` (``logits[i]`` over option i's tail: the last
    prompt token, the option, its end-of-turn token, which is not counted); differentiable."""
    means = []
    for lg, tail in zip(logits, tails):
        targets = tail[1:-1]  # the option's tokens, after the last prompt token
        means.append(torch.log_softmax(lg[: targets.numel()].float(), dim=-1).gather(1, targets[:, None]).mean())
    return torch.stack(means)


def option_scores(logits: Sequence[torch.Tensor], records: Sequence[Any]) -> list[float]:
    """Each option's mean log-likelihood per token (its end-of-turn token not counted), as floats."""
    return option_means(logits, [r.tail_ids for r in records]).tolist()
