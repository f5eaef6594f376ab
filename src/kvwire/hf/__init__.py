"""The one place that touches transformers: loading, cache <-> packet, generation.

Split by idea -- :mod:`.loading` (models, specs), :mod:`.rotary` (RoPE tables, checked
on the model itself), :mod:`.cache` (extract, build, append, recompute,
attention probe),
:mod:`.generation` (timed generation, teacher-forced logits), :mod:`.step` (a plain decode
step of a Llama or Qwen2 model as its tensor operations), :mod:`.linears` (the fastest
exact fp32 product for each pass's linear layers), :mod:`.engine` (the
batched-decode engine: rows join and leave between steps), :mod:`.attention` (its
shared-prefix attention and per-row cache) and :mod:`.head` (its output layer in
cache-sized slices), :mod:`.training` (forward passes with
autograd, for trainers), :mod:`.tokens` (offsets, exact decoding, chat rendering,
tokenizer identity), :mod:`.describe` (a model folder's facts without its weights),
:mod:`.devices` (where a model may run) and :mod:`.prefill` (read, keep the cache) -- and
re-exported here, so callers write ``hf.extract``.
If transformers changes, this package changes; nothing else does.

The names are imported on first use (``hf.extract`` imports :mod:`.cache`), so ``from kvwire import hf``
and its torch-only modules (:mod:`.weights`, :mod:`.linears`, :mod:`.devices`) do not import
transformers: a command that refuses its options does so before that ~2 s import.
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # kvwire never contacts a model hub, whichever module comes first

# each name, and the module it is imported from on first use
_MODULES: dict[str, tuple[str, ...]] = {
    "cache": ("Filled", "append", "append_placeholders", "attention_to_cache", "build_cache", "cache_length",
              "clone_cache", "decoder_layers", "extract", "fill", "layer_kv", "new_cache", "recompute", "reserved",
              "check_layout", "check_model_layout"),
    "engine": ("Engine", "Prefix", "Request", "RowResult", "Step", "attention_reach", "auto_prefill_chunk",
               "chunk_tokens", "generate_batch"),
    "generation": ("Generation", "Sampling", "forward_logits", "generate"),
    "linears": ("fast_linears",),
    "describe": ("config_facts",),
    "devices": ("check_device",),
    "loading": ("check_fits", "config_spec", "context_window", "convert_gguf", "eos_token_ids", "load_model",
                "model_device", "model_dtype", "model_spec", "spec_from_pretrained"),
    "pass_cost": ("PassCost", "known_pass_cost", "measure_pass_cost"),
    "prefill": ("prefill",),
    "random_weights": ("random_model",),
    "rotary": ("RopeProbe", "probe_rope", "rope_tables"),
    "tokens": ("decode_exact", "default_system_prompt", "encode_with_offsets", "load_tokenizer", "render_chat",
               "special_ids", "tokenizer_info", "whole_characters"),
    "training": ("context_kv", "continuation_logits", "freeze", "lora_state", "sequence_logits", "set_lora_state"),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "Engine", "Filled", "Generation", "PassCost", "Prefix", "Request", "RopeProbe", "RowResult", "Sampling", "Step",
    "append", "append_placeholders", "attention_reach", "attention_to_cache", "auto_prefill_chunk", "build_cache",
    "cache_length", "check_device", "check_fits", "check_layout", "check_model_layout", "chunk_tokens", "clone_cache",
    "config_facts", "config_spec", "context_kv", "context_window", "continuation_logits", "convert_gguf",
    "decode_exact", "decoder_layers", "default_system_prompt", "encode_with_offsets", "eos_token_ids", "extract",
    "fast_linears", "fill", "forward_logits", "freeze", "generate", "generate_batch", "known_pass_cost", "layer_kv",
    "load_model", "load_tokenizer", "lora_state", "measure_pass_cost", "model_device", "model_dtype", "model_spec",
    "new_cache",
    "prefill", "probe_rope", "random_model", "recompute", "render_chat", "reserved", "rope_tables", "sequence_logits",
    "set_lora_state", "spec_from_pretrained", "special_ids", "tokenizer_info", "whole_characters",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        try:  # a submodule (hf.weights, hf.step, ...)
            return import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise  # the submodule exists; something it imports does not
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and editors see: the same names, eagerly
    from .cache import (Filled, append, append_placeholders, attention_to_cache, build_cache, cache_length,
                        clone_cache, decoder_layers, extract, fill, layer_kv, new_cache, recompute, reserved,
                        check_layout, check_model_layout)
    from .engine import (Engine, Prefix, Request, RowResult, Step, attention_reach, auto_prefill_chunk, chunk_tokens,
                         generate_batch)
    from .generation import Generation, Sampling, forward_logits, generate
    from .linears import fast_linears
    from .describe import config_facts
    from .devices import check_device
    from .loading import (check_fits, config_spec, context_window, convert_gguf, eos_token_ids, load_model,
                          model_device, model_dtype, model_spec, spec_from_pretrained)
    from .pass_cost import PassCost, known_pass_cost, measure_pass_cost
    from .prefill import prefill
    from .random_weights import random_model
    from .rotary import RopeProbe, probe_rope, rope_tables
    from .tokens import (decode_exact, default_system_prompt, encode_with_offsets, load_tokenizer, render_chat,
                         special_ids, tokenizer_info, whole_characters)
    from .training import context_kv, continuation_logits, freeze, lora_state, sequence_logits, set_lora_state
