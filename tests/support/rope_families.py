"""Tiny random models of every RoPE family transformers ships, built from its own registry.

:func:`families` lists the causal-LM model types of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose (text) config carries RoPE parameters
(``rope_parameters``, or ``rotary_dim`` for GPT-J-style models that rotate inside
attention). :func:`build` makes one with every size field the config knows shrunk to
a few KB of weights, or returns why it cannot (:class:`Skipped`). Used by
``tests/hf/test_rope_families.py``; ``python -m tests.support.rope_families`` prints the table.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import CONFIG_MAPPING, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

MAX_PARAMETERS = 5_000_000  # a tiny model; anything larger means a size field was not shrunk

# Size fields, by their name in any config (or in its attribute_map); absent ones are ignored.
SHRINK: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rotary_dim=8, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32, first_k_dense_replace=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    vocab_size_per_layer_input=320, hidden_size_per_layer_input=8, ffn_dim=64, num_layers=2, audio_vocab_size=32,
    ngram_vocab_size_base=320, expert_ffn_hidden_size=32, ffn_hidden_size=64, n_group=1, topk_group=1,
)

# The fast subset in the default suite: one of each convention and of each way the tables are found.
FAST = ("llama", "qwen2", "gpt_neox", "gemma3_text", "cohere", "glm", "gptj")


@dataclass(frozen=True)
class Skipped:
    """A family that cannot be probed here, and why."""

    model_type: str
    reason: str


def families() -> list[str]:
    """Model types of causal LMs whose config has RoPE parameters."""
    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config that cannot even default-construct is listed, then skipped
            out.append(model_type)
            continue
        text = config.get_text_config(decoder=True)
        if getattr(text, "rope_parameters", None) or getattr(text, "rotary_dim", None):
            out.append(model_type)
    return out


def tiny_config(model_type: str) -> Any:
    cls = CONFIG_MAPPING[model_type]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    aliases = getattr(cls, "attribute_map", {})
    kwargs = {}
    for name, value in SHRINK.items():
        if name in fields:
            kwargs[name] = value
        elif name in aliases and aliases[name] in fields:
            kwargs[aliases[name]] = value
    return cls(**kwargs)


def build(model_type: str, seed: int = 0) -> torch.nn.Module | Skipped:
    """A tiny random fp32 model of ``model_type`` in eval mode, or why not."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(model_type)
        except Exception as err:  # noqa: BLE001 - the reason is the result
            return Skipped(model_type, f"no tiny config: {type(err).__name__}: {_first_line(err)}")
        try:
            with torch.device("meta"):
                shape_only = AutoModelForCausalLM.from_config(config)
        except Exception as err:  # noqa: BLE001
            return Skipped(model_type, f"does not build: {type(err).__name__}: {_first_line(err)}")
        count = sum(p.numel() for p in shape_only.parameters())
        if count > MAX_PARAMETERS:
            return Skipped(model_type, f"{count:,} parameters once shrunk (a multimodal or size field this "
                                       "generic builder does not know)")
        torch.manual_seed(seed)
        try:
            return AutoModelForCausalLM.from_config(config).eval()
        except Exception as err:  # noqa: BLE001
            return Skipped(model_type, f"does not build: {type(err).__name__}: {_first_line(err)}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0][:160]


if __name__ == "__main__":  # python -m tests.support.rope_families: the family table the slow test checks
    from kvwire import KvwireError, hf

    for name in families():
        model = build(name)
        if isinstance(model, Skipped):
            print(f"{name:28} skipped  {model.reason}")
            continue
        try:
            probe = hf.probe_rope(model)
        except KvwireError as err:  # anything else is a kvwire bug: let it raise
            print(f"{name:28} refused  {type(err).__name__}: {err.message[:150]}")
            continue
        if probe.tables:
            print(f"{name:28} ok       {'/'.join(sorted(set(probe.conventions))):12} "
                  f"{max(t.probe_error or 0 for t in probe.tables):.1e}  {probe.source}")
        else:
            worst = {c: f"{max(e):.2g}" for c, e in probe.errors.items()}
            print(f"{name:28} refused  {worst} {probe.source}")
