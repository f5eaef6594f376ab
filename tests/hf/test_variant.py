"""A fine-tuned variant (kvwire.variant) made from a tiny model: trained on held-in stdlib
source, saved under KVWIRE_HOME (adapter + recipe, no model weights), and rebuilt on load."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import tiny
from kvwire import hf
from kvwire.errors import ModelError
from kvwire import variant
from kvwire.hf import lora


def test_the_corpus_holds_out_every_fourth_module():
    train, held = set(variant.training_files()), set(variant.held_out_files())
    assert train and held and not train & held
    assert train | held == set(variant.corpus_files())
    assert not any(p.name.startswith(("_", "test")) for p in train | held)


def test_make_and_load_a_variant(tmp_path, monkeypatch, tiny_tokenizer):
    monkeypatch.setenv("KVWIRE_HOME", str(tmp_path / "home"))
    base_dir = tmp_path / "base"
    tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id).save_pretrained(base_dir)
    tiny_tokenizer.save_pretrained(base_dir)
    recipe = variant.VariantRecipe(base=str(base_dir), steps=3, batch_size=2, seq_len=32, windows_per_file=1, lr=1e-2,
                                   rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    info = variant.make(recipe, name="tiny")
    target = tmp_path / "home" / "variants" / "tiny"
    assert {p.name for p in target.iterdir()} == {"adapter.safetensors", "recipe.json"}
    saved = json.loads((target / "recipe.json").read_text())
    assert saved["recipe"]["steps"] == 3 and saved["corpus"]["files"] == len(variant.training_files())
    assert len(info.losses) == 3 and saved["base_fingerprint"] == info.base_fingerprint

    made, _ = variant.load("tiny")
    base, _ = hf.load_model(base_dir)
    expected = lora.merge(lora.load_adapter(hf.load_model(base_dir)[0], target / "adapter.safetensors"))
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        got, want, plain = (m(input_ids=ids).logits for m in (made, expected, base))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got - plain).abs().max() > 1e-4  # the variant is not the base
    assert hf.model_spec(made).fingerprint != info.base_fingerprint


def test_a_missing_variant_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="python -m kvwire.variant"):
        variant.load("nope")


def test_the_old_command_still_runs_the_variant_with_a_warning(tmp_path):
    """``python -m kvwire.hf.variant`` (the name before it moved above hf and models) runs ``kvwire.variant``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import kvwire

    env = dict(os.environ, PYTHONPATH=str(Path(kvwire.__file__).resolve().parents[1]), KVWIRE_HOME=str(tmp_path),
               PYTHONWARNINGS="always::DeprecationWarning")
    proc = subprocess.run([sys.executable, "-m", "kvwire.hf.variant", "--help"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m kvwire.variant") and "--steps" in proc.stdout
    assert "kvwire.hf.variant moved to kvwire.variant" in proc.stderr
