"""``kvwire serve`` on the bundled SmolLM2-135M-Instruct: reuse is exact end to end."""

from __future__ import annotations

import importlib.util

import pytest

from kvwire.serve import ServeConfig, Service
from serve_utils import ROOT, in_process

pytestmark = pytest.mark.real_model


def test_agents_through_the_server_answer_the_same_with_and_without_reuse(real_model):
    model, tokenizer, _ = real_model
    spec = importlib.util.spec_from_file_location("openai_agents", ROOT / "examples" / "openai_agents.py")
    agents = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agents)
    report = agents.REPORT.read_text()[:600]
    with in_process(Service(ServeConfig(), model, tokenizer)) as reusing, \
            in_process(Service(ServeConfig(reuse=False), model, tokenizer)) as plain:
        with_reuse = agents.run(reusing.url, max_tokens=6, report=report, agents=3)["agents"]
        without = agents.run(plain.url, max_tokens=6, report=report, agents=3)["agents"]
    assert [a["text"] for a in with_reuse] == [a["text"] for a in without]
    assert all(a["cached_tokens"] == 0 for a in without)
    for before, after in zip(with_reuse, with_reuse[1:]):
        assert after["cached_tokens"] >= before["prompt_tokens"]
        assert after["cached_tokens"] / after["prompt_tokens"] >= 0.8
