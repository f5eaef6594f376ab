"""``kvwire check A B``: the side-by-side table and its three verdicts, on real model folders.

Tiny random models saved as HF folders stand in for pairs the machine cannot hold twice:
the same folder (identical), two seeds of one architecture (a fine-tuned variant) and two
architectures (different). The real pair is checked by ``make test-fuse``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import tiny
from kvwire.fuse import check


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Model folders: llama (seed 0), llama (seed 1: same shapes, other weights), qwen2."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = tiny.tokenizer()
    paths = {}
    for name, arch, seed in (("llama", "llama", 0), ("llama-tuned", "llama", 1), ("qwen2", "qwen2", 0)):
        model = tiny.model(arch, len(tokenizer), tokenizer.eos_token_id, seed=seed)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def test_the_same_folder_is_identical(folders, tmp_path):
    result = check.compare(folders["llama"], folders["llama"], fusers_root=tmp_path)
    assert result.verdict == "identical" and result.differences == []
    assert "pass caches directly" in result.advice and result.a.fingerprint == result.b.fingerprint != ""


def test_a_model_whose_cache_kvwire_cannot_pass_is_not_advised_to_pass_it(tmp_path):
    """Falcon with multi-query attention: one folder against itself is identical, but its cache holds one KV
    head where its config counts four, so check says text mode, as the pipelines refuse it."""
    import torch
    from transformers import FalconConfig, FalconForCausalLM

    tokenizer = tiny.tokenizer()
    torch.manual_seed(0)
    FalconForCausalLM(FalconConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, multi_query=True, new_decoder_architecture=False)
                      ).save_pretrained(tmp_path / "falcon")
    tokenizer.save_pretrained(tmp_path / "falcon")
    result = check.compare(str(tmp_path / "falcon"), str(tmp_path / "falcon"), fusers_root=tmp_path)
    assert result.verdict == "identical" and "pass caches directly" not in result.advice
    assert "caches cannot be passed: falcon models cache keys" in result.advice and "text mode" in result.advice
    assert result.to_json()["a"]["layout"].startswith("falcon models cache keys")


def test_other_weights_of_one_architecture_are_a_variant(folders, tmp_path):
    result = check.compare(folders["llama"], folders["llama-tuned"], fusers_root=tmp_path)
    assert result.verdict == "variant" and result.differences == ["fingerprint"]
    assert "partial-layer transfer" in result.advice


def test_without_weights_a_variant_cannot_be_told_from_identical(folders, tmp_path):
    result = check.compare(folders["llama"], folders["llama-tuned"], weights=False, fusers_root=tmp_path)
    assert result.verdict == "variant" and "not compared" in result.reason
    assert result.a.fingerprint == "" and "fingerprint" not in [row.name for row in result.rows]


def test_different_architectures_need_a_fuser(folders, tmp_path):
    result = check.compare(folders["qwen2"], folders["llama"], fusers_root=tmp_path)
    assert result.verdict == "different" and "architecture" in result.differences
    assert "same tokenizer" in result.reason  # one tokenizer: alignment is the identity
    assert result.fusers == {"A->B": [], "B->A": []} and "train-fuser --sharer" in result.advice
    assert result.a.fingerprint == ""  # nothing on disk for this pair: no weights were loaded to say so


def test_cli_check_prints_the_table_and_json(folders, tmp_path):
    from click.testing import CliRunner

    from kvwire.cli import cli

    args = ["check", folders["qwen2"], folders["llama"], "--fusers", str(tmp_path)]
    table = CliRunner().invoke(cli, args)
    assert table.exit_code == 0, table.output
    assert "verdict: different" in table.output and "Qwen2ForCausalLM" in table.output
    as_json = CliRunner().invoke(cli, [*args, "--json"])
    payload = json.loads(as_json.output.strip().splitlines()[-1])
    assert payload["verdict"] == "different" and "KV heads" not in payload["differences"]  # both tiny: 2 KV heads


def test_cli_check_on_a_missing_folder_is_one_error_line(folders, tmp_path):
    missing = subprocess.run([sys.executable, "-m", "kvwire", "check", str(tmp_path / "nope"), folders["llama"]],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and missing.stderr.count("error:") == 1 and "no model at" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_check_says_whether_each_fuser_found_helps(folders, tmp_path):
    """``kvwire check`` lists every checkpoint for the pair with its recorded gain, and which ones
    fuse mode would refuse (no gain over the receiver alone, or none recorded)."""
    from kvwire import hf
    from kvwire.fuse import checkpoint
    from kvwire.fuse.fuser import Fuser, FuserConfig

    specs = {name: hf.model_spec(hf.load_model(folders[name])[0]) for name in ("qwen2", "llama")}
    r, s = specs["llama"], specs["qwen2"]
    config = FuserConfig(r.num_kv_heads, r.head_dim, s.num_kv_heads, s.head_dim, (0,) * r.num_layers, hidden=8,
                         blocks=0)
    gains = {"helps": {"heldout_nats_per_token": 0.05, "mc_points": 2.0, "mc_ci95": [-1.0, 5.0], "mc_items": 150},
             "worse": {"heldout_nats_per_token": -0.01}, "none": None,
             "unasked": {"heldout_nats_per_token": 0.05}}  # a lower loss alone is what an adapter gets too
    for name, gain in gains.items():
        checkpoint.save(tmp_path / name, checkpoint.CheckpointConfig(
            "fuser", checkpoint.ModelRef("llama", r), checkpoint.ModelRef("qwen2", s), "char-offsets-v1/chat/last",
            config.layer_map, config.to_json(), {"gain": gain}), Fuser(config).state_dict())
    result = check.compare(folders["qwen2"], folders["llama"], fusers_root=tmp_path)
    assert sorted(result.fusers["A->B"]) == sorted(str(tmp_path / name) for name in gains)
    assert result.gains[str(tmp_path / "helps")] == ("helps: held-out loss -0.050 nats/token against the receiver "
                                                     "alone; questions +2.0 points [-1.0, +5.0] over 150 items")
    assert result.gains[str(tmp_path / "worse")].startswith("refused without --allow-worse: held-out loss +0.010")
    assert result.gains[str(tmp_path / "none")] == "refused without --allow-worse: no validated gain recorded"
    assert result.gains[str(tmp_path / "unasked")] == (
        "refused without --allow-worse: held-out loss -0.050 nats/token against the receiver alone; "
        "the bundled questions not measured (train with --eval-questions)")
