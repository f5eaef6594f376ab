"""The one place that touches transformers: loading, cache <-> packet, generation.

Split by idea -- :mod:`.loading` (models, specs), :mod:`.rotary` (RoPE tables, checked
on the model itself), :mod:`.cache` (extract, build, append, recompute,
attention probe),
:mod:`.generation` (timed generation, teacher-forced logits), :mod:`.engine` (the
batched-decode engine: rows join and leave between steps) and :mod:`.attention` (its
shared-prefix attention and per-row cache) -- and re-exported here, so callers write
``hf.extract``.
If transformers changes, this package changes; nothing else does.
"""

from .cache import (append, append_placeholders, attention_to_cache, build_cache, cache_length, clone_cache,
                    decoder_layers, extract, layer_kv, new_cache, recompute)
from .engine import Engine, Prefix, Request, RowResult, Step, generate_batch
from .generation import Generation, Sampling, forward_logits, generate
from .loading import config_spec, convert_gguf, eos_token_ids, load_model, model_spec, spec_from_pretrained
from .rotary import RopeProbe, probe_rope, rope_tables

__all__ = [
    "Engine", "Generation", "Prefix", "Request", "RopeProbe", "RowResult", "Sampling", "Step", "append",
    "append_placeholders", "attention_to_cache", "build_cache", "cache_length", "clone_cache", "config_spec",
    "convert_gguf", "decoder_layers", "eos_token_ids", "extract", "forward_logits", "generate", "generate_batch",
    "layer_kv", "load_model", "model_spec", "new_cache", "probe_rope", "recompute", "rope_tables",
    "spec_from_pretrained",
]
