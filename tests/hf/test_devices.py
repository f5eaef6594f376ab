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


def test_load_model_puts_the_model_on_the_device(device, tiny_folder):
    model, _ = hf.load_model(tiny_folder, device=device)
    assert hf.model_device(model).type == device.type


def test_kvwire_run_on_the_device_is_exact(device, tiny_folder):
    """The command line's --device: a compare run on the device, its prefix mode exact against text mode."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "three_agents.toml"
    proc = subprocess.run([sys.executable, "-m", "kvwire", "run", str(example), "--model", str(tiny_folder),
                           "--device", str(device), "--mode", "compare", "--max-new-tokens", "6", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (f"on {device}" in proc.stderr) == (device.type != "cpu")  # the model line says where, off the CPU
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert payload["identical"] is True and payload["exact"] is True, payload


def test_kvwire_serve_on_the_device_answers_as_on_the_cpu_and_reuses(device, tiny_folder, tiny_served):
    """A server whose model is on the device: the same greedy answers as the CPU's, the second turn's prompt read
    from the first's published cache (moved to the device once, published back from CPU memory)."""
    from kvwire.serve import ServeConfig, Service
    from tests.serve.test_serve import converse
    from tests.support.serve_utils import client, in_process

    on_device = hf.load_model(tiny_folder, device=device)
    config = dict(model=str(tiny_folder), block_size=4)
    service = Service(ServeConfig(**config, device=str(device)), *on_device)
    if device.type != "cpu":  # --prefill-chunk auto: whole prefills where a chunk costs a whole pass
        assert service.prefill_chunk is None
    assert service.health()["device"].startswith(device.type)
    with in_process(service) as there, in_process(Service(ServeConfig(**config), *tiny_served)) as here:
        api, cpu = client(there.url), client(here.url)
        model = api.models.list().data[0].id
        answers, expected = converse(api, model, max_tokens=8), converse(cpu, model, max_tokens=8)
    assert [a.choices[0].message.content for a in answers] == [e.choices[0].message.content for e in expected]
    assert all(a.usage.prompt_tokens_details.cached_tokens > 0 for a in answers[1:])


def test_prefill_chunks_keep_their_size_off_the_cpu(device, tiny_tokenizer):
    """On the CPU later chunks shrink as the prompt's context grows (its attention costs as much as the linear layers
    there); on an accelerator a pass costs about the same for any chunk, so they keep the first one's size."""
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id).to(device)
    engine = hf.Engine(model, prefill_chunk=64)
    assert (engine.attention_reach == float("inf")) == (device.type != "cpu")
    assert hf.chunk_tokens(64, 5000, engine.attention_reach) == 64 or device.type == "cpu"


def test_the_cost_probe_times_a_prefill_on_the_device(device, tiny_folder):
    """kvwire probe --device and an auto agent's own probe: the prefill rate of the model where it runs."""
    from kvwire.pipeline.cost import probe_model

    model, _ = hf.load_model(tiny_folder, device=device)
    spec = hf.model_spec(model)
    cost = probe_model(model, spec.kv_bytes(1), tokens=32, spec=spec)
    assert cost.prefill_rate > 0 and cost.bytes_per_token > 0


def test_a_device_is_checked_before_any_weights_load(monkeypatch):
    """hf.check_device (what --device and ServeConfig.device run first): a name torch does not know, the meta
    device, an accelerator torch does not see, one numbered past those it sees, and a compact weight format
    (torch's CPU kernels) on an accelerator -- each a ModelError that says what to use instead."""
    from kvwire import ModelError

    assert hf.check_device("cpu", "int8") == torch.device("cpu")
    with pytest.raises(ModelError, match="unknown device 'gpu0'"):
        hf.check_device("gpu0")
    with pytest.raises(ModelError, match="meta device"):
        hf.check_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="no cuda device here") as refused:
        hf.check_device("cuda")
    assert "--device cpu" in str(refused.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert hf.check_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ModelError, match=r"torch sees 2 cuda device\(s\)"):
        hf.check_device("cuda:2")
    for weights in ("bf16", "int8", "int4"):
        with pytest.raises(ModelError, match=f"--weights {weights} runs on the CPU only"):
            hf.check_device("cuda", weights)
