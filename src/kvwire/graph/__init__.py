"""Pipelines as graphs: agents that read the same agent decode together, a merging agent splices or prefills its branches.

In: a :class:`~kvwire.pipefile.PipelineSpec` whose agents name what they read
(``after``), a model, a store. Out: one :class:`~kvwire.results.PipelineResult` per run,
each agent's packet and handoff in the store, and for ``compare`` a
:class:`~kvwire.results.Comparison` against text mode.

- :mod:`.structure` -- checks and orders the graph, and says what each agent's
  conversation holds (pure; no model).
- :mod:`.runner` -- :class:`~.runner.GraphRunner`: runs it layer by layer in text mode or
  with caches (prefix chains, one engine batch per layer, merges spliced or prefilled).
- :mod:`.merge` -- a merging agent's context and cache: the first branch's chain as an
  exact prefix, later branches' segments re-rotated and partly recomputed
  (:func:`kvwire.splice.assemble`) -- or prefilled, when :func:`.merge.plan` finds that cheaper.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "GraphRunner":  # imported on first use: the structure is needed without transformers
        from .runner import GraphRunner

        return GraphRunner
    raise AttributeError(f"module 'kvwire.graph' has no attribute {name!r}")
