"""Agents that share one model and one chat transcript, passing text or KV-cache packets.

Each agent appends its own instruction turn to the shared transcript and
generates a reply. What travels between agents (always through a store) is:

- ``text``: the baseline that frameworks use today. The next agent gets the
  messages as strings, renders and tokenizes the whole transcript and prefills
  all of it.
- ``prefix``: the next agent gets the messages, the exact token ids, and the id
  of the upstream packet chain. It assembles the chain into a cache of the
  transcript so far and prefills only its own new tokens. Exact: greedy output
  equals a recomputation from the same ids.

:meth:`Pipeline.compare` runs both on one model in one process and reports the
speedup, the ideal speedup and the efficiency (see :class:`Comparison`).
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

from . import chain, hf
from .errors import ChainError, KvwireError, PacketError
from .pipefile import PipelineSpec
from .spec import ModelSpec
from .store import Store, open_store
from .transcript import ChatTranscript

log = logging.getLogger(__name__)

Mode = Literal["text", "prefix"]
MODES: tuple[str, ...] = ("text", "prefix")
Event = Callable[[dict[str, Any]], None]


@dataclass
class Handoff:
    """What an agent leaves in the store for the next one (small JSON)."""

    messages: list[dict[str, str]]
    ids: list[int]  # the exact transcript ids (prefix mode extends these)
    generated: dict[int, list[int]]  # message index -> ids the model generated for it
    packet: str | None  # id of the head of the packet chain covering a prefix of `ids`
    producer: str

    def to_bytes(self) -> bytes:
        return json.dumps({"messages": self.messages, "ids": self.ids,
                           "generated": {str(k): v for k, v in self.generated.items()},
                           "packet": self.packet, "producer": self.producer}).encode()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, key: str) -> Handoff:
        try:
            obj = json.loads(bytes(data))
            messages = obj["messages"]
            ok = (isinstance(messages, list)
                  and all(isinstance(m, dict) and set(m) == {"role", "content"}
                          and all(isinstance(v, str) for v in m.values()) for m in messages)
                  and isinstance(obj["ids"], list) and all(type(i) is int for i in obj["ids"])
                  and isinstance(obj["generated"], dict)
                  and all(isinstance(v, list) and all(type(i) is int for i in v) for v in obj["generated"].values())
                  and isinstance(obj["packet"], (str, type(None))) and isinstance(obj["producer"], str))
            if not ok:
                raise ValueError("fields have the wrong types")
            generated = {int(k): v for k, v in obj["generated"].items()}
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ChainError(f"malformed handoff at {key}: {err}") from None
        return cls(messages, obj["ids"], generated, obj["packet"], obj["producer"])


@dataclass
class AgentResult:
    """One agent's turn. Times in seconds; ``transfer_s = receive_s + publish_s``."""

    agent: str
    mode: str
    context_tokens: int  # tokens the reply was generated from
    cached_tokens: int  # of those, served from upstream packets
    new_tokens: int
    output_text: str
    output_ids: list[int]
    ttft_s: float  # agent start -> first token (receive, tokenize, inject, prefill)
    prefill_s: float
    decode_s: float
    receive_s: float  # handoff + packets: store get, decode, join, build cache
    publish_s: float  # extract, encode, store put, handoff
    tokenize_s: float  # building the transcript ids (incl. the template check)
    total_s: float
    packet_bytes: int  # K/V bytes this agent published (0 in text mode)
    transcript_matches_template: bool
    retokenized_turns: list[int]
    context_ids: list[int] = field(repr=False, default_factory=list)
    first_logits: torch.Tensor | None = field(repr=False, default=None)

    @property
    def transfer_s(self) -> float:
        return self.receive_s + self.publish_s

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent, "mode": self.mode, "context_tokens": self.context_tokens,
            "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
            "ttft_s": self.ttft_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "transfer_s": self.transfer_s, "tokenize_s": self.tokenize_s, "total_s": self.total_s,
            "packet_bytes": self.packet_bytes, "transcript_matches_template": self.transcript_matches_template,
            "output": self.output_text,
        }


@dataclass
class PipelineResult:
    pipeline: str
    mode: str
    store: str
    session: str
    agents: list[AgentResult]
    total_s: float  # wall time of the whole run

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "mode": self.mode, "store": self.store, "total_s": self.total_s,
                "agents": [a.to_json() for a in self.agents]}


@dataclass
class AgentComparison:
    agent: str
    identical: bool  # same output ids in both modes
    same_context: bool  # both modes generated from the same ids
    exact: bool  # prefix output equals a recomputation from its own ids without any cache
    max_logit_diff: float | None  # first-token logits, prefix vs recomputation
    note: str


@dataclass
class Comparison:
    """``text`` and ``prefix`` runs of one pipeline, side by side.

    - ``speedup``       text total / prefix total
    - ``ttft_speedup``  mean TTFT of agents 2..N, text / prefix
    - ``ideal_s``       text total minus the re-prefill prefix mode avoids (per agent 2..N,
                        text prefill - prefix prefill, measured in this run): prefix mode
                        with free packets, codec, store and inject
    - ``efficiency``    speedup / ideal speedup = ideal_s / prefix total
    """

    text: PipelineResult
    prefix: PipelineResult
    agents: list[AgentComparison]

    @property
    def speedup(self) -> float:
        return self.text.total_s / self.prefix.total_s

    @property
    def ttft_speedup(self) -> float:
        text = [a.ttft_s for a in self.text.agents[1:]]
        prefix = [a.ttft_s for a in self.prefix.agents[1:]]
        return sum(text) / sum(prefix) if prefix else 1.0

    @property
    def avoided_s(self) -> float:
        return sum(t.prefill_s - p.prefill_s for t, p in zip(self.text.agents[1:], self.prefix.agents[1:]))

    @property
    def ideal_s(self) -> float:
        return self.text.total_s - self.avoided_s

    @property
    def ideal_speedup(self) -> float:
        return self.text.total_s / self.ideal_s

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.prefix.total_s

    @property
    def identical(self) -> bool:
        return all(a.identical for a in self.agents)

    @property
    def exact(self) -> bool:
        return all(a.exact for a in self.agents)

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.text.pipeline, "store": self.prefix.store,
            "speedup": self.speedup, "ttft_speedup": self.ttft_speedup,
            "ideal_speedup": self.ideal_speedup, "efficiency": self.efficiency,
            "identical": self.identical, "exact": self.exact,
            "text_s": self.text.total_s, "prefix_s": self.prefix.total_s,
            "agents": [{"agent": a.agent, "identical": a.identical, "exact": a.exact,
                        "max_logit_diff": a.max_logit_diff, "note": a.note} for a in self.agents],
            "runs": [self.text.to_json(), self.prefix.to_json()],
        }


class Pipeline:
    """Run a :class:`PipelineSpec` with one model, agents exchanging through ``store``."""

    def __init__(self, model: Any, tokenizer: Any, spec: PipelineSpec, *, store: Store | str = "memory://",
                 model_spec: ModelSpec | None = None, sampling: hf.Sampling | None = None,
                 on_event: Event | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.store = open_store(store) if isinstance(store, str) else store
        self.cache_spec = model_spec or hf.model_spec(model)
        self.eos = hf.eos_token_ids(model)
        self.sampling = sampling or hf.Sampling()
        self.on_event = on_event or (lambda event: None)

    # -- running ---------------------------------------------------------------------------------

    def run(self, mode: Mode, session: str | None = None) -> PipelineResult:
        if mode not in MODES:
            raise KvwireError(f"unknown mode {mode!r}", f"use one of {', '.join(MODES)}")
        session = session or uuid.uuid4().hex[:12]
        results: list[AgentResult] = []
        upstream: str | None = None
        start = time.perf_counter()
        for index in range(len(self.spec.agents)):
            self.on_event({"event": "agent_start", "mode": mode, "index": index,
                           "agent": self.spec.agents[index].name, "agents": len(self.spec.agents)})
            result, upstream = self._run_agent(mode, index, session, upstream)
            results.append(result)
            self.on_event({"event": "agent_done", "mode": mode, "index": index, "result": result})
        return PipelineResult(self.spec.name, mode, self.store.url, session, results, time.perf_counter() - start)

    def compare(self, verify_exact: bool = True, prefix_first: bool = False) -> Comparison:
        """Run ``text`` then ``prefix`` (or the other way round) and compare them agent by agent.

        Where both modes generated from the same ids, the text run *is* the
        recomputation without an upstream cache. Where they did not (a generated turn
        re-tokenizes differently), ``verify_exact`` recomputes the prefix agent's
        context from scratch to check exactness.
        """
        if prefix_first:
            prefix = self.run("prefix")
            text = self.run("text")
        else:
            text = self.run("text")
            prefix = self.run("prefix")
        return Comparison(text, prefix, [self._compare_agent(t, p, verify_exact)
                                         for t, p in zip(text.agents, prefix.agents)])

    def _compare_agent(self, text: AgentResult, prefix: AgentResult, verify_exact: bool) -> AgentComparison:
        identical = text.output_ids == prefix.output_ids
        same_context = text.context_ids == prefix.context_ids
        if same_context:
            reference_ids, reference_logits = text.output_ids, text.first_logits
            note = "identical" if identical else "DIFFERENT output from the same context ids"
        else:
            turns = ", ".join(str(t) for t in prefix.retokenized_turns) or "?"
            note = (f"context differs from text mode: re-tokenizing generated message(s) {turns} gives "
                    f"other ids; output {'identical' if identical else 'differs'}")
            reference_ids, reference_logits = None, None
            if verify_exact:
                reference = hf.generate(self.model, prefix.context_ids, max_new_tokens=len(prefix.output_ids),
                                        eos_ids=self.eos, sampling=self.sampling)
                reference_ids, reference_logits = reference.tokens, reference.first_logits
        exact = reference_ids == prefix.output_ids if reference_ids is not None else False
        diff = None
        if reference_logits is not None and prefix.first_logits is not None:
            diff = float((reference_logits - prefix.first_logits).abs().max())
        return AgentComparison(prefix.agent, identical, same_context, exact, diff, note)

    # -- one agent --------------------------------------------------------------------------------

    def _run_agent(self, mode: Mode, index: int, session: str, upstream: str | None) -> tuple[AgentResult, str]:
        agent = self.spec.agents[index]
        start = time.perf_counter()
        handoff = self._read_handoff(upstream) if upstream is not None else None
        cache, parent, cached = None, None, 0
        tokenize_s = 0.0
        if handoff is not None and mode == "prefix":
            transcript = ChatTranscript(self.tokenizer, handoff.messages, handoff.ids, handoff.generated)
            if handoff.packet is not None:
                received = chain.receive(self.store, handoff.packet, self.cache_spec)
                context = received.context
                if context.token_ids[0].tolist() != transcript.ids[: context.length]:
                    raise ChainError(f"packet chain {handoff.packet[:12]} does not cover the transcript's first "
                                     f"{context.length} tokens", "the handoff and its packets do not belong together")
                cache = hf.build_cache(context, self.model, self.cache_spec)
                parent, cached = received.head, context.length
        else:
            mark = time.perf_counter()
            transcript = (ChatTranscript.from_messages(self.tokenizer, handoff.messages) if handoff is not None
                          else ChatTranscript(self.tokenizer))
            tokenize_s += time.perf_counter() - mark
        receive_s = time.perf_counter() - start - tokenize_s

        mark = time.perf_counter()
        if handoff is None and self.spec.system:
            transcript.add("system", self.spec.system)
        transcript.add("user", self.spec.turn(index))
        transcript.open_assistant_turn()
        context_ids = list(transcript.ids)
        tokenize_s += time.perf_counter() - mark

        generation = hf.generate(self.model, context_ids, cache=cache, max_new_tokens=self.spec.new_tokens(index),
                                 eos_ids=self.eos, sampling=self.sampling)
        ttft_s = time.perf_counter() - start - generation.decode_s

        mark = time.perf_counter()
        check = transcript.verify()  # incremental ids == full template rendering (or explained)
        transcript.add_generated(generation.tokens, self.eos)
        tokenize_s += time.perf_counter() - mark

        mark = time.perf_counter()
        packet_id, packet_bytes = None, 0
        if mode == "prefix":
            assert generation.cache is not None
            covered = (context_ids + generation.tokens)[: hf.cache_length(generation.cache)]
            packet = hf.extract(generation.cache, self.cache_spec, torch.tensor([covered]), parent=parent,
                                producer=agent.name, session=session)
            packet_id, packet_bytes = chain.publish(self.store, packet), packet.nbytes
        key = f"sessions/{session}/handoff/{index}-{agent.name}"
        self.store.put(key, Handoff(transcript.messages, transcript.ids, transcript.generated, packet_id,
                                    agent.name).to_bytes())
        publish_s = time.perf_counter() - mark
        total_s = time.perf_counter() - start

        result = AgentResult(
            agent=agent.name, mode=mode, context_tokens=len(context_ids), cached_tokens=cached,
            new_tokens=len(generation.tokens),
            output_text=self.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip(),
            output_ids=generation.tokens, ttft_s=ttft_s, prefill_s=generation.prefill_s,
            decode_s=generation.decode_s, receive_s=receive_s, publish_s=publish_s, tokenize_s=tokenize_s,
            total_s=total_s, packet_bytes=packet_bytes, transcript_matches_template=check.matches,
            retokenized_turns=check.retokenized_turns, context_ids=context_ids,
            first_logits=generation.first_logits,
        )
        if not check.matches:
            log.info("%s: transcript differs from a fresh template rendering at token %s (re-tokenized turns %s)",
                     agent.name, check.first_difference, check.retokenized_turns)
        return result, key

    def _read_handoff(self, key: str) -> Handoff:
        data = self.store.get(key)
        if data is None:
            raise PacketError(f"no handoff at {key} in {self.store.url}", "the upstream agent has not run")
        return Handoff.from_bytes(data, key)
