"""One turn of an agent, in phases: receive, build the context, prefill, decode, publish, result, fidelity.

The linear pipeline (:meth:`kvwire.pipeline.agent.Agent.turn`) composes the phases for one
agent at a time; the graph runner (:class:`kvwire.pipeline.graph.GraphRunner`) composes them
for a layer of agents, whose rows decode together in one engine batch. Both keep a turn's
state in a :class:`Turn`.

What differs between the modes of passing is a :class:`TurnMode`, one object per mode
(:data:`TURN_MODES`), never an ``if mode ==`` branch:

- :class:`TextMode` -- the context is rendered from the messages; nothing is received or sent;
- :class:`PrefixMode` -- the context continues the upstream's exact ids; its chain is received
  (:func:`kvwire.kv.receive.fetch_verified`) and this turn's tokens published as the next link;
- :class:`AutoMode` -- as prefix, but each hop sends its cache only where the cost model says
  that beats sending ids (:class:`kvwire.pipeline.cost.CostModel`);
- :class:`SpliceMode` -- agents with private prompts: upstream turns are spliced in as segments
  (re-rotated, partly recomputed) and this turn is published as a segment of its own.

A fourth way of passing, between different models, lives in :mod:`kvwire.fuse` (its own runner).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .. import hf
from ..errors import KvwireError, OverBudget, PacketError
from ..kv import chain, splice
from ..store import Store
from ..store.metered import Traffic
from ..wire.packet import Packet
from .cost import Decision
from . import rates
from .probe import refine, refine_prefill
from .fidelity import Fidelity, measure
from .handoff import Handoff, handoff_key
from .results import AgentResult
from .transcript import ChatTranscript

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Turn:
    """One agent's turn while it runs: its context, the cache it got, what it decoded and sent."""

    agent: Agent
    index: int
    round: int
    session: str
    mode: str
    transcript: ChatTranscript
    context_ids: list[int]
    start: float  # perf_counter when it could start (a graph layer's start for its batched turns)
    messages: list[dict[str, str]] = field(default_factory=list)  # the conversation read (no system prompt)
    generated: dict[int, list[int]] = field(default_factory=dict)  # message index -> its generated ids
    started_at: float = 0.0  # wall clock at its start
    turn_start: int = 0  # where this agent's own turn begins in its context
    offsets: list[int] = field(default_factory=list)  # splice: where each upstream message starts
    cache: Any = None  # a private cache (received, spliced or a copy)
    prefix: hf.Prefix | None = None  # a shared received chain (an engine batch reads it once)
    positions: torch.Tensor | None = None  # splice: the placed position ids, [1, T], when not 0..T-1
    first_logits: torch.Tensor | None = None  # splice: the cache covers the whole context; the first token's logits
    parent: Packet | None = None  # the chain head its packet continues
    links: int = 0  # links of the chain it received
    cached: int = 0
    recomputed: int = 0
    staleness: list[float | None] = field(default_factory=list)  # splice: per segment
    guarded: int = 0  # splice: spliced tokens the guard recomputed
    used_fingerprint: str | None = None  # weights that made the cache used
    events: list[str] = field(default_factory=list)
    decision: str = ""
    prediction: Decision | None = None
    receive_s: float = 0.0
    compute_s: float = 0.0
    select_s: float = 0.0
    tokenize_s: float = 0.0
    measuring: float = 0.0  # fidelity work inside the turn's span (left out of its times)
    device_bytes: int = 0
    out: Any = None  # hf.Generation (decoded alone) or hf.RowResult (a row of an engine batch)
    ttft_s: float = 0.0
    check: Any = None  # the transcript's check against a fresh template rendering
    packet_id: str | None = None
    packet_bytes: int = 0
    publish_s: float = 0.0
    traffic: Traffic = field(default_factory=Traffic)
    approximate_via: str | None = None

    @property
    def covered(self) -> list[int]:
        """The ids the decoded cache covers (context and tokens, all but the last)."""
        return (self.context_ids + self.out.tokens)[: hf.cache_length(self.out.cache)]

    @property
    def provenance(self) -> dict[str, Any]:
        return {"producer": self.agent.name, "session": self.session, "round": self.round}


# -- build the context --------------------------------------------------------------------------------


def with_system(system: str, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in messages]


def open_turn(transcript: ChatTranscript, instruction: str) -> list[int]:
    """Append the agent's own instruction and open its answer; the context ids to generate from."""
    transcript.add("user", instruction)
    transcript.open_assistant_turn()
    return list(transcript.ids)


# -- decode ---------------------------------------------------------------------------------------------


def decode_alone(turn: Turn, keep_logits: bool) -> None:
    """Decode one turn by itself (``hf.generate`` on its own cache)."""
    agent = turn.agent
    turn.out = hf.generate(agent.model, turn.context_ids, cache=turn.cache, position_ids=turn.positions,
                           max_new_tokens=agent.spec.new_tokens(turn.index), eos_ids=agent.eos,
                           sampling=agent.sampling, keep_logits=keep_logits, first_logits=turn.first_logits)
    turn.ttft_s = time.perf_counter() - turn.start - turn.out.decode_s - turn.measuring


def decode_rows(turns: list[Turn], engine: hf.Engine, keep_logits: bool) -> int:
    """Decode turns of one model together, each a row of one engine batch; returns the rows decoded at once."""
    requests = [hf.Request(turn.context_ids, prefix=turn.prefix, cache=turn.cache,
                           max_new_tokens=turn.agent.spec.new_tokens(turn.index), sampling=turn.agent.sampling,
                           eos_ids=turn.agent.eos, keep_logits=keep_logits, tag=turn) for turn in turns]
    added = time.perf_counter()
    for turn, row in zip(turns, engine.run(requests)):
        if row.error is not None:  # the engine isolated it to this row: the caller decodes it another way
            raise EngineRowFailed(f"agent {turn.agent.name!r}: the batched engine failed on this model "
                                  f"({type(row.error).__name__}: {row.error})",
                                  "decode the agents one at a time: kvwire run --no-batch (GraphRunner(batch=False))")
        turn.out = row
        turn.ttft_s = (added - turn.start) + row.ttft_s
    return max(1, engine.last_run_batch)


class EngineRowFailed(KvwireError):
    """A turn's row failed in the batched engine (its own work raised: a model the engine's probe passed but whose
    attention it cannot run). The graph runner then decodes the layer one agent at a time."""


def close_transcript(turn: Turn) -> None:
    """Check the transcript against the chat template, then append what was generated."""
    mark = time.perf_counter()
    turn.check = turn.transcript.verify()  # incremental ids == full template rendering (or explained)
    turn.transcript.add_generated(turn.out.tokens, turn.agent.eos)
    turn.tokenize_s += time.perf_counter() - mark
    if not turn.check.matches:
        log.info("%s: transcript differs from a fresh template rendering at token %s (re-tokenized turns %s)",
                 turn.agent.name, turn.check.first_difference, turn.check.retokenized_turns)


# -- publish -------------------------------------------------------------------------------------------


def chain_link(turn: Turn) -> Packet | None:
    """The decoded K/V as the next link of the chain the turn received (``None``: nothing was cached)."""
    spec = turn.agent.cache_spec
    if isinstance(turn.out, hf.RowResult):
        return turn.out.extract(spec, parent=turn.parent, **turn.provenance)
    if turn.out.cache is None:
        return None
    return hf.extract(turn.out.cache, spec, torch.tensor([turn.covered]), parent=turn.parent, **turn.provenance)


def publish_packet(turn: Turn, store: Store, packet: Packet | None) -> str | None:
    """Publish ``packet`` (from the host); a packet over the store's whole budget is not sent
    (``packet-too-large``): the next agent re-prefills from ids, as in text mode."""
    if packet is None:
        return None
    agent = turn.agent
    if packet.device.type != "cpu":
        packet, turn.device_bytes = packet.to("cpu"), turn.device_bytes + packet.nbytes
    try:
        turn.packet_id = chain.publish(store, packet, options=agent.codec_options)
    except OverBudget as err:  # documented fallback: this hop passes ids, the next agent re-prefills
        turn.events.append(f"packet-too-large: {err}")
        log.warning("%s sends no cache this turn: %s", agent.name, err)
        return None
    turn.packet_bytes = packet.nbytes
    return turn.packet_id


def publish_handoff(turn: Turn, store: Store, packet: str | None, segments: list[tuple[str, int]]) -> str:
    """Leave the conversation (its new turn appended) for the next agent; returns its key.
    Compare-and-set: a turn is taken once; a second writer (a stale or duplicate process) is rejected."""
    agent = turn.agent
    messages = turn.messages + [{"role": "user", "content": agent.spec.turn(turn.index)},
                                {"role": "assistant", "content": turn.transcript.messages[-1]["content"]}]
    generated = dict(turn.generated)
    generated[len(messages) - 1] = turn.transcript.generated[len(turn.transcript.messages) - 1]
    key = handoff_key(turn.session, turn.index, agent.name, turn.round)
    store.put(key, Handoff(messages, generated, agent.name, turn.transcript.ids, packet, segments)
              .to_bytes(agent.codec_options.key_bytes), expect_version=0)
    return key


# -- result and fidelity ----------------------------------------------------------------------------------


def guard_note(staleness: list[float | None], bound: float, guarded: int) -> str:
    """What the fidelity guard did, for a turn's decision line."""
    worst = max(value for value in staleness if value is not None)
    return f"the guard recomputed {guarded} spliced tokens exactly (staleness {worst:.3f} > {bound:g})"


def result(turn: Turn, total_s: float) -> AgentResult:
    """The turn's :class:`AgentResult` (fidelity is measured afterwards, outside its times)."""
    agent, out = turn.agent, turn.out
    step_logits = out.step_logits
    if isinstance(out, hf.Generation) and step_logits is not None:
        step_logits = step_logits[0]
    return AgentResult(
        agent=agent.name, mode=turn.mode, context_tokens=len(turn.context_ids), cached_tokens=turn.cached,
        new_tokens=len(out.tokens),
        output_text=hf.whole_characters(agent.tokenizer, out.tokens)[1].strip(), output_ids=out.tokens,
        finish_reason="stop" if out.tokens and out.tokens[-1] in agent.eos else "length",
        ttft_s=turn.ttft_s, prefill_s=out.prefill_s, decode_s=out.decode_s, receive_s=turn.receive_s,
        compute_s=turn.compute_s, publish_s=turn.publish_s, tokenize_s=turn.tokenize_s, total_s=total_s,
        packet_bytes=turn.packet_bytes, transcript_matches_template=turn.check.matches,
        retokenized_turns=turn.check.retokenized_turns, recomputed_tokens=turn.recomputed, round=turn.round,
        staleness=turn.staleness, guarded_tokens=turn.guarded,
        events=turn.events, cache_fingerprint=turn.used_fingerprint, device_copy_bytes=turn.device_bytes,
        decision=turn.decision, select_s=turn.select_s, prediction=turn.prediction, started_at=turn.started_at,
        traffic=turn.traffic, approximate_via=turn.approximate_via, fingerprint=agent.cache_spec.fingerprint,
        lossy_encoding=agent.lossy_encoding if turn.cached else None,
        context_ids=turn.context_ids, first_logits=out.first_logits, step_logits=step_logits)


def measure_fidelity(turn: Turn, result: AgentResult, reference: AgentResult, probe: Callable[[], Any] | None,
                     exact: bool) -> None:
    """Fidelity against the reference run's agent: agreement, and with a ``probe`` (a fresh copy of the
    cache as it was before decoding, per call) the teacher-forced KL. ``exact``: also against a
    recomputation of the turn's own context ids without any cache (what splicing approximates, free
    of any difference in how text mode tokenized)."""
    if probe is None:  # nothing was received: agreement only
        result.fidelity = measure(reference.output_ids, result.output_ids)
        return
    agent = turn.agent
    if exact:
        again = hf.generate(agent.model, turn.context_ids, max_new_tokens=agent.spec.new_tokens(turn.index),
                            eos_ids=agent.eos, sampling=agent.sampling, keep_logits=True)
        result.exact_fidelity = _forced(agent.model, probe(), turn.context_ids, again.tokens, again.step_logits[0],
                                        result.output_ids, turn.first_logits)
    if reference.step_logits is None:
        result.fidelity = measure(reference.output_ids, result.output_ids)
    else:
        result.fidelity = _forced(agent.model, probe(), turn.context_ids, reference.output_ids,
                                  reference.step_logits, result.output_ids, turn.first_logits)


def _forced(model: Any, probe: Any, context_ids: list[int], reference_ids: list[int],
            reference_logits: torch.Tensor, candidate_ids: list[int], first_logits: torch.Tensor | None = None
            ) -> Fidelity:
    """Teacher forced on ``reference_ids`` from the cache ``probe``: agreement and KL against the reference.
    A probe that covers the whole context comes with the ``first_logits`` computed with it."""
    covered = hf.cache_length(probe)
    forced = context_ids[covered:] + reference_ids[:-1]
    parts = []  # the logits before each reference token: the first from the probe's own pass where it covers all
    if covered == len(context_ids):
        if first_logits is None:
            raise ValueError("a probe that covers the whole context needs the first_logits computed with it")
        parts.append(first_logits.reshape(1, -1))
    if forced:
        parts.append(hf.forward_logits(model, probe, forced))
    logits = torch.cat([part.float().cpu() for part in parts])[-len(reference_ids):]
    return measure(reference_ids, candidate_ids, reference_logits, logits)


# -- the modes ------------------------------------------------------------------------------------------


class TurnMode:
    """How a turn of one mode builds its context, gets its cache and what it leaves for the next agent.
    The base is text mode's behaviour where a mode has nothing of its own to do."""

    name = ""
    exact_fidelity = False  # also measure against a no-cache recomputation of its own ids (approximate modes)

    def check(self, agent: Agent) -> None:
        """Raise if ``agent`` cannot take a turn in this mode."""

    def context(self, agent: Agent, system: str, handoff: Handoff | None) -> tuple[ChatTranscript, list[int]]:
        """The transcript up to the agent's own turn, and where each upstream message starts (splice)."""
        messages = handoff.messages if handoff is not None else []
        return ChatTranscript.from_messages(agent.tokenizer, with_system(system, messages)), []

    def receive(self, agent: Agent, turn: Turn, handoff: Handoff | None, store: Store) -> None:
        """Get the turn's cache from upstream packets (sets ``turn.cache``, ``turn.cached``, events...)."""

    def packet(self, agent: Agent, turn: Turn) -> Packet | None:
        """What this turn publishes once decoded (``None``: nothing)."""
        return None

    def handoff_refs(self, turn: Turn, handoff: Handoff | None, packet_id: str | None
                     ) -> tuple[str | None, list[tuple[str, int]]]:
        """The chain head and the segments the handoff names."""
        return None, list(handoff.segments) if handoff is not None else []


class TextMode(TurnMode):
    name = "text"


class PrefixMode(TurnMode):
    name = "prefix"

    def context(self, agent: Agent, system: str, handoff: Handoff | None) -> tuple[ChatTranscript, list[int]]:
        if handoff is None:
            return super().context(agent, system, handoff)
        generated = {k + bool(system): v for k, v in handoff.generated.items()}
        return ChatTranscript(agent.tokenizer, with_system(system, handoff.messages), handoff.ids, generated), []

    def receive(self, agent: Agent, turn: Turn, handoff: Handoff | None, store: Store) -> None:
        if handoff is None or handoff.packet is None:
            return
        received = agent.receive_chain(handoff.packet, turn.context_ids, turn.round, turn.events, store=store)
        if received is None:
            return
        links = []
        for link in received.links:  # built from the links, not their join: one copy of the chain, not two
            link, moved = agent.to_model(link)
            links.append(link)
            turn.device_bytes += moved
        turn.cache = hf.build_cache(links, agent.model, agent.cache_spec)
        turn.parent, turn.cached, turn.links = received.head, sum(link.length for link in links), len(links)
        turn.used_fingerprint = agent.cache_spec.fingerprint

    def packet(self, agent: Agent, turn: Turn) -> Packet | None:
        return chain_link(turn)

    def handoff_refs(self, turn: Turn, handoff: Handoff | None, packet_id: str | None
                     ) -> tuple[str | None, list[tuple[str, int]]]:
        return packet_id, super().handoff_refs(turn, handoff, packet_id)[1]


class AutoMode(PrefixMode):
    """Prefix mode whose every hop sends its cache or only ids, whichever the cost model predicts cheaper."""

    name = "auto"

    def check(self, agent: Agent) -> None:
        if agent.cost is None and agent.estimator is None:
            raise PacketError("mode auto needs a cost model", "create the agent with cost=CostModel(...)")

    def packet(self, agent: Agent, turn: Turn) -> Packet | None:
        prefilled = len(turn.context_ids) - turn.cached  # this turn's prefill measured the model
        prefill_s = getattr(turn.out, "prefill_s", 0.0)
        covered = len(turn.covered)
        delta, links = covered - (turn.parent.end if turn.parent is not None else 0), 1 + turn.links
        estimator = agent.estimator
        if estimator is not None:  # an agent process: figures from its turns, its host and priors (pipeline.rates)
            estimator.observe(rates.Measurement(prefilled, prefill_s, getattr(turn.out, "prefill_cpu_s", 0.0),
                                                estimator.threads))
            agent.cost, verdict = estimator.decide(covered, delta, links, turn.traffic)
        else:
            agent.cost = refine(agent.cost, turn.traffic)  # the chain just received measured the link: use it
            agent.cost = refine_prefill(agent.cost, prefilled, prefill_s)
            verdict = agent.cost.decide(covered, delta, links)
        turn.decision, turn.prediction = verdict.reason, verdict
        return super().packet(agent, turn) if verdict.choice == "cache" else None


class SpliceMode(TurnMode):
    """Private system prompts: upstream turns spliced in as segments, this turn sent as one."""

    name = "splice"
    exact_fidelity = True

    def context(self, agent: Agent, system: str, handoff: Handoff | None) -> tuple[ChatTranscript, list[int]]:
        if handoff is None:
            return super().context(agent, system, handoff)
        return ChatTranscript.replay(agent.tokenizer, system, handoff.messages, handoff.generated)

    def receive(self, agent: Agent, turn: Turn, handoff: Handoff | None, store: Store) -> None:
        if handoff is not None and handoff.segments:
            self._splice(agent, turn, handoff, store)
        elif agent.placement == "global":
            # the session's global position counter starts after the longest private prefix, so every
            # agent's turn keeps one position in every context that splices it
            positions = torch.arange(len(turn.context_ids))
            positions[turn.turn_start:] += agent.global_base() - turn.turn_start
            turn.positions = positions[None]

    def _splice(self, agent: Agent, turn: Turn, handoff: Handoff, store: Store) -> None:
        segments = []
        for packet_id, message in handoff.segments:
            segment, moved = agent.to_model(agent.fetch_segment(packet_id, store=store))
            segments.append(splice.Segment(turn.offsets[message], segment))
            turn.device_bytes += moved
        cost = splice.estimate(len(turn.context_ids), segments[0].offset,
                               [(s.offset, s.offset + s.packet.length) for s in segments], agent.recompute,
                               agent.cache_spec.num_layers, hf.known_pass_cost(agent.model), through=True)
        if agent.splice_when == "cheaper" and agent.placement == "end" and not cost.splice_pays:
            turn.decision = f"splice: prefilled the upstream turns exactly, cheaper ({cost.describe()})"
            return
        spliced = splice.assemble(agent.model, agent.cache_spec, agent.rope_tables(), turn.context_ids, segments,
                                  recompute=agent.recompute, placement=agent.placement, through=True)
        turn.cache, turn.cached, turn.recomputed = spliced.cache, spliced.spliced, spliced.recomputed
        turn.staleness, turn.guarded = spliced.staleness, spliced.guarded
        turn.first_logits = spliced.first_logits  # its own turn was computed in the same pass: no prefill left
        turn.used_fingerprint = agent.cache_spec.fingerprint
        turn.compute_s = spliced.compute_s
        turn.select_s = spliced.timings["select_s"]
        turn.positions = None if spliced.contiguous else spliced.positions[None]
        turn.decision = f"splice: spliced {len(segments)} upstream turn(s) ({cost.describe()})"
        if spliced.guarded:
            turn.decision += f"; {guard_note(spliced.staleness, agent.recompute.guard, spliced.guarded)}"

    def packet(self, agent: Agent, turn: Turn) -> Packet | None:
        packet = hf.extract(turn.out.cache, agent.cache_spec, torch.tensor([turn.covered]), start=turn.turn_start,
                            **turn.provenance)
        if turn.positions is not None:  # keys sit at the placed positions, not at the slot index
            packet = packet.with_provenance(start=int(turn.positions[0, turn.turn_start]))
        return packet

    def handoff_refs(self, turn: Turn, handoff: Handoff | None, packet_id: str | None
                     ) -> tuple[str | None, list[tuple[str, int]]]:
        segments = super().handoff_refs(turn, handoff, packet_id)[1]
        return None, segments + ([(packet_id, len(turn.messages))] if packet_id is not None else [])


TURN_MODES: dict[str, TurnMode] = {mode.name: mode for mode in (TextMode(), PrefixMode(), SpliceMode(), AutoMode())}


def turn_mode(name: str) -> TurnMode:
    """The :class:`TurnMode` called ``name``; :class:`~kvwire.errors.KvwireError` for an unknown one."""
    if name not in TURN_MODES:
        raise KvwireError(f"unknown mode {name!r}", f"use one of {', '.join(TURN_MODES)}")
    return TURN_MODES[name]
