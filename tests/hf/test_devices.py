"""Models on an accelerator: the same exactness as on the CPU, with every copy explicit.

A model may live on any device torch knows (``model.to("cuda")``). Packets are encoded from
CPU memory only; an agent moves a received packet to its model's device with
``Packet.to()`` and counts the bytes (``AgentResult.device_copy_bytes``). These tests run
each exact path on every accelerator this machine has -- prefix mode, splice mode at
R = 1, a graph's fan-out decoded as one batch, a packet through the codec -- and compare
token for token (greedy) and logit for logit against recomputation on that same device.
Without an accelerator they are skipped; ``make test-device`` runs them where there is one.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvwire import PacketError, Pipeline, codec, hf
from kvwire.kv.splice import Recompute
from kvwire.pipeline.graph import GraphRunner
from tests.pipeline.test_graph import BOARD  # the CPU tests' pipelines: a review board whose reviewers batch,
from tests.pipeline.test_pipeline_tiny import SPEC  # and a three-agent review
from tests.support import tiny


def _accelerators() -> list:
    if os.environ.get("KVWIRE_TEST_DEVICES"):  # e.g. "cpu": these tests' own logic, on a machine without one
        return os.environ["KVWIRE_TEST_DEVICES"].split(",")
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found or [pytest.param("none", marks=pytest.mark.skip(
        reason="no accelerator on this machine (cuda, mps); `make test-device` runs these where there is one"))]


# fp32 on an accelerator: matrix products in another order than the CPU's (and than the uncached
# reference's), so the logits agree to rounding, not bit for bit; greedy tokens must agree exactly
ATOL = 2e-4


@pytest.fixture(scope="module", params=_accelerators())
def device(request):
    return torch.device(request.param)


@pytest.fixture(scope="module", params=tiny.ARCHS)
def on_device(request, device, tiny_tokenizer):
    """(arch, model on the accelerator, its spec)."""
    model = tiny.model(request.param, len(tiny_tokenizer), tiny_tokenizer.eos_token_id).to(device)
    return request.param, model, hf.model_spec(model)


def _check_against_recomputation(model, agents, new_tokens, arch):
    for index, agent in enumerate(agents):
        reference = hf.generate(model, agent.context_ids, max_new_tokens=new_tokens(index), use_cache=False)
        assert agent.output_ids == reference.tokens, (arch, agent.agent)
        assert agent.first_logits.device.type == "cpu"  # results are plain CPU tensors wherever the model ran
        torch.testing.assert_close(agent.first_logits, reference.first_logits, atol=ATOL, rtol=0)


def test_prefix_mode_on_the_device_is_exact_and_counts_its_copies(on_device, tiny_tokenizer):
    arch, model, spec = on_device
    result = Pipeline(model, tiny_tokenizer, SPEC, model_spec=spec).run("prefix")
    _check_against_recomputation(model, result.agents, SPEC.new_tokens, arch)
    first, *rest = result.agents
    off_cpu = next(model.parameters()).device.type != "cpu"
    for agent in rest:  # each received its upstream's packet from the (CPU) store: explicit copies, counted
        assert agent.cached_tokens > 0 and (agent.device_copy_bytes > 0) == off_cpu, (arch, agent.agent)


def test_splice_mode_at_full_recompute_on_the_device_is_exact(on_device, tiny_tokenizer):
    arch, model, spec = on_device
    if spec.has_sliding_window:
        pytest.skip("splice mode places segments in full-attention models only")
    result = Pipeline(model, tiny_tokenizer, SPEC, model_spec=spec, recompute=Recompute(1.0)).run("splice")
    _check_against_recomputation(model, result.agents, SPEC.new_tokens, arch)


def test_a_fan_out_on_the_device_decodes_as_one_batch_and_exactly(on_device, tiny_tokenizer):
    arch, model, spec = on_device
    if spec.has_sliding_window:
        pytest.skip("graph batches decode full-attention models only (sliding windows decode one at a time)")
    runner = GraphRunner(model, tiny_tokenizer, BOARD, model_spec=spec, recompute=Recompute(1.0), merge="splice")
    result = runner.run("graph")
    assert result.batches == [1, 3, 1]
    order = list(BOARD.graph.order)
    _check_against_recomputation(model, result.agents, lambda i: BOARD.new_tokens(order[i]), arch)


def test_a_packet_leaves_the_device_explicitly_and_continues_exactly_there(device, tiny_tokenizer):
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id).to(device)
    spec = hf.model_spec(model)
    ids = torch.tensor([tiny_tokenizer.encode("Summarize the document in three sentences.")])
    first = hf.generate(model, ids, max_new_tokens=4)
    covered = torch.cat([ids, torch.tensor([first.tokens[:-1]])], dim=1)
    packet = hf.extract(first.cache, spec, covered)
    assert packet.device.type == device.type
    if device.type != "cpu":
        with pytest.raises(PacketError, match="move it explicitly"):
            codec.encode(packet)  # never an implicit copy off the device
    decoded = codec.decode(codec.encode(packet.to("cpu")))
    assert decoded.device.type == "cpu"
    cache = hf.build_cache(decoded.to(device), model, spec)
    context = torch.cat([covered, torch.tensor([[first.tokens[-1]]])], dim=1)
    continued = hf.generate(model, context, cache=cache, max_new_tokens=6)
    reference = hf.generate(model, context, max_new_tokens=6, use_cache=False)
    assert continued.tokens == reference.tokens
    torch.testing.assert_close(continued.first_logits, reference.first_logits, atol=ATOL, rtol=0)
    if device.type != "cpu":  # a CPU packet into a model on the device: what to do, not a crash deep inside
        with pytest.raises(PacketError, match=r"packet\.to"):
            hf.build_cache(decoded, model, spec)
