"""Agents that share one model and one conversation, passing text or KV-cache packets.

Each agent appends its own instruction turn to the conversation and generates a
reply, reading the conversation under its system prompt (the pipeline's, or its
own). What travels between agents, always through a store, is a :class:`Handoff`:

- ``text``: the baseline frameworks use today. The next agent renders and
  tokenizes the whole conversation from strings and prefills all of it.
- ``prefix``: every agent shares one system prompt, so its context extends the
  sender's. It assembles the upstream packet chain into a cache and prefills only
  its own new tokens. Exact: greedy output equals a recomputation from the same ids.
- ``splice``: agents have private system prompts. Each one splices the upstream
  agents' segments (their turns' K/V) into its own context, re-rotated, with
  selective recomputation (:class:`kvwire.splice.Recompute`). Approximate: measured.

:meth:`Pipeline.compare` runs ``text`` and another mode on one model in one process
and reports speedup, ideal speedup, efficiency and fidelity (see :class:`Comparison`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from . import chain, codec, hf, splice
from .errors import ChainError, KvwireError, PacketError, PipelineConfigError
from .fidelity import Fidelity, measure
from .pipefile import PipelineSpec
from .spec import ModelSpec
from .store import Store, open_store
from .transcript import ChatTranscript

log = logging.getLogger(__name__)

Mode = Literal["text", "prefix", "splice"]
MODES: tuple[str, ...] = ("text", "prefix", "splice")
Event = Callable[[dict[str, Any]], None]


@dataclass
class Handoff:
    """What an agent leaves in the store for the next one (small JSON).

    ``messages`` is the conversation without any system prompt; ``generated`` maps a
    message index to the ids the model generated for it; ``ids`` are the producer's
    exact context ids (its system prompt included) for prefix mode, covered up to some
    point by the chain ending at ``packet``; ``segments`` lists splice mode's segment
    packets, each with the index of the message it starts at.
    """

    messages: list[dict[str, str]]
    generated: dict[int, list[int]]
    producer: str
    ids: list[int] = field(default_factory=list)
    packet: str | None = None
    segments: list[tuple[str, int]] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return json.dumps({"messages": self.messages, "generated": {str(k): v for k, v in self.generated.items()},
                           "producer": self.producer, "ids": self.ids, "packet": self.packet,
                           "segments": [[p, m] for p, m in self.segments]}).encode()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, key: str) -> Handoff:
        try:
            obj = json.loads(bytes(data))
            messages = obj["messages"]
            ok = (isinstance(messages, list)
                  and all(isinstance(m, dict) and set(m) == {"role", "content"}
                          and all(isinstance(v, str) for v in m.values()) for m in messages)
                  and _int_list(obj["ids"]) and isinstance(obj["generated"], dict)
                  and all(_int_list(v) for v in obj["generated"].values())
                  and isinstance(obj["packet"], (str, type(None))) and isinstance(obj["producer"], str)
                  and isinstance(obj["segments"], list)
                  and all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int
                          for s in obj["segments"]))
            if not ok:
                raise ValueError("fields have the wrong types")
            generated = {int(k): v for k, v in obj["generated"].items()}
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ChainError(f"malformed handoff at {key}: {err}") from None
        return cls(messages, generated, obj["producer"], obj["ids"], obj["packet"],
                   [(p, m) for p, m in obj["segments"]])


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(i) is int for i in value)


@dataclass
class AgentResult:
    """One agent's turn. Times in seconds; ``transfer_s = receive_s + publish_s``."""

    agent: str
    mode: str
    context_tokens: int  # tokens the reply was generated from
    cached_tokens: int  # of those, served from upstream packets (kept as received)
    new_tokens: int
    output_text: str
    output_ids: list[int]
    ttft_s: float  # agent start -> first token (receive, tokenize, inject/splice, prefill)
    prefill_s: float  # the forward pass over the uncached tail of the context
    decode_s: float
    receive_s: float  # handoff + packets: store get, decode, verify, join, place, build cache
    compute_s: float  # model work before the prefill: splice's own prefix, selection, recompute
    publish_s: float  # extract, encode, store put, handoff
    tokenize_s: float  # building the transcript ids (incl. the template check)
    total_s: float
    packet_bytes: int  # K/V bytes this agent published (0 in text mode)
    transcript_matches_template: bool
    retokenized_turns: list[int]
    recomputed_tokens: int = 0  # splice: segment tokens recomputed (gaps not counted)
    fidelity: Fidelity | None = None  # vs the reference run's agent, when compared
    context_ids: list[int] = field(repr=False, default_factory=list)
    first_logits: torch.Tensor | None = field(repr=False, default=None)
    step_logits: torch.Tensor | None = field(repr=False, default=None)  # [n, V], kept for references

    @property
    def transfer_s(self) -> float:
        return self.receive_s + self.publish_s

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent, "mode": self.mode, "context_tokens": self.context_tokens,
            "cached_tokens": self.cached_tokens, "recomputed_tokens": self.recomputed_tokens,
            "new_tokens": self.new_tokens, "ttft_s": self.ttft_s, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "transfer_s": self.transfer_s, "compute_s": self.compute_s,
            "tokenize_s": self.tokenize_s, "total_s": self.total_s, "packet_bytes": self.packet_bytes,
            "transcript_matches_template": self.transcript_matches_template,
            "fidelity": self.fidelity.to_json() if self.fidelity else None, "output": self.output_text,
        }


@dataclass
class PipelineResult:
    pipeline: str
    mode: str
    store: str
    session: str
    agents: list[AgentResult]
    total_s: float  # wall time of the whole run
    settings: str = ""  # e.g. splice's "R=0.15"

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "mode": self.mode, "settings": self.settings, "store": self.store,
                "total_s": self.total_s, "agents": [a.to_json() for a in self.agents]}


@dataclass
class AgentComparison:
    agent: str
    identical: bool  # same output ids in both modes
    same_context: bool  # both modes generated from the same ids
    exact: bool | None  # prefix: output equals a recomputation from its own ids; None for splice
    max_logit_diff: float | None  # first-token logits vs the recomputation (prefix)
    fidelity: Fidelity | None  # vs text mode
    note: str


@dataclass
class Comparison:
    """``text`` and another mode's runs of one pipeline, side by side.

    - ``speedup``       text total / candidate total
    - ``ttft_speedup``  mean TTFT of agents 2..N, text / candidate
    - ``ideal_s``       text total minus the re-prefill the candidate avoids (per agent 2..N:
                        text prefill - candidate prefill - candidate model work before it),
                        i.e. the candidate with free packets, codec, store and inject
    - ``efficiency``    speedup / ideal speedup = ideal_s / candidate total
    - ``agreement``     mean greedy token agreement with text mode over agents 2..N
    """

    text: PipelineResult
    other: PipelineResult
    agents: list[AgentComparison]

    @property
    def prefix(self) -> PipelineResult:  # the issue-2 name for the candidate
        return self.other

    @property
    def speedup(self) -> float:
        return self.text.total_s / self.other.total_s

    @property
    def ttft_speedup(self) -> float:
        text = [a.ttft_s for a in self.text.agents[1:]]
        other = [a.ttft_s for a in self.other.agents[1:]]
        return sum(text) / sum(other) if other else 1.0

    @property
    def avoided_s(self) -> float:
        return sum(t.prefill_s - o.prefill_s - o.compute_s for t, o in zip(self.text.agents[1:], self.other.agents[1:]))

    @property
    def ideal_s(self) -> float:
        return self.text.total_s - self.avoided_s

    @property
    def ideal_speedup(self) -> float:
        return self.text.total_s / self.ideal_s

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.other.total_s

    @property
    def identical(self) -> bool:
        return all(a.identical for a in self.agents)

    @property
    def exact(self) -> bool:
        return all(a.exact is not False for a in self.agents)

    @property
    def agreement(self) -> float:
        scores = [a.fidelity.agreement for a in self.agents[1:] if a.fidelity is not None]
        return sum(scores) / len(scores) if scores else 1.0

    @property
    def kl(self) -> float | None:
        scores = [a.fidelity.kl for a in self.agents[1:] if a.fidelity is not None and a.fidelity.kl is not None]
        return sum(scores) / len(scores) if scores else None

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.text.pipeline, "mode": self.other.mode, "settings": self.other.settings,
            "store": self.other.store, "speedup": self.speedup, "ttft_speedup": self.ttft_speedup,
            "ideal_speedup": self.ideal_speedup, "efficiency": self.efficiency,
            "identical": self.identical, "exact": self.exact, "agreement": self.agreement, "kl": self.kl,
            "text_s": self.text.total_s, "other_s": self.other.total_s,
            "agents": [{"agent": a.agent, "identical": a.identical, "exact": a.exact,
                        "max_logit_diff": a.max_logit_diff, "note": a.note,
                        "fidelity": a.fidelity.to_json() if a.fidelity else None} for a in self.agents],
            "runs": [self.text.to_json(), self.other.to_json()],
        }


class Pipeline:
    """Run a :class:`PipelineSpec` with one model, agents exchanging through ``store``."""

    def __init__(self, model: Any, tokenizer: Any, spec: PipelineSpec, *, store: Store | str = "memory://",
                 model_spec: ModelSpec | None = None, sampling: hf.Sampling | None = None,
                 recompute: splice.Recompute | None = None, placement: splice.Placement = "end",
                 on_event: Event | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.store = open_store(store) if isinstance(store, str) else store
        self.cache_spec = model_spec or hf.model_spec(model)
        self.eos = hf.eos_token_ids(model)
        self.sampling = sampling or hf.Sampling()
        self.recompute = recompute or splice.Recompute()
        self.placement = placement
        self.on_event = on_event or (lambda event: None)
        self._tables: list[Any] | None = None
        self._base: int | None = None

    # -- running ---------------------------------------------------------------------------------

    def run(self, mode: Mode, session: str | None = None, reference: PipelineResult | None = None,
            keep_logits: bool = False) -> PipelineResult:
        """Run every agent once in ``mode``. With a ``reference`` run (text mode, kept
        logits), each agent also measures its fidelity against the reference's agent."""
        if mode not in MODES:
            raise KvwireError(f"unknown mode {mode!r}", f"use one of {', '.join(MODES)}")
        if mode == "prefix" and not self.spec.shared_system:
            raise PipelineConfigError(f"pipeline {self.spec.name!r} gives agents private system prompts, so no "
                                      "agent's context extends another's", "use splice mode (or text)")
        if mode == "splice" and self._tables is None:
            self._tables = hf.rope_tables(self.model)
        session = session or uuid.uuid4().hex[:12]
        results: list[AgentResult] = []
        upstream: str | None = None
        measuring = 0.0  # time spent on fidelity probes: not part of the pipeline's cost
        start = time.perf_counter()
        for index in range(len(self.spec.agents)):
            self.on_event({"event": "agent_start", "mode": mode, "index": index,
                           "agent": self.spec.agents[index].name, "agents": len(self.spec.agents)})
            ref = reference.agents[index] if reference is not None else None
            result, upstream, spent = self._run_agent(mode, index, session, upstream, ref, keep_logits)
            measuring += spent
            results.append(result)
            self.on_event({"event": "agent_done", "mode": mode, "index": index, "result": result})
        settings = self.recompute.describe() + ("" if self.placement == "end" else f",positions={self.placement}")
        return PipelineResult(self.spec.name, mode, self.store.url, session, results,
                              time.perf_counter() - start - measuring, settings if mode == "splice" else "")

    def compare(self, mode: Mode = "prefix", verify_exact: bool = True, candidate_first: bool = False,
                kl: bool | None = None, prefix_first: bool | None = None) -> Comparison:
        """Run ``text`` and ``mode`` and compare them agent by agent.

        Every agent's fidelity against text mode is measured: greedy token agreement,
        and with ``kl`` (default: for splice) the teacher-forced next-token KL, which
        needs text to run first and keep its logits. ``candidate_first`` swaps the order
        (benchmarks alternate it to cancel drift). Where both modes generated from the
        same ids, the text run *is* the recomputation without an upstream cache; where
        they did not (a generated turn re-tokenizes differently), ``verify_exact``
        recomputes the prefix agent's context from scratch.
        """
        candidate_first = candidate_first if prefix_first is None else prefix_first
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
        return Comparison(text, other, [self._compare_agent(t, o, verify_exact)
                                        for t, o in zip(text.agents, other.agents)])

    def _compare_agent(self, text: AgentResult, other: AgentResult, verify_exact: bool) -> AgentComparison:
        identical = text.output_ids == other.output_ids
        same_context = text.context_ids == other.context_ids
        if other.mode != "prefix":
            note = "identical" if identical else f"agreement {other.fidelity.agreement:.0%}" if other.fidelity else ""
            return AgentComparison(other.agent, identical, same_context, None, None, other.fidelity, note)
        if same_context:
            reference_ids, reference_logits = text.output_ids, text.first_logits
            note = "identical" if identical else "DIFFERENT output from the same context ids"
        else:
            turns = ", ".join(str(t) for t in other.retokenized_turns) or "?"
            note = (f"context differs from text mode: re-tokenizing generated message(s) {turns} gives "
                    f"other ids; output {'identical' if identical else 'differs'}")
            reference_ids, reference_logits = None, None
            if verify_exact:
                reference = hf.generate(self.model, other.context_ids, max_new_tokens=len(other.output_ids),
                                        eos_ids=self.eos, sampling=self.sampling)
                reference_ids, reference_logits = reference.tokens, reference.first_logits
        exact = reference_ids == other.output_ids if reference_ids is not None else False
        diff = None
        if reference_logits is not None and other.first_logits is not None:
            diff = float((reference_logits - other.first_logits).abs().max())
        return AgentComparison(other.agent, identical, same_context, exact, diff, other.fidelity, note)

    # -- one agent --------------------------------------------------------------------------------

    def _run_agent(self, mode: Mode, index: int, session: str, upstream: str | None,
                   reference: AgentResult | None, keep_logits: bool) -> tuple[AgentResult, str, float]:
        agent = self.spec.agents[index]
        system = self.spec.system_for(index)
        start = time.perf_counter()
        handoff = self._read_handoff(upstream) if upstream is not None else None
        messages = handoff.messages if handoff is not None else []
        generated = handoff.generated if handoff is not None else {}
        cache, parent, cached, stats = None, None, 0, {}
        tokenize_s = compute_s = 0.0
        positions = None

        mark = time.perf_counter()
        if mode == "text" or handoff is None:
            transcript = ChatTranscript.from_messages(self.tokenizer, _with_system(system, messages))
            offsets: list[int] = []
        elif mode == "prefix":
            transcript = ChatTranscript(self.tokenizer, _with_system(system, messages), handoff.ids,
                                        {k + bool(system): v for k, v in generated.items()})
            offsets = []
        else:
            transcript, offsets = ChatTranscript.replay(self.tokenizer, system, messages, generated)
        turn_start = len(transcript.ids)  # where this agent's own turn (its splice segment) begins
        transcript.add("user", self.spec.turn(index))
        transcript.open_assistant_turn()
        context_ids = list(transcript.ids)
        tokenize_s += time.perf_counter() - mark

        if handoff is not None and mode == "prefix" and handoff.packet is not None:
            received = chain.receive(self.store, handoff.packet, self.cache_spec)
            context = received.context
            if context.token_ids[0].tolist() != context_ids[: context.length]:
                raise ChainError(f"packet chain {handoff.packet[:12]} does not cover the transcript's first "
                                 f"{context.length} tokens", "the handoff and its packets do not belong together")
            cache = hf.build_cache(context, self.model, self.cache_spec)
            parent, cached = received.head, context.length
        elif handoff is not None and mode == "splice" and handoff.segments:
            segments = [splice.Segment(offsets[message], self._fetch_segment(packet_id))
                        for packet_id, message in handoff.segments]
            spliced = splice.assemble(self.model, self.cache_spec, self._tables or [], context_ids, segments,
                                      recompute=self.recompute, placement=self.placement)
            cache, cached = spliced.cache, spliced.spliced
            compute_s = sum(spliced.timings[k] for k in ("prefix_s", "select_s", "recompute_s"))
            stats = {"recomputed": spliced.recomputed}
            positions = None if spliced.contiguous else spliced.positions[None]
        elif mode == "splice" and self.placement == "global":
            # the session's global position counter starts after the longest private prefix, so every
            # agent's turn keeps one position in every context that splices it
            base = self._global_base()
            positions = torch.arange(len(context_ids))
            positions[turn_start:] += base - turn_start
            positions = positions[None]
        receive_s = time.perf_counter() - start - tokenize_s - compute_s

        mark = time.perf_counter()
        probe = hf.clone_cache(cache, self.model) if reference is not None and cache is not None else None
        measuring = time.perf_counter() - mark
        generation = hf.generate(self.model, context_ids, cache=cache, position_ids=positions,
                                 max_new_tokens=self.spec.new_tokens(index), eos_ids=self.eos,
                                 sampling=self.sampling, keep_logits=keep_logits)
        ttft_s = time.perf_counter() - start - generation.decode_s - measuring

        mark = time.perf_counter()
        check = transcript.verify()  # incremental ids == full template rendering (or explained)
        transcript.add_generated(generation.tokens, self.eos)
        tokenize_s += time.perf_counter() - mark

        mark = time.perf_counter()
        packet_id, packet_bytes = None, 0
        segments_out = list(handoff.segments) if handoff is not None else []
        covered = (context_ids + generation.tokens)[: hf.cache_length(generation.cache)]
        if mode == "prefix":
            packet = hf.extract(generation.cache, self.cache_spec, torch.tensor([covered]), parent=parent,
                                producer=agent.name, session=session)
            packet_id, packet_bytes = chain.publish(self.store, packet), packet.nbytes
        elif mode == "splice":
            packet = hf.extract(generation.cache, self.cache_spec, torch.tensor([covered]), start=turn_start,
                                producer=agent.name, session=session)
            if positions is not None:  # keys sit at the placed positions, not at the slot index
                packet = packet.with_provenance(start=int(positions[0, turn_start]))
            packet_id, packet_bytes = chain.publish(self.store, packet), packet.nbytes
            segments_out.append((packet_id, len(messages)))
        conversation = messages + [{"role": "user", "content": self.spec.turn(index)},
                                   {"role": "assistant", "content": transcript.messages[-1]["content"]}]
        generated_out = dict(generated)
        generated_out[len(messages) + 1] = transcript.generated[len(transcript.messages) - 1]
        key = f"sessions/{session}/handoff/{index}-{agent.name}"
        self.store.put(key, Handoff(conversation, generated_out, agent.name, transcript.ids,
                                    packet_id if mode == "prefix" else None, segments_out).to_bytes())
        publish_s = time.perf_counter() - mark
        total_s = time.perf_counter() - start - measuring

        result = AgentResult(
            agent=agent.name, mode=mode, context_tokens=len(context_ids), cached_tokens=cached,
            new_tokens=len(generation.tokens),
            output_text=self.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip(),
            output_ids=generation.tokens, ttft_s=ttft_s, prefill_s=generation.prefill_s,
            decode_s=generation.decode_s, receive_s=receive_s, compute_s=compute_s, publish_s=publish_s,
            tokenize_s=tokenize_s, total_s=total_s, packet_bytes=packet_bytes,
            transcript_matches_template=check.matches, retokenized_turns=check.retokenized_turns,
            recomputed_tokens=stats.get("recomputed", 0), context_ids=context_ids,
            first_logits=generation.first_logits,
            step_logits=generation.step_logits[0] if generation.step_logits is not None else None,
        )
        if reference is not None:
            mark = time.perf_counter()
            result.fidelity = self._fidelity(reference, result, probe)
            measuring += time.perf_counter() - mark
        if not check.matches:
            log.info("%s: transcript differs from a fresh template rendering at token %s (re-tokenized turns %s)",
                     agent.name, check.first_difference, check.retokenized_turns)
        return result, key, measuring

    def _fidelity(self, reference: AgentResult, result: AgentResult, probe: Any) -> Fidelity:
        """Agreement with the reference output; KL teacher forced on it (outside the timed path)."""
        if reference.step_logits is None or probe is None:  # nothing was received: agreement only
            return measure(reference.output_ids, result.output_ids)
        cached = hf.cache_length(probe)
        forced = result.context_ids[cached:] + reference.output_ids[:-1]
        logits = hf.forward_logits(self.model, probe, forced)[-len(reference.output_ids):]
        return measure(reference.output_ids, result.output_ids, reference.step_logits, logits)

    def _global_base(self) -> int:
        """First position of the shared conversation under placement "global": past every agent's prefix."""
        if self._base is None:
            lengths = []
            for index in range(len(self.spec.agents)):
                transcript = ChatTranscript(self.tokenizer)
                system = self.spec.system_for(index)
                if system:
                    transcript.add("system", system)
                lengths.append(len(transcript.ids))
            self._base = max(lengths)
        return self._base

    def _fetch_segment(self, packet_id: str) -> Any:
        data = self.store.get(chain.packet_key(packet_id))
        if data is None:
            raise ChainError(f"segment {packet_id[:12]} is not in {self.store.url}",
                             "the sender must publish its segment before the handoff")
        packet = codec.decode(data)
        if packet.id != packet_id:
            raise ChainError(f"{self.store.url} holds a packet under id {packet_id[:12]} whose content hashes to "
                             f"{packet.id[:12]}")
        return packet

    def _read_handoff(self, key: str) -> Handoff:
        data = self.store.get(key)
        if data is None:
            raise PacketError(f"no handoff at {key} in {self.store.url}", "the upstream agent has not run")
        return Handoff.from_bytes(data, key)


def _with_system(system: str, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in messages]
