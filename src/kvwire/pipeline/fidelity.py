"""Moved to :mod:`kvwire.evals.fidelity` (``hf`` measures with it too, and ``hf`` is below ``pipeline``);
the pipeline's runners and results keep importing it from here."""

from __future__ import annotations

from ..evals.fidelity import Fidelity, mean_kl, measure, token_agreement

__all__ = ["Fidelity", "mean_kl", "measure", "token_agreement"]
