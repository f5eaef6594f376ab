"""--model and kvwire's cache folder from the command line: a damaged GGUF, an incomplete folder, an empty name,
a cache path that is a file, a bad environment variable -- each one ``error:`` line said before any model loads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cli.test_cli import ROOT, assert_one_error_line
from tests.support import cli

EXAMPLE = str(ROOT / "examples" / "document_pipeline.toml")


def kvwire(*args: str, **env: str) -> subprocess.CompletedProcess:
    return cli.run(*args, **env)  # each of these ends before a model runs: in this process (tests/support/cli.py)


@pytest.mark.parametrize("make", [
    lambda whole: whole[:1_000_000],  # cut in the tensor table: struct.error deep in transformers' reader
    # the other damages take the same path (13 s each: two commands loading torch): `make test-slow`
    pytest.param(lambda whole: whole[:40], marks=pytest.mark.slow),  # cut in the header
    pytest.param(lambda whole: b"GGUF" + b"\xff" * 60, marks=pytest.mark.slow),  # the magic, then nonsense
])
def test_a_damaged_gguf_is_one_error_naming_the_file_and_leaves_nothing_converted(tmp_path, make):
    from kvwire import models

    broken = tmp_path / "cut.gguf"
    broken.write_bytes(make(models.default_gguf().read_bytes()))
    home = tmp_path / "home"
    proc = kvwire("size", "--model", str(broken), "--tokens", "1", KVWIRE_HOME=str(home))
    assert_one_error_line(proc, f"cannot convert {broken}: it is truncated, damaged or not a GGUF model")
    assert not any((home / "models").iterdir())  # no folder, hidden or not, that a later run could take
    again = kvwire("size", "--model", str(broken), "--tokens", "1", KVWIRE_HOME=str(home))
    assert_one_error_line(again, "it is truncated")  # refused again, not taken as converted


def _fake_gguf_reader(monkeypatch, folder: Path) -> None:
    """transformers' GGUF readers answer with the tiny model saved in ``folder`` (a real conversion takes ~20 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvwire.hf import loading

    class Tokenizer:
        from_pretrained = staticmethod(lambda *a, **k: AutoTokenizer.from_pretrained(folder))

    class Model:
        from_pretrained = staticmethod(lambda *a, **k: AutoModelForCausalLM.from_pretrained(folder))

    monkeypatch.setattr(loading, "AutoTokenizer", Tokenizer)
    monkeypatch.setattr(loading, "AutoModelForCausalLM", Model)


def test_a_conversion_that_cannot_be_written_blames_the_destination_not_the_file(tmp_path, tiny_folder, monkeypatch):
    """A folder in the way was 'it is truncated, damaged or not a GGUF model' about a good file; kvwire's own
    cache replaces a leftover folder without config.json, which no run takes as converted."""
    from kvwire import ModelError, hf, models

    _fake_gguf_reader(monkeypatch, tiny_folder)
    gguf = tmp_path / "good.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    out = tmp_path / "out" / "good"
    (out / "half").mkdir(parents=True)
    with pytest.raises(ModelError, match=r"cannot write the conversion of good\.gguf to .*: a folder without "
                                         r"config\.json is already there \(remove .* and run again\)"):
        hf.convert_gguf(gguf, out, progress_bars=False)
    assert sorted(p.name for p in out.parent.iterdir()) == ["good"]  # the hidden .tmp folder is gone
    shutil.rmtree(out)

    def refuse(*args, **kwargs):
        raise RuntimeError("The weights trying to be saved contained shared tensors")

    with monkeypatch.context() as patch:  # transformers read the model but will not save it: no traceback either
        patch.setattr("transformers.PreTrainedModel.save_pretrained", refuse)
        with pytest.raises(ModelError, match=r"cannot save the model read from good\.gguf as safetensors: The "):
            hf.convert_gguf(gguf, out, progress_bars=False)
    assert list(out.parent.iterdir()) == []

    monkeypatch.setenv("KVWIRE_HOME", str(tmp_path / "home"))
    target = models.converted_folder(gguf, "good")
    (target / "half").mkdir(parents=True)
    assert models.resolve(gguf) == target and (target / "config.json").is_file()
    assert not (target / "half").exists()


def test_an_empty_model_or_a_folder_without_weights_is_one_line(tmp_path, tiny_folder):
    assert_one_error_line(kvwire("run", EXAMPLE, "--model", ""), "the model is empty", "--model")
    config_only = tmp_path / "cfgonly"
    config_only.mkdir()
    shutil.copy(tiny_folder / "config.json", config_only)
    assert_one_error_line(kvwire("run", EXAMPLE, "--model", str(config_only)),
                          f"{config_only} has a config.json but no weights (*.safetensors)")


@pytest.mark.parametrize("config, fragment, command", [
    ("{not json", "is not a valid JSON file", "size"),
    ("{}", "Should have a `model_type` key", "run"),
    ('{"model_type": "llama", "num_attention_heads": 0}', "division", "check"),  # was a ZeroDivisionError traceback
    ('{"model_type": "llama", "hidden_size": "big"}', "'hidden_size'", "run"),  # was a StrictDataclass traceback
])
def test_a_damaged_config_is_one_line_naming_the_folder(tmp_path, tiny_folder, config, fragment, command):
    """Every command reads a config through one function (``hf.read_config``): each damage is tried through one of
    the commands that read one, and every command meets at least one damage (a subprocess each: ~3 s)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)  # weights and tokenizer there: the config is what is wrong
    (folder / "config.json").write_text(config)
    args = {"size": ("size", "--tokens", "1", "--model", str(folder)), "run": ("run", EXAMPLE, "--model", str(folder)),
            "check": ("check", str(folder), str(tiny_folder))}[command]
    proc = kvwire(*args)
    assert_one_error_line(proc, f"cannot read the model config in {folder}: ", fragment, "check its config.json")
    assert len(proc.stderr) < 600, proc.stderr  # transformers' own message lists every model type it knows


def test_a_cache_folder_that_is_or_lies_in_a_file_names_its_variable(tmp_path):
    """KVWIRE_HOME=FILE/sub or XDG_CACHE_HOME=FILE was "[Errno 20] Not a directory: .../models"."""
    file = tmp_path / "file"
    file.write_text("x")
    cases = [({"KVWIRE_HOME": str(file / "sub")}, f"KVWIRE_HOME='{file / 'sub'}' is not a folder: {file} is a file"),
             ({"KVWIRE_HOME": "", "XDG_CACHE_HOME": str(file)}, f"XDG_CACHE_HOME='{file}' is not a folder")]
    for env, message in cases:
        for args in (("size", "--tokens", "1"), ("run", EXAMPLE)):
            proc = kvwire(*args, **env)
            assert_one_error_line(proc, message)
            assert "Errno" not in proc.stderr


@pytest.fixture
def unloadable(tmp_path, tiny_folder) -> Path:
    """A complete-looking model folder whose weights are cut: loading it fails, checking before it does not."""
    folder = tmp_path / "unloadable"
    shutil.copytree(tiny_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    return folder


def test_environment_variables_are_checked_before_the_model_loads(unloadable):
    """KVWIRE_LINEARS and KVWIRE_STEP were read after the weights had loaded; KVWIRE_WEIGHTS was blamed on
    --weights, an option never typed."""
    assert_one_error_line(kvwire("run", EXAMPLE, "--model", str(unloadable)), "cannot load the model")  # the fixture
    for variable, value, message in (("KVWIRE_LINEARS", "bogus", "KVWIRE_LINEARS='bogus' is not a way"),
                                     ("KVWIRE_STEP", "maybe", "KVWIRE_STEP='maybe' is neither on nor off"),
                                     ("KVWIRE_ENCODING", "int9", "KVWIRE_ENCODING='int9' in the environment")):
        proc = kvwire("run", EXAMPLE, "--model", str(unloadable), **{variable: value})
        assert_one_error_line(proc, message)
        assert "cannot load the model" not in proc.stderr
    proc = kvwire("run", EXAMPLE, "--model", str(unloadable), KVWIRE_WEIGHTS="int3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "KVWIRE_WEIGHTS='int3' in the environment is not one of fp32, bf16, int8, int4" in proc.stderr
    typed = kvwire("run", EXAMPLE, "--weights", "int3")
    assert typed.returncode == 2 and "'int3' is not one of" in typed.stderr and "KVWIRE_WEIGHTS" not in typed.stderr


def test_an_output_path_inside_a_file_is_a_usage_error_before_anything_runs(tmp_path):
    """fuser-data FILE/sub was "[Errno 20] Not a directory"; run --timeline FILE/x.png "[Errno 17] File exists"
    after the whole run; train-fuser --out FILE "cannot write a checkpoint ... File exists"."""
    file = tmp_path / "notes.txt"
    file.write_text("x")
    inside = str(file / "sub")
    for args, option in ((("fuser-data", inside), "OUT_DIR"),
                         (("run", EXAMPLE, "--timeline", inside + ".png"), "--timeline"),
                         (("plot", str(ROOT / "benchmarks" / "results" / "splice-stdlib.json"), "--out",
                           inside + ".png"), "--out"),
                         (("train-fuser", "--sharer", "x", "--out", inside), "--out"),
                         (("train-fuser", "--sharer", "x", "--sharer-cache", inside), "--sharer-cache"),
                         (("fit-ridge", "--sharer", "x", "--out", inside), "--out")):
        proc = kvwire(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and "Errno" not in proc.stderr, proc.stderr
        assert f"Invalid value for '{option}'" in proc.stderr and f"is inside '{file}', a file" in proc.stderr, args
    for args in (("train-fuser", "--sharer", "x", "--out", str(file)),
                 ("fit-ridge", "--sharer", "x", "--out", str(file))):
        proc = kvwire(*args)
        assert proc.returncode == 2 and "is a file" in proc.stderr and "Errno" not in proc.stderr, proc.stderr


def test_an_os_error_reaching_the_command_line_names_the_path_without_errno():
    from kvwire.cli import describe_os_error

    said = describe_os_error(NotADirectoryError(20, "Not a directory", "/x/notes.txt/out"))
    assert said.startswith("/x/notes.txt/out: Not a directory (check the path") and "Errno" not in said
    assert describe_os_error(OSError(17, "File exists", "/a", None, "/b")).startswith("/a -> /b: File exists")
    assert describe_os_error(OSError("no path here")) == "no path here"


def test_a_device_torch_cannot_use_is_one_line_before_the_model_loads(unloadable):
    """--device (or KVWIRE_DEVICE) is checked before any weights load (each case: tests/hf/test_devices.py)."""
    import torch

    unseen = ("cuda:99", "torch sees") if torch.cuda.is_available() else ("cuda", "no cuda device here")
    for command, (device, message) in ((("run", EXAMPLE), ("bogus", "unknown device 'bogus'")),
                                       (("run", EXAMPLE), unseen),
                                       (("serve", "--port", "0"), ("meta", "the meta device holds no weights"))):
        proc = kvwire(*command, "--model", str(unloadable), "--device", device)
        assert_one_error_line(proc, message)
        assert "cannot load the model" not in proc.stderr, (command, device)
    proc = kvwire("run", EXAMPLE, "--model", str(unloadable), KVWIRE_DEVICE="bogus")
    assert_one_error_line(proc, "unknown device 'bogus'")
