"""Splice mode in the pipeline: agents with private system prompts splice each other's turns.

    spec = PipelineSpec.from_toml("examples/document_private_prompts.toml")
    pipeline = Pipeline(model, tokenizer, spec, recompute=Recompute(fraction=0.15))  # splice_when="cheaper"
    comparison = pipeline.compare("splice")   # text vs splice: speed and fidelity
    # each agent splices the upstream turns where that beats prefilling them (long turns), else prefills
    # them exactly (short ones) and says which in AgentResult.decision; splice_when="always" forces it
"""

from __future__ import annotations

import json

import pytest
import torch

from kvwire import AgentSpec, PipelineConfigError, PipelineSpec, hf
from kvwire.pipeline.linear import Pipeline
from kvwire.kv.splice import Recompute
from tests.support import cli

PRIVATE = PipelineSpec(
    name="tiny-private",
    input_text="def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)",
    input_label="Code",
    max_new_tokens=6,
    agents=(AgentSpec("analyst", "List the bugs.", system="You find bugs."),
            AgentSpec("fixer", "Suggest a fix for each bug.", system="You are a careful engineer who fixes code."),
            AgentSpec("critic", "Point out what is wrong or missing.", system="You review.")),
)


@pytest.fixture(params=["llama", "qwen2", "neox"])
def model(request, tiny_tokenizer):
    from tests.support import tiny

    net = tiny.model(request.param, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    return net, tiny_tokenizer, hf.model_spec(net)


def test_full_recompute_equals_recomputation_from_the_same_ids(model):
    net, tokenizer, spec = model
    result = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, recompute=Recompute(1.0),
                      splice_when="always").run("splice")
    for index, agent in enumerate(result.agents):
        ref = hf.generate(net, agent.context_ids, max_new_tokens=PRIVATE.new_tokens(index), use_cache=False)
        assert agent.output_ids == ref.tokens, agent.agent
        torch.testing.assert_close(agent.first_logits, ref.first_logits, atol=1e-4, rtol=0)
    assert result.agents[0].recomputed_tokens == 0  # nothing upstream
    assert all(a.recomputed_tokens > 0 and a.cached_tokens == 0 for a in result.agents[1:])


def test_the_guard_recomputes_a_splice_whose_segment_moved_too_far(model):
    """Every spliced agent reports each segment's staleness; with ``Recompute(R, guard=g)`` below it, the agent
    recomputes from that segment on, exactly (its reply is a recomputation's), and says so in its decision."""
    net, tokenizer, spec = model
    plain = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, recompute=Recompute(0.3),
                     splice_when="always").run("splice")
    assert all(a.staleness and a.guarded_tokens == 0 for a in plain.agents[1:])
    guarded = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, recompute=Recompute(0.3, guard=1e-6),
                       splice_when="always").run("splice")
    for index, agent in enumerate(guarded.agents[1:], start=1):
        assert agent.guarded_tokens > 0 and agent.cached_tokens == 0 and "the guard recomputed" in agent.decision
        ref = hf.generate(net, agent.context_ids, max_new_tokens=PRIVATE.new_tokens(index), use_cache=False)
        assert agent.output_ids == ref.tokens, agent.agent


def test_each_agent_splices_every_upstream_turn(model):
    net, tokenizer, spec = model
    pipeline = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, splice_when="always")
    result = pipeline.run("splice", session="s")
    assert len(pipeline.store.keys("packets/")) == 3  # one segment per agent turn
    # each agent publishes its own turn as one segment; downstream agents keep all of them
    from kvwire.wire import codec
    from kvwire.kv.chain import packet_key
    from kvwire.pipeline.handoff import Handoff

    last = Handoff.from_bytes(pipeline.store.get("sessions/s/r0/handoff/2-critic"), "critic")
    lengths = [codec.decode(pipeline.store.get(packet_key(p))).length for p, _ in last.segments]
    assert [m for _, m in last.segments] == [0, 2, 4]  # each segment starts at its agent's user turn
    assert result.agents[1].cached_tokens == lengths[0]
    assert result.agents[2].cached_tokens == lengths[0] + lengths[1]
    assert all(a.recomputed_tokens == 0 for a in result.agents)  # R = 0: only gaps recomputed


def test_compare_measures_fidelity(model):
    net, tokenizer, spec = model
    comparison = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, recompute=Recompute(0.5),
                          splice_when="always").compare("splice")
    assert comparison.other.mode == "splice" and comparison.other.settings == "R=0.5"
    first = comparison.agents[0]
    assert first.fidelity.agreement == 1.0 and first.identical  # no upstream: same as text
    for agent in comparison.agents[1:]:
        assert 0.0 <= agent.fidelity.agreement <= 1.0 and agent.fidelity.kl is not None and agent.fidelity.kl >= -1e-9
    payload = comparison.to_json()
    assert payload["mode"] == "splice" and "agreement" in payload and payload["agents"][1]["fidelity"]
    splice_agent = payload["runs"][1]["agents"][1]
    assert splice_agent["exact_fidelity"] is not None  # vs a recomputation of its own ids
    assert 0.0 <= comparison.exact_agreement <= 1.0


def test_prefix_mode_needs_a_shared_system_prompt(model):
    net, tokenizer, spec = model
    with pytest.raises(PipelineConfigError, match="use splice mode"):
        Pipeline(net, tokenizer, PRIVATE, model_spec=spec).run("prefix")


@pytest.mark.real_model
def test_real_model_full_recompute_is_exact_and_partial_is_measured(real_model):
    model_, tokenizer, spec = real_model
    three = PipelineSpec.from_toml("examples/document_private_prompts.toml")
    report = three.input_text[: three.input_text.index("\n\n", len(three.input_text) // 6)]  # ~400 tokens of it
    three = PipelineSpec(three.name, three.agents[:3], report, three.input_label, "", max_new_tokens=8)
    exact = Pipeline(model_, tokenizer, three, model_spec=spec, recompute=Recompute(1.0),
                     splice_when="always").run("splice")
    for agent in exact.agents[1:]:
        ref = hf.generate(model_, agent.context_ids, max_new_tokens=8)
        assert agent.output_ids == ref.tokens
        torch.testing.assert_close(agent.first_logits, ref.first_logits, atol=1e-3, rtol=0)
    comparison = Pipeline(model_, tokenizer, three, model_spec=spec, recompute=Recompute(0.15)).compare("splice")
    assert all(a.cached_tokens > 200 for a in comparison.other.agents[1:])
    assert all(a.fidelity.kl is not None for a in comparison.agents[1:])


@pytest.mark.real_model
def test_cli_splice_compare_json(real_model, tmp_path):
    (tmp_path / "p.toml").write_text(
        'input_text = "def mean(xs): return sum(xs) / len(xs)"\nmax_new_tokens = 4\n'
        '[[agents]]\nname = "a"\nsystem = "You find bugs."\ninstruction = "Name one bug."\n'
        '[[agents]]\nname = "b"\nsystem = "You fix code."\ninstruction = "Fix it."\n')
    proc = cli.run("run", str(tmp_path / "p.toml"), "--recompute", "0.3", "--splice-when", "always", "--json")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert payload["mode"] == "splice" and payload["settings"] == "R=0.3"
    assert 0.0 <= payload["agreement"] <= 1.0 and payload["agents"][1]["fidelity"]["kl"] is not None


def test_global_positions_keep_each_turn_where_the_session_put_it(model):
    """Under placement "global" every agent's turn has one position in every context: the
    session counter starts after the longest private prefix, and nothing is re-rotated."""
    from kvwire.wire import codec
    from kvwire.kv.chain import packet_key
    from kvwire.pipeline.handoff import Handoff

    net, tokenizer, spec = model
    pipeline = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, placement="global", recompute=Recompute(1.0))
    result = pipeline.run("splice", session="g")
    last = Handoff.from_bytes(pipeline.store.get("sessions/g/r0/handoff/2-critic"), "critic")
    starts = [codec.decode(pipeline.store.get(packet_key(p))).start for p, _ in last.segments]
    base = pipeline.agents[0]._global_base()
    assert starts[0] == base and starts[0] < starts[1] < starts[2]
    # consecutive turns: each starts where the previous one (plus its closing tokens) ended
    lengths = [codec.decode(pipeline.store.get(packet_key(p))).length for p, _ in last.segments]
    gaps = [starts[i + 1] - (starts[i] + lengths[i]) for i in range(2)]
    assert all(0 < gap <= 4 for gap in gaps), gaps
    assert result.agents[2].context_tokens > result.agents[1].context_tokens


@pytest.mark.real_model
def test_real_model_recompute_knob_moves_the_kl(real_model):
    """On text nobody here wrote (the start of Python's bisect.py, three agents with private
    prompts), recomputing 30 % of the spliced tokens chosen by the default criterion divides the
    KL against an exact recomputation by more than 4; CacheBlend's layer-1 deviation alone does
    not (it leaves the turns right before the receiver's own stale)."""
    model_, tokenizer, spec = real_model
    stdlib = PipelineSpec.from_toml("examples/stdlib_private_prompts.toml")
    short = PipelineSpec(stdlib.name, stdlib.agents, stdlib.input_text[:600], stdlib.input_label, "", max_new_tokens=8)
    text = Pipeline(model_, tokenizer, short, model_spec=spec).run("text", keep_logits=True)

    def exact_kl(recompute):
        run = Pipeline(model_, tokenizer, short, model_spec=spec, recompute=recompute, splice_when="always").run(
            "splice", reference=text)
        return sum(a.exact_fidelity.kl for a in run.agents[1:]) / 2

    stale, new = exact_kl(Recompute(0.0)), exact_kl(Recompute(0.3))
    old = exact_kl(Recompute(0.3, select="kv-deviation"))
    assert new < stale / 4 and new < old / 4, (stale, new, old)


def test_an_agent_without_a_system_prompt_among_private_ones_is_refused_up_front(real_model, tiny_tokenizer):
    """SmolLM2's template writes its own system turn when a chat has none; splice mode could not place an
    agent's turns under it, so such a pipeline is refused before anything runs (text mode still runs it)."""
    model, tokenizer, spec = real_model
    assert hf.default_system_prompt(tokenizer) and not hf.default_system_prompt(tiny_tokenizer)
    mixed = PipelineSpec("mixed", (AgentSpec("finder", "Find the bug."),
                                   AgentSpec("fixer", "Fix it.", system="You fix bugs.")),
                         input_text="def add(a, b): return a - b", max_new_tokens=3)
    pipeline = Pipeline(model, tokenizer, mixed, model_spec=spec)
    for run in (lambda: pipeline.run("splice"), lambda: pipeline.compare("splice")):
        with pytest.raises(PipelineConfigError, match="agent finder has no system prompt"):
            run()
    assert len(pipeline.run("text").agents) == 2


def test_short_upstream_turns_are_prefilled_exactly_when_that_is_cheaper(model):
    """splice_when="cheaper" (the default): these upstream turns are a few dozen tokens, cheaper to prefill
    than to splice (splice.estimate) -- so the agents prefill them, exactly, and say so; "always" splices."""
    net, tokenizer, spec = model
    cheaper = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, recompute=Recompute(0.15)).run("splice")
    for index, agent in enumerate(cheaper.agents[1:], start=1):
        assert agent.decision.startswith("splice: prefilled") and "est." in agent.decision
        assert agent.cached_tokens == 0 and agent.recomputed_tokens == 0
        ref = hf.generate(net, agent.context_ids, max_new_tokens=PRIVATE.new_tokens(index), use_cache=False)
        assert agent.output_ids == ref.tokens, agent.agent
    always = Pipeline(net, tokenizer, PRIVATE, model_spec=spec, recompute=Recompute(0.15),
                      splice_when="always").run("splice")
    assert all(a.decision.startswith("splice: spliced") and a.cached_tokens > 0 for a in always.agents[1:])
    with pytest.raises(ValueError, match="splice_when"):
        Pipeline(net, tokenizer, PRIVATE, model_spec=spec, splice_when="sometimes")
