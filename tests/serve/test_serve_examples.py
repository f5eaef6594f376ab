"""The examples run against the server as users run them: the plain openai client, and smolagents."""

from __future__ import annotations

import importlib.util

import pytest

from kvwire.serve import ServeConfig, Service
from tests.support.serve_utils import ROOT, in_process


def example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def serve(tiny_served, tiny_folder):
    model, tokenizer = tiny_served

    def make(**config):
        return in_process(Service(ServeConfig(model=str(tiny_folder), **config), model, tokenizer))
    return make


def test_five_agents_with_the_openai_client_reuse_the_transcript(serve):
    agents = example("openai_agents")
    with serve() as server:
        result = agents.run(server.url, max_tokens=8, report="Checkout failed for 2 hours; 18,420 of 23,950 "
                                                             "attempts failed.")
    runs = result["agents"]
    assert [a["agent"] for a in runs] == [name for name, _, _ in agents.AGENTS]
    assert runs[0]["cached_tokens"] == 0
    for before, after in zip(runs, runs[1:]):  # each agent's request extends the one before it
        assert after["cached_tokens"] >= before["prompt_tokens"]


def test_smolagents_review_splices_the_answers_it_passes_on(serve):
    pytest.importorskip("smolagents", reason="a dev dependency: pip install -c constraints.txt smolagents")
    review = example("smolagents_review")
    with serve(store="memory://smolagents", splice=0.0, splice_when="always") as server:  # short answers: forced
        replies = review.review(server.url, "none", max_tokens=24, code="def export(rows, totals={}): return 1")
    assert [name for name, _ in replies] == ["analyst", "fixer", "reviewer"]
    spliced = [reply.raw.model_extra["kvwire"]["spliced_tokens"] for _, reply in replies]
    assert spliced[0] == 0 and spliced[2] > spliced[1] > 0, spliced  # smolagents merged them into one message
