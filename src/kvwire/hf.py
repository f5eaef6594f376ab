"""The one module that touches transformers: load, read a spec, extract, inject, generate.

Everything here uses transformers' public cache surface only: ``DynamicCache(config=...)``,
``cache.update(k, v, layer_idx)``, ``cache.layers[i].keys / .values`` (shape
``[B, H_kv, T, D]``, the packet layout, so nothing is transposed) and, for
sliding-window layers, ``cumulative_length``. If transformers changes, this file
changes; nothing else does.

Facts this module handles (see DESIGN.md):

- ``forward`` with a cache must get at least one uncached token: the logits of the
  last context token are what generation starts from.
- Forward passes grow a ``DynamicCache`` in place (by ``torch.cat``; existing tensors
  are never written), so a cache built from a packet belongs to one generation.
- A sliding-window layer keeps only ``sliding_window - 1`` tokens; its true length
  (``cumulative_length``) must be set, or positions and masks go wrong.
- End-of-sequence ids come from ``model.generation_config``, not the tokenizer.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # kvwire never contacts a model hub

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from .errors import ModelError, PacketError  # noqa: E402
from .packet import Packet  # noqa: E402
from .spec import DTYPES, ModelSpec, dtype_name, fingerprint  # noqa: E402

log = logging.getLogger(__name__)

_SUPPORTED_LAYERS = {DynamicLayer: "full_attention", DynamicSlidingWindowLayer: "sliding_attention"}


# -- models ----------------------------------------------------------------------------------------


def load_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load a local HF model folder (never a hub id) as ``(model, tokenizer)`` in eval mode."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"no model folder at {path} (config.json missing)",
                         "pass a local HF model folder or a .gguf file")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a local load takes ~1 s; its bar is noise
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load the model at {path}: {err}", "check that the folder is complete") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tokenizer


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file to a safetensors model folder (fp32) at ``out_dir``.

    Slow (transformers dequantizes every tensor; ~20 s for the default model) and done
    once; the folder is written under a temporary name and renamed into place.
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ModelError(f"no GGUF file at {gguf_file}", "check the path")
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    try:
        log.info("converting %s to %s (one time)", gguf_file, out_dir)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32, local_files_only=True)
        # transformers refuses to save a GGUF-loaded model while it still looks quantized
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # not a concurrent conversion that won
                raise
    except (OSError, ValueError, RuntimeError) as err:
        raise ModelError(f"cannot convert {gguf_file}: {err}", "check the file is a complete GGUF model") from None
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def config_spec(config: Any, dtype: torch.dtype = torch.float32) -> ModelSpec:
    """The cache spec a model with this HF config has, without weights (fingerprint ``""``).

    Layer kinds come from the layers ``DynamicCache(config=...)`` builds, so they follow
    transformers' own rules (``layer_types``, ``sliding_window``).
    """
    text_config = config.get_text_config(decoder=True)
    layers = DynamicCache(config=config).layers
    kinds = []
    windows = set()
    for index, layer in enumerate(layers):
        kind = _SUPPORTED_LAYERS.get(type(layer))
        if kind is None:
            raise ModelError(f"{text_config.model_type} models use {type(layer).__name__} cache layers "
                             f"(layer {index})", "kvwire supports full and sliding-window attention caches")
        kinds.append(kind)
        if kind == "sliding_attention":
            windows.add(layer.sliding_window)
    if len(windows) > 1:
        raise ModelError(f"{text_config.model_type} mixes sliding windows {sorted(windows)}")
    if dtype_name(dtype) not in DTYPES:
        raise ModelError(f"model dtype {dtype_name(dtype)} is not supported", f"load it as one of {sorted(DTYPES)}")
    num_heads = text_config.num_attention_heads
    return ModelSpec(
        architecture=(getattr(config, "architectures", None) or [text_config.model_type])[0],
        model_type=text_config.model_type,
        num_layers=len(layers),
        num_kv_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads,
        dtype=dtype_name(dtype),
        vocab_size=text_config.vocab_size,
        layer_kinds=tuple(kinds),
        sliding_window=windows.pop() if windows else None,
        rope=_jsonable(getattr(text_config, "rope_parameters", None) or {}),
    )


def spec_from_pretrained(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> ModelSpec:
    """The cache spec of a local model folder, read from its config alone (no weights loaded)."""
    try:
        config = AutoConfig.from_pretrained(Path(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read the model config in {path}: {err}") from None
    return config_spec(config, dtype)


def model_spec(model: Any) -> ModelSpec:
    """A loaded model's cache spec, with its weights' fingerprint (~70 ms per 135M parameters)."""
    spec = config_spec(model.config, next(model.parameters()).dtype)
    fields = {k: v for k, v in spec.to_json().items() if k != "fingerprint"}
    return replace(spec, fingerprint=fingerprint(fields, model.named_parameters()))


def eos_token_ids(model: Any) -> frozenset[int]:
    """End-of-sequence ids from the generation config (a GGUF tokenizer's eos can be wrong)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


# -- cache <-> packet ------------------------------------------------------------------------------


def new_cache(model: Any) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def extract(cache: DynamicCache, spec: ModelSpec, token_ids: torch.Tensor, *, parent: Packet | None = None,
            **provenance: Any) -> Packet:
    """A packet of the tokens ``cache`` holds beyond ``parent`` (all of them if no parent).

    ``token_ids`` [B, N] are the ids the cache covers (``N == cache length``). The
    packet's tensors are views of the cache's (transformers never writes them in place);
    the codec copies them when encoding.
    """
    n = cache_length(cache)
    if token_ids.dim() != 2 or token_ids.shape[1] != n:
        raise PacketError(f"token_ids must be [B, {n}] (the cache length), got {list(token_ids.shape)}")
    start = parent.end if parent is not None else 0
    if parent is not None and (parent.length > n or not torch.equal(parent.token_ids, token_ids[:, start - parent.length:start])):
        raise PacketError(f"the cache does not extend its parent packet {parent.id[:12]}: the token ids differ")
    if len(cache.layers) != spec.num_layers:
        raise PacketError(f"cache has {len(cache.layers)} layers, the spec {spec.num_layers}")
    segment = n - start
    keys, values = [], []
    for index, layer in enumerate(cache.layers):
        kept = spec.kept_tokens(index, segment)
        stored = int(layer.keys.shape[-2])
        if kept > stored:
            raise PacketError(f"layer {index} holds {stored} tokens, {kept} needed for the segment")
        # [B, H, stored, D] -> the last `kept` tokens: [B, H, kept, D]
        keys.append(layer.keys[:, :, stored - kept : stored, :])
        values.append(layer.values[:, :, stored - kept : stored, :])
    token_ids = token_ids[:, start:].to(torch.int64)
    return Packet(
        spec=spec,
        keys=tuple(keys),
        values=tuple(values),
        token_ids=token_ids,
        mask=torch.ones_like(token_ids, dtype=torch.uint8),
        start=start,
        parent=parent.id if parent is not None else None,
        parent_checksum=parent.checksum if parent is not None else None,
        **provenance,
    ).validate()


def build_cache(packet: Packet, model: Any, spec: ModelSpec | None = None) -> DynamicCache:
    """A fresh ``DynamicCache`` holding ``packet`` as the model's context prefix.

    The packet must start at position 0, be made by this model (``spec``, computed if
    not given), and carry no padding. The result is the caller's to grow.
    """
    spec = spec or model_spec(model)
    packet.validate()
    spec.check_same_model(packet.spec)
    if packet.start != 0:
        raise PacketError(f"packet starts at position {packet.start}; a prefix cache must start at 0",
                          "assemble the whole chain first (kvwire.chain.receive)")
    if bool((packet.mask == 0).any()):
        raise PacketError("packet has padding; prefix injection supports unpadded packets only")
    cache = new_cache(model)
    for index, layer in enumerate(cache.layers):
        cache.update(packet.keys[index], packet.values[index], index)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = packet.end  # the layer holds only the window; record the true length
    if cache_length(cache) != packet.end:
        raise PacketError(f"built cache has length {cache_length(cache)}, packet ends at {packet.end}")
    return cache


# -- generation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` is greedy (the default)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generation:
    """What :func:`generate` returns. Times are seconds, measured with ``perf_counter``."""

    tokens: list[int]  # new tokens, including a final eos if one was produced
    first_logits: torch.Tensor  # fp32 [V]: the distribution the first token was chosen from
    prefill_s: float  # forward over the uncached context tokens, up to the first token
    decode_s: float  # the remaining tokens
    prefilled: int  # context tokens computed here (not served from a cache)
    stopped_by_eos: bool
    cache: DynamicCache | None = field(repr=False, default=None)  # covers context + tokens[:-1]


@torch.inference_mode()
def generate(model: Any, input_ids: torch.Tensor | Sequence[int], *, cache: DynamicCache | None = None,
             max_new_tokens: int = 32, eos_ids: frozenset[int] | None = None,
             sampling: Sampling | None = None, use_cache: bool = True) -> Generation:
    """Continue ``input_ids`` ([1, N] or a list) from ``cache`` (covering its first tokens).

    ``use_cache=False`` is the reference: every step recomputes the whole sequence
    with no cache at all (slow; for checking exactness).
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {list(ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    eos_ids = eos_token_ids(model) if eos_ids is None else eos_ids
    sampling = sampling or Sampling()
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cached = cache_length(cache)
    if cached >= ids.shape[1]:
        raise PacketError(f"the cache covers {cached} tokens but the context has {ids.shape[1]}",
                          "leave at least one context token uncached")
    if not use_cache:
        if cache is not None:
            raise ValueError("use_cache=False recomputes from scratch; do not pass a cache")
        return _generate_uncached(model, ids, max_new_tokens, eos_ids, sampling, generator)
    cache = cache if cache is not None else new_cache(model)

    start = time.perf_counter()
    out = model(input_ids=ids[:, cached:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    first_logits = out.logits[0, -1].float()
    token = _pick(first_logits, sampling, generator)
    prefill_s = time.perf_counter() - start
    tokens = [token]
    start = time.perf_counter()
    while token not in eos_ids and len(tokens) < max_new_tokens:
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        token = _pick(out.logits[0, -1].float(), sampling, generator)
        tokens.append(token)
    decode_s = time.perf_counter() - start
    return Generation(tokens, first_logits.cpu(), prefill_s, decode_s, ids.shape[1] - cached,
                      tokens[-1] in eos_ids, cache)


def _generate_uncached(model: Any, ids: torch.Tensor, max_new_tokens: int, eos_ids: frozenset[int],
                       sampling: Sampling, generator: torch.Generator | None) -> Generation:
    start = time.perf_counter()
    tokens: list[int] = []
    first_logits = None
    prefill_s = 0.0
    while not tokens or (tokens[-1] not in eos_ids and len(tokens) < max_new_tokens):
        seq = torch.cat([ids, torch.tensor([tokens], dtype=torch.long)], dim=1) if tokens else ids
        logits = model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        if first_logits is None:
            first_logits, prefill_s = logits, time.perf_counter() - start
        tokens.append(_pick(logits, sampling, generator))
    return Generation(tokens, first_logits.cpu(), prefill_s, time.perf_counter() - start - prefill_s,
                      ids.shape[1], tokens[-1] in eos_ids, None)


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1).cpu()
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
