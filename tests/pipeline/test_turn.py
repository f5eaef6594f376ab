"""One turn in phases, and one strategy object per mode.

This is also the API in brief: a runner (the linear pipeline, the graph runner) takes a turn by
composing the phases of :mod:`kvwire.pipeline.turn`, and what differs between modes is a
:class:`~kvwire.pipeline.turn.TurnMode`::

    how = turn_mode("prefix")                         # TextMode, PrefixMode, SpliceMode, AutoMode
    transcript, offsets = how.context(agent, system, handoff)
    turn = Turn(agent, index, round, session, how.name, transcript, open_turn(transcript, instruction), start)
    how.receive(agent, turn, handoff, store)          # the cache: received, spliced, or none
    decode_alone(turn, keep_logits=False)             # or decode_rows(turns, engine, ...) for a batch
    close_transcript(turn)
    packet_id = publish_packet(turn, store, how.packet(agent, turn))
    publish_handoff(turn, store, *how.handoff_refs(turn, handoff, packet_id))
    done = result(turn, total_s)
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from kvwire import AgentSpec, KvwireError, PacketError, PipelineSpec, hf, open_store
from kvwire.pipeline.agent import Agent
from kvwire.pipeline.turn import (AutoMode, PrefixMode, SpliceMode, TextMode, Turn, close_transcript, decode_alone,
                                  open_turn, publish_handoff, publish_packet, result, turn_mode)

SPEC = PipelineSpec(name="two", system="You are terse.", input_text="Sum 2 and 3.", max_new_tokens=6,
                    agents=(AgentSpec("a", "Answer."), AgentSpec("b", "Check the answer.")))
PRIVATE = PipelineSpec(name="two-private", input_text="Sum 2 and 3.", max_new_tokens=6,
                       agents=(AgentSpec("a", "Answer.", system="You answer."),
                               AgentSpec("b", "Check the answer.", system="You check.")))


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    from tests.support import tiny

    return tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)


def _take(agent, how, handoff, store, session="s"):
    """Agent ``agent``'s turn composed from the phases by hand."""
    transcript, offsets = how.context(agent, agent.spec.system_for(agent.index), handoff)
    turn_start = len(transcript.ids)
    turn = Turn(agent, agent.index, 0, session, how.name, transcript,
                open_turn(transcript, agent.spec.turn(agent.index)), time.perf_counter(),
                messages=handoff.messages if handoff else [], generated=handoff.generated if handoff else {},
                turn_start=turn_start, offsets=offsets)
    how.receive(agent, turn, handoff, store)
    decode_alone(turn, keep_logits=False)
    close_transcript(turn)
    packet_id = publish_packet(turn, store, how.packet(agent, turn))
    key = publish_handoff(turn, store, *how.handoff_refs(turn, handoff, packet_id))
    return turn, result(turn, time.perf_counter() - turn.start), key


def test_there_is_one_strategy_per_mode_and_unknown_modes_are_refused(model, tiny_tokenizer):
    assert [type(turn_mode(m)) for m in ("text", "prefix", "splice", "auto")] == [TextMode, PrefixMode, SpliceMode,
                                                                                  AutoMode]
    assert turn_mode("splice").exact_fidelity and not turn_mode("prefix").exact_fidelity
    with pytest.raises(KvwireError, match="unknown mode 'fuse'"):
        turn_mode("fuse")  # different models pass caches through kvwire.fuse, its own runner
    with pytest.raises(PacketError, match="mode auto needs a cost model"):
        turn_mode("auto").check(Agent(SPEC, 0, model, tiny_tokenizer, open_store("memory://")))


def test_phases_composed_by_hand_are_the_agents_turn(model, tiny_tokenizer):
    """A prefix turn built from the phases receives the upstream chain and decodes exactly what
    ``Agent.turn`` and a recomputation without any cache decode."""
    store = open_store("memory://")
    a, b = (Agent(SPEC, i, model, tiny_tokenizer, store) for i in range(2))
    _, first, key = _take(a, turn_mode("prefix"), None, store)
    assert first.packet_bytes > 0 and first.cached_tokens == 0
    handoff = b.read_handoff(key)
    turn, second, _ = _take(b, turn_mode("prefix"), handoff, store)
    assert turn.links == 1 and second.cached_tokens == first.context_tokens + first.new_tokens - 1
    assert second.output_ids == hf.generate(model, second.context_ids, max_new_tokens=6, use_cache=False).tokens
    a.turn("prefix", "t", None)
    same, _, _ = b.turn("prefix", "t", key.replace("/s/", "/t/"))
    assert same.output_ids == second.output_ids and same.context_ids == second.context_ids


def test_text_mode_receives_nothing_and_sends_no_packet(model, tiny_tokenizer):
    store = open_store("memory://")
    a, b = (Agent(SPEC, i, model, tiny_tokenizer, store) for i in range(2))
    _, _, key = _take(a, turn_mode("text"), None, store)
    turn, second, _ = _take(b, turn_mode("text"), b.read_handoff(key), store)
    assert turn.cache is None and second.cached_tokens == 0 and second.packet_bytes == 0
    assert b.read_handoff("sessions/s/r0/handoff/1-b").packet is None


def test_a_chain_from_other_weights_is_refused_and_the_turn_rebuilds(model, tiny_tokenizer):
    store = open_store("memory://")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(0.01)  # an update: another fingerprint
    a, b = Agent(SPEC, 0, model, tiny_tokenizer, store), Agent(SPEC, 1, other, tiny_tokenizer, store)
    _, _, key = _take(a, turn_mode("prefix"), None, store)
    turn, second, _ = _take(b, turn_mode("prefix"), b.read_handoff(key), store)
    assert turn.cache is None and second.cached_tokens == 0
    assert len(second.events) == 1 and second.events[0].startswith("stale-fingerprint: packet ")


def test_splice_mode_places_upstream_turns_by_their_offsets(model, tiny_tokenizer):
    store = open_store("memory://")
    a, b = (Agent(PRIVATE, i, model, tiny_tokenizer, store, splice_when="always") for i in range(2))
    _, first, key = _take(a, turn_mode("splice"), None, store)
    handoff = b.read_handoff(key)
    assert handoff.packet is None and [m for _, m in handoff.segments] == [0]  # a's turn starts at message 0
    turn, second, _ = _take(b, turn_mode("splice"), handoff, store)
    assert turn.offsets and second.cached_tokens + second.recomputed_tokens > 0
    assert second.decision.startswith("splice: spliced 1 upstream turn(s)")
