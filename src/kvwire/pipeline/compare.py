"""One agent of a comparison: its turn in text mode against its turn in a run that passed caches.

:meth:`kvwire.pipeline.linear.Pipeline.compare` and :meth:`kvwire.pipeline.graph.GraphRunner.compare`
both judge each agent with :func:`compare_agent`, so a note, an ``exact`` verdict and a logit
difference mean the same in either table and JSON (:class:`~.results.AgentComparison`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import hf
from .results import AgentComparison, AgentResult

if TYPE_CHECKING:
    from .agent import Agent

# Runs whose caches claim to be exact: their agents are checked against a recomputation. The others (splice,
# and auto, whose hops may send ids only) are reported by their agreement with text mode, as the CLI does.
CHECKED_MODES: tuple[str, ...] = ("prefix", "graph")


def compare_agent(text: AgentResult, other: AgentResult, agent: Agent | None) -> AgentComparison:
    """Agent ``other`` against the same agent's turn in the text run ``text``.

    - a mode not claimed exact, or a graph merge that spliced (its ``exact_fidelity`` measured):
      the note gives its agreement with text mode; ``exact`` is ``None`` (no claim);
    - an agent whose cache extends a merge's spliced one (``approximate_via``), or came as packets of a
      lossy encoding (``lossy_encoding``: int8, int4, bf16 of an fp32 model): approximate too, with the
      first-token logit difference where both read the same ids;
    - otherwise the claim is checked. Where both generated from the same ids the text run *is* the
      recomputation without an upstream cache; where they did not (a generated turn re-tokenizes
      into other ids), ``agent`` recomputes ``other``'s own context ids from scratch (``None``:
      not checked, ``exact`` False).
    """
    identical = text.output_ids == other.output_ids
    same_context = text.context_ids == other.context_ids
    if other.mode not in CHECKED_MODES or other.exact_fidelity is not None:
        note = "identical" if identical else _agreement(other, "")
        return AgentComparison(other.agent, identical, same_context, None, None, other.fidelity, note)
    if other.approximate_via is not None or other.lossy_encoding is not None:
        diff = _logit_diff(text.first_logits, other) if same_context else None
        why = (f"its cache extends {other.approximate_via}'s spliced cache" if other.approximate_via is not None
               else f"its cache came as {other.lossy_encoding} packets (lossy)")
        note = (f"approximate: {why}; "
                + ("output identical to text mode" if identical else
                   f"{_agreement(other, 'not measured')} with text mode")
                + (f", first-token logits within {diff:.3g}" if diff is not None else ""))
        return AgentComparison(other.agent, identical, same_context, None, diff, other.fidelity, note)
    if same_context:
        exact, diff = identical, _logit_diff(text.first_logits, other)
        note = "identical" if identical else "DIFFERENT output from the same context ids"
    else:
        exact, diff, note = _recomputed(other, identical, agent)
    if not exact and agent is not None and (precision := reduced_precision(agent.model)) is not None:
        note += (f" ({precision}, which is not batch-invariant: a prefill and a decode step round differently "
                 "and a near-tie between two tokens can flip; prefix mode is exact in float32)")
    return AgentComparison(other.agent, identical, same_context, exact, diff, other.fidelity, note)


def reduced_precision(model: Any) -> str | None:
    """How ``model`` computes below float32, in words (its dtype, or its compact weight format), or None."""
    from ..hf.loading import model_dtype
    from ..hf.weights import format_of

    dtype = model_dtype(model)
    if dtype != torch.float32:
        return f"the model computes in {str(dtype).removeprefix('torch.')}"
    weights = format_of(model)
    return None if weights == "fp32" else f"the model's linear layers compute with {weights} weights"


def _recomputed(other: AgentResult, identical: bool, agent: Agent | None) -> tuple[bool, float | None, str]:
    """``other`` (whose context differs from text mode's) against a recomputation of its own ids by
    ``agent``: whether its output equals it, the first-token logit difference, and the note."""
    turns = ", ".join(str(t) for t in other.retokenized_turns)
    why = (f"re-tokenizing generated message(s) {turns} gives other ids" if turns
           else "an upstream agent's reply differs")
    note = f"context differs from text mode: {why}; output "
    if agent is None:
        return False, None, note + f"{'identical' if identical else 'differs'} (not checked against a recomputation)"
    reference = hf.generate(agent.model, other.context_ids, max_new_tokens=agent.spec.new_tokens(agent.index),
                            eos_ids=agent.eos, sampling=agent.sampling)
    exact = reference.tokens == other.output_ids
    note += f"{'equals' if exact else 'DIFFERS from'} a recomputation of its own ids"
    return exact, _logit_diff(reference.first_logits, other), note


def _agreement(other: AgentResult, missing: str) -> str:
    return f"agreement {other.fidelity.agreement:.0%}" if other.fidelity else missing


def _logit_diff(reference: torch.Tensor | None, other: AgentResult) -> float | None:
    """Largest absolute difference of the first generated token's logits (``None``: either is missing)."""
    if reference is None or other.first_logits is None:
        return None
    return float((reference - other.first_logits).abs().max())
