"""One agent of a pipeline: its model, and how it takes a turn.

A turn: read the upstream :class:`~kvwire.pipeline.handoff.Handoff` from the store, build
the context (ids under this agent's system prompt), get a cache for it the way the
mode says, generate, publish this agent's packet and handoff. The same code runs
inside :class:`kvwire.pipeline.Pipeline` (all agents in one process) and in
``kvwire agent`` (one agent per process or host).

A received cache is used only if it is fresh and was made by this agent's exact
weights. Otherwise the agent *rebuilds*: it re-prefills from the token ids the
handoff carries, logs why and counts it (``AgentResult.events``):

- ``stale-fingerprint``: a packet was made by other weights (the model was updated);
- ``broken-chain``: a link is missing or does not verify (e.g. evicted, a round gap);
- ``expired``: the chain is older than :class:`Freshness` allows (rounds or seconds);
- ``store-unreachable``: the packets could not be fetched (the handoff could).

When publishing, a packet larger than the store's whole budget is not sent
(``packet-too-large``): the next agent re-prefills from ids, as in text mode.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..kv import chain, splice
from ..wire import codec
from .. import hf
from ..wire.options import CodecOptions
from .cost import CostModel
from ..errors import (ChainError, ModelMismatchError, OverBudget, PacketError, StoreConfigError, StoreError,
                     StoreUnavailable)
from .fidelity import Fidelity, measure
from .handoff import Handoff, handoff_key
from ..wire.packet import Packet
from .spec import PipelineSpec
from .results import AgentResult
from ..wire.spec import ModelSpec
from ..store import Store
from ..store.metered import MeteredStore
from .transcript import ChatTranscript

log = logging.getLogger(__name__)

Mode = Literal["text", "prefix", "splice", "auto"]
MODES: tuple[str, ...] = ("text", "prefix", "splice", "auto")


@dataclass(frozen=True)
class Freshness:
    """How old a received cache may be before it is rebuilt instead of used."""

    max_rounds: int | None = None  # rounds between the chain's first packet and now
    max_age_s: float | None = None  # seconds since the chain's first packet was made


class Agent:
    """Agent ``index`` of ``spec``, running ``model``."""

    def __init__(self, spec: PipelineSpec, index: int, model: Any, tokenizer: Any, store: Store, *,
                 cache_spec: ModelSpec | None = None, sampling: hf.Sampling | None = None,
                 recompute: splice.Recompute | None = None, placement: splice.Placement = "end",
                 freshness: Freshness | None = None, cost: CostModel | None = None,
                 codec_options: CodecOptions | None = None, splice_when: splice.When = "cheaper") -> None:
        self.spec = spec
        self.index = index
        self.name = spec.agents[index].name
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.cache_spec = cache_spec or hf.model_spec(model)
        self.eos = hf.eos_token_ids(model)
        self.sampling = sampling or hf.Sampling()
        self.recompute = recompute or splice.Recompute()
        self.placement = placement
        if splice_when not in splice.WHEN:
            raise ValueError(f"splice_when must be one of {', '.join(splice.WHEN)}, got {splice_when!r}")
        # splice mode: splice upstream turns only where that beats prefilling them (splice.estimate), or always
        self.splice_when = splice_when
        self.freshness = freshness or Freshness()
        self.cost = cost  # for mode "auto": decides per hop whether a cache is worth sending
        # encoding, signing key and size limit for the packets it sends and accepts (default: KVWIRE_* variables)
        self.codec_options = codec_options if codec_options is not None else CodecOptions.from_env()
        self._tables: list[Any] | None = None
        self._base: int | None = None

    def use_model(self, model: Any, cache_spec: ModelSpec | None = None) -> ModelSpec:
        """Switch to new weights (an update or a fine-tune); returns the new spec."""
        self.model = model
        self.cache_spec = cache_spec or hf.model_spec(model)
        self.eos = hf.eos_token_ids(model)
        self._tables = None
        return self.cache_spec

    # -- a turn ----------------------------------------------------------------------------------

    def turn(self, mode: Mode, session: str, upstream: str | None, *, round: int = 0,
             reference: AgentResult | None = None, keep_logits: bool = False) -> tuple[AgentResult, str, float]:
        """Take one turn; returns the result, the key of the handoff left for the next agent,
        and the seconds spent on fidelity measurement (not part of the turn's cost)."""
        system = self.spec.system_for(self.index)
        events: list[str] = []
        auto, mode = mode == "auto", ("prefix" if mode == "auto" else mode)  # auto receives like prefix
        if auto and self.cost is None:
            raise PacketError("mode auto needs a cost model", "create the agent with cost=CostModel(...)")
        started_at, start = time.time(), time.perf_counter()
        packets = MeteredStore(self.store)  # this turn's packet traffic, timed apart from the compute around it
        handoff = self._read_handoff(upstream) if upstream is not None else None
        messages = handoff.messages if handoff is not None else []
        generated = handoff.generated if handoff is not None else {}
        cache, parent, cached, recomputed, used_fingerprint, received = None, None, 0, 0, None, None
        decision = ""  # auto: cache or ids for this hop; splice: spliced or prefilled, and why
        tokenize_s = compute_s = select_s = 0.0
        positions = None

        mark = time.perf_counter()
        offsets: list[int] = []
        if mode == "text" or handoff is None:
            transcript = ChatTranscript.from_messages(self.tokenizer, _with_system(system, messages))
        elif mode == "prefix":
            transcript = ChatTranscript(self.tokenizer, _with_system(system, messages), handoff.ids,
                                        {k + bool(system): v for k, v in generated.items()})
        else:
            transcript, offsets = ChatTranscript.replay(self.tokenizer, system, messages, generated)
        turn_start = len(transcript.ids)  # where this agent's own turn (its splice segment) begins
        transcript.add("user", self.spec.turn(self.index))
        transcript.open_assistant_turn()
        context_ids = list(transcript.ids)
        tokenize_s += time.perf_counter() - mark

        device_bytes = 0
        if handoff is not None and mode == "prefix" and handoff.packet is not None:
            received = self._receive_chain(packets, handoff.packet, context_ids, round, events)
            if received is not None:
                context, moved = self._to_model(received.context)
                device_bytes += moved
                cache = hf.build_cache(context, self.model, self.cache_spec)
                parent, cached, used_fingerprint = received.head, received.context.length, self.cache_spec.fingerprint
        elif handoff is not None and mode == "splice" and handoff.segments:
            if self._tables is None:
                self._tables = hf.rope_tables(self.model, self.cache_spec)  # checked on the model (probe)
            segments = []
            for packet_id, message in handoff.segments:
                segment, moved = self._to_model(self._fetch_segment(packets, packet_id))
                segments.append(splice.Segment(offsets[message], segment))
                device_bytes += moved
            cost = splice.estimate(len(context_ids), segments[0].offset,
                                   [(s.offset, s.offset + s.packet.length) for s in segments], self.recompute,
                                   self.cache_spec.num_layers)
            estimated = cost.describe()
            if self.splice_when == "cheaper" and self.placement == "end" and not cost.splice_pays:
                decision = f"splice: prefilled the upstream turns exactly, cheaper ({estimated})"
            else:
                spliced = splice.assemble(self.model, self.cache_spec, self._tables, context_ids, segments,
                                          recompute=self.recompute, placement=self.placement)
                cache, cached, recomputed = spliced.cache, spliced.spliced, spliced.recomputed
                used_fingerprint = self.cache_spec.fingerprint
                compute_s = sum(spliced.timings[k] for k in ("prefix_s", "select_s", "recompute_s"))
                select_s = spliced.timings["select_s"]
                positions = None if spliced.contiguous else spliced.positions[None]
                decision = f"splice: spliced {len(segments)} upstream turn(s) ({estimated})"
        elif mode == "splice" and self.placement == "global":
            # the session's global position counter starts after the longest private prefix, so every
            # agent's turn keeps one position in every context that splices it
            positions = torch.arange(len(context_ids))
            positions[turn_start:] += self._global_base() - turn_start
            positions = positions[None]
        receive_s = time.perf_counter() - start - tokenize_s - compute_s

        mark = time.perf_counter()
        probe = hf.clone_cache(cache, self.model) if reference is not None and cache is not None else None
        measuring = time.perf_counter() - mark
        generation = hf.generate(self.model, context_ids, cache=cache, position_ids=positions,
                                 max_new_tokens=self.spec.new_tokens(self.index), eos_ids=self.eos,
                                 sampling=self.sampling, keep_logits=keep_logits)
        ttft_s = time.perf_counter() - start - generation.decode_s - measuring

        mark = time.perf_counter()
        check = transcript.verify()  # incremental ids == full template rendering (or explained)
        transcript.add_generated(generation.tokens, self.eos)
        tokenize_s += time.perf_counter() - mark

        mark = time.perf_counter()
        packet_id, packet_bytes, segments_out = None, 0, list(handoff.segments) if handoff is not None else []
        covered = (context_ids + generation.tokens)[: hf.cache_length(generation.cache)]
        provenance = {"producer": self.name, "session": session, "round": round}
        packet, send_cache, verdict = None, True, None
        if auto:  # cache or ids for this hop; with ids the handoff alone goes on and the next agent re-prefills
            links = 1 + (received.links if parent is not None else 0)
            verdict = self.cost.decide(len(covered), len(covered) - (parent.end if parent is not None else 0), links)
            decision, send_cache = verdict.reason, verdict.choice == "cache"
        if send_cache and mode == "prefix":
            packet = hf.extract(generation.cache, self.cache_spec, torch.tensor([covered]), parent=parent,
                                **provenance)
        elif send_cache and mode == "splice":
            packet = hf.extract(generation.cache, self.cache_spec, torch.tensor([covered]), start=turn_start,
                                **provenance)
            if positions is not None:  # keys sit at the placed positions, not at the slot index
                packet = packet.with_provenance(start=int(positions[0, turn_start]))
        if packet is not None:
            if packet.device.type != "cpu":
                packet, device_bytes = packet.to("cpu"), device_bytes + packet.nbytes
            try:
                packet_id, packet_bytes = chain.publish(packets, packet, options=self.codec_options), packet.nbytes
            except OverBudget as err:  # documented fallback: this hop passes ids, the next agent re-prefills
                events.append(f"packet-too-large: {err}")
                log.warning("%s sends no cache this turn: %s", self.name, err)
            else:
                if mode == "splice":
                    segments_out.append((packet_id, len(messages)))
        conversation = messages + [{"role": "user", "content": self.spec.turn(self.index)},
                                   {"role": "assistant", "content": transcript.messages[-1]["content"]}]
        generated_out = dict(generated)
        generated_out[len(messages) + 1] = transcript.generated[len(transcript.messages) - 1]
        key = handoff_key(session, self.index, self.name, round)
        # compare-and-set: a turn is taken once; a second writer (a stale or duplicate process) is rejected
        self.store.put(key, Handoff(conversation, generated_out, self.name, transcript.ids,
                                    packet_id if mode == "prefix" else None, segments_out)
                       .to_bytes(self.codec_options.key_bytes), expect_version=0)
        publish_s = time.perf_counter() - mark
        total_s = time.perf_counter() - start - measuring

        result = AgentResult(
            agent=self.name, mode="auto" if auto else mode, context_tokens=len(context_ids), cached_tokens=cached,
            new_tokens=len(generation.tokens),
            output_text=self.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip(),
            output_ids=generation.tokens, ttft_s=ttft_s, prefill_s=generation.prefill_s,
            decode_s=generation.decode_s, receive_s=receive_s, compute_s=compute_s, publish_s=publish_s,
            tokenize_s=tokenize_s, total_s=total_s, packet_bytes=packet_bytes,
            transcript_matches_template=check.matches, retokenized_turns=check.retokenized_turns,
            recomputed_tokens=recomputed, round=round, events=events, cache_fingerprint=used_fingerprint,
            device_copy_bytes=device_bytes, decision=decision, select_s=select_s, prediction=verdict,
            started_at=started_at, traffic=packets.traffic,
            fingerprint=self.cache_spec.fingerprint, context_ids=context_ids, first_logits=generation.first_logits,
            step_logits=generation.step_logits[0] if generation.step_logits is not None else None,
        )
        if reference is not None:
            mark = time.perf_counter()
            if mode == "splice" and probe is not None:  # the splice error alone, without tokenization effects
                result.exact_fidelity = self._exact_fidelity(result, hf.clone_cache(probe, self.model))
            result.fidelity = self._fidelity(reference, result, probe)
            measuring += time.perf_counter() - mark
        if not check.matches:
            log.info("%s: transcript differs from a fresh template rendering at token %s (re-tokenized turns %s)",
                     self.name, check.first_difference, check.retokenized_turns)
        return result, key, measuring

    # -- receiving -------------------------------------------------------------------------------

    def _receive_chain(self, store: Store, head: str, context_ids: list[int], round: int,
                       events: list[str]) -> chain.Received | None:
        """The upstream chain if it may be used; ``None`` (and an event) if the agent must rebuild."""
        try:
            received = chain.receive(store, head, self.cache_spec, options=self.codec_options)
        except ModelMismatchError as err:
            return self._rebuild(events, "stale-fingerprint", str(err))
        except (ChainError, PacketError) as err:
            return self._rebuild(events, "broken-chain", str(err))
        except StoreConfigError:  # wrong credentials or set-up: rebuilding on every turn would only hide it
            raise
        except StoreUnavailable as err:  # the store went away after the handoff was read: re-prefill from its ids
            return self._rebuild(events, "store-unreachable", str(err))
        except StoreError as err:  # a damaged value: the chain cannot be used
            return self._rebuild(events, "broken-chain", str(err))
        context = received.context
        if context.token_ids[0].tolist() != context_ids[: context.length]:
            return self._rebuild(events, "broken-chain", f"chain {head[:12]} does not cover this context's first "
                                                         f"{context.length} tokens")
        first = received.first
        fresh = self.freshness
        if fresh.max_rounds is not None and round - first.round > fresh.max_rounds:
            return self._rebuild(events, "expired", f"chain started in round {first.round}, now round {round} "
                                                    f"(max {fresh.max_rounds} rounds)")
        if fresh.max_age_s is not None and time.time() - first.created_at > fresh.max_age_s:
            return self._rebuild(events, "expired", f"chain is {time.time() - first.created_at:.0f} s old "
                                                    f"(max {fresh.max_age_s:g} s)")
        return received

    def _rebuild(self, events: list[str], kind: str, why: str) -> None:
        events.append(f"{kind}: {why}")
        log.warning("%s rebuilds its context from token ids (%s): %s", self.name, kind, why)
        return None

    def _to_model(self, packet: Packet) -> tuple[Packet, int]:
        """The packet on the model's device, and the bytes moved to put it there (0 on CPU)."""
        device = next(self.model.parameters()).device
        if packet.device == device:
            return packet, 0
        return packet.to(device), packet.nbytes

    def _fetch_segment(self, store: Store, packet_id: str) -> Packet:
        data = store.get(chain.packet_key(packet_id))
        if data is None:
            raise ChainError(f"segment {packet_id[:12]} is not in {self.store.url}",
                             "the sender must publish its segment before the handoff")
        packet = codec.decode(data, options=self.codec_options)
        if packet.id != packet_id:
            raise ChainError(f"{self.store.url} holds a packet under id {packet_id[:12]} whose content hashes to "
                             f"{packet.id[:12]}")
        return packet

    def _read_handoff(self, key: str) -> Handoff:
        data = self.store.get(key)
        if data is None:
            raise PacketError(f"no handoff at {key} in {self.store.url}", "the upstream agent has not run")
        return Handoff.from_bytes(data, key, self.codec_options.key_bytes)

    # -- the receiving steps, for runners that schedule turns themselves (kvwire.graph) ------------

    def receive_chain(self, head: str, context_ids: list[int], round: int, events: list[str]) -> chain.Received | None:
        """The chain ending at ``head`` if it may be used for ``context_ids``; else ``None`` and an event."""
        return self._receive_chain(self.store, head, context_ids, round, events)

    def read_handoff(self, key: str) -> Handoff:
        return self._read_handoff(key)

    def fetch_segment(self, packet_id: str) -> Packet:
        """One verified packet (not its chain)."""
        return self._fetch_segment(self.store, packet_id)

    def to_model(self, packet: Packet) -> tuple[Packet, int]:
        """The packet on the model's device, and the bytes moved."""
        return self._to_model(packet)

    # -- measuring -------------------------------------------------------------------------------

    def _fidelity(self, reference: AgentResult, result: AgentResult, probe: Any) -> Fidelity:
        """Agreement with the reference output; KL teacher forced on it (outside the timed path)."""
        if reference.step_logits is None or probe is None:  # nothing was received: agreement only
            return measure(reference.output_ids, result.output_ids)
        cached = hf.cache_length(probe)
        forced = result.context_ids[cached:] + reference.output_ids[:-1]
        logits = hf.forward_logits(self.model, probe, forced)[-len(reference.output_ids):]
        return measure(reference.output_ids, result.output_ids, reference.step_logits, logits)

    def _exact_fidelity(self, result: AgentResult, probe: Any) -> Fidelity:
        """Agreement and KL against a recomputation of this agent's own context ids without any
        cache: what splicing approximates, free of any difference in how text mode tokenized."""
        exact = hf.generate(self.model, result.context_ids, max_new_tokens=self.spec.new_tokens(self.index),
                            eos_ids=self.eos, sampling=self.sampling, keep_logits=True)
        forced = result.context_ids[hf.cache_length(probe):] + exact.tokens[:-1]
        logits = hf.forward_logits(self.model, probe, forced)[-len(exact.tokens):]
        return measure(exact.tokens, result.output_ids, exact.step_logits[0], logits)

    def _global_base(self) -> int:
        """First position of the shared conversation under placement "global": past every agent's prefix."""
        if self._base is None:
            lengths = []
            for index in range(len(self.spec.agents)):
                transcript = ChatTranscript(self.tokenizer)
                if self.spec.system_for(index):
                    transcript.add("system", self.spec.system_for(index))
                lengths.append(len(transcript.ids))
            self._base = max(lengths)
        return self._base


def _with_system(system: str, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in messages]
