"""What a model folder is, read from its config and tokenizer without loading weights (transformers side).

Used by ``kvwire check`` to put two models side by side. The cache spec comes from
:func:`kvwire.hf.config_spec` (so it agrees with every other spec kvwire makes); the
rest are the config fields that decide whether two models' caches could line up.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # kvwire never contacts a model hub

from .loading import config_spec, read_config  # noqa: E402


def config_facts(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Architecture facts of the model folder at ``path`` (config.json only, no weights).

    Keys: ``spec`` (a :class:`~kvwire.wire.spec.ModelSpec` without fingerprint), ``hidden_size``,
    ``num_attention_heads``, ``rope_type``, ``rope_theta`` (None where RoPE is per layer
    type), ``max_position_embeddings``, ``tie_word_embeddings``, ``dtype`` (of the weights on disk).
    """
    config = read_config(path)
    text = config.get_text_config(decoder=True)
    rope = getattr(text, "rope_parameters", None) or {}
    flat = "rope_type" in rope or "rope_theta" in rope
    return {
        "spec": config_spec(config),
        "hidden_size": int(text.hidden_size),
        "num_attention_heads": int(text.num_attention_heads),
        "rope_type": str(rope.get("rope_type", "default")) if flat else "per layer type",
        "rope_theta": float(rope["rope_theta"]) if flat and rope.get("rope_theta") is not None else None,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "dtype": str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "unknown"),
    }
