"""Loading a model in a compact weight format (``load_model(..., weights="int8")``) reads it one tensor at a time:
each linear's fp32 weights are read just before they are converted and dropped after, so the load never holds the
fp32 model. The result is the same model, bit for bit, as transformers' own load followed by ``convert``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from kvwire import hf
from kvwire.errors import ModelError
from kvwire.hf import loading, weights
from tests.support import tiny


def _folder(tmp_path, arch, tokenizer):
    folder = tmp_path / arch
    tiny.model(arch, len(tokenizer), tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _the_usual_way(folder, fmt):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    return weights.convert(model, fmt)


def _assert_same_model(ours, theirs, as_loaded=True):
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys()
    for key in reference:
        assert mine[key].dtype == reference[key].dtype and torch.equal(mine[key], reference[key]), key
    buffers = dict(theirs.named_buffers())  # the non-persistent ones too: RoPE's tables, int8's fp32 scales
    assert {k: torch.equal(v, buffers[k]) for k, v in ours.named_buffers()} == dict.fromkeys(buffers, True)
    if as_loaded:  # (load_model goes on: it adds the tokenizer's end-of-generation tokens, adopts the attention)
        assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
        assert ours.config._attn_implementation == theirs.config._attn_implementation
    ids = torch.arange(3, 40).unsqueeze(0) % ours.config.get_text_config(decoder=True).vocab_size
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("arch", tiny.ARCHS)  # gemma3 ties its output layer to the embeddings; the others do not
def test_a_compact_load_gives_the_same_bits_as_loading_then_converting(arch, fmt, tmp_path, tiny_tokenizer):
    folder = _folder(tmp_path, arch, tiny_tokenizer)
    streamed = loading.load_compact(folder, loading.read_config(folder), fmt)
    if arch == "neox":  # its checkpoint names the output layer embed_out, which transformers renames: the usual way
        assert streamed is None
    else:  # read one tensor at a time
        _assert_same_model(streamed.eval(), _the_usual_way(folder, fmt))
    model, _ = hf.load_model(folder, weights=fmt)
    _assert_same_model(model, _the_usual_way(folder, fmt), as_loaded=False)
    assert weights.format_of(model) == fmt


def test_the_real_default_model_loads_the_same_in_int8_one_tensor_at_a_time():
    from kvwire import models

    folder = models.resolve()
    assert loading.load_compact(folder, loading.read_config(folder), "int8") is not None
    model, _ = hf.load_model(folder, weights="int8")
    _assert_same_model(model, _the_usual_way(folder, "int8"), as_loaded=False)


def test_a_checkpoint_that_does_not_name_the_models_parameters_loads_the_usual_way(tmp_path, tiny_tokenizer):
    folder = _folder(tmp_path, "llama", tiny_tokenizer)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.extra.weight"] = torch.zeros(3)  # a tensor the model has no place for
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert loading.load_compact(folder, loading.read_config(folder), "int8") is None
    model, _ = hf.load_model(folder, weights="int8")  # transformers' own load, then convert: still loads
    _assert_same_model(model, _the_usual_way(folder, "int8"), as_loaded=False)


_PEAK = """
import json, sys
from kvwire import hf
from kvwire.errors import ModelError
from kvwire.hf import loading, weights  # torch and transformers, imported before the count starts
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
before = status("VmRSS:")
model, _ = hf.load_model(sys.argv[1], weights="int8")
print(json.dumps({"added": status("VmHWM:") - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc")
def test_an_int8_load_never_holds_the_fp32_model(tmp_path, tiny_tokenizer):
    """A model whose layers outweigh its embeddings (as a 0.5B model's do): the fp32 checkpoint is 258 MiB, its
    int8 layers 64 MiB. Loading the whole before converting added 359 MiB at the peak; one tensor at a time, 119."""
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    folder = tmp_path / "layers-heavy"
    with torch.device("meta"):
        shapes = LlamaForCausalLM(config).state_dict()
    save_file({k: torch.randn(v.shape) * 0.02 for k, v in shapes.items()}, tmp_path / "weights.safetensors",
              metadata={"format": "pt"})
    folder.mkdir()
    config.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    (tmp_path / "weights.safetensors").rename(folder / "model.safetensors")
    checkpoint = (folder / "model.safetensors").stat().st_size
    out = subprocess.run([sys.executable, "-c", _PEAK, str(folder)], capture_output=True, text=True, check=True)
    added = json.loads(out.stdout.strip().splitlines()[-1])["added"]
    assert added < 0.6 * checkpoint, f"the load added {added / 2**20:.0f} MiB at its peak; the fp32 checkpoint is " \
                                     f"{checkpoint / 2**20:.0f} MiB"


def test_the_checkpoint_reader_reads_what_safetensors_wrote_into_aligned_memory(tmp_path):
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
               "i64": torch.arange(5), "i8": torch.tensor([-3, 4], dtype=torch.int8),
               "flags": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "t.safetensors")
    with loading._Checkpoint(tmp_path / "t.safetensors") as checkpoint:
        assert not checkpoint.unreadable and checkpoint.entries.keys() == tensors.keys()
        for key, expected in tensors.items():
            got = checkpoint.read(key)
            assert got.dtype == expected.dtype and torch.equal(got, expected), key
            assert got.numel() == 0 or got.data_ptr() % 64 == 0  # no copy for _align to make


def test_a_damaged_checkpoint_is_refused_in_a_compact_format_as_in_fp32(tmp_path, tiny_tokenizer):
    folder = _folder(tmp_path, "llama", tiny_tokenizer)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])  # its last tensor cut short
    with loading._Checkpoint(file) as checkpoint:
        assert "do not hold" in checkpoint.unreadable
    for fmt in ("int8", "fp32"):
        with pytest.raises(ModelError, match="cannot load the model"):
            hf.load_model(folder, weights=fmt)
    file.write_bytes(b"\xff" * 8 + data[8:])  # a header length past the end
    with loading._Checkpoint(file) as checkpoint:
        assert "header" in checkpoint.unreadable
    with pytest.raises(ModelError, match="cannot load the model"):
        hf.load_model(folder, weights="int8")
