"""Pipelines as graphs on tiny random models: a fan-out decodes as one batch and every
agent equals itself decoded alone; a merging agent splices its branches (exact at R=1,
measured otherwise); rounds, different weights and sliding-window models.

The API in brief::

    spec = PipelineSpec.from_toml("examples/review_board.toml")     # agents name what they read: after = [...]
    runner = GraphRunner(model, tokenizer, spec, store="memory://", recompute=Recompute(0.15))
    result = runner.run("graph")          # caches + one engine batch per layer; "text": the baseline
    comparison = runner.compare()         # text vs graph, agent by agent, fidelity of the merges
"""

from __future__ import annotations

import pytest
import torch

from kvwire import AgentSpec, KvwireError, PipelineConfigError, PipelineSpec, hf, open_store
from kvwire.pipeline.graph import GraphRunner
from kvwire.pipeline import merge
from kvwire.kv.splice import Recompute

BOARD = PipelineSpec(
    name="tiny-board",
    system="You are on a review board.",
    input_text="def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)",
    input_label="Code",
    max_new_tokens=6,
    agents=(AgentSpec("intake", "Say what the code does."),
            AgentSpec("bugs", "List the bugs.", role="analyst", after=("intake",)),
            AgentSpec("style", "Review the style.", after=("intake",), max_new_tokens=4),
            AgentSpec("tests", "Suggest tests.", after=("intake",)),
            AgentSpec("chair", "Merge the reviews.", after=("bugs", "style", "tests"))),
)


def recomputed(model, agent, tokens):
    """The agent's output recomputed from its own context ids, without any cache."""
    return hf.generate(model, agent.context_ids, max_new_tokens=tokens, use_cache=False)


@pytest.fixture(scope="module", params=["llama", "qwen2", "neox"])
def model3(request, tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model(request.param, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    return model, hf.model_spec(model)


def test_layers_and_conversations():
    graph = BOARD.graph
    assert graph.layers == ((0,), (1, 2, 3), (4,)) and not graph.is_linear
    assert graph.conversation(4) == ((0, 0), (0, 1), (0, 2), (0, 3))  # intake, then each branch
    assert graph.conversation(0, round=1) == ((0, 0), (0, 1), (0, 2), (0, 3), (0, 4))  # round 2 reads the chair


def test_fan_out_decodes_as_one_batch_and_each_agent_equals_itself_alone(model3, tiny_tokenizer):
    model, spec = model3
    store = open_store("memory://")
    runner = GraphRunner(model, tiny_tokenizer, BOARD, store=store, model_spec=spec, recompute=Recompute(1.0),
                         merge="splice")
    result = runner.run("graph", session="s")
    assert [a.agent for a in result.agents] == ["intake", "bugs", "style", "tests", "chair"]
    assert result.batches == [1, 3, 1]  # the three reviewers decoded together
    for index, agent in zip(BOARD.graph.order, result.agents):
        reference = recomputed(model, agent, BOARD.new_tokens(index))
        assert agent.output_ids == reference.tokens, agent.agent  # R=1 makes the merge exact too
        torch.testing.assert_close(agent.first_logits, reference.first_logits, atol=1e-4, rtol=0)
    intake = result.agents[0]
    for reviewer in result.agents[1:4]:  # each read intake's chain: everything intake saw and wrote
        assert reviewer.cached_tokens == intake.context_tokens + intake.new_tokens - 1 and not reviewer.events
    chair = result.agents[4]
    assert chair.cached_tokens + chair.recomputed_tokens > result.agents[1].cached_tokens
    handoffs = store.keys("sessions/s/")
    assert len(handoffs) == 5 and len(store.keys("packets/")) == 5  # each agent its own handoff and packet


def test_merge_fidelity_is_measured_against_text_and_exact_recomputation(model3, tiny_tokenizer):
    model, spec = model3
    comparison = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(0.0),
                             merge="splice").compare()
    chair, bugs = comparison.other.agents[4], comparison.other.agents[1]
    assert chair.exact_fidelity is not None and chair.exact_fidelity.kl is not None
    assert chair.fidelity is not None and chair.fidelity.kl is not None
    assert not chair.events and chair.recomputed_tokens == 0
    first_branch = bugs.context_tokens + bugs.new_tokens - 1  # the chain of the branch it continues exactly
    spliced = chair.cached_tokens - first_branch
    # each later reviewer's packet (what it appended to intake's chain) minus its first few tokens -- the end of
    # intake's answer, which the chair already holds -- is spliced
    packets = [a.context_tokens + a.new_tokens - 1 - bugs.cached_tokens for a in comparison.other.agents[2:4]]
    assert sum(packets) - 2 * 4 <= spliced < sum(packets)
    assert comparison.exact  # every non-merging agent equals a recomputation of its own ids
    assert [a.exact for a in comparison.agents] == [True] * 4 + [None]
    assert comparison.text.mode == "text" and comparison.other.mode == "graph"
    assert len(comparison.agents) == 5


def test_the_fidelity_guard_recomputes_a_stale_branch_exactly(model3, tiny_tokenizer):
    """``Recompute(R, guard=g)``: each spliced branch reports its staleness (how far the chair's context moved the
    K/V of its recomputed tokens); a branch over ``g`` is recomputed exactly with everything after it. Under a
    bound below every branch's the chair is a plain prefill's chair; above them all it is the splice as it was."""
    model, spec = model3
    plain = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(0.3),
                        merge="splice").run("graph").agents[4]
    assert len(plain.staleness) == 2 and all(value > 0 for value in plain.staleness) and plain.guarded_tokens == 0
    low = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(0.3, guard=1e-6),
                      merge="splice").run("graph").agents[4]
    assert low.guarded_tokens > 0 and "the guard recomputed" in low.decision
    assert low.output_ids == recomputed(model, low, BOARD.new_tokens(4)).tokens
    assert low.approximate_via is None  # nothing is left as received: exact
    high = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(0.3, guard=1e6),
                       merge="splice").run("graph").agents[4]
    assert high.guarded_tokens == 0 and high.output_ids == plain.output_ids and high.staleness == plain.staleness


def test_short_branches_are_prefilled_exactly_when_that_is_cheaper_than_splicing(model3, tiny_tokenizer):
    """merge="auto": the chair's later reviews are a few dozen tokens, cheaper to prefill after the first review's
    chain than to splice -- and then the chair is exact, like every other agent."""
    model, spec = model3
    comparison = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(0.15),
                             merge="auto").compare()
    chair = comparison.other.agents[4]
    assert chair.decision.startswith("merge prefilled its") and "est." in chair.decision
    assert chair.exact_fidelity is None and chair.recomputed_tokens == 0 and chair.approximate_via is None
    bugs = comparison.other.agents[1]
    assert chair.cached_tokens == bugs.context_tokens + bugs.new_tokens - 1
    assert [a.exact for a in comparison.agents] == [True] * 5  # the merge too: compared with a recomputation
    assert chair.output_ids == recomputed(model, chair, BOARD.new_tokens(4)).tokens
    forced = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, merge="prefill").run("graph")
    assert forced.agents[4].output_ids == chair.output_ids and "merge=prefill" in forced.agents[4].decision
    default = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(0.15)).run("graph")
    assert default.agents[4].decision == forced.agents[4].decision  # merges are exact unless asked to splice


def test_long_branches_are_spliced_when_that_is_cheaper():
    """The plan in tokens prefilled: the review board's chair (three ~60-token reviews after a 1760-token
    chain, a 77-token turn) prefills; the map-reduce reducer (three ~370-token summaries of their own
    chunks after a 744-token chain) splices. Both forced ways are honoured and say so."""
    board = [((0, 2), 1763, 1814), ((0, 3), 1814, 1865), ((0, 4), 1865, 1916)]  # then the chair's 77-token turn
    chair = merge.plan(1993, 1760, board, Recompute(0.15), 30)
    assert chair.choice == "prefill" and chair.cost.between == 1916 - 1760
    assert chair.cost.prefill_tokens < chair.cost.splice_tokens
    reducer = merge.plan(1908, 744, [((0, 2), 760, 1130), ((0, 3), 1130, 1500), ((0, 4), 1500, 1870)],
                         Recompute(0.15), 30)
    assert reducer.choice == "splice" and reducer.cost.splice_tokens < reducer.cost.prefill_tokens / 2
    assert merge.plan(1908, 744, [((0, 2), 760, 1870)], Recompute(1.0), 30).choice == "prefill"  # R=1: no saving
    assert merge.plan(1993, 1760, board, Recompute(0.15), 30, "splice").choice == "splice"
    assert "merge=prefill" in merge.plan(1908, 744, [((0, 2), 760, 1870)], Recompute(0.0), 30, "prefill").describe()
    with pytest.raises(ValueError, match="auto, splice, prefill"):
        merge.plan(10, 5, [], Recompute(), 2, "guess")
    with pytest.raises(KvwireError, match="unknown merge strategy"):
        GraphRunner(None, None, BOARD, merge="guess")


def test_a_merge_of_long_branches_splices_them_on_its_own(tiny_tokenizer):
    """Map-reduce: each part reads its own long chunk, so the reducer's branches are long and merge="auto" splices
    them (by default merges prefill: exact)."""
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    chunks = [" ".join(words[(i + j) % 10] for j in range(40)) for i in range(3)]
    spec = PipelineSpec(
        name="map-reduce", system="Summarize.", input_text="A document in three parts.", max_new_tokens=4,
        agents=(AgentSpec("coordinator", "Say what to keep."),
                *(AgentSpec(f"part{i}", "Summarize this part.", after=("coordinator",), input_text=chunk,
                            input_label=f"Part {i}") for i, chunk in enumerate(chunks)),
                AgentSpec("reducer", "Combine the summaries.", after=("part0", "part1", "part2"))))
    # (selection by attention alone: by K/V deviation it would run layer 1 of this 2-layer model, a whole pass)
    result = GraphRunner(model, tiny_tokenizer, spec, recompute=Recompute(0.15, select="attention"),
                         merge="auto").run("graph")
    reducer = result.agents[4]
    assert reducer.decision.startswith("merge spliced its") and reducer.approximate_via == "reducer"
    assert reducer.recomputed_tokens > 0


@pytest.mark.parametrize("pipeline", ["BOARD", "PANEL"])  # PANEL: roots without batching copy the shared input
def test_batching_off_gives_the_same_outputs(model3, tiny_tokenizer, pipeline):
    model, spec = model3
    pipeline = globals()[pipeline]
    on = GraphRunner(model, tiny_tokenizer, pipeline, model_spec=spec).run("graph")
    off = GraphRunner(model, tiny_tokenizer, pipeline, model_spec=spec, batch=False).run("graph")
    assert off.batches == [1] * len(pipeline.agents)
    assert [a.output_ids for a in on.agents] == [a.output_ids for a in off.agents]
    assert [a.cached_tokens for a in on.agents] == [a.cached_tokens for a in off.agents]


def test_rounds_run_the_whole_graph(model3, tiny_tokenizer):
    model, spec = model3
    result = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(1.0)).run(
        "graph", rounds=2)
    assert [a.round for a in result.agents] == [0] * 5 + [1] * 5
    second_intake = result.agents[5]
    chair = result.agents[4]
    assert second_intake.cached_tokens == chair.context_tokens + chair.new_tokens - 1  # it read the chair's chain
    for index, agent in zip(BOARD.graph.order * 2, result.agents):
        assert agent.output_ids == recomputed(model, agent, BOARD.new_tokens(index)).tokens
    assert all(agent.approximate_via is None for agent in result.agents)  # R = 1: every merge is exact


def test_agents_reading_a_spliced_merge_are_reported_approximate(model3, tiny_tokenizer):
    """At R < 1 a merge's cache keeps spliced K/V at shifted positions; every agent whose cache extends
    it (here the whole second round) is approximate too: no exactness claimed, the merge named."""
    model, spec = model3
    comparison = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(0.0),
                             merge="splice").compare(rounds=2)
    graph = comparison.other.agents
    assert [a.approximate_via for a in graph] == [None] * 4 + ["chair"] * 6
    assert [a.exact for a in comparison.agents] == [True] * 4 + [None] * 6
    assert all("chair's spliced cache" in a.note for a in comparison.agents[5:9])  # [9]: the merge itself
    assert comparison.exact  # the claim covers the agents that are exact


def test_private_system_prompts_run_in_text_mode_and_are_refused_in_graph_mode(model3, tiny_tokenizer):
    model, spec = model3
    agents = list(BOARD.agents)
    agents[2] = AgentSpec("style", "Review the style.", after=("intake",), system="You review style only.")
    private = PipelineSpec(BOARD.name, tuple(agents), BOARD.input_text, BOARD.input_label, BOARD.system, 4)
    runner = GraphRunner(model, tiny_tokenizer, private, model_spec=spec)
    text = runner.run("text")
    assert text.agents[2].context_ids[:12] != text.agents[1].context_ids[:12]  # it read its own system prompt
    with pytest.raises(PipelineConfigError, match="style have private system prompts.*--mode text"):
        runner.run("graph")
    with pytest.raises(PipelineConfigError, match="private system prompts"):
        runner.compare()


def test_a_branch_on_other_weights_is_rebuilt_not_spliced(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    other = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=1)
    result = GraphRunner(model, tiny_tokenizer, BOARD, agent_models={"style": other}, merge="splice").run("graph")
    style, chair = result.agents[2], result.agents[4]
    assert any(e.startswith("stale-fingerprint") for e in style.events)  # intake's chain: other weights
    assert any(e.startswith("stale-fingerprint") for e in chair.events)  # style's branch: other weights
    assert result.rebuilds["stale-fingerprint"] == 2
    assert style.output_ids == hf.generate(other, style.context_ids, max_new_tokens=4, use_cache=False).tokens


def test_a_merge_whose_first_branch_ran_on_other_weights_prefills_or_splices_from_nothing(tiny_tokenizer):
    """No usable chain: the chair has no exact prefix. Prefilled, it computes its whole context (exact);
    forced to splice, it prefills its own start and splices the later branches (approximate, named)."""
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    other = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=1)
    for strategy in ("auto", "splice"):
        result = GraphRunner(model, tiny_tokenizer, BOARD, agent_models={"bugs": other}, merge=strategy,
                             recompute=Recompute(0.15)).run("graph")
        chair = result.agents[4]
        assert any(e.startswith("stale-fingerprint") for e in chair.events)  # bugs's chain: other weights
        if strategy == "auto":
            assert "whole context before its turn" in chair.decision and chair.cached_tokens == 0
            assert chair.approximate_via is None
            assert chair.output_ids == recomputed(model, chair, BOARD.new_tokens(4)).tokens
        else:
            assert chair.decision.startswith("merge spliced") and chair.approximate_via == "chair"


def test_sliding_window_models_decode_one_at_a_time(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("gemma3", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    result = GraphRunner(model, tiny_tokenizer, BOARD, merge="splice").run("graph")
    assert result.batches == [1, 1, 1, 1, 1]
    chair, bugs = result.agents[4], result.agents[1]
    assert "sliding-window layers cannot be spliced" in chair.decision and not chair.events
    assert chair.cached_tokens == bugs.context_tokens + bugs.new_tokens - 1  # the first branch's chain, exact
    for index, agent in zip(BOARD.graph.order, result.agents):
        assert agent.output_ids == recomputed(model, agent, BOARD.new_tokens(index)).tokens


@pytest.mark.real_model
def test_real_model_fan_out_is_exact_and_a_full_recompute_merge_too(real_model):
    model, tokenizer, spec = real_model
    board = PipelineSpec(
        name="real-board", system="You review code. Answer briefly.", input_label="Code", max_new_tokens=8,
        input_text="def mean(rows, totals={}):\n    totals['n'] = len(rows)\n    return sum(rows) / len(rows)\n",
        agents=(AgentSpec("intake", "Say what the function does."),
                AgentSpec("bugs", "Name one bug.", after=("intake",)),
                AgentSpec("tests", "Name one test to add.", after=("intake",)),
                AgentSpec("chair", "Merge the two reviews.", after=("bugs", "tests"))))
    result = GraphRunner(model, tokenizer, board, model_spec=spec, recompute=Recompute(1.0)).run("graph")
    assert result.batches == [1, 2, 1]
    for index, agent in zip(board.graph.order, result.agents):
        reference = hf.generate(model, agent.context_ids, max_new_tokens=8)
        assert agent.output_ids == reference.tokens, agent.agent
        torch.testing.assert_close(agent.first_logits, reference.first_logits, atol=2e-3, rtol=0)
    assert result.agents[3].cached_tokens > result.agents[1].cached_tokens > 0


@pytest.mark.real_model
def test_real_model_roots_sharing_the_input_are_exact_and_identical_to_text(real_model):
    """Two reviewers start the graph (the input is a message of its own, prefilled once), a chair merges:
    on the default model every agent equals text mode token for token and a recomputation logit for logit."""
    model, tokenizer, spec = real_model
    panel = PipelineSpec(
        name="real-panel", system="You review code. Answer briefly.", input_label="Code", max_new_tokens=8,
        input_text="def mean(rows, totals={}):\n    totals['n'] = len(rows)\n    return sum(rows) / len(rows)\n",
        agents=(AgentSpec("bugs", "Name one bug.", after=()), AgentSpec("tests", "Name one test to add.", after=()),
                AgentSpec("chair", "Merge the two reviews.", after=("bugs", "tests"))))
    comparison = GraphRunner(model, tokenizer, panel, model_spec=spec).compare()
    graph = comparison.other
    assert graph.batches == [2, 1] and graph.agents[0].cached_tokens == graph.agents[1].cached_tokens > 40
    assert [a.identical for a in comparison.agents[:2]] == [True, True]  # the chair: vs its own ids when a
    assert [a.exact for a in comparison.agents] == [True] * 3             # cut-off reply re-tokenizes otherwise
    for index, agent in zip(panel.graph.order, graph.agents):
        reference = hf.generate(model, agent.context_ids, max_new_tokens=8, use_cache=False)
        assert agent.output_ids == reference.tokens, agent.agent
        torch.testing.assert_close(agent.first_logits, reference.first_logits, atol=2e-3, rtol=0)


def test_a_layer_over_the_memory_budget_decodes_in_smaller_batches(tiny_tokenizer, caplog):
    import logging

    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    budget = hf.Engine(model).rows_cache.nbytes_for(1, 128)  # the first agent alone; 2 of the 3 reviewers
    with caplog.at_level(logging.INFO, logger="kvwire.hf.engine"):
        tight = GraphRunner(model, tiny_tokenizer, BOARD, memory_budget=budget).run("graph")
    assert "smaller batches" in caplog.text
    roomy = GraphRunner(model, tiny_tokenizer, BOARD).run("graph")
    assert [a.output_ids for a in tight.agents] == [a.output_ids for a in roomy.agents]


def test_the_merge_curve_is_drawn(tmp_path):
    """benchmarks/graph.py --plot: fidelity and TTFT against R, with the prefilled merge's TTFT as a level."""
    from kvwire.plots import merge_curve

    rows = [{"fraction": r, "exact_agreement": a, "exact_kl": k, "agreement": a, "kl": k, "ttft_speedup": t,
             "exact_forced_agreement": min(1.0, a + 0.03)}
            for r, a, k, t in [(0.0, 0.92, 0.027, 5.8), (0.15, 0.96, 0.016, 3.8), (1.0, 1.0, 1e-11, 3.9)]]
    for level in (None, 5.1):
        path = merge_curve(rows, tmp_path / f"curve-{level}.png", prefilled_ttft=level)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# -- shapes past the review board ---------------------------------------------------------------------

SINKS = PipelineSpec(  # two agents no one reads (d, e): the next round's first agent reads both
    name="two-sinks", system="Be brief.", input_text="def f(x): return x / 0", max_new_tokens=4,
    agents=(AgentSpec("a", "Say what f does."), AgentSpec("b", "Name the bug.", after=("a",)),
            AgentSpec("c", "Fix it.", after=("a",)), AgentSpec("d", "Merge.", after=("b", "c")),
            AgentSpec("e", "Test the fix.", after=("c",))))


def test_the_next_round_reads_every_agent_no_one_read():
    """With several sinks a later round's first agent merges them all (the last one first), so no
    answer of a round is dropped; a chain's one sink is read as before."""
    graph = SINKS.graph
    assert graph.sinks == (3, 4) and graph.reads(0, 1) == ((0, 4), (0, 3)) and graph.is_merge(0, 1)
    assert set(graph.conversation(0, 1)) == {(0, i) for i in range(5)}
    chain = PipelineSpec("chain", (AgentSpec("x", "One."), AgentSpec("y", "Two.")), input_text="t")
    assert chain.graph.sinks == (1,) and chain.graph.reads(0, 1) == ((0, 1),) and not chain.graph.is_merge(0, 1)


@pytest.mark.parametrize("strategy", ["auto", "splice"])
def test_a_later_round_merges_every_sink_and_is_exact_at_r_1(model3, tiny_tokenizer, strategy):
    model, spec = model3
    result = GraphRunner(model, tiny_tokenizer, SINKS, model_spec=spec, recompute=Recompute(1.0),
                         merge=strategy).run("graph", rounds=2)
    first_of_round_two = result.agents[5]
    assert first_of_round_two.decision.startswith("merge") and first_of_round_two.round == 1
    for index, agent in zip(SINKS.graph.order * 2, result.agents):
        assert agent.output_ids == recomputed(model, agent, SINKS.new_tokens(index)).tokens, agent.agent
    for sink in (3, 4):  # both sinks' answers are in what round two's first agent read
        answer = result.agents[SINKS.graph.order.index(sink)].output_ids
        assert any(first_of_round_two.context_ids[i:i + len(answer)] == answer
                   for i in range(len(first_of_round_two.context_ids)))


def test_reading_an_agent_and_its_ancestor_is_a_chain_not_a_merge(model3, tiny_tokenizer):
    """``after = ["b", "a"]`` where b read a: a's turn is already in b's chain; nothing to merge, and
    the agent is exact (not reported as a spliced merge)."""
    model, spec = model3
    pipeline = PipelineSpec("ancestor", (AgentSpec("a", "Start."), AgentSpec("b", "Go on.", after=("a",)),
                                         AgentSpec("d", "End.", after=("b", "a"))), input_text="x", max_new_tokens=4)
    assert not pipeline.graph.is_merge(2)
    result = GraphRunner(model, tiny_tokenizer, pipeline, model_spec=spec, merge="splice").run("graph")
    b, d = result.agents[1], result.agents[2]
    assert d.decision == "" and d.approximate_via is None and d.cached_tokens == b.context_tokens + b.new_tokens - 1
    assert d.output_ids == recomputed(model, d, 4).tokens


def test_deep_graphs_in_any_order_are_checked_and_ordered():
    """Thousands of agents deep, listed bottom-up: ordered and conversed without Python's recursion
    limit; a long cycle is named, not a RecursionError."""
    n = 1500
    agents = [AgentSpec("a0", "Start.")] + [AgentSpec(f"a{i}", "Go on.", after=(f"a{i - 1}",))
                                            for i in range(n - 1, 0, -1)]
    graph = PipelineSpec("deep", tuple(agents), input_text="x").graph
    assert len(graph.layers) == n and graph.order[-1] == 1  # a{n-1} is listed second, runs last
    assert len(graph.conversation(1)) == n - 1
    loop = [AgentSpec("a0", "Start."), AgentSpec("a1", "Go on.", after=(f"a{n - 1}",))] + \
        [AgentSpec(f"a{i}", "Go on.", after=(f"a{i - 1}",)) for i in range(2, n)]
    with pytest.raises(PipelineConfigError, match="agents form a cycle: a1 -> a2 -> .* -> a1"):
        PipelineSpec("loop", tuple(loop), input_text="x")


def test_batches_report_the_rows_really_decoded_together(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    assert GraphRunner(model, tiny_tokenizer, BOARD, max_batch=2).run("graph").batches == [1, 2, 1]
    assert GraphRunner(model, tiny_tokenizer, BOARD, batch=False).run("graph").batches == [1] * 5


def test_bad_runner_settings_and_a_reused_session_are_refused(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    for bad in ({"max_batch": 0}, {"max_batch": 2.5}, {"memory_budget": -5}, {"memory_budget": 0}):
        with pytest.raises(KvwireError, match="must be"):
            GraphRunner(model, tiny_tokenizer, BOARD, **bad)
    runner = GraphRunner(model, tiny_tokenizer, BOARD.with_max_new_tokens(2))
    runner.run("graph", session="s1")
    with pytest.raises(KvwireError, match="session 's1' already holds the handoffs of a run"):
        runner.run("graph", session="s1")  # before any agent runs, not at the first handoff's put
    assert len(runner.run("graph", session="s2").agents) == 5


def test_a_merge_whose_branch_packets_are_gone_says_it_recomputed_them(tiny_tokenizer):
    """The later branches' packets deleted before the chair's layer: it recomputes those tokens, counts
    the events, and its decision says so (not "spliced")."""
    from tests.support import tiny

    from kvwire.pipeline.handoff import Handoff, handoff_key

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    store = open_store("memory://")

    def drop_later_branches(event):
        if event["event"] == "layer_start" and event["agents"] == ["chair"]:
            for index, name in ((2, "style"), (3, "tests")):
                handoff = Handoff.from_bytes(store.get(handoff_key("s", index, name)), "test")
                store.delete(f"packets/{handoff.packet}")

    result = GraphRunner(model, tiny_tokenizer, BOARD, store=store, merge="splice", recompute=Recompute(0.0),
                         on_event=drop_later_branches).run("graph", session="s")
    chair = result.agents[4]
    assert sum(e.startswith("broken-chain") for e in chair.events) == 2
    assert chair.decision.startswith("merge recomputed its") and "no branch could be spliced" in chair.decision
    assert chair.output_ids == recomputed(model, chair, BOARD.new_tokens(4)).tokens  # nothing spliced: exact


def test_the_drawn_graph_says_what_the_next_round_reads():
    from rich.console import Console

    from kvwire.cli.graph import graph_tree

    console = Console(record=True, width=200)
    console.print(graph_tree(SINKS, 0.15, "auto", rounds=2))
    drawn = console.export_text()
    assert "next round: a reads d, e (merge: every agent no one read)" in drawn
    console.print(graph_tree(BOARD, 0.15, "auto", rounds=2))
    assert "next round: intake reads chair\n" in console.export_text()


# -- several agents start the graph: they share the input ---------------------------------------------

PANEL = PipelineSpec(  # three reviewers read the input in parallel (no agent before them), a chair merges
    name="tiny-panel", system="You are on a review board.", input_label="Code", max_new_tokens=6,
    input_text="def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)",
    agents=(AgentSpec("bugs", "List the bugs.", role="analyst"),
            AgentSpec("style", "Review the style.", after=(), max_new_tokens=4),
            AgentSpec("tests", "Suggest tests.", after=()),
            AgentSpec("chair", "Merge the reviews.", after=("bugs", "style", "tests"))),
)


def test_several_roots_read_the_input_as_a_message_of_their_own():
    """``after = []`` starts the graph beside the first agent. The input then opens every conversation
    as a user message of its own (no agent's turn carries it), so the chair reads it once."""
    graph = PANEL.graph
    assert graph.roots == (0, 1, 2) and graph.shares_input and graph.layers == ((0, 1, 2), (3,))
    assert graph.conversation(3) == ((0, 0), (0, 1), (0, 2))
    assert PANEL.turn(0) == "You are the analyst. List the bugs."  # the input is not in the first turn
    assert PANEL.opening(3) == [{"role": "system", "content": PANEL.system},
                                {"role": "user", "content": f"Code:\n\n{PANEL.input_text}"}]
    assert not BOARD.graph.shares_input and BOARD.opening(0) == [{"role": "system", "content": BOARD.system}]
    assert BOARD.turn(0).startswith("Code:\n\n")  # one root: the input heads its turn, as in a chain


def test_roots_share_one_prefill_of_the_input_and_each_equals_itself_alone(model3, tiny_tokenizer):
    model, spec = model3
    store = open_store("memory://")
    comparison = GraphRunner(model, tiny_tokenizer, PANEL, store=store, model_spec=spec).compare()
    text, graph = comparison.text, comparison.other
    assert graph.batches == [3, 1]  # the three roots decoded as one batch
    opening = graph.agents[0].cached_tokens
    assert opening > 20 and all(a.cached_tokens == opening for a in graph.agents[:3])
    assert all(a.cached_tokens == 0 for a in text.agents)
    for index, agent in zip(PANEL.graph.order, graph.agents):
        reference = recomputed(model, agent, PANEL.new_tokens(index))
        assert agent.output_ids == reference.tokens, agent.agent
        torch.testing.assert_close(agent.first_logits, reference.first_logits, atol=1e-4, rtol=0)
    assert [a.output_ids for a in text.agents[:3]] == [a.output_ids for a in graph.agents[:3]]
    assert [a.exact for a in comparison.agents] == [True] * 4  # the chair: vs text, or (a reply of a random
    # model that re-tokenizes differently) vs a recomputation of its own ids
    chair = graph.agents[3]
    bugs = graph.agents[0]
    assert chair.context_ids.count(tiny_tokenizer.convert_tokens_to_ids("def")) == \
        bugs.context_ids.count(tiny_tokenizer.convert_tokens_to_ids("def"))  # the input once, not per branch
    # the opening is one packet that every root's packet continues: the input's K/V are stored once
    packets = [key for key in store.keys("packets/")]
    assert len(packets) == 5  # the opening and four agents (the text run publishes none)
    from kvwire.kv import chain
    from kvwire.wire import codec

    heads = [codec.decode(store.get(key)) for key in packets]
    (first,) = [p for p in heads if p.producer == "input"]
    assert first.length == opening and first.parent is None
    assert sorted(p.producer for p in heads if p.parent == first.id) == ["bugs", "style", "tests"]
    received = chain.receive(store, next(p.id for p in heads if p.producer == "bugs"), spec)
    assert received.links == 2 and received.context.length == bugs.context_tokens + bugs.new_tokens - 1


def test_several_roots_over_rounds_each_read_the_last_round(model3, tiny_tokenizer):
    model, spec = model3
    result = GraphRunner(model, tiny_tokenizer, PANEL, model_spec=spec, recompute=Recompute(1.0)).run(
        "graph", rounds=2)
    assert [a.round for a in result.agents] == [0] * 4 + [1] * 4 and result.batches == [3, 1, 3, 1]
    chair = result.agents[3]
    for root in result.agents[4:7]:  # each reads the chair's chain, which opens with the input once
        assert root.cached_tokens == chair.context_tokens + chair.new_tokens - 1
    for index, agent in zip(PANEL.graph.order * 2, result.agents):
        assert agent.output_ids == recomputed(model, agent, PANEL.new_tokens(index)).tokens, agent.agent


def test_roots_on_sliding_window_models_share_the_input_one_at_a_time(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("gemma3", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    result = GraphRunner(model, tiny_tokenizer, PANEL).run("graph")
    assert result.batches == [1, 1, 1, 1] and result.agents[1].cached_tokens > 20
    for index, agent in zip(PANEL.graph.order, result.agents):
        assert agent.output_ids == recomputed(model, agent, PANEL.new_tokens(index)).tokens


def test_a_template_that_refuses_two_user_messages_in_a_row_is_named(tiny_tokenizer):
    """Roots read the input, then their own turn: two user messages in a row. A template that enforces
    alternation is refused before any agent runs, with what to do instead."""
    import copy

    from tests.support import tiny

    strict = copy.deepcopy(tiny_tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'system' and loop.index0 > 0 and "
        "messages[loop.index0 - 1]['role'] == m['role'] %}{{ raise_exception('Conversation roles must "
        "alternate user/assistant/user/assistant') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    runner = GraphRunner(model, strict, PANEL)
    for mode in ("text", "graph"):
        with pytest.raises(PipelineConfigError, match="3 agents start the graph .*roles must alternate"):
            runner.run(mode)
    assert len(GraphRunner(model, strict, BOARD.with_max_new_tokens(2)).run("graph").agents) == 5  # one root: fine


def test_a_shared_input_past_the_context_window_is_refused_before_its_prefill(tiny_tokenizer, monkeypatch):
    import dataclasses

    from tests.support import tiny

    from kvwire import ContextTooLong

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    long = dataclasses.replace(PANEL, input_text="x = 1\n" * 400)  # ~1,200 tokens, past the window of 1,024
    monkeypatch.setattr(hf, "prefill", lambda *a, **k: pytest.fail("the opening was prefilled"))
    with pytest.raises(ContextTooLong, match="agent 'bugs': a context of .* past the model's context window"):
        GraphRunner(model, tiny_tokenizer, long).run("graph")
    # a later root whose own input passes the window: named, before the shared input is prefilled
    agents = list(PANEL.agents)
    agents[2] = AgentSpec("tests", "Suggest tests.", after=(), input_text="y = 2\n" * 330, input_label="More")
    own = dataclasses.replace(PANEL, agents=tuple(agents))
    for batch in (True, False):
        with pytest.raises(ContextTooLong, match="agent 'tests': a context of"):
            GraphRunner(model, tiny_tokenizer, own, batch=batch).run("graph")


def test_the_drawn_graph_says_roots_share_the_input():
    import dataclasses

    from rich.console import Console

    from kvwire.cli.graph import graph_tree

    console = Console(record=True, width=200)
    console.print(graph_tree(PANEL, 0.15, "auto", rounds=2))
    drawn = console.export_text()
    assert "layer 0 (3 agents, one batch)" in drawn
    assert "bugs reads the input (a message of its own, shared by 3 agents)" in drawn
    assert "next round: bugs, style, tests each read chair" in drawn
    alone = Console(record=True, width=200)  # no input at all, agents one at a time
    alone.print(graph_tree(dataclasses.replace(PANEL, input_text=""), 0.15, "auto", batch=False))
    drawn = alone.export_text()
    assert ("layer 0 (3 agents, one at a time)" in drawn
            and "bugs starts the graph (reads no agent and no input)" in drawn)
