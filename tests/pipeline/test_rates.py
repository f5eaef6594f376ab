"""Mode auto in an agent process measures nothing before a turn (:mod:`kvwire.pipeline.rates`).

Each decision's costs come from the turn's own prefill (recognised as contended when the process did not get its
threads' CPU time), the rates other agents of the host shared through the store, a measurement of the store and
the codec run beside the model's loading, and priors; every decision says which figure came from where.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
from dataclasses import replace

import pytest

from kvwire import __version__
from kvwire.pipeline import rates
from kvwire.pipeline.cost import ModelCost
from kvwire.store import MemoryStore
from kvwire.wire.spec import ModelSpec

SPEC = ModelSpec(architecture="LlamaForCausalLM", model_type="llama", num_layers=2, num_kv_heads=2, head_dim=16,
                 dtype="float32", vocab_size=100, layer_kinds=("full_attention",) * 2, fingerprint="f" * 64)


def estimator(store, **kwargs) -> rates.Estimator:
    return rates.Estimator(store, SPEC, threads=2, host="h1", **kwargs)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed_loop(seconds: float = 0.4) -> rates.Measurement:
    """A CPU-bound stretch of this thread, measured as a turn's prefill is (one thread)."""
    start, cpu = time.perf_counter(), time.process_time()
    busy(seconds)
    return rates.Measurement(1000, time.perf_counter() - start, time.process_time() - cpu, 1)


def test_a_measurement_taken_while_other_processes_hold_the_cores_is_recognised():
    """Beside as many busy processes as there are cores (agents loading their models, say), the process gets
    about half its time: the measurement is contended, and its rate is scaled to the CPU time it got."""
    cores = len(os.sched_getaffinity(0))
    burners = [multiprocessing.get_context("fork").Process(target=busy, args=(3.0,)) for _ in range(2 * cores)]
    for proc in burners:
        proc.start()
    try:
        time.sleep(0.2)  # let them take the cores
        shared = timed_loop()
    finally:
        for proc in burners:
            proc.terminate()
            proc.join()
    assert not shared.clean and shared.utilization < rates.CLEAN, shared
    assert shared.rate > shared.tokens / shared.seconds * 1.3  # as if it had had the CPU: faster than it ran
    assert "the machine busy" in shared.describe()


def test_a_measurement_classifies_by_the_cpu_share_it_got():
    alone = rates.Measurement(256, 0.5, 0.98, 2)
    busy_one = rates.Measurement(256, 1.0, 1.0, 2)
    assert alone.clean and alone.rate == 512 and "busy" not in alone.describe()
    assert not busy_one.clean and busy_one.utilization == 0.5 and busy_one.rate == 512  # 256 / (1.0 / 2)


def test_a_clean_prefill_is_shared_with_the_hosts_other_agents_and_a_contended_one_never():
    store = MemoryStore()
    first, second = estimator(store), estimator(store)
    first.observe(rates.Measurement(240, 2.0, 2.0, 2))  # the machine busy: 50 % of two threads
    assert not first.publish()  # nothing clean to share
    assert dict(second.costs().sources)["prefill"].startswith("prior")
    assert dict(first.costs().sources)["prefill"].startswith("contended")

    first.observe(rates.Measurement(240, 0.3, 0.58, 2))  # its next turn, alone: 800 tokens/s
    assert first.publish()
    cost = second.costs()
    assert cost.model.prefill_rate == pytest.approx(800) and dict(cost.sources)["prefill"].startswith("shared")
    assert not first.publish()  # nothing new: not published again

    second.observe(rates.Measurement(30, 0.06, 0.12, 2))  # a short clean prefill: mostly a pass's fixed cost
    assert second.costs().model.prefill_rate == pytest.approx(800)  # the shared figure, from 240 tokens, wins
    second.observe(rates.Measurement(300, 0.3, 0.6, 2))  # its own long clean prefill wins over it
    assert second.costs().model.prefill_rate == pytest.approx(1000)


def test_a_clean_figure_wins_over_a_contended_one_measured_later():
    est = estimator(MemoryStore())
    est.observe(rates.Measurement(240, 0.3, 0.58, 2))
    est.observe(rates.Measurement(240, 3.0, 3.0, 2))  # busy: does not replace the clean one
    assert est.costs().model.prefill_rate == pytest.approx(800)


def good_value(**changes) -> dict:
    value = {"format": rates.FORMAT, "kvwire": __version__, "measured_at": time.time(), "ttl_s": 600.0,
             "fingerprint": SPEC.fingerprint, "weights": SPEC.weights, "device": "cpu", "threads": 2,
             "prefill_rate": 900.0, "prefill_tokens": 240, "encode_rate": 1.5e9, "decode_rate": 6e9,
             "wire_bytes_per_token": 4096.0, "encoding": ""}
    value.update(changes)
    return value


def test_shared_rates_are_used_as_they_were_measured():
    store = MemoryStore()
    est = estimator(store)
    store.put(est.key, json.dumps(good_value()).encode())
    cost = est.costs()
    assert cost.model.prefill_rate == 900 and cost.model.encode_rate == 1.5e9
    assert dict(cost.sources)["codec"].startswith("shared")


@pytest.mark.parametrize("changes, why", [
    ({"kvwire": "0.0.1"}, "kvwire '0.0.1' wrote it"),
    ({"fingerprint": "e" * 64}, "it is for fingerprint"),
    ({"weights": "int8"}, "it is for weights 'int8'"),
    ({"threads": 16}, "measured on 16 threads"),
    ({"prefill_rate": float("nan")}, "prefill_rate is nan"),
    ({"prefill_rate": -5.0}, "prefill_rate is -5.0"),
    ({"encode_rate": float("inf")}, "encode_rate is inf"),
    ({"decode_rate": "fast"}, "decode_rate is 'fast'"),
    ({"prefill_rate": 0.0, "encode_rate": 0.0, "decode_rate": 0.0}, "holds no rate above 0"),
    ({"decode_rate": 0.0}, "codec rates are incomplete"),
    ({"format": 9}, "its format is 9"),
])
def test_a_shared_rate_that_does_not_fit_is_named_in_one_line_and_not_used(changes, why, caplog):
    store = MemoryStore()
    est = estimator(store)
    store.put(est.key, json.dumps(good_value(**changes), allow_nan=True).encode())
    with caplog.at_level(logging.WARNING, logger="kvwire.pipeline.rates"):
        cost = est.costs()
    [record] = [r for r in caplog.records if r.name == "kvwire.pipeline.rates"]
    assert why in record.getMessage() and "priors" in record.getMessage(), record.getMessage()
    assert dict(cost.sources)["prefill"].startswith("prior") and dict(cost.sources)["codec"].startswith("prior")


def test_bytes_that_are_not_json_and_an_expired_value_are_not_used(caplog):
    store = MemoryStore()
    est = estimator(store)
    store.put(est.key, b"\xff not json")
    with caplog.at_level(logging.WARNING, logger="kvwire.pipeline.rates"):
        assert dict(est.costs().sources)["prefill"].startswith("prior")
    assert "it is not JSON" in caplog.text
    caplog.clear()
    store.put(est.key, json.dumps(good_value(measured_at=time.time() - 7200)).encode())  # an hour past its TTL
    with caplog.at_level(logging.WARNING, logger="kvwire.pipeline.rates"):
        assert dict(est.costs().sources)["prefill"].startswith("prior")
    assert not caplog.text  # merely old: no warning


def test_with_nothing_known_a_short_upstream_goes_as_ids_and_the_decision_says_why():
    est = estimator(MemoryStore())
    cost, verdict = est.decide(200, 200, 1)
    assert verdict.choice == "ids" and "not known yet" in verdict.reason and f"at most {rates.SHORT}" in verdict.reason
    assert "prefill: prior" in verdict.reason and "codec: prior" in verdict.reason
    assert "store estimate: prior" in verdict.reason  # no probe ran
    assert verdict.to_json()["sources"]["prefill"].startswith("prior")


def test_a_long_upstream_with_nothing_known_is_decided_with_fast_priors():
    """Past SHORT the costs decide, with a fast prior prefill: a cache only where the store is clearly cheap."""
    est = estimator(MemoryStore())
    _, verdict = est.decide(5000, 5000, 1)
    assert not verdict.rule and verdict.ids_s == pytest.approx(5000 / rates.PRIOR_PREFILL_RATE)


def test_the_measurement_beside_the_loading_is_used_once_it_is_done():
    store = MemoryStore()
    background = rates.Background(store, SPEC, start=False)  # still running, as if the model were loading
    est = estimator(store, background=background)
    before = est.costs()
    assert before.probe.source == "prior" and "has not finished" in before.probe.note
    assert dict(before.sources)["codec"].startswith("prior")
    background._run()  # the thread's work, here
    after = est.costs()
    assert after.probe.source == "probe" and dict(after.sources)["codec"].startswith("measured beside")
    assert isinstance(background.codec, ModelCost) and background.codec.encode_rate > 0
    assert est.publish()  # the codec's rates go to the host's other agents, with no prefill rate yet
    other = estimator(store)
    assert dict(other.costs().sources)["codec"].startswith("shared")


def test_a_background_that_fails_leaves_priors_and_a_warning(caplog):
    class Broken(MemoryStore):
        def get(self, key):
            raise RuntimeError("disk on fire")

    store = Broken()
    with caplog.at_level(logging.WARNING, logger="kvwire.pipeline.rates"):
        background = rates.Background(store, SPEC)
        assert background.wait(10)
    assert background.error is not None and "disk on fire" in caplog.text
    est = rates.Estimator(MemoryStore(), SPEC, threads=2, host="h1", background=background)
    assert est.costs().probe.source == "prior"


def test_rates_are_shared_per_model_device_and_threads():
    keys = {rates.model_key("redis://a:6379/0", "h1", fingerprint, device, threads)
            for fingerprint, device, threads in [("f", "cpu", 2), ("g", "cpu", 2), ("f", "cuda:0", 2), ("f", "cpu", 4)]}
    assert len(keys) == 4 and all(k.startswith("kvwire-rates/v1/") for k in keys)
    assert replace(rates.HostRates("f", "fp32", "cpu", 2), prefill_rate=1.0) != rates.HostRates("f", "fp32", "cpu", 2)
