"""Pipelines of agents: what they are (a TOML spec), how each takes its turn, how runs are measured.

In: a :class:`~kvwire.pipeline.spec.PipelineSpec` (agents, their instructions, who reads
whom), a model, a store. Out: one :class:`~kvwire.pipeline.results.PipelineResult` per
run, each agent's packet and handoff in the store, and for ``compare`` a
:class:`~kvwire.pipeline.results.Comparison` against text mode.

- :mod:`.spec` -- :class:`~.spec.PipelineSpec` read from TOML, and its :class:`~.spec.Graph`:
  who reads whom, in which order, what each agent's conversation holds (pure; no model).
- :mod:`.transcript` -- a chat transcript whose token ids match the chat template.
- :mod:`.handoff` -- what agents leave each other in the store (small JSON).
- :mod:`.turn` -- one turn in phases (receive, build the context, prefill, decode, publish, result,
  fidelity), shared by both runners, and one strategy object per mode (text, prefix, splice, auto).
- :mod:`.agent` -- one agent: its model, and its turn composed from those phases.
- :mod:`.linear` -- :class:`Pipeline`: agents that share one conversation, one after another.
- :mod:`.graph` -- :class:`~.graph.GraphRunner`: a graph run layer by layer, agents that read
  the same agent decoding together.
- :mod:`.merge` -- a merging agent's context and cache, its branches spliced or prefilled.
- :mod:`.worker` -- one agent in its own process (``kvwire agent``), riding out store faults.
- :mod:`.results`, :mod:`.fidelity` -- what runs produce, and how far a mode is from text.
- :mod:`.compare` -- one agent of a comparison against text mode, for both runners.
- :mod:`.cost`, :mod:`.breakeven` -- when sending a cache is worth it, here and beyond.
- :mod:`.evaluation` -- ``kvwire eval``: a pipeline over a task set in several modes, judged by the tasks'
  checkers (:mod:`kvwire.evals`), one result line per (task, mode).

The runners need transformers: :class:`Pipeline` and :class:`~.graph.GraphRunner` are
imported on first use, so the spec is read without it.
"""

from __future__ import annotations

from typing import Any

_LINEAR = ("MODES", "Mode", "Pipeline", "Freshness", "AgentResult", "PipelineResult", "Comparison")


def __getattr__(name: str) -> Any:
    if name in _LINEAR:
        from . import linear

        return getattr(linear, name)
    if name == "GraphRunner":
        from .graph import GraphRunner

        return GraphRunner
    raise AttributeError(f"module 'kvwire.pipeline' has no attribute {name!r}")
