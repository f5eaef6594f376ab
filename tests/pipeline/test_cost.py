"""The cost model behind --mode auto: send the cache when it beats re-prefilling the ids."""

from __future__ import annotations

import pytest

from kvwire import AgentSpec, PipelineSpec, open_store
from kvwire.pipeline.cost import CostModel, ModelCost, StoreCost, probe_store
from kvwire.pipeline.linear import Pipeline

MODEL = ModelCost(prefill_rate=500.0, codec_rate=1e9, bytes_per_token=46080)  # SmolLM2-135M on 2 cores
LOCAL = StoreCost(latency_s=1e-4, bandwidth=2e9)
SLOW_LINK = StoreCost(latency_s=0.05, bandwidth=1e6)  # 8 Mbit/s, 50 ms


def test_a_local_store_sends_caches_a_slow_link_sends_ids():
    local, slow = CostModel(LOCAL, MODEL), CostModel(SLOW_LINK, MODEL)
    assert local.decide(tokens=1500, delta_tokens=40, links=3).choice == "cache"
    assert slow.decide(tokens=1500, delta_tokens=40, links=3).choice == "ids"
    decision = local.decide(1500, 40, 3)
    assert decision.cache_s < decision.ids_s and decision.reason.startswith("cache: sending the cache")


def test_break_even():
    local = CostModel(LOCAL, MODEL)
    n = local.break_even_tokens()
    assert n is not None and local.decide(n + 1, n + 1, 1).choice == "cache"
    assert local.decide(max(1, n // 4), max(1, n // 4), 1).choice == "ids" or n < 4
    assert CostModel(SLOW_LINK, MODEL).break_even_tokens() is None  # the link moves K/V slower than prefill makes it


@pytest.mark.parametrize("url", ["memory://", "file://{tmp}/s"])
def test_probe_measures_a_real_store(url, tmp_path):
    cost = probe_store(open_store(url.format(tmp=tmp_path)), large=1 << 20, repeats=3)
    assert cost.latency_s > 0 and cost.bandwidth > 0


CHAIN = PipelineSpec("chain", (AgentSpec("a", "Go on."), AgentSpec("b", "Go on."), AgentSpec("c", "Go on.")),
                     system="You take turns.", input_text="Count to ten.", max_new_tokens=4)


def test_auto_mode_reports_each_hop(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    sends = Pipeline(model, tiny_tokenizer, CHAIN, cost=CostModel(LOCAL, MODEL)).run("auto")
    assert all(t.decision.startswith("cache") for t in sends.agents) and sends.agents[2].cached_tokens > 0
    withholds = Pipeline(model, tiny_tokenizer, CHAIN, cost=CostModel(SLOW_LINK, MODEL)).run("auto")
    assert all(t.decision.startswith("ids") for t in withholds.agents)
    assert all(t.cached_tokens == 0 and t.packet_bytes == 0 for t in withholds.agents)
    assert [t.output_ids for t in withholds.agents] == [t.output_ids for t in sends.agents]  # same answers
    measured = Pipeline(model, tiny_tokenizer, CHAIN).run("auto")  # probes the store and model itself
    assert all(t.decision for t in measured.agents)


@pytest.mark.real_model
def test_probe_command(real_model):
    import json

    from tests.support import cli

    proc = cli.run("probe", "memory://", "--large", "1MiB", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["model"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4 and report["model"]["prefill_rate"] > 0
    assert report["store"]["latency_s"] > 0 and report["break_even_tokens"] is not None


def test_costs_saved_by_probe_are_read_back():
    """``kvwire probe --json`` prints CostModel.to_json(); ``kvwire agent --mode auto --costs FILE`` reads it back."""
    from kvwire import KvwireError

    local = CostModel(StoreCost(1e-4, 2e9, "redis://h:6379/0"), MODEL)
    assert CostModel.from_json(local.to_json()) == local
    assert CostModel.from_json(local.to_json()).decide(1500, 40, 3) == local.decide(1500, 40, 3)
    broken = local.to_json()
    del broken["model"]["prefill_rate"]
    with pytest.raises(KvwireError, match="costs.json has no model.prefill_rate"):
        CostModel.from_json(broken, "costs.json")
    for bad in (0, -1.0, "fast", True, None):
        data = local.to_json()
        data["store"]["bandwidth"] = bad
        with pytest.raises(KvwireError, match="store.bandwidth must be a positive number"):
            CostModel.from_json(data)
    data = local.to_json()
    data["model"]["bytes_per_token"] = 1.5
    with pytest.raises(KvwireError, match="bytes_per_token"):
        CostModel.from_json(data)
