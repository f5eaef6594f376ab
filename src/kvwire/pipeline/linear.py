"""Agents that share one conversation, passing text or KV-cache packets through a store.

Each agent (:class:`kvwire.pipeline.agent.Agent`) appends its own instruction turn to the
conversation and generates a reply, reading the conversation under its system
prompt (the pipeline's, or its own). Modes:

- ``text``: the baseline frameworks use today. The next agent renders and
  tokenizes the whole conversation from strings and prefills all of it.
- ``prefix``: every agent shares one system prompt, so its context extends the
  sender's. It assembles the upstream packet chain into a cache and prefills only
  its own new tokens. Exact: greedy output equals a recomputation from the same ids.
- ``splice``: agents have private system prompts. Each one splices the upstream
  agents' turns into its own context, re-rotated, with selective recomputation
  (:class:`kvwire.kv.splice.Recompute`). Approximate: measured against text.

Agents may run their own models (``agent_models``) and pipelines may run several
rounds (A -> B -> C -> A ...). :meth:`Pipeline.compare` runs ``text`` and another mode
on one model in one process and reports speedup, ideal speedup, efficiency and
fidelity (:class:`kvwire.pipeline.results.Comparison`).
"""

from __future__ import annotations

import logging
import resource
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..kv import chain, splice
from .. import hf
from .agent import MODES, Agent, Freshness, Mode, build_agents
from ..wire.options import CodecOptions
from .cost import CostModel
from .cost import measure as probe_costs
from ..errors import ContextTooLong, KvwireError, PipelineConfigError
from .fidelity import measure
from .handoff import Handoff
from .spec import PipelineSpec
from .compare import compare_agent
from .results import AgentResult, Comparison, PipelineResult
from ..wire.spec import ModelSpec
from ..store import Store, open_store

log = logging.getLogger(__name__)

Event = Callable[[dict[str, Any]], None]
BeforeTurn = Callable[["Pipeline", int, int], None]  # (pipeline, round, agent index)

__all__ = ["MODES", "Mode", "Pipeline", "Freshness", "AgentResult", "PipelineResult", "Comparison"]


class Pipeline:
    """Run a :class:`PipelineSpec`: agents take turns in order, exchanging through ``store``."""

    def __init__(self, model: Any, tokenizer: Any, spec: PipelineSpec, *, store: Store | str = "memory://",
                 model_spec: ModelSpec | None = None, sampling: hf.Sampling | None = None,
                 recompute: splice.Recompute | None = None, placement: splice.Placement = "end",
                 freshness: Freshness | None = None, agent_models: dict[str, Any] | None = None,
                 cost: CostModel | None = None, codec_options: CodecOptions | None = None,
                 on_event: Event | None = None, splice_when: splice.When = "cheaper") -> None:
        if not spec.graph.is_linear:
            raise PipelineConfigError(f"pipeline {spec.name!r} is a graph (agents name what they read with 'after')",
                                      "run it with kvwire.graph.GraphRunner (kvwire run does)")
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.store = open_store(store) if isinstance(store, str) else store
        self.cache_spec = model_spec or hf.model_spec(model)
        self.on_event = on_event or (lambda event: None)
        self.agents = build_agents(spec, model, self.cache_spec, tokenizer, self.store, agent_models,
                                   sampling=sampling, recompute=recompute, placement=placement, freshness=freshness,
                                   cost=cost, codec_options=codec_options, splice_when=splice_when)
        self.recompute = self.agents[0].recompute
        self.placement = placement

    def measure_costs(self, force: bool = False) -> CostModel:
        """Probe the store and the model once (about a second) for mode ``auto``'s decisions."""
        if force or any(agent.cost is None for agent in self.agents):
            agent = self.agents[0]
            measured = probe_costs(self.store, self.model, self.cache_spec.kv_bytes(1), spec=self.cache_spec,
                                   options=agent.codec_options)
            log.info("costs measured: %s", measured.to_json())
            for agent in self.agents:
                agent.cost = agent.cost if agent.cost is not None and not force else measured
        return self.agents[0].cost  # type: ignore[return-value]

    def release(self, session: str) -> int:
        """Delete a finished session's handoffs and the packets they reference; returns keys removed.

        Packets are content-addressed and may be shared with other sessions that reached
        the same context, so release only sessions whose packets nobody else reads.
        """
        removed = 0
        for key in self.store.keys(f"sessions/{session}/"):
            data = self.store.get(key)
            if data is not None:
                handoff = Handoff.from_bytes(data, key, self.agents[0].codec_options.key_bytes)
                heads = ([handoff.packet] if handoff.packet else []) + [p for p, _ in handoff.segments]
                removed += sum(chain.release(self.store, head) for head in heads)
            removed += self.store.delete(key)
        return removed

    def agent(self, name: str) -> Agent:
        for agent in self.agents:
            if agent.name == name:
                return agent
        raise PipelineConfigError(f"pipeline {self.spec.name!r} has no agent {name!r}")

    def update_model(self, name: str, model: Any) -> ModelSpec:
        """Give agent ``name`` new weights. Its packets of the old weights stop being used:
        receivers check fingerprints, so any cache the old weights made is rebuilt, not used."""
        agent = self.agent(name)
        old = agent.cache_spec.fingerprint
        new = agent.use_model(model)
        log.info("%s: weights updated (fingerprint %s -> %s)", name, old[:12], new.fingerprint[:12])
        return new

    # -- running ---------------------------------------------------------------------------------

    def run(self, mode: Mode, session: str | None = None, reference: PipelineResult | None = None,
            keep_logits: bool = False, rounds: int = 1, before_turn: BeforeTurn | None = None) -> PipelineResult:
        """Run every agent ``rounds`` times in order (round 2 continues round 1's conversation).

        With a ``reference`` run (text mode, kept logits), each agent also measures its
        fidelity against the reference's agent. ``before_turn(pipeline, round, index)``
        runs before each turn (e.g. to update an agent's weights mid-run).
        """
        if mode not in MODES:
            raise KvwireError(f"unknown mode {mode!r}", f"use one of {', '.join(MODES)}")
        if mode in ("prefix", "auto") and not self.spec.shared_system:
            raise PipelineConfigError(f"pipeline {self.spec.name!r} gives agents private system prompts, so no "
                                      "agent's context extends another's", "use splice mode (or text)")
        if rounds < 1:
            raise KvwireError(f"rounds must be >= 1, got {rounds}")
        if mode != "text":  # a model whose cache kvwire cannot pass is refused before any turn is spent
            for agent in self.agents:
                hf.check_model_layout(agent.model, agent.cache_spec)
        if mode == "splice":
            self.check_splice()
        if mode == "auto":
            self.measure_costs()
        session = session or uuid.uuid4().hex[:12]
        results: list[AgentResult] = []
        upstream: str | None = None
        measuring = 0.0  # time spent on fidelity probes: not part of the pipeline's cost
        peak_store = 0
        start = time.perf_counter()
        for round in range(rounds):
            for index, agent in enumerate(self.agents):
                if before_turn is not None:
                    before_turn(self, round, index)
                self.on_event({"event": "agent_start", "mode": mode, "index": index, "round": round,
                               "agent": agent.name, "agents": len(self.agents)})
                ref = reference.agents[len(results)] if reference is not None else None
                try:
                    result, upstream, spent = agent.turn(mode, session, upstream, round=round, reference=ref,
                                                         keep_logits=keep_logits)
                except ContextTooLong as error:  # name the agent; the turns done so far are not lost
                    where = f"{index + 1} of {len(self.agents)}" + (f", round {round + 1}" if rounds > 1 else "")
                    raise ContextTooLong(f"agent {agent.name!r} ({where}): {error.message}", error.hint,
                                         finished=tuple(results)) from None
                measuring += spent
                results.append(result)
                mark = time.perf_counter()  # a file store scans its directory: keep that out of the timing
                peak_store = max(peak_store, self.store.used_bytes)
                measuring += time.perf_counter() - mark
                self.on_event({"event": "agent_done", "mode": mode, "index": index, "round": round,
                               "result": result})
        settings = self.recompute.describe() + ("" if self.placement == "end" else f",positions={self.placement}")
        events = Counter(event.split(":", 1)[0] for r in results for event in r.events)
        return PipelineResult(self.spec.name, mode, self.store.url, session, results,
                              time.perf_counter() - start - measuring, settings if mode == "splice" else "",
                              rebuilds=dict(events), peak_store_bytes=peak_store,
                              peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def check_splice(self) -> None:
        """Splice mode places each agent's turns by their tokens under its own system prompt; an agent
        without one gets the chat template's default system turn, which no segment accounts for.
        :class:`PipelineConfigError` naming such agents."""
        bare = [a.name for i, a in enumerate(self.spec.agents) if not self.spec.system_for(i)]
        if bare and not self.spec.shared_system and hf.default_system_prompt(self.tokenizer):
            raise PipelineConfigError(
                f"pipeline {self.spec.name!r}: {'agent' if len(bare) == 1 else 'agents'} {', '.join(bare)} "
                f"{'has' if len(bare) == 1 else 'have'} no system prompt while others have "
                "private ones; this model's chat template then writes a default system turn of its own, which "
                "splice mode cannot place", "give those agents a system prompt (system = \"...\")")

    def compare(self, mode: Mode = "prefix", verify_exact: bool = True, candidate_first: bool = False,
                kl: bool | None = None) -> Comparison:
        """Run ``text`` and ``mode`` and compare them agent by agent.

        Every agent's fidelity against text mode is measured: greedy token agreement,
        and with ``kl`` (default: for splice) the teacher-forced next-token KL, which
        needs text to run first and keep its logits. ``candidate_first`` swaps the order
        (benchmarks alternate it to cancel drift). Where both modes generated from the
        same ids, the text run *is* the recomputation without an upstream cache; where
        they did not (a generated turn re-tokenizes differently), ``verify_exact``
        recomputes the prefix agent's context from scratch.
        """
        if mode == "splice":
            self.check_splice()  # before the text run, not after it
        kl = (mode == "splice") if kl is None else kl
        if kl and candidate_first:
            raise ValueError("the KL needs text mode's logits first: candidate_first=False")
        if kl:
            text = self.run("text", keep_logits=True)
            other = self.run(mode, reference=text)
        else:
            other = self.run(mode) if candidate_first else None
            text = self.run("text")
            other = other or self.run(mode)
            for t, o in zip(text.agents, other.agents):
                o.fidelity = measure(t.output_ids, o.output_ids)
        return Comparison(text, other, [compare_agent(t, o, self.agent(o.agent) if verify_exact else None)
                                        for t, o in zip(text.agents, other.agents)])
