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
tokenizer identity), :mod:`.describe` (a model folder's facts without its weights) and
:mod:`.prefill` (read, keep the cache) -- and re-exported here, so callers write
``hf.extract``.
If transformers changes, this package changes; nothing else does.
"""

from .cache import (append, append_placeholders, attention_to_cache, build_cache, cache_length, clone_cache,
                    decoder_layers, extract, layer_kv, new_cache, recompute, reserved, check_layout,
                    check_model_layout)
from .engine import Engine, Prefix, Request, RowResult, Step, attention_reach, chunk_tokens, generate_batch
from .generation import Generation, Sampling, forward_logits, generate
from .linears import fast_linears
from .describe import config_facts
from .loading import (check_device, check_fits, config_spec, context_window, convert_gguf, eos_token_ids, load_model,
                      model_device, model_spec, spec_from_pretrained)
from .prefill import prefill
from .rotary import RopeProbe, probe_rope, rope_tables
from .tokens import (decode_exact, default_system_prompt, encode_with_offsets, load_tokenizer, render_chat, special_ids,
                     tokenizer_info, whole_characters)
from .training import context_kv, continuation_logits, freeze, lora_state, sequence_logits, set_lora_state

__all__ = [
    "Engine", "Generation", "attention_reach", "check_device", "check_fits", "chunk_tokens", "context_window",
    "Prefix", "Request", "RopeProbe", "RowResult", "Sampling",
    "Step", "append", "append_placeholders", "attention_to_cache", "build_cache", "cache_length", "check_layout",
    "check_model_layout", "clone_cache",
    "config_facts", "config_spec",
    "context_kv", "continuation_logits", "convert_gguf", "decode_exact", "decoder_layers", "encode_with_offsets",
    "eos_token_ids", "extract", "fast_linears", "forward_logits", "freeze", "generate", "generate_batch", "layer_kv",
    "load_model", "load_tokenizer", "lora_state", "model_device", "model_spec", "new_cache", "prefill", "probe_rope",
    "reserved",
    "default_system_prompt", "recompute", "render_chat", "rope_tables", "sequence_logits", "set_lora_state",
    "spec_from_pretrained",
    "special_ids", "tokenizer_info", "whole_characters",
]
