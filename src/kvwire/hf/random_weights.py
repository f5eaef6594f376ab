"""A model made from its config alone, with seeded random weights: to time a model whose weights are not at hand.

A pass's time depends on the shapes and the kernels, not on the weights' values, so a Llama-2-7B made from its
``config.json`` on a GPU runs what the real one runs. Two things differ, and :func:`random_model` settles both:

- **It never stops.** A random model's end-of-sequence token comes only by chance, so its end-of-sequence ids are
  cleared: every reply runs to its token limit, the same length in every mode.
- **Its vocabulary may be smaller than the tokenizer's.** The text comes from the bundled tokenizer (SmolLM2's
  49,152 ids); Llama-2 has 32,000. Every id must be one the model has (packets check it), so the vocabulary grows
  to the tokenizer's: for Llama-2-7B 17,152 more rows of embedding and head, ~1 % more of a token's products
  (70 M of 6.7 G multiply-adds) and no change to the layers, whose shapes and kernels are the real model's.

Replies of a random model are noise, so only timings, bytes and exactness (mode against mode on the same model)
mean anything.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..errors import ModelError

__all__ = ["DTYPES", "random_model"]

log = logging.getLogger(__name__)

# the names the command lines take, and the torch dtype each loads the model in
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def random_model(config: str | os.PathLike[str], *, dtype: str = "fp32", device: str = "cpu", seed: int = 0,
                 tokenizer_vocab: int | None = None) -> Any:
    """The causal LM that ``config`` (a ``config.json``) describes, with random weights from ``seed``, in ``dtype``
    (a key of :data:`DTYPES`), built on ``device``; its vocabulary at least ``tokenizer_vocab`` ids. ``dtype`` and
    ``device`` are checked, and the config read, before anything is built: one :class:`ModelError` each."""
    from transformers import AutoModelForCausalLM

    from .attention import adopt
    from .devices import check_device
    from .loading import _align, read_config

    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    where = check_device(device)
    if not os.path.isfile(config):
        raise ModelError(f"no config file at {config}", "give a model's config.json (benchmarks/configs/ has some)")
    hf_config = read_config(config)
    hf_config.eos_token_id = None  # a random model stops only by chance: every reply runs to its limit
    if tokenizer_vocab is not None and tokenizer_vocab > hf_config.vocab_size:
        log.info("the vocabulary grows from %d to the tokenizer's %d ids", hf_config.vocab_size, tokenizer_vocab)
        hf_config.vocab_size = tokenizer_vocab
    torch.manual_seed(seed)
    try:
        with torch.device(where):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=DTYPES[dtype])
    except torch.OutOfMemoryError:
        raise ModelError(f"{os.path.basename(config)} in {dtype} does not fit on {where}",
                         "use a smaller config or a narrower dtype") from None
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    adopt(model)
    if where.type == "cpu":
        _align(model)
    return model
