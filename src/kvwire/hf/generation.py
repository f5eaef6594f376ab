"""Generation from a context and an optional cache, timed; teacher-forced logits (transformers side).

A plain loop over ``model(...)`` rather than ``model.generate``: it times prefill and
decode separately, takes an attention mask and explicit positions (padded batches,
spliced contexts with gaps), keeps per-step logits when asked, and computes the
linear layers of every pass with the product :mod:`.linears` picks for its rows (decode
steps 1.5-1.6x faster on a 2-core CPU; prefills 1.6x on an AMD EPYC).
``forward`` with a cache must get at least one uncached token -- the logits of the last
context token are where generation starts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ..errors import PacketError
from .cache import cache_length, new_cache, reserved
from .loading import check_fits, eos_token_ids, model_device
from .linears import fast_linears
from .step import plan_for, step as lean_step


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` is greedy (the default), and so is any
    temperature under :data:`GREEDY_BELOW` (1e-5)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError(f"seed must fit a 64-bit generator ([-2**63, 2**64 - 1]), got {self.seed}")


@dataclass
class Generation:
    """What :func:`generate` returns. Times are seconds, measured with ``perf_counter``.

    For a batch, ``batch_tokens[b]`` is row ``b``'s output (cut after its first eos);
    ``tokens`` and ``first_logits`` are row 0's, the whole story for a single sequence.
    """

    batch_tokens: list[list[int]]
    batch_first_logits: torch.Tensor  # fp32 [B, V]: the distributions the first tokens were chosen from
    prefill_s: float  # forward over the uncached context tokens, up to the first token
    decode_s: float  # the remaining tokens
    prefilled: int  # context tokens computed here (not served from a cache)
    cache: DynamicCache | None = field(repr=False, default=None)  # covers context + tokens[:-1]
    step_logits: torch.Tensor | None = field(repr=False, default=None)  # fp32 [B, steps, V] if kept
    prefill_cpu_s: float = 0.0  # this process's CPU time over the prefill (all its threads): with ``prefill_s``,
    # whether the prefill had the machine to itself (kvwire.pipeline.rates.Measurement)

    @property
    def tokens(self) -> list[int]:
        return self.batch_tokens[0]

    @property
    def first_logits(self) -> torch.Tensor:
        return self.batch_first_logits[0]


@torch.inference_mode()
def generate(model: Any, input_ids: torch.Tensor | Sequence[int], *, cache: DynamicCache | None = None,
             attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
             max_new_tokens: int = 32, eos_ids: frozenset[int] | None = None, sampling: Sampling | None = None,
             use_cache: bool = True, keep_logits: bool = False, first_logits: torch.Tensor | None = None
             ) -> Generation:
    """Continue ``input_ids`` ([B, N] or a list) from ``cache``, which covers its first tokens.

    ``first_logits`` ([V] or [B, V]): the context was computed already (a splice computes its last tokens in its own
    pass, :func:`kvwire.kv.splice.assemble`): ``cache`` covers all N tokens, and the first new token is picked from
    these logits, with no prefill here.

    ``attention_mask`` [B, N] (1 = token, 0 = padding) covers the cached tokens too;
    ``position_ids`` [B, N] default to the count of real tokens before each one (padding
    takes no position, as in transformers' own batched generation). ``use_cache=False``
    is the reference: every step recomputes the whole sequence with no cache at all.
    """
    device = model_device(model)  # inputs follow the model; results (logits) come back on the CPU
    ids = torch.as_tensor(input_ids, dtype=torch.long).to(device)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, N], got {list(ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    B, N = ids.shape
    eos_ids = eos_token_ids(model) if eos_ids is None else eos_ids
    sampling = sampling or Sampling()
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cached = _check_continuation(model, B, N, cache, attention_mask, position_ids, max_new_tokens,
                                 computed=first_logits is not None)
    if not use_cache:
        if cache is not None or B != 1 or attention_mask is not None or position_ids is not None:
            raise ValueError("use_cache=False is the single-sequence reference: no cache, mask or positions")
        return _generate_uncached(model, ids, max_new_tokens, eos_ids, sampling, generator, keep_logits)
    cache = cache if cache is not None else new_cache(model)
    if attention_mask is not None and any(layer.is_sliding for layer in cache.layers):
        _check_left_padded(attention_mask)
    plain = attention_mask is None and position_ids is None  # let transformers build the causal mask
    mask = attention_mask.to(device, torch.long) if attention_mask is not None else \
        torch.ones(B, N, dtype=torch.long, device=device)
    positions = position_ids.to(device) if position_ids is not None else (mask.cumsum(1) - 1).clamp(min=0)

    start, cpu = time.perf_counter(), time.process_time()
    logits = _first_logits(model, ids, cache, cached, None if plain else (mask, positions), first_logits)
    first_logits = logits.cpu()
    step = [pick(logits[b], sampling, generator) for b in range(B)]
    prefill_s, prefill_cpu_s = time.perf_counter() - start, time.process_time() - cpu

    kept = [first_logits] if keep_logits else []
    start = time.perf_counter()
    with reserved(cache, max_new_tokens):  # decode steps write into reserved room, not a new copy each
        rows = _decode(model, cache, step, None if plain else mask, positions[:, -1:] + 1, max_new_tokens,
                       eos_ids, sampling, generator, kept if keep_logits else None)
    decode_s = time.perf_counter() - start
    return Generation(rows, first_logits, prefill_s, decode_s, N - cached, cache,
                      torch.stack(kept, dim=1) if keep_logits else None, prefill_cpu_s)


def _first_logits(model: Any, ids: torch.Tensor, cache: DynamicCache, cached: int,
                  placed: tuple[torch.Tensor, torch.Tensor] | None, given: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits [B, V] the first new tokens are picked from: ``given`` (the context was computed already), or
    a prefill of the uncached ``ids[:, cached:]`` into ``cache``. ``placed``: (mask, positions) over all N tokens,
    or None for transformers' own causal mask and positions."""
    B, N = ids.shape
    if given is not None:
        return given.reshape(B, -1).to(ids.device).float()
    extra = {} if placed is None else {"attention_mask": placed[0], "position_ids": placed[1][:, cached:]}
    with fast_linears(model, B * (N - cached), B):
        out = model(input_ids=ids[:, cached:], past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
    return out.logits[:, -1].float()

def _check_continuation(model: Any, B: int, N: int, cache: DynamicCache | None, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, max_new_tokens: int, computed: bool = False) -> int:
    """The tokens ``cache`` covers, once it, the mask and the positions are known to fit a [B, N] input
    and the context plus ``max_new_tokens`` to fit the model's window. ``computed``: the cache must cover all
    N tokens (their last logits are given), else fewer."""
    cached = cache_length(cache)
    if computed and cached != N:
        raise PacketError(f"first logits were given, so the cache must cover all {N} context tokens; it covers "
                          f"{cached}", "give first_logits only with the cache they were computed into")
    if cached >= N and not computed:
        raise PacketError(f"the cache covers {cached} tokens but the context has {N}",
                          "leave at least one context token uncached")
    if cached and cache.layers[0].keys.device != model_device(model):
        raise PacketError(f"the cache is on {cache.layers[0].keys.device}, the model on {model_device(model)}",
                          "move a packet to the model's device (packet.to(device)) before building its cache")
    if cached and int(cache.layers[0].keys.shape[0]) != B:
        raise PacketError(f"the cache holds a batch of {int(cache.layers[0].keys.shape[0])} rows, the input {B}",
                          "continue a batched packet with one input row per packet row")
    if attention_mask is not None and tuple(attention_mask.shape) != (B, N):
        raise PacketError(f"attention_mask must be [B, N]=[{B}, {N}] (cached tokens included), "
                          f"got {list(attention_mask.shape)}")
    if position_ids is not None and tuple(position_ids.shape) != (B, N):
        raise PacketError(f"position_ids must be [B, N]=[{B}, {N}], got {list(position_ids.shape)}")
    last = int(position_ids[:, -1].max()) if position_ids is not None else N - 1
    check_fits(model, last + 1 + max_new_tokens,
               f"a context of {N:,} tokens" + (f" (placed up to position {last:,})" if last != N - 1 else "")
               + f" plus {max_new_tokens} new tokens")
    return cached


def _check_left_padded(attention_mask: torch.Tensor) -> None:
    real_seen = attention_mask.to(torch.long).cummax(dim=1).values.bool()
    if bool((real_seen & (attention_mask == 0)).any()):
        raise PacketError("padding after a real token in a model with sliding-window layers",
                          "sliding windows count cache slots, so pad such batches on the left only")


def _decode(model: Any, cache: DynamicCache, step: list[int], mask: torch.Tensor | None, next_pos: torch.Tensor,
            max_new_tokens: int, eos_ids: frozenset[int], sampling: Sampling, generator: torch.Generator | None,
            kept: list[torch.Tensor] | None) -> list[list[int]]:
    """Each row's tokens from its first, ``step``, one forward a token, until every row met an eos or
    ``max_new_tokens``; each row cut after its first eos. ``mask`` (None: transformers' causal mask) and
    ``next_pos`` [B, 1] grow by one slot a step; ``kept`` (if given) receives each step's fp32 logits."""
    B = len(step)
    rows = [[t] for t in step]
    done = [t in eos_ids for t in step]
    # rows with no padding, all at one position: a model :mod:`.step` knows decodes without its modules
    uniform = mask is None or (bool(mask.all()) and bool((next_pos == next_pos[0, 0]).all()))
    plan = plan_for(model, B) if uniform else None
    while not all(done) and len(rows[0]) < max_new_tokens:
        if plan is not None:
            logits = lean_step(plan, cache, torch.tensor(step, device=next_pos.device),
                               None if mask is None else int(next_pos[0, 0]))
            next_pos = next_pos + 1
        else:
            extra = {}
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
                extra = {"attention_mask": mask, "position_ids": next_pos}
                next_pos = next_pos + 1
            with fast_linears(model, B, B):
                out = model(input_ids=torch.tensor(step, device=next_pos.device)[:, None], past_key_values=cache,
                            use_cache=True, **extra)
            logits = out.logits[:, -1].float()
        if kept is not None:
            kept.append(logits.cpu())
        step = [pick(logits[b], sampling, generator) for b in range(B)]
        for b in range(B):
            rows[b].append(step[b])  # a finished row's tokens keep the batch rectangular; cut below
            done[b] = done[b] or step[b] in eos_ids
    return [_cut(row, eos_ids) for row in rows]


@torch.inference_mode()
def forward_logits(model: Any, cache: DynamicCache | None, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Logits ``[n, V]`` (fp32) at every position of ``input_ids`` (a single sequence) after ``cache``.

    Teacher forcing: the distribution over each next token given the true previous ones.
    Grows ``cache``; pass a clone to keep the original.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(model_device(model))
    out = model(input_ids=ids, past_key_values=cache if cache is not None else new_cache(model), use_cache=True)
    return out.logits[0].float().cpu()


def _cut(row: list[int], eos_ids: frozenset[int]) -> list[int]:
    for index, token in enumerate(row):
        if token in eos_ids:
            return row[: index + 1]
    return row


def _generate_uncached(model: Any, ids: torch.Tensor, max_new_tokens: int, eos_ids: frozenset[int],
                       sampling: Sampling, generator: torch.Generator | None, keep_logits: bool) -> Generation:
    start = time.perf_counter()
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    first_logits = None
    prefill_s = 0.0
    while not tokens or (tokens[-1] not in eos_ids and len(tokens) < max_new_tokens):
        seq = torch.cat([ids, torch.tensor([tokens], dtype=torch.long, device=ids.device)], dim=1) if tokens else ids
        logits = model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        if first_logits is None:
            first_logits, prefill_s = logits.cpu(), time.perf_counter() - start
        kept.append(logits.cpu())
        tokens.append(pick(logits, sampling, generator))
    return Generation([tokens], first_logits[None], prefill_s, time.perf_counter() - start - prefill_s,
                      ids.shape[1], None, torch.stack(kept)[None] if keep_logits else None)


GREEDY_BELOW = 1e-5  # temperatures under this pick greedily (vLLM's rule: the limit of sampling as T -> 0)


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from one row's logits ``[V]``: greedy, or sampled at the temperature (then top-p)."""
    logits = logits.float()
    if sampling.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    # the largest logit moved to 0 first: divided by a small temperature the others go to -inf, never +inf
    # (logits / 1e-40 overflowed, the softmax was NaN and multinomial raised)
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1).cpu()
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
