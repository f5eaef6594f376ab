"""Partial-layer transfer, transformers side: record hidden states, compute runs of layers.

The sender prefills (and decodes) as usual inside :func:`record`, which notes the hidden
state entering the layers a :class:`~kvwire.wire.layers.LayerPlan` needs; :func:`extract` makes the packet
(K/V of the reused layers, those hidden states). The receiver calls :func:`complete`: it
runs its *own* weights over each recomputed run of layers, starting from the shipped
hidden state, and assembles a full ``DynamicCache`` from the shipped and computed K/V.
:func:`send` does the sender's part in one call::

    plan = LayerPlan.prefix(spec.num_layers, k=24)
    packet = partial.send(sender_model, context[:, :-1], plan)           # K/V 0..23 + hidden entering 24
    cache = partial.complete(packet, receiver_model)                      # computes layers 24..29
    out = hf.generate(receiver_model, context, cache=cache)               # exact if the weights are equal

A run ``[a, b)`` is computed by the model's own forward over a *view* of the model that
holds only decoder layers ``a..b-1`` (shallow copies of the LM and decoder modules
sharing every weight, and of the config with ``num_hidden_layers`` and ``layer_types``
cut to match), fed the hidden state as ``inputs_embeds``, with a fresh cache (so positions
and masks are those of a prefill of the ``T`` context tokens). Layers keep their index,
so their K/V land in the right cache slots; masks, RoPE (per layer type for Gemma3) and
sliding windows are the model's own. Nothing else is patched (the passes compute their linears
as every prefill does, :mod:`.linears`); the model's modules are never replaced.

Receivers with other weights than the sender (a fine-tuned variant) must say so:
``complete(..., allow_variant=True)``; otherwise a weight-fingerprint mismatch is refused
like any foreign packet. Another architecture is always refused.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..errors import ModelMismatchError, PacketError
from ..evals.fidelity import mean_kl
from ..wire.packet import Packet
from ..wire.layers import LayerPlan
from ..wire.spec import ModelSpec
from .cache import build_cache, cache_length, decoder_layers, extract as extract_full, new_cache
from .linears import fast_linears
from .loading import model_spec

log = logging.getLogger(__name__)

__all__ = ["LayerPlan", "Recorder", "complete", "extract", "layer_sensitivity", "record", "run_layers", "send",
           "swap_layers"]


class Recorder:
    """Hidden states entering chosen layers, concatenated over every forward pass while recording."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = layers
        self._parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}

    def hidden(self) -> dict[int, torch.Tensor]:
        """``{layer: [B, T, H]}`` over all tokens seen (T = sum of the forwards' lengths)."""
        missing = [layer for layer, parts in self._parts.items() if not parts]
        if missing:
            raise PacketError(f"no forward pass reached layers {missing} while recording")
        return {layer: torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for layer, parts in self._parts.items()}

    def _take(self, layer: int, hidden: torch.Tensor) -> None:
        self._parts[layer].append(hidden.detach().clone())


@contextlib.contextmanager
def record(model: Any, layers: Iterable[int]) -> Iterator[Recorder]:
    """Record the hidden state entering each of ``layers`` (e.g. ``plan.hidden_layers``) during every
    forward inside the block.

    A forward pre-hook on each such decoder layer copies its input (the hooks only read).
    Every forward inside the block counts, so a prefill followed by decode steps records
    every token, in order.
    """
    modules = decoder_layers(model)
    wanted = tuple(sorted(set(layers)))
    bad = [layer for layer in wanted if not 0 <= layer < len(modules)]
    if bad:
        raise PacketError(f"layers {bad} are out of range 0..{len(modules) - 1} for a {len(modules)}-layer model")
    recorder = Recorder(wanted)
    handles = []
    for layer in wanted:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int = layer) -> None:
            recorder._take(layer, args[0] if args else kwargs["hidden_states"])

        handles.append(modules[layer].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


def extract(cache: DynamicCache, hidden: dict[int, torch.Tensor], spec: ModelSpec, token_ids: torch.Tensor,
            plan: LayerPlan, **provenance: Any) -> Packet:
    """The partial packet for ``plan`` from a sender's full cache and recorded hidden states.

    ``token_ids`` [B, T] are the ids the cache covers. A plan that reuses every layer gives
    an ordinary packet. The packet's tensors are views of the cache's and the recorder's.
    """
    if plan.num_layers != spec.num_layers:
        raise PacketError(f"the plan is for {plan.num_layers} layers, the model has {spec.num_layers}")
    full = extract_full(cache, spec, token_ids, **provenance)
    if plan.is_full:
        return full
    T = full.length
    missing = [layer for layer in plan.hidden_layers if layer not in hidden]
    if missing:
        raise PacketError(f"the plan needs the hidden states entering layers {missing}, which were not recorded",
                          "record them: with partial.record(model, plan.hidden_layers) around the prefill")
    hidden = {layer: hidden[layer] for layer in plan.hidden_layers}
    for layer, h in hidden.items():
        if h.shape[1] != T:
            raise PacketError(f"the hidden state entering layer {layer} covers {h.shape[1]} tokens, the cache {T}")
    return Packet(spec=spec, keys=tuple(full.keys[i] for i in plan.reused),
                  values=tuple(full.values[i] for i in plan.reused), token_ids=full.token_ids, mask=full.mask,
                  layers=plan.reused, hidden=hidden, **provenance).validate()


@torch.inference_mode()
def send(model: Any, token_ids: torch.Tensor, plan: LayerPlan, *, spec: ModelSpec | None = None,
         **provenance: Any) -> Packet:
    """Prefill ``token_ids`` [B, T] (no padding) and return the partial packet for ``plan``."""
    spec = spec or model_spec(model)
    cache = new_cache(model)
    with record(model, plan.hidden_layers) as recorder, fast_linears(model, token_ids.numel(), token_ids.shape[0]):
        model(input_ids=token_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    hidden = recorder.hidden() if plan.hidden_layers else {}
    return extract(cache, hidden, spec, token_ids, plan, **provenance)


@torch.inference_mode()
def complete(packet: Packet, model: Any, spec: ModelSpec | None = None, *,
             allow_variant: bool = False) -> DynamicCache:
    """A full ``DynamicCache`` for the packet's tokens: shipped K/V where the packet has them, the
    receiver's own layers run from the shipped hidden states everywhere else.

    An ordinary (full) packet is simply built (:func:`kvwire.hf.build_cache`). The receiver
    must have the sender's architecture; other weights only with ``allow_variant=True``.
    """
    spec = spec or model_spec(model)
    packet.validate()
    _check_compatible(packet.spec, spec, allow_variant)
    if not packet.is_partial:  # every layer shipped; compatibility was just checked (variants included)
        return build_cache(packet, model, packet.spec)
    plan = LayerPlan(spec.num_layers, packet.layers)  # type: ignore[arg-type]
    hidden_size = int(next(iter(packet.hidden.values())).shape[2])  # type: ignore[union-attr]
    if hidden_size != _hidden_size(model):
        raise ModelMismatchError(f"the packet's hidden states have size {hidden_size}, the model {_hidden_size(model)}")
    if bool((packet.mask == 0).any()):
        raise PacketError("partial-layer packets with padding are not supported", "send one row per packet")
    positions = packet.positions()
    computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for start, stop in plan.runs:
        run_cache = run_layers(model, packet.hidden[start], start, stop, positions)  # type: ignore[index]
        for layer in range(start, stop):
            computed[layer] = run_cache.layers[layer].keys, run_cache.layers[layer].values
    shipped = dict(zip(plan.reused, zip(packet.keys, packet.values)))
    cache = new_cache(model)
    for layer, cache_layer in enumerate(cache.layers):
        keys, values = shipped[layer] if layer in shipped else computed[layer]
        cache.update(keys, values, layer)
        if isinstance(cache_layer, DynamicSlidingWindowLayer):
            cache_layer.cumulative_length = packet.length  # holds only the window; record the true length
    if cache_length(cache) != packet.length:
        raise PacketError(f"the assembled cache has length {cache_length(cache)}, expected {packet.length}")
    return cache


@torch.inference_mode()
def run_layers(model: Any, hidden: torch.Tensor, start: int, stop: int, positions: torch.Tensor) -> DynamicCache:
    """Run decoder layers ``start..stop-1`` of ``model`` over ``hidden`` [B, T, H] (the state entering
    ``start``) at ``positions`` [B, T]; return a fresh cache holding only those layers' K/V."""
    layers = decoder_layers(model)
    if not 0 <= start < stop <= len(layers):
        raise PacketError(f"layer run [{start}, {stop}) is out of range for a {len(layers)}-layer model")
    view = _layer_view(model, start, stop)
    cache = new_cache(model)
    with fast_linears(model, hidden.shape[0] * hidden.shape[1], hidden.shape[0]):  # the view shares its layers
        view(inputs_embeds=hidden, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _layer_view(model: Any, start: int, stop: int) -> Any:
    """The model with only decoder layers ``start..stop-1``: shallow copies sharing every weight."""
    decoder = model.get_decoder()
    name = next((n for n, child in model.named_children() if child is decoder), None)
    if name is None or not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise PacketError(f"cannot run a range of layers of {type(model).__name__}",
                          "partial-layer transfer needs a decoder with a `layers` ModuleList")
    config = copy.copy(decoder.config)
    config.num_hidden_layers = stop - start
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[start:stop]
    view_decoder = copy.copy(decoder)
    view_decoder._modules = dict(decoder._modules)
    view_decoder._modules["layers"] = decoder.layers[start:stop]
    view_decoder.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._modules[name] = view_decoder
    return view


def _hidden_size(model: Any) -> int:
    return int(model.config.get_text_config(decoder=True).hidden_size)


def _check_compatible(sender: ModelSpec, receiver: ModelSpec, allow_variant: bool) -> None:
    diffs = [d for d in sender.differences(receiver) if not d.startswith("fingerprint:")]
    if diffs:
        raise ModelMismatchError(
            "partial-layer transfer needs the same architecture on both sides; the packet's model differs: "
            + "; ".join(diffs), "between different models use a fuser (kvwire check A B says which applies)")
    if sender.fingerprint != receiver.fingerprint and not allow_variant:
        raise ModelMismatchError(
            f"the packet was made by other weights of this architecture (fingerprint {sender.fingerprint[:12]} != "
            f"{receiver.fingerprint[:12]})",
            "for a fine-tuned variant pass allow_variant=True (approximate: measure it), else re-prefill")


def swap_layers(cache: DynamicCache, donor: DynamicCache, layers: Iterable[int], model: Any) -> DynamicCache:
    """A new cache: ``cache``'s K/V, except ``layers``, whose K/V come from ``donor`` (same tokens)."""
    chosen = set(layers)
    if cache_length(cache) != cache_length(donor):
        raise PacketError(f"the caches cover {cache_length(cache)} and {cache_length(donor)} tokens")
    out = new_cache(model)
    for index, layer in enumerate(out.layers):
        source = donor.layers[index] if index in chosen else cache.layers[index]
        out.update(source.keys, source.values, index)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = source.cumulative_length
    return out


@torch.inference_mode()
def layer_sensitivity(model: Any, own: DynamicCache, foreign: DynamicCache, continuation: torch.Tensor) -> list[float]:
    """Per layer ``l``: the mean next-token KL over ``continuation`` [1, n] (teacher forced) between
    ``model`` reading its ``own`` cache and reading it with layer ``l``'s K/V taken from ``foreign``
    (another model's cache of the same tokens). DroidSpeak recomputes the layers where this is large."""
    def logits(cache: DynamicCache) -> torch.Tensor:
        return model(input_ids=continuation, past_key_values=cache, use_cache=True).logits[0].float()

    reference = logits(swap_layers(own, foreign, (), model))
    return [mean_kl(reference, logits(swap_layers(own, foreign, (layer,), model)))
            for layer in range(len(own.layers))]
