"""Beyond this machine: the cost model with puts and gets apart, the break-even sweep, and the pictures.

The decision between sending a cache and re-prefilling ids turns on rates this CPU
fixes; ``kvwire.pipeline.breakeven`` runs the same cost model over prefill rates and link speeds
this machine does not have. These tests tie its byte counts to real encoded packets,
check the direction of every trade-off it claims, and draw the timeline and the map.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.support.helpers import spec as tiny_spec
from kvwire import open_store
from kvwire.pipeline.breakeven import MODELS, Codec, KVShape, hop_costs, link_store, sweep
from kvwire.wire.options import CodecOptions
from kvwire.pipeline.cost import CostModel, ModelCost, StoreCost, probe_codec
from kvwire.plots import break_even_map, timeline, turn_phases
from kvwire.store.metered import MeteredStore

CODECS = {"fp32": Codec(encode_rate=2e9, decode_rate=1e9), "int8": Codec(encode_rate=0.5e9, decode_rate=0.8e9)}


@pytest.mark.parametrize("encoding", ["fp32", "int8", "int4"])
def test_bytes_per_token_of_a_shape_are_those_of_real_packets(encoding):
    """KVShape's arithmetic against packets the codec really writes (header aside: ~1 KB of JSON)."""
    spec = tiny_spec(num_layers=3, kv_heads=2, head_dim=64)
    measured = probe_codec(spec, CodecOptions(encoding=encoding), tokens=1024, repeats=1)
    shape = KVShape("tiny", layers=3, kv_heads=2, head_dim=64)
    predicted = shape.wire_bytes_per_token(encoding, tokens=1024)
    assert measured.bytes_per_token == shape.bytes_per_token == spec.kv_bytes(1)
    assert predicted <= measured.wire_bytes_per_token <= predicted + 4096 / 1024 + 8 + 1  # + header, ids, mask


def test_llama3_8b_sized_cache():
    llama = MODELS["llama-3-8b"]
    assert llama.bytes_per_token == 2 * 32 * 8 * 128 * 4 == 256 << 10
    assert 3.7 < llama.bytes_per_token / llama.wire_bytes_per_token("int8") < 3.8


def test_puts_and_gets_are_priced_apart():
    """A store whose gets are 4x slower than its puts: the receiver's get of the chain dominates."""
    store = StoreCost.from_rates(0.002, put_rate=400e6, get_rate=100e6)
    model = ModelCost(prefill_rate=300.0, codec_rate=1e9, bytes_per_token=46080)
    cost = CostModel(store, model)
    transfer = cost.transfer_s(tokens=1000, delta_tokens=100, links=3)
    assert transfer == pytest.approx(4 * 0.001 + 100 * 46080 / 400e6 + 1000 * 46080 / 100e6)
    assert store.bandwidth == pytest.approx(80e6)  # put + get of the same bytes together
    legacy = StoreCost(0.002, 80e6)  # the old symmetric form: put and get each at twice the pair's rate
    assert legacy.put_rate == legacy.get_rate == 160e6
    decision = cost.decide(1000, 100, 3)
    assert decision.transfer_s == pytest.approx(transfer) and decision.cache_s > transfer


def test_costs_with_the_new_fields_survive_json_and_old_json_still_reads():
    cost = CostModel(StoreCost.from_rates(1e-3, 5e8, 1e8, "redis://h:6379/0"),
                     ModelCost(300.0, 1e9, 46080, 12600.0, 4e8, 6e8, "int8"))
    assert CostModel.from_json(cost.to_json()) == cost
    old = cost.to_json()
    for field in ("put_rate", "get_rate"):
        del old["store"][field]
    for field in ("wire_bytes_per_token", "encode_rate", "decode_rate", "encoding"):
        del old["model"][field]
    again = CostModel.from_json(old)
    assert again.store.put_rate == again.store.get_rate == 2 * cost.store.bandwidth
    assert again.model.wire_bytes_per_token == 46080 and again.model.decode_rate == 1e9 / 2


def test_the_winner_moves_with_the_link_and_the_prefill_rate():
    shape = MODELS["llama-3-8b"]

    def winner(link_bits: float, prefill: float) -> str:
        seconds = hop_costs(shape, link_store(link_bits), prefill, CODECS, tokens=2000)
        return min(seconds, key=seconds.__getitem__)

    assert winner(100e6, 20_000) == "ids"  # a slow link against a GPU: never send the cache
    assert winner(10e9, 300) in ("fp32", "int8")  # a fast link against this CPU: always send it
    assert winner(1e9, 300) == "int8"  # bytes dominate: the smaller packet wins
    assert winner(100e9, 300) == "fp32"  # the link is nearly free: quantizing costs more than it saves
    points = sweep(shape, [100e6, 1e9, 10e9, 100e9], [300, 3000, 30_000], CODECS)
    assert len(points) == 12 and {p.winner for p in points} == {"ids", "fp32", "int8"}
    for link in (100e6, 1e9, 10e9, 100e9):  # faster prefill never makes the cache more attractive
        column = [p for p in points if p.link_bits == link]
        flags = [p.winner == "ids" for p in sorted(column, key=lambda p: p.prefill_rate)]
        assert flags == sorted(flags)


def test_a_metered_store_times_puts_and_gets():
    store = MeteredStore(open_store("memory://"))
    store.put("packets/a", b"x" * 1000)
    assert bytes(store.get("packets/a")) == b"x" * 1000 and store.get("packets/missing") is None
    traffic = store.traffic
    assert (traffic.puts, traffic.gets, traffic.put_bytes, traffic.get_bytes) == (1, 2, 1000, 1000)
    assert traffic.put_s > 0 and traffic.get_s > 0 and traffic.nbytes == 2000


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_turn_phases_follow_the_docstring_example():
    agent = {"receive_s": 0.2, "prefill_s": 0.1, "ttft_s": 0.35, "decode_s": 1.0, "publish_s": 0.05, "total_s": 1.45}
    phases = turn_phases(agent)
    assert phases["receive"] == (0.0, 0.2) and phases["decode"] == (0.35, 1.0)
    assert phases["prefill"] == pytest.approx((0.25, 0.1)) and phases["publish"] == pytest.approx((1.4, 0.05))


def test_a_timeline_and_a_break_even_map_are_drawn(tmp_path):
    def turn(name: str, start: float, prefill: float) -> dict:
        return {"agent": name, "started_at": start, "receive_s": 0.05, "prefill_s": prefill, "ttft_s": prefill + 0.1,
                "decode_s": 0.5, "publish_s": 0.02, "total_s": prefill + 0.7}

    runs = [("text", [turn("a", 100.0, 1.0), turn("b", 101.8, 1.2)]),
            ("prefix", [turn("a", 200.0, 1.0), turn("b", 201.8, 0.1)])]
    width, height = _png_size(timeline(runs, tmp_path / "t.png"))
    assert width > 600 and height > 100
    grid = [p.to_json() for p in sweep(MODELS["smollm2-135m"], [1e8, 1e9, 1e10], [300, 3000], CODECS)]
    measured = [{"link_bits": 1e8, "prefill_rate": 300, "winner": "int8", "label": "doc 100mbit"}]
    path = break_even_map([("SmolLM2", grid), ("again", grid)], tmp_path / "map.png", measured, title="t")
    assert _png_size(path)[0] > 600


def test_kvwire_run_draws_its_timeline(tmp_path, tiny_tokenizer):
    """``kvwire run ... --timeline out.png``: text mode's turns above prefix mode's, one PNG."""
    from tests.support import tiny
    from kvwire.cli import cli

    folder = tmp_path / "tiny"
    tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    pipeline = tmp_path / "p.toml"
    pipeline.write_text('name = "duo"\nsystem = "Take turns."\ninput_text = "Count to ten."\nmax_new_tokens = 3\n'
                        '[[agents]]\nname = "a"\ninstruction = "Go on."\n'
                        '[[agents]]\nname = "b"\ninstruction = "Go on."\n')
    out = tmp_path / "where.png"
    cli.main(["run", str(pipeline), "--model", str(folder), "--timeline", str(out)], standalone_mode=False)
    width, height = _png_size(out)
    assert width > 600 and height > 100
