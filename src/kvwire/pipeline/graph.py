"""Run a pipeline graph layer by layer: in text mode, or with caches and batched decoding.

``text`` -- the baseline frameworks use today: agents one at a time (in layered order),
each rendering and tokenizing its whole conversation from strings and prefilling it.

``graph`` -- every agent gets a cache for what it reads, and each layer decodes together:

- an agent with one upstream agent receives that agent's chain: its context extends the
  chain's, so the cache is exact (prefix mode). The agents of a layer that read the same
  upstream (a *fan-out*) receive it once and share it: one :class:`kvwire.hf.Prefix` that
  every row of the layer's engine batch attends to once per step (no copy per agent);
- a merging agent (several upstreams) continues its first branch's chain exactly, then either
  prefills the later branches (exact: ``merge="prefill"``, the default) or splices them (:mod:`.merge`:
  approximate, its fidelity measured against an exact recomputation of its own ids and against text):
  ``merge="auto"`` picks the cheaper by :func:`.merge.plan`, ``"splice"`` forces it. Why exact by default: a
  later branch was computed without the earlier ones, so spliced it lacks the cross-candidate attention a judge
  reads with (the ACL 2026 failure mode). Measured on HumanEval's judge graph (BENCHMARKS.md, section 11):
  spliced at R = 0.15 the judge's final answer was text mode's on 73 % of tasks, prefilled on 100 %, for 1.47x
  end to end against 1.57x -- the fan-out batch and the first branch's chain, both exact, give most of the gain;
- each layer's agents are one :class:`kvwire.hf.Engine` batch (per model), each with its
  own instruction tokens and stopping; each publishes its own packet and handoff.

With ``batch=False`` each agent decodes alone (``hf.generate``, its own copy of the cache):
the cache's gain without batching's. Models with sliding-window layers decode one at a
time, and their merges prefill the later branches (selective recompute needs every slot).

A round runs the whole graph; the first agent of the next round reads every agent no one
read in this one -- the last agent, or, with several, a merge of them (see :class:`kvwire.pipeline.spec.Graph`).
Rebuilds (a stale fingerprint, a broken chain) are events on the agent's result and counted,
as in the linear runner.
"""

from __future__ import annotations

import logging
import resource
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..kv import chain, splice
from ..kv.receive import Reason, Refusal
from .. import hf
from .agent import build_agents
from .turn import (EngineRowFailed, Turn, chain_link, close_transcript, decode_alone, decode_rows, guard_note,
                   measure_fidelity, open_turn, publish_handoff, publish_packet, result)
from ..wire.options import CodecOptions
from ..errors import ContextTooLong, KvwireError, ModelError, PipelineConfigError, TranscriptError
from .handoff import Handoff, handoff_key
from ..wire.packet import Packet
from .spec import PipelineSpec
from .compare import compare_agent
from .results import AgentResult, Comparison, PipelineResult
from ..wire.spec import ModelSpec
from ..store import Store, open_store
from .transcript import ChatTranscript
from . import merge
from .merge import MERGE_STRATEGIES, MergeStrategy
from .spec import Item

log = logging.getLogger(__name__)

GraphMode = Literal["text", "graph"]
Event = Callable[[dict[str, Any]], None]


@dataclass(eq=False)
class _Turn(Turn):
    """One agent's turn while its layer runs (:class:`~.turn.Turn`), with what a graph adds."""

    conv: merge.Conversation | None = None
    opening: int = 0  # a root: tokens of its opening (system prompt, and the input when roots share it)
    merging: bool = False
    spliced: bool = False  # a merge that spliced its later branches (approximate)
    starts: list[tuple[Item, int, int]] = field(default_factory=list)  # merge: later branches' turns (start, end)
    base: int = 0  # tokens ``cache`` covered before decoding (hf.generate grows it)
    result: AgentResult | None = None


@dataclass(eq=False)
class _Received:
    """An upstream chain as received: its head and its whole context (one packet)."""

    head: Packet
    context: Packet
    _prefix: hf.Prefix | None = None

    def prefix(self) -> hf.Prefix:
        if self._prefix is None:
            self._prefix = hf.Prefix.from_packet(self.context)
        return self._prefix


def check_graph_mode(spec: PipelineSpec) -> None:
    """Raise :class:`PipelineConfigError` if ``spec`` cannot run in graph mode: its agents must share one
    system prompt (a received chain starts with it). Text mode runs any graph."""
    if not spec.shared_system:
        private = [a.name for i, a in enumerate(spec.agents) if spec.system_for(i) != spec.system]
        raise PipelineConfigError(f"pipeline {spec.name!r}: agents {', '.join(private)} have private system prompts; "
                                  "graph mode passes caches that start with one shared system prompt",
                                  "run it with --mode text, or move what the private prompts say into those "
                                  "agents' instructions")


class GraphRunner:
    """Run ``spec`` (a pipeline graph) on ``model``, exchanging handoffs and packets through ``store``."""

    def __init__(self, model: Any, tokenizer: Any, spec: PipelineSpec, *, store: Store | str = "memory://",
                 model_spec: ModelSpec | None = None, sampling: hf.Sampling | None = None,
                 recompute: splice.Recompute | None = None, batch: bool = True, max_batch: int = 8,
                 memory_budget: int | None = None, agent_models: dict[str, Any] | None = None,
                 codec_options: CodecOptions | None = None, on_event: Event | None = None,
                 merge: MergeStrategy = "prefill") -> None:
        self.spec, self.graph = spec, spec.graph
        self.model, self.tokenizer = model, tokenizer
        self.store = open_store(store) if isinstance(store, str) else store
        self.recompute = recompute or splice.Recompute()
        if merge not in MERGE_STRATEGIES:
            raise KvwireError(f"unknown merge strategy {merge!r}", f"use one of {', '.join(MERGE_STRATEGIES)}")
        self.merge = merge
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise KvwireError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                          or memory_budget < 1):
            raise KvwireError(f"memory_budget must be a number of bytes >= 1 (or None), got {memory_budget!r}")
        self.batch, self.max_batch, self.memory_budget = batch, max_batch, memory_budget
        self.on_event = on_event or (lambda event: None)
        self.agents = build_agents(spec, model, model_spec or hf.model_spec(model), tokenizer, self.store,
                                   agent_models, sampling=sampling, recompute=self.recompute,
                                   codec_options=codec_options)
        self._engines: dict[int, hf.Engine | None] = {}
        self._received: dict[tuple[str | None, str], tuple[_Received | None, list[str]]] = {}
        self._openings: dict[tuple[tuple[int, ...], str], _Received] = {}  # per run: see _opening
        self._handoffs: dict[str, Handoff] = {}
        self._approximate: dict[Item, str | None] = {}  # per turn of a run: see _Turn.approximate_via

    # -- running -----------------------------------------------------------------------------------

    def run(self, mode: GraphMode = "graph", session: str | None = None, rounds: int = 1,
            reference: PipelineResult | None = None, keep_logits: bool = False) -> PipelineResult:
        """Run every layer of the graph ``rounds`` times. With a ``reference`` run (text mode, kept
        logits), merges that splice measure their fidelity against it and against an exact recomputation."""
        if mode not in ("text", "graph"):
            raise KvwireError(f"unknown graph mode {mode!r}", "use text or graph")
        if rounds < 1:
            raise KvwireError(f"rounds must be >= 1, got {rounds}")
        if mode == "graph":
            check_graph_mode(self.spec)
            for agent in self.agents:  # a model whose cache kvwire cannot pass: refused before any turn
                hf.check_model_layout(agent.model, agent.cache_spec)
        if session is not None and self.store.keys(f"sessions/{session}/"):
            raise KvwireError(f"session {session!r} already holds the handoffs of a run in {self.store.url}",
                              "give each run its own session (or none: a fresh one is made)")
        session = session or uuid.uuid4().hex[:12]
        self._check_roots()
        self._handoffs, self._approximate, self._openings = {}, {}, {}
        refs = {(a.round, a.agent): a for a in reference.agents} if reference is not None else {}
        results: list[AgentResult] = []
        measuring = 0.0
        peak_store, batches = 0, []
        start = time.perf_counter()
        for round in range(rounds):
            for layer in self.graph.layers:
                self.on_event({"event": "layer_start", "mode": mode, "round": round,
                               "agents": [self.graph.names[i] for i in layer]})
                try:
                    turns, widths = self._run_layer(mode, layer, round, session, keep_logits)
                except ContextTooLong as error:  # name the layer's agents; the finished turns are not lost
                    names = [self.graph.names[i] for i in layer]
                    who = f"agent {names[0]!r}" if len(names) == 1 else f"one of agents {', '.join(names)}"
                    raise ContextTooLong(f"{who}" + (f" (round {round + 1})" if rounds > 1 else "") +
                                         f": {error.message}", error.hint, finished=tuple(results)) from None
                batches += widths  # the rows each batch of the layer really decoded together
                for turn in turns:
                    reference = refs.get((round, turn.result.agent))
                    if reference is not None and mode == "graph":
                        mark = time.perf_counter()
                        self._measure(turn, turn.result, reference)
                        measuring += time.perf_counter() - mark
                    results.append(turn.result)
                    self.on_event({"event": "agent_done", "mode": mode, "round": round, "result": turn.result})
                mark = time.perf_counter()  # a file store scans its directory: keep that out of the timing
                peak_store = max(peak_store, self.store.used_bytes)
                measuring += time.perf_counter() - mark
        events = Counter(event.split(":", 1)[0] for r in results for event in r.events)
        settings = ""
        if mode == "graph":
            settings = f"batch={'on' if self.batch else 'off'},{self.recompute.describe()}"
        return PipelineResult(self.spec.name, mode, self.store.url, session, results,
                              time.perf_counter() - start - measuring, settings, rebuilds=dict(events),
                              peak_store_bytes=peak_store, batches=batches,
                              peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def _run_layer(self, mode: GraphMode, layer: tuple[int, ...], round: int, session: str,
                   keep_logits: bool) -> tuple[list[_Turn], list[int]]:
        """Take the turns of one layer: together in one batch, or one at a time (text mode, batching off).
        Returns the turns and the rows each batch decoded together."""
        if mode == "graph" and all(self._engine(self.agents[i].model) is not None for i in layer):
            self._received = {}  # each upstream chain is received once for the layer
            start = time.perf_counter()
            turns = [self._prepare(index, round, session, start) for index in layer]
            try:
                widths = self._decode(turns, keep_logits)
            except EngineRowFailed as error:  # nothing of the layer is published yet: take it again, unbatched
                log.warning("decoding one agent at a time from here: %s", error.message)
                for index in layer:
                    self._engines[id(self.agents[index].model)] = None
                return self._run_layer(mode, layer, round, session, keep_logits)
        else:
            turns, widths = [], []
            for index in layer:  # as frameworks run agents: each one receives, decodes and publishes alone
                self._received = {}
                start = time.perf_counter()
                turn = (self._context(index, round, session, start, "text") if mode == "text" else
                        self._prepare(index, round, session, start))
                widths += self._decode([turn], keep_logits)
                turn.result = self._publish(turn)
                turns.append(turn)
            return turns, widths
        for turn in turns:
            turn.result = self._publish(turn)
        return turns, widths

    def compare(self, rounds: int = 1) -> Comparison:
        """Text mode (agents one at a time) against the graph with caches and batching, agent by agent."""
        check_graph_mode(self.spec)
        text = self.run("text", rounds=rounds, keep_logits=True)
        graph = self.run("graph", rounds=rounds, reference=text)
        order = list(self.graph.order) * rounds
        return Comparison(text, graph, [compare_agent(t, g, self.agents[i])
                                        for i, t, g in zip(order, text.agents, graph.agents)])

    # -- graph mode: prepare, decode, publish --------------------------------------------------------

    def _context(self, index: int, round: int, session: str, start: float, mode: GraphMode) -> _Turn:
        """Read the handoffs agent ``index`` needs and build its context ids (its own turn appended)."""
        agent = self.agents[index]
        mark = time.perf_counter()  # not `start`: in a batched layer, the turns prepared before this one
        handoffs = {item: self._handoff(item, session) for item in merge.needed(self.graph, index, round)}
        receive_s = time.perf_counter() - mark
        mark = time.perf_counter()
        conv = merge.conversation(self.graph, index, round, handoffs)
        transcript, starts = merge.transcript(self.tokenizer, self.spec.opening(index), conv,
                                              from_text=mode == "text")
        opening = len(transcript.ids) if conv.first is None else 0
        context_ids = open_turn(transcript, self.spec.turn(index))
        return _Turn(agent, index, round, session, mode, transcript, context_ids, start, conv.messages,
                     conv.generated, conv=conv, opening=opening, merging=self.graph.is_merge(index, round),
                     starts=starts, receive_s=receive_s, tokenize_s=time.perf_counter() - mark)

    def _prepare(self, index: int, round: int, session: str, start: float) -> _Turn:
        """Context and cache of agent ``index``: its first upstream's chain, and for a merge the
        other branches spliced after it (or left to prefill: :func:`.merge.plan`)."""
        turn = self._context(index, round, session, start, "graph")
        if turn.conv.first is None:
            received = self._opening(turn, session)
            if received is None:
                return turn
        else:
            mark = time.perf_counter()
            received = self._receive(turn)
            turn.receive_s += time.perf_counter() - mark
        agent = turn.agent
        if received is not None:
            turn.parent, turn.cached = received.head, received.context.length
        plan = None
        if turn.merging:
            strategy, why = (("prefill", "sliding-window layers cannot be spliced")
                             if agent.cache_spec.has_sliding_window else (self.merge, ""))
            plan = merge.plan(len(turn.context_ids), turn.cached, turn.starts, self.recompute,
                              agent.cache_spec.num_layers, strategy, why, hf.known_pass_cost(agent.model))
            turn.decision = plan.describe()
        if plan is not None and plan.choice == "splice":
            turn.spliced = True
            mark = time.perf_counter()
            context = received.context if received is not None else None
            built = merge.splice_branches(agent.model, agent.cache_spec, agent.rope_tables(), turn.context_ids,
                                          context, turn.starts, turn.conv,
                                          agent.receive_segment, self.recompute)
            turn.cache, turn.events = built.cache, turn.events + built.events
            if built.events:  # branches whose packets could not be used were recomputed: say so, not "spliced"
                kinds = ", ".join(sorted({event.split(":", 1)[0] for event in built.events}))
                if len(built.events) >= len(turn.starts):
                    turn.decision = (f"merge recomputed its {plan.cost.between} branch tokens: no branch could be "
                                     f"spliced ({kinds})")
                else:
                    turn.decision += (f"; {len(built.events)} of {len(turn.starts)} branches recomputed instead "
                                      f"({kinds})")
            if not built.extends_prefix:
                turn.parent, turn.cached = None, 0
            if built.spliced:  # tokens kept as received at overlapping positions: approximate from here on
                turn.approximate_via = agent.name
            turn.cached += built.spliced
            turn.recomputed, turn.compute_s = built.recomputed, built.compute_s
            turn.staleness, turn.guarded = built.staleness, built.guarded
            if built.guarded:
                turn.decision += f"; {guard_note(built.staleness, self.recompute.guard, built.guarded)}"
            turn.receive_s += time.perf_counter() - mark - built.compute_s
        elif received is not None and self._engine(agent.model) is not None:
            turn.prefix = received.prefix()  # one object per chain: every row reading it shares it
        elif received is not None:
            turn.cache = hf.build_cache(received.context, agent.model, agent.cache_spec)
        if turn.conv.first is not None and turn.parent is not None and turn.approximate_via is None:
            # it extends its first upstream's chain
            turn.approximate_via = self._approximate.get(self.graph.reads(index, round)[0])
        self._approximate[(round, index)] = turn.approximate_via
        turn.base = hf.cache_length(turn.cache)
        return turn

    def _receive(self, turn: _Turn) -> _Received | None:
        """The chain of the turn's first upstream (on the model's device), received once per layer and
        weights; ``None`` and an event when it cannot be used."""
        agent, first = turn.agent, turn.conv.first
        key = (first.packet, agent.cache_spec.fingerprint)
        if key not in self._received:
            events: list[str] = []
            received = None
            if first.packet is None:
                events.append(Refusal(Reason.BROKEN_CHAIN, f"{first.producer} sent no cache").pipeline_event)
            else:
                received = agent.receive_chain(first.packet, turn.context_ids, turn.round, events)
            self._received[key] = (_Received(received.head, agent.to_model(received.context)[0])
                                   if received is not None else None, events)
        received, events = self._received[key]
        turn.events += events
        return received

    def _opening(self, turn: _Turn, session: str) -> _Received | None:
        """The opening several roots share (the system prompt and the input): prefilled once per run
        and weights, published as the chain every root's packet continues, and read by each root as a
        received chain (one shared prefix in the engine batch). ``None`` where nothing is shared: one
        root (its opening is its own), a later round (roots read the sinks) or an empty opening."""
        if not self.graph.shares_input or turn.round > 0 or turn.opening == 0:
            return None
        agent = turn.agent
        ids = tuple(turn.context_ids[: turn.opening])
        key = (ids, agent.cache_spec.fingerprint)
        if key not in self._openings:  # every root's fit was checked when the run began (_check_roots)
            mark = time.perf_counter()
            cache = hf.prefill(agent.model, list(ids))
            packet = hf.extract(cache, agent.cache_spec, torch.tensor([ids]), producer="input", session=session,
                                round=turn.round)
            computed = time.perf_counter() - mark
            host = packet if packet.device.type == "cpu" else packet.to("cpu")
            chain.publish(self.store, host, options=agent.codec_options)
            packet.checksum = host.checksum  # the roots' packets pin it as their parent
            self._openings[key] = _Received(packet, packet)
            turn.compute_s = computed  # the layer's first turn waited for it; the others find it ready
            turn.receive_s += time.perf_counter() - mark - computed
        return self._openings[key]

    def _decode(self, turns: list[_Turn], keep_logits: bool) -> list[int]:
        """Decode a layer: one engine batch per model, or (no engine) one agent at a time. Returns the
        rows each batch decoded together."""
        widths: list[int] = []
        by_model: dict[int, list[_Turn]] = {}
        for turn in turns:
            by_model.setdefault(id(turn.agent.model), []).append(turn)
        for group in by_model.values():
            engine = self._engine(group[0].agent.model) if group[0].mode == "graph" else None
            if engine is not None:
                widths.append(decode_rows(group, engine, keep_logits))
                continue
            for turn in group:
                decode_alone(turn, keep_logits)
                widths.append(1)
        return widths

    def _publish(self, turn: _Turn) -> AgentResult:
        """Publish the turn's packet (graph mode) and handoff; return its result."""
        close_transcript(turn)
        mark = time.perf_counter()
        packet_id = publish_packet(turn, self.store, chain_link(turn) if turn.mode == "graph" else None)
        publish_handoff(turn, self.store, packet_id, [])
        turn.publish_s = time.perf_counter() - mark
        turn.used_fingerprint = turn.agent.cache_spec.fingerprint if turn.cached else None
        return result(turn, turn.ttft_s + turn.out.decode_s + turn.publish_s)

    # -- measuring ---------------------------------------------------------------------------------

    def _measure(self, turn: _Turn, result: AgentResult, reference: AgentResult) -> None:
        """Fidelity against the text run, and for a merge against an exact recomputation of its own ids."""
        if not turn.spliced or turn.cache is None:
            return measure_fidelity(turn, result, reference, None, exact=False)
        model, cached = turn.agent.model, turn.base

        def probe() -> Any:  # the merge's cache as it was before decoding
            copy = hf.clone_cache(turn.cache, model)
            if hf.cache_length(copy) > cached:
                copy.crop(cached - hf.cache_length(copy))
            return copy

        measure_fidelity(turn, result, reference, probe, exact=True)

    # -- helpers -----------------------------------------------------------------------------------

    def _check_roots(self) -> None:
        """Before any agent runs: every root's context must render and fit its model's window with its new
        tokens (a root may bring a long input of its own; several roots share a long prefill). Several roots
        read the input as a user message of its own, each followed by its own user turn: a chat template
        that will not render two user messages in a row is refused, with what to do instead."""
        for root in self.graph.roots:
            try:
                script = ChatTranscript.from_messages(self.tokenizer, self.spec.opening(root))
                script.add("user", self.spec.turn(root))
                script.open_assistant_turn()
            except TranscriptError as err:
                if not (self.graph.shares_input and self.spec.input_text):
                    raise
                raise PipelineConfigError(
                    f"pipeline {self.spec.name!r}: {len(self.graph.roots)} agents start the graph "
                    f"({', '.join(self.graph.names[i] for i in self.graph.roots)}), so the input is a user message "
                    f"of its own before each one's turn, and this model's chat template refuses that: {err.message}",
                    "let one agent read the input first and the others read it (after = [\"that agent\"]), or use "
                    "a model whose chat template accepts two user messages in a row") from None
            new = self.spec.new_tokens(root)
            hf.check_fits(self.agents[root].model, len(script.ids) + new,
                          f"agent {self.graph.names[root]!r}: a context of {len(script.ids):,} tokens plus {new} "
                          "new tokens")

    def _handoff(self, item: Item, session: str) -> Handoff:
        round, index = item
        key = handoff_key(session, index, self.graph.names[index], round)
        if key not in self._handoffs:  # read once per run, whoever reads it
            self._handoffs[key] = self.agents[index].read_handoff(key)
        return self._handoffs[key]

    def _engine(self, model: Any) -> hf.Engine | None:
        """The batched engine for ``model`` (None: batching off, or a model it cannot batch)."""
        if not self.batch:
            return None
        if id(model) not in self._engines:
            try:
                self._engines[id(model)] = hf.Engine(model, max_batch=self.max_batch,
                                                     memory_budget=self.memory_budget)
            except ModelError as err:
                log.warning("decoding one agent at a time: %s", err)
                self._engines[id(model)] = None
        return self._engines[id(model)]
