"""RoPE tables read from a model and checked on the model itself (transformers side).

Configs cannot be trusted to say how a model rotates its keys: families differ in
which dims form a pair (:data:`kvwire.wire.rope.Convention`), in partial rotary, in
per-layer-type bases, and some apply RoPE inside attention in their own way. So
:func:`rope_tables` builds *candidate* tables -- frequencies from the model's rotary
embedding module (or, for models that rotate inside attention such as GPT-J, from
the config), each in both conventions -- and keeps, per layer, the candidate that
reproduces what the model computes:

    probe  = PROBE_TOKENS tokens run at positions 0.. and again at PROBE_OFFSET..
    error  = |rotate(K_0, 0.. -> PROBE_OFFSET..) - K_offset| / |K_offset|     per layer, every layer

Layer 0's keys depend only on token and position, so its error tests the rotation
alone; deeper layers add the translation invariance that moving a cache relies on.
A model for which no candidate is within :data:`TOLERANCE` of every layer (an
unknown convention, RoPE kvwire cannot reproduce, absolute position embeddings, no
RoPE at all) is refused with an :class:`~kvwire.errors.UnsupportedRopeError` naming
the model and the measured errors. The probe costs two forwards of a few tokens and
runs once per model: results are cached by weight fingerprint and config.

*Compact weights* (``bf16``, ``int8``, ``int4``: :mod:`.weights`) round every linear's input and
output to bf16, so two passes at different positions differ deep in the model by the format's
own noise (~4e-3 relative on the default model), which says nothing about the rotation. The
probe therefore runs under :func:`.weights.exact_products` -- the same weights multiplied in
fp32, the model's own RoPE -- and holds the rotation to the fp32 tolerance; the format's
pass-to-pass difference is measured beside it (two more forwards) and reported as the
format's (:attr:`RopeProbe.format_noise`), never read as a RoPE mismatch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import blake3
import torch

from ..errors import ModelError, UnsupportedRopeError
from ..wire.rope import CONVENTIONS, RopeTable, rotate
from ..wire.spec import ModelSpec
from .cache import check_layout, new_cache
from .loading import model_spec
from .weights import exact_products, format_of

log = logging.getLogger(__name__)

PROBE_TOKENS = 4
PROBE_OFFSET = 61  # far enough that every pair of a real RoPE turns visibly (pair 0 by 61 radians)
# relative error allowed per layer: fp32 re-rotation is ~1e-7 at layer 0 and ~1e-5 deep in a
# model; the wrong convention, or none, gives ~1 (~0.7 with a quarter of the dims rotated).
# Half-precision keys round at ~5e-4 (fp16) and ~4e-3 (bf16) per layer, and deep models add up.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
DEFAULT_ROPE_THETA = 10000.0  # GPT-J / CodeGen / RoFormer: RoPE inside attention, base fixed in code
_CACHE_SIZE = 32


@dataclass(frozen=True)
class RopeProbe:
    """What the probe measured: the checked tables, and every candidate's worst error per layer."""

    model: str
    tables: list[RopeTable]  # one per layer; empty when refused
    errors: dict[str, list[float]]  # convention -> relative error per layer
    source: str  # where the candidate frequencies came from
    tolerance: float
    offset: int = PROBE_OFFSET  # positions the probe moved keys by
    weights: str = "fp32"  # the model's weight format; the rotation is checked with exact fp32 products
    format_noise: list[float] | None = None  # compact formats: the checked tables' error per layer with the
    #                                          format's own products -- its rounding, not the rotation's

    @property
    def conventions(self) -> list[str]:
        return [t.convention for t in self.tables]


_checked: OrderedDict[str, RopeProbe] = OrderedDict()


def rope_tables(model: Any, spec: ModelSpec | None = None) -> list[RopeTable]:
    """Each layer's RoPE table, checked on ``model`` (see the module docstring); raises
    :class:`UnsupportedRopeError` if kvwire cannot re-rotate this model's keys exactly.

    ``spec`` (with its fingerprint, from :func:`kvwire.hf.model_spec`) saves hashing the
    weights again. Example: a Llama-family model -> one ``"half"`` table per layer; a
    Cohere model -> ``"interleaved"`` ones; GPT-2 (no RoPE) -> refused.
    """
    probe = probe_rope(model, spec)
    if not probe.tables:
        raise _refusal(probe)
    return probe.tables


def probe_rope(model: Any, spec: ModelSpec | None = None) -> RopeProbe:
    """Run (or recall) the probe; a refused model gets a :class:`RopeProbe` with no tables."""
    spec = spec if spec is not None and spec.fingerprint else model_spec(model)
    config_json = model.config.to_json_string(use_diff=False)
    key = blake3.blake3(f"{spec.fingerprint}\0{config_json}".encode()).hexdigest()
    if key in _checked:
        _checked.move_to_end(key)
        return _checked[key]
    probe = _run_probe(model, spec)
    _checked[key] = probe
    while len(_checked) > _CACHE_SIZE:
        _checked.popitem(last=False)
    if probe.tables:
        log.info("RoPE of %s: %s convention, probe error %.1e (%s)%s", probe.model,
                 "/".join(sorted(set(probe.conventions))), max(t.probe_error or 0.0 for t in probe.tables),
                 probe.source, "" if probe.format_noise is None else
                 f"; {probe.weights} weights add {max(probe.format_noise):.1e} between two positions (the format's "
                 "rounding, as between a prefill and a decode step)")
    return probe


def _run_probe(model: Any, spec: ModelSpec) -> RopeProbe:
    name = spec.architecture if spec.architecture == spec.model_type else f"{spec.architecture} ({spec.model_type})"
    tolerance = TOLERANCE.get(spec.torch_dtype, 5e-2)
    weights = format_of(model)
    base, source = _candidates(model, spec)
    offset = PROBE_OFFSET
    limits = [t.limit for t in base if t.limit is not None]
    max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    for bound in (*limits, max_positions):
        if isinstance(bound, int) and bound > 0:
            offset = min(offset, bound - PROBE_TOKENS - 1)
    if offset < 1:
        return RopeProbe(name, [], {}, f"{source}; no room for a probe below position {offset + PROBE_TOKENS}",
                         tolerance, weights=weights)
    with exact_products():  # compact weights: the rotation alone, without the format's rounding
        at_0 = _keys_at(model, spec, name, 0)
        at_offset = _keys_at(model, spec, name, offset)
    for layer, keys in enumerate(at_0):  # heads and widths are check_layout's; the tokens a sliding layer keeps:
        if keys.shape[2] != spec.kept_tokens(layer, PROBE_TOKENS):
            raise UnsupportedRopeError(f"{name}: layer {layer} caches {keys.shape[2]} of {PROBE_TOKENS} probe tokens, "
                                       f"not the {spec.kept_tokens(layer, PROBE_TOKENS)} its config implies "
                                       "(attention kvwire does not model)", "use text mode for this model")
    errors: dict[str, list[float]] = {}
    for convention in CONVENTIONS:
        errors[convention] = [_error(k0, k1, replace(table, convention=convention), offset)
                              for k0, k1, table in zip(at_0, at_offset, base)]
    tables = []
    for layer, table in enumerate(base):
        best = min(CONVENTIONS, key=lambda c: errors[c][layer])
        if not errors[best][layer] <= tolerance:  # also refuses nan
            return RopeProbe(name, [], errors, source, tolerance, offset, weights)
        tables.append(replace(table, convention=best, probe_error=errors[best][layer]))
    noise = None
    if weights != "fp32":  # what the format's own rounding adds between two positions: reported, not refused
        noise = [_error(k0, k1, table, offset) for k0, k1, table in
                 zip(_keys_at(model, spec, name, 0), _keys_at(model, spec, name, offset), tables)]
    return RopeProbe(name, tables, errors, source, tolerance, offset, weights, noise)


@torch.inference_mode()
def _keys_at(model: Any, spec: ModelSpec, name: str, start: int) -> list[torch.Tensor]:
    """Every layer's cached keys (fp64 ``[1, H, T_l, D]``) for the probe tokens at positions start.."""
    vocab = max(2, min(spec.vocab_size, 1000))
    ids = torch.randint(1, vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    device = next(model.parameters()).device
    cache = new_cache(model)
    # the body that fills the cache, without the output layer where transformers names one (base_model): the probe
    # reads keys, and under exact_products a compact output layer is dequantized for its logits (a vocabulary of
    # 151,936 rows: 0.6-1 GB of temporaries, once a splicing server's peak RSS); else the logits of one token
    body = getattr(model, "base_model", model)
    run, extra = (body, {}) if body is not model else (model, {"logits_to_keep": 1})
    try:
        run(input_ids=ids.to(device), position_ids=torch.arange(start, start + PROBE_TOKENS, device=device)[None],
            past_key_values=cache, use_cache=True, **extra)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise UnsupportedRopeError(f"{name}: the RoPE probe (a forward of {PROBE_TOKENS} tokens at "
                                   f"position {start}) failed: {err}",
                                   "kvwire cannot check this model's RoPE; use prefix or text mode") from None
    try:
        check_layout(cache, spec)
    except ModelError as err:
        raise UnsupportedRopeError(f"{name}: {err.message}", err.hint) from None
    return [layer.keys.detach().to("cpu", torch.float64) for layer in cache.layers]


def _error(k0: torch.Tensor, k1: torch.Tensor, table: RopeTable, offset: int) -> float:
    T = k0.shape[2]  # a sliding layer may keep fewer than PROBE_TOKENS
    src = torch.arange(PROBE_TOKENS - T, PROBE_TOKENS)
    moved = rotate(k0, table, src, src + offset)
    scale = float(k1.norm())
    return float((moved - k1).norm()) / scale if scale > 0 else float("inf")


# -- candidate frequencies ------------------------------------------------------------------------


def _candidates(model: Any, spec: ModelSpec) -> tuple[list[RopeTable], str]:
    """One unchecked table per layer (convention still to be measured), and where it came from."""
    config = model.config.get_text_config(decoder=True)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * spec.num_layers)
    layer_types = (layer_types + ["full_attention"] * spec.num_layers)[: spec.num_layers]
    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    distinct = _distinct(rotaries)
    if len(distinct) == 1:
        rotary = distinct[0]
        cached: dict[str, RopeTable] = {}
        for layer_type in layer_types:
            if layer_type not in cached:
                cached[layer_type] = _module_table(rotary, config, spec.head_dim, layer_type)
        return [cached[t] for t in layer_types], f"{type(rotary).__name__}"
    if len(rotaries) == spec.num_layers:  # one module per attention layer
        return ([_module_table(r, config, spec.head_dim, t) for r, t in zip(rotaries, layer_types)],
                f"{spec.num_layers} per-layer {type(rotaries[0]).__name__} modules")
    if rotaries:
        raise UnsupportedRopeError(f"{spec.architecture} has {len(rotaries)} differing rotary embedding modules "
                                   f"for {spec.num_layers} layers; kvwire cannot tell which rotates which layer",
                                   "use prefix or text mode for this model")
    described = getattr(config, "rope_parameters", None) or getattr(config, "rotary_dim", None)
    source = ("the config (RoPE inside attention)" if described else
              "no rotary embedding module and no RoPE in the config: default RoPE tried")
    return [_config_table(config, spec.head_dim)] * spec.num_layers, source


def _distinct(rotaries: list[Any]) -> list[Any]:
    out: list[Any] = []
    for module in rotaries:
        if not any(_same_module(module, seen) for seen in out):
            out.append(module)
    return out


def _same_module(a: Any, b: Any) -> bool:
    if getattr(a, "rope_type", None) != getattr(b, "rope_type", None):
        return False
    fa, fb = getattr(a, "inv_freq", None), getattr(b, "inv_freq", None)
    if fa is None or fb is None:
        return fa is fb
    return fa.shape == fb.shape and bool(torch.equal(fa.cpu(), fb.cpu()))


def _module_table(rotary: Any, config: Any, head_dim: int, layer_type: str) -> RopeTable:
    """The static frequencies of a transformers ``*RotaryEmbedding`` module for one layer type.

    Uses the *original* frequencies: ``dynamic`` and ``longrope`` get a position limit below
    which those are the ones the model applies. Per-layer-type RoPE (Gemma3: sliding layers
    base 1e4, full layers 1e6) gives each layer type its own table.
    """
    rope_type = getattr(rotary, "rope_type", "default")
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope_type, dict):  # per-layer-type RoPE (Gemma3)
        if layer_type not in rope_type:
            raise UnsupportedRopeError(f"{type(rotary).__name__} has no RoPE for layer type {layer_type!r}")
        rope_type = rope_type[layer_type]
        inv_freq = getattr(rotary, f"{layer_type}_original_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq")
        scaling = getattr(rotary, f"{layer_type}_attention_scaling", 1.0)
        params = params.get(layer_type, {}) if isinstance(params, dict) else {}
    else:
        inv_freq = getattr(rotary, "original_inv_freq", None)
        if inv_freq is None:
            inv_freq = rotary.inv_freq
        scaling = getattr(rotary, "attention_scaling", 1.0)
    limit = None
    if rope_type == "dynamic":
        limit = int(rotary.original_max_seq_len)  # frequencies grow past the trained length
    elif rope_type == "longrope":
        limit = int(params["original_max_position_embeddings"]) + 1  # long factors from here on
    return _table(inv_freq.detach().to("cpu", torch.float32).clone(), head_dim, str(rope_type),
                  float(scaling if scaling is not None else 1.0), limit)


def _config_table(config: Any, head_dim: int) -> RopeTable:
    """Default RoPE as the config describes it, for models that rotate inside attention.

    ``rotary_dim`` (GPT-J, CodeGen) or ``partial_rotary_factor`` sets R; the base is the
    config's ``rope_theta`` or 10000. Frequencies are computed as transformers does:
    ``1 / base ** (arange(0, R, 2) / R)`` in fp32. A model with no RoPE gets this table
    too, and the probe refuses it.
    """
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = float(theta or getattr(config, "rope_theta", None) or DEFAULT_ROPE_THETA)
    rotary_dim = getattr(config, "rotary_dim", None)
    if not rotary_dim:
        factor = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
        rotary_dim = int(head_dim * float(factor))
    rotary_dim = min(int(rotary_dim), head_dim) // 2 * 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim))
    return _table(inv_freq, head_dim, "default", 1.0, None)


def _table(inv_freq: torch.Tensor, head_dim: int, rope_type: str, scaling: float, limit: int | None) -> RopeTable:
    try:
        return RopeTable(inv_freq, head_dim, rope_type, scaling, limit)
    except ValueError as err:
        raise UnsupportedRopeError(f"unsupported rotary embedding: {err}") from None


def _refusal(probe: RopeProbe) -> UnsupportedRopeError:
    if not probe.errors:
        return UnsupportedRopeError(f"cannot check the RoPE of {probe.model}: {probe.source}",
                                    "use prefix or text mode for this model")
    worst = {c: max(e) for c, e in probe.errors.items()}
    layer = {c: max(range(len(e)), key=e.__getitem__) for c, e in probe.errors.items()}
    measured = ", ".join(f"{c} {worst[c]:.2g} (layer {layer[c]})" for c in CONVENTIONS)
    return UnsupportedRopeError(
        f"kvwire cannot re-rotate the keys of {probe.model} exactly: re-rotating its own keys by "
        f"{probe.offset} positions differs from what the model computes by a relative error of {measured} "
        f"(tolerance {probe.tolerance:g}; frequencies from {probe.source}"
        + ("" if probe.weights == "fp32" else
           f"; measured with its {probe.weights} weights multiplied exactly in fp32, so not the format's rounding")
        + ")",
        "this model's RoPE (or its absence) is not one kvwire reproduces; use prefix or text mode, which never "
        "move keys",
    )
