"""One agent of a pipeline: its model, and how it takes a turn.

A turn: read the upstream :class:`~kvwire.pipeline.handoff.Handoff` from the store, build
the context (ids under this agent's system prompt), get a cache for it the way the
mode says, generate, publish this agent's packet and handoff: the phases of
:mod:`kvwire.pipeline.turn`, the mode a :class:`~kvwire.pipeline.turn.TurnMode`. The same code runs
inside :class:`kvwire.pipeline.Pipeline` (all agents in one process) and in
``kvwire agent`` (one agent per process or host).

A received cache is used only if it is fresh and was made by this agent's exact
weights (:func:`kvwire.kv.receive.fetch_verified`). Otherwise the agent *rebuilds*: it
re-prefills from the token ids the handoff carries, logs why and counts it
(``AgentResult.events``, under the pipeline labels of :class:`kvwire.kv.receive.Reason`):

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
from typing import Any, Literal


from ..kv import splice
from ..kv.receive import Freshness, Received, Refusal, fetch_verified
from .. import hf
from ..wire import quant
from ..wire.options import CodecOptions
from .cost import CostModel
from .rates import Estimator
from ..errors import ChainError, PacketError, PipelineConfigError
from .handoff import Handoff
from ..wire.packet import Packet
from .spec import PipelineSpec
from .results import AgentResult
from ..wire.spec import ModelSpec
from ..store import Store
from ..store.metered import MeteredStore
from .transcript import ChatTranscript
from .turn import (Turn, TurnMode, close_transcript, decode_alone, measure_fidelity, open_turn, publish_handoff,
                   publish_packet, result, turn_mode)

__all__ = ["MODES", "Mode", "Agent", "Freshness", "build_agents"]

log = logging.getLogger(__name__)

Mode = Literal["text", "prefix", "splice", "auto"]
MODES: tuple[str, ...] = ("text", "prefix", "splice", "auto")


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
        # mode "auto" in an agent process: builds `cost` at each decision from what the process knows by then
        self.estimator: Estimator | None = None
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
        how = turn_mode(mode)
        how.check(self)
        started_at, start = time.time(), time.perf_counter()
        packets = MeteredStore(self.store)  # this turn's packet traffic, timed apart from the compute around it
        handoff = self._read_handoff(upstream) if upstream is not None else None
        turn = self._context(how, session, round, handoff, start, started_at)
        turn.traffic = packets.traffic  # live: mode auto reads what the receive moved before it decides
        how.receive(self, turn, handoff, packets)
        turn.receive_s = time.perf_counter() - start - turn.tokenize_s - turn.compute_s

        mark = time.perf_counter()
        probe = hf.clone_cache(turn.cache, self.model) if reference is not None and turn.cache is not None else None
        turn.measuring = time.perf_counter() - mark
        decode_alone(turn, keep_logits)
        close_transcript(turn)

        mark = time.perf_counter()
        packet_id = publish_packet(turn, packets, how.packet(self, turn))
        key = publish_handoff(turn, self.store, *how.handoff_refs(turn, handoff, packet_id))
        turn.publish_s = time.perf_counter() - mark
        done = result(turn, time.perf_counter() - start - turn.measuring)
        if reference is not None:
            mark = time.perf_counter()
            copy = (lambda: hf.clone_cache(probe, self.model)) if probe is not None else None
            measure_fidelity(turn, done, reference, copy, exact=how.exact_fidelity)
            turn.measuring += time.perf_counter() - mark
        return done, key, turn.measuring

    def _context(self, how: TurnMode, session: str, round: int, handoff: Handoff | None, start: float,
                 started_at: float) -> Turn:
        """Build the context: the upstream conversation under this agent's system prompt, then its own turn."""
        mark = time.perf_counter()
        transcript, offsets = how.context(self, self.spec.system_for(self.index), handoff)
        turn_start = len(transcript.ids)  # where this agent's own turn (its splice segment) begins
        context_ids = open_turn(transcript, self.spec.turn(self.index))
        return Turn(self, self.index, round, session, how.name, transcript, context_ids, start,
                    messages=handoff.messages if handoff is not None else [],
                    generated=handoff.generated if handoff is not None else {}, started_at=started_at,
                    turn_start=turn_start, offsets=offsets, tokenize_s=time.perf_counter() - mark)

    # -- receiving (also for runners that schedule turns themselves: kvwire.pipeline.graph) ----------

    def receive_chain(self, head: str, context_ids: list[int], round: int, events: list[str], *,
                      store: Store | None = None) -> Received | None:
        """The chain ending at ``head`` if it may be used for ``context_ids``; else ``None`` and an event."""
        got = fetch_verified(store or self.store, head, self.cache_spec, ids=context_ids, freshness=self.freshness,
                             round=round, options=self.codec_options)
        if isinstance(got, Refusal):
            events.append(got.pipeline_event)
            log.warning("%s rebuilds its context from token ids (%s): %s", self.name, got.reason.pipeline_label,
                        got.message)
            return None
        return got

    def fetch_segment(self, packet_id: str, *, store: Store | None = None) -> Packet:
        """A splice segment a handoff names; one that cannot be received fails the turn (its error)."""
        got = fetch_verified(store or self.store, packet_id, self.cache_spec, kind="segment",
                             options=self.codec_options, store_faults="raise")
        if isinstance(got, Refusal):
            raise got.error or ChainError(got.message)
        return got.head

    def receive_segment(self, packet_id: str) -> Packet | Refusal:
        """One verified packet (not its chain) on the model's device, or why it cannot be used."""
        got = fetch_verified(self.store, packet_id, self.cache_spec, kind="segment", options=self.codec_options)
        return got if isinstance(got, Refusal) else self.to_model(got.head)[0]

    @property
    def lossy_encoding(self) -> str | None:
        """The packet encoding this agent's caches travel in where it loses precision (``KVWIRE_ENCODING=int4``
        on an fp32 model, say): a cache received so is close to, not equal to, a recomputation."""
        encoding = self.codec_options.encoding
        return None if quant.lossless(encoding, self.cache_spec.torch_dtype) else encoding

    def to_model(self, packet: Packet) -> tuple[Packet, int]:
        """The packet on the model's device, and the bytes moved to put it there (0 on CPU)."""
        device = hf.model_device(self.model)
        if packet.device == device:
            return packet, 0
        return packet.to(device), packet.nbytes

    def read_handoff(self, key: str) -> Handoff:
        data = self.store.get(key)
        if data is None:
            raise PacketError(f"no handoff at {key} in {self.store.url}", "the upstream agent has not run")
        return Handoff.from_bytes(data, key, self.codec_options.key_bytes)

    _read_handoff = read_handoff

    def rope_tables(self) -> list[Any]:
        """The model's RoPE tables, checked on the model itself (probed once)."""
        if self._tables is None:
            self._tables = hf.rope_tables(self.model, self.cache_spec)
        return self._tables

    # -- placement -------------------------------------------------------------------------------

    def global_base(self) -> int:
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

    _global_base = global_base  # the name tests and benchmarks used



def build_agents(spec: PipelineSpec, model: Any, model_spec: ModelSpec, tokenizer: Any, store: Store,
                 agent_models: dict[str, Any] | None = None, **options: Any) -> list[Agent]:
    """One :class:`Agent` per agent of ``spec``, on ``model`` (whose spec is ``model_spec``) unless
    ``agent_models`` gives it weights of its own; ``options`` go to every agent."""
    agent_models = dict(agent_models or {})
    unknown = sorted(set(agent_models) - {a.name for a in spec.agents})
    if unknown:
        raise PipelineConfigError(f"agent_models names agents {unknown} that pipeline {spec.name!r} lacks")
    specs = {id(model): model_spec}
    agents = []
    for index, agent in enumerate(spec.agents):
        own = agent_models.get(agent.name, model)
        if id(own) not in specs:
            specs[id(own)] = hf.model_spec(own)
        agents.append(Agent(spec, index, own, tokenizer, store, cache_spec=specs[id(own)], **options))
    return agents
