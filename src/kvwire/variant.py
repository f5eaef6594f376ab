"""A fine-tuned variant of a model: a short LoRA fine-tune on Python's standard library source.

DroidSpeak's setting needs two models of one architecture with different weights. This
makes one reproducibly, offline: the running Python's own standard library source is the
corpus (it exists wherever kvwire runs), :mod:`kvwire.hf.lora` trains the adapter, and the
result is kept under ``$KVWIRE_HOME/variants/<name>/`` -- the adapter (safetensors, a few
MB, tied to the base weights' fingerprint) and ``recipe.json`` (what was trained, on what,
and how long it took). The variant is rebuilt from the base on load (merge, ~1 s); no
weights are ever written to the repository::

    python -m kvwire.variant [--steps 60] [--name stdlib-lora]     # or: make variant
    variant, tokenizer = variant.load()                             # base + adapter, merged

The corpus: ``.py`` files directly in the stdlib folder, sorted by name, skipping private
and test modules; every fourth file is held out (:func:`held_out_files`) so evaluations can
use source the variant was not trained on. Each training file contributes its first
``seq_len``-token windows (at most ``windows_per_file``), to spread the fine-tune over
many modules.

It finds its base through :mod:`kvwire.models` and trains it through :mod:`kvwire.hf`, so it sits
above both (it was ``kvwire.hf.variant``, which still imports, and runs with ``python -m``,
with a warning).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import blake3
import torch

from . import models
from .errors import ModelError, TrainingError
from .hf import lora
from .hf.loading import load_model, model_spec

log = logging.getLogger(__name__)

DEFAULT_NAME = "stdlib-lora"


@dataclass(frozen=True)
class VariantRecipe:
    """Everything that determines the variant (written to ``recipe.json``)."""

    base: str = models.DEFAULT_MODEL  # a model name models.resolve() knows
    steps: int = 60
    batch_size: int = 4
    seq_len: int = 256
    windows_per_file: int = 2
    lr: float = 1e-3
    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    seed: int = 0

    def lora(self) -> lora.LoraSettings:
        return lora.LoraSettings(rank=self.rank, alpha=self.alpha, target_modules=self.target_modules)

    def train(self) -> lora.TrainSettings:
        return lora.TrainSettings(steps=self.steps, lr=self.lr, batch_size=self.batch_size,
                                  warmup_steps=min(10, self.steps), seed=self.seed)


@dataclass
class VariantInfo:
    """What was made: where, from which base, on what corpus, how training went."""

    name: str
    folder: str
    base_fingerprint: str
    recipe: dict[str, Any]
    corpus: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    trainable_parameters: int = 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> list[Path]:
    """The stdlib's top-level public modules, sorted by name (deterministic for a Python version)."""
    return sorted(p for p in stdlib_dir().glob("*.py")
                  if not p.name.startswith(("_", "test")) and p.name != "this.py")


def training_files() -> list[Path]:
    return [p for i, p in enumerate(corpus_files()) if i % 4 != 0]


def held_out_files() -> list[Path]:
    """Every fourth module: never trained on, for evaluating the variant on unseen source."""
    return [p for i, p in enumerate(corpus_files()) if i % 4 == 0]


def build_examples(tokenizer: Any, recipe: VariantRecipe) -> tuple[list[lora.Example], dict[str, Any]]:
    """Language-modelling examples from the training files, and a description of the corpus."""
    hasher = blake3.blake3()
    examples = []
    files = training_files()
    for path in files:
        # enough characters for the windows used (code averages 3-4 characters per token)
        text = path.read_text(encoding="utf-8", errors="replace")[: 8 * recipe.seq_len * recipe.windows_per_file]
        hasher.update(path.name.encode() + b"\0" + text.encode())
        ids = tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, min(len(ids), recipe.seq_len * recipe.windows_per_file) - recipe.seq_len + 1,
                           recipe.seq_len):
            examples.append(lora.Example.lm(ids[start:start + recipe.seq_len]))
    if not examples:
        raise TrainingError(f"no training text found under {stdlib_dir()}")
    corpus = {"source": str(stdlib_dir()), "python": sys.version.split()[0], "files": len(files),
              "examples": len(examples), "tokens": len(examples) * recipe.seq_len,
              "fingerprint": hasher.hexdigest()[:16]}
    return examples, corpus


def folder(name: str = DEFAULT_NAME) -> Path:
    return models.home() / "variants" / name


def make(recipe: VariantRecipe | None = None, name: str = DEFAULT_NAME,
         on_step: Any = None) -> VariantInfo:
    """Train the variant (minutes on 2 cores) and save its adapter and recipe under :func:`folder`."""
    recipe = recipe or VariantRecipe()
    base, tokenizer = load_model(models.resolve(recipe.base))
    examples, corpus = build_examples(tokenizer, recipe)
    fingerprint = model_spec(base).fingerprint
    log.info("training variant %s: %d examples, %d steps", name, len(examples), recipe.steps)
    trained, result = lora.train(base, examples, recipe.lora(), recipe.train(), on_step=on_step)
    target = folder(name)
    target.mkdir(parents=True, exist_ok=True)
    lora.save_adapter(trained, target / "adapter.safetensors")
    info = VariantInfo(name=name, folder=str(target), base_fingerprint=fingerprint,
                       recipe={**asdict(recipe), "target_modules": list(recipe.target_modules)}, corpus=corpus,
                       losses=result.losses, seconds=result.seconds,
                       trainable_parameters=result.trainable_parameters)
    (target / "recipe.json").write_text(json.dumps(asdict(info), indent=1) + "\n")
    return info


def load(name: str = DEFAULT_NAME, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The variant as a plain model (base weights + merged adapter) and its tokenizer."""
    target = folder(name)
    recipe_file = target / "recipe.json"
    if not recipe_file.is_file():
        raise ModelError(f"no variant {name!r} at {target}",
                         "make it first: python -m kvwire.variant (make variant)")
    info = json.loads(recipe_file.read_text())
    base, tokenizer = load_model(models.resolve(info["recipe"]["base"]), dtype)
    return lora.merge(lora.load_adapter(base, target / "adapter.safetensors")), tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwire.variant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default=DEFAULT_NAME)
    parser.add_argument("--steps", type=int, default=VariantRecipe.steps)
    parser.add_argument("--base", default=VariantRecipe.base)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    start = time.perf_counter()

    def progress(step: int, loss: float, result: lora.TrainResult) -> None:
        if step % 10 == 0 or step + 1 == args.steps:
            rate = result.tokens / max(result.seconds, 1e-9)
            eta = (args.steps - step - 1) * result.seconds / (step + 1)
            print(f"step {step + 1}/{args.steps}  loss {loss:.3f}  {rate:.0f} tok/s  eta {eta:.0f}s", flush=True)

    try:
        info = make(VariantRecipe(base=args.base, steps=args.steps), args.name, on_step=progress)
    except (ModelError, TrainingError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"variant {info.name}: {info.folder} (loss {info.losses[0]:.3f} -> {info.losses[-1]:.3f}, "
          f"{time.perf_counter() - start:.0f} s)")
    print(json.dumps({"name": info.name, "folder": info.folder, "first_loss": info.losses[0],
                      "last_loss": info.losses[-1], "seconds": info.seconds, "corpus": info.corpus}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
