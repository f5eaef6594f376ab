"""The batched engine's forward passes (:mod:`.engine` decides which rows go in them; this builds and runs them).

A :class:`Pass` covers buffer rows of the engine's :class:`.attention.RowCache`; :func:`prefill_pass` and
:func:`decode_pass` build one from the engine's rows, :func:`prefill_groups` splits joining rows into
prefill passes. :func:`forward`
runs one or several: a decode step of a model :mod:`.step` knows walks the weights directly with
the engine's attention; one pass otherwise runs as the model's batch through transformers'
modules; several are packed into one sequence (:class:`.attention.Packed`), the linear layers
computing every token at once while each part attends to its own rows. :func:`probe` checks a
model routes its attention through the engine's, and :func:`chunk_tokens` sizes prefill chunks.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelError
from .attention import (KWARG, BatchAttention, Packed, Plan, PrefixGroup, RowCache, Segment, engine_attention,
                        own_and_prefix_attention)
from .head import sliced_head
from .linears import fast_linears
from .rows import LiveRow, Prefix
from .step import plan_for, step_rows

__all__ = ["AUTO_FLOOR", "Pass", "attention_reach", "auto_prefill_chunk", "chunk_for", "chunk_tokens", "decode_pass",
           "forward", "prefill_groups", "prefill_pass", "prefix_groups", "probe"]


@dataclass
class Pass:
    """A forward pass over buffer rows ``plan.first_row..``: ``ids`` / ``positions`` ``[b, q]``, ``mask``
    ``[b, 1, q, width]`` bool, the prefixes its rows read, and which of the ``q`` tokens' logits to keep
    (``None``: the last)."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    plan: Plan
    groups: list[PrefixGroup]
    keep: torch.Tensor | None = None
    causal: bool = False  # the mask is plain causal and nothing else


def prefill_pass(group: list[LiveRow], pieces: list[list[int]], first_row: int, pad_id: int) -> Pass:
    """The pass that prefills ``pieces`` (the next piece of each row's suffix) of ``group``: rows in a block of
    buffer rows from ``first_row``, their pieces starting at the same slot, padded to the longest."""
    b, width = len(group), max(len(piece) for piece in pieces)
    slot = group[0].start_slot + group[0].done
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    positions = torch.zeros(b, width, dtype=torch.long)
    lengths = torch.tensor([len(piece) for piece in pieces])
    for i, row in enumerate(group):
        ids[i, : len(pieces[i])] = torch.tensor(pieces[i])
        positions[i] = row.first_position + row.done + torch.arange(width)
    t = torch.arange(slot + width)
    query = torch.arange(width)
    # [b, 1, width, slot + width]: causal, and nothing past each row's own suffix
    mask = ((t[None, None, :] <= slot + query[None, :, None]) & (t[None, None, :] < slot + lengths[:, None, None]))
    causal = slot == 0 and bool((lengths == width).all())  # the mask is causal and nothing else
    plan = Plan(b, torch.full((b,), slot), width, slot + width, first_row)
    return Pass(ids, positions, mask[:, None], plan, prefix_groups(group), torch.unique(lengths - 1), causal)


def decode_pass(rows: list[LiveRow], first_row: int, pad_id: int) -> Pass:
    """The decode step of ``rows`` (buffer rows from ``first_row``) as a forward pass.

    A row mid-way through a chunked prefill rides along (the pass covers buffer rows 0..n-1) with a
    pad token at the slot its next chunk will overwrite; its output is dropped. Rows attend only to
    their own slots and prefix, so it changes nothing for the others."""
    B = len(rows)
    ids = torch.tensor([[row.tokens[-1] if not row.prefilling else pad_id] for row in rows])
    positions = torch.tensor([[row.first_position + len(row.suffix) + len(row.tokens) - 1 if not row.prefilling
                               else row.first_position + row.done] for row in rows])
    slots = torch.tensor([row.own_length for row in rows])
    width = int(slots.max()) + 1
    mask = torch.arange(width)[None, :] <= slots[:, None]  # [B, width]
    return Pass(ids, positions, mask[:, None, None], Plan(B, slots, 1, width, first_row), prefix_groups(rows))


def prefix_groups(rows: list[LiveRow]) -> list[PrefixGroup]:
    """Rows of one forward pass that read a prefix through cascade attention, grouped by prefix object."""
    by_prefix: dict[int, list[int]] = {}
    prefixes: dict[int, Prefix] = {}
    for index, row in enumerate(rows):
        if row.prefix is not None and row.own_start > 0:
            by_prefix.setdefault(id(row.prefix), []).append(index)
            prefixes[id(row.prefix)] = row.prefix
    return [PrefixGroup(prefixes[key].keys, prefixes[key].values,
                        torch.tensor(indices, device=prefixes[key].keys[0].device))
            for key, indices in by_prefix.items()]


def prefill_groups(rows: list[LiveRow]) -> list[list[LiveRow]]:
    """Split joining rows (contiguous buffer rows) into forward passes: same start slot, and padding to the
    longest suffix costing at most a quarter of the real tokens (or 64 tokens)."""
    groups: list[list[LiveRow]] = []
    for row in rows:
        group = groups[-1] if groups else None
        if group and group[0].start_slot == row.start_slot:
            lengths = [len(r.suffix) for r in group] + [len(row.suffix)]
            waste = max(lengths) * len(lengths) - sum(lengths)
            if waste <= max(64, sum(lengths) // 4):
                group.append(row)
                continue
        groups.append([row])
    return groups


def forward(model: Any, rows_cache: RowCache, parts: list[Pass]) -> list[torch.Tensor]:
    """One forward pass of the model over ``parts``: each part's logits ``[b, kept, V]``.

    A decode step (one part, one token a row) runs through :mod:`.step` where it knows the model. Else
    one part runs as the model's batch ``[b, q]``. Several are packed into one sequence ``[1, N]``
    (each part's tokens, row by row): the linear layers compute every token at once, while the
    attention keeps each part to its own rows, slots, mask and prefixes (:class:`.attention.Packed`)."""
    if len(parts) == 1 and parts[0].ids.shape[1] == 1 and (logits := _lean(model, rows_cache, parts[0])) \
            is not None:
        return [logits[:, None]]  # a decode step without transformers' modules
    if len(parts) == 1:
        (part,) = parts
        ids, positions, mask, keep = part.ids, part.positions, part.mask, part.keep
        plan: Plan | Packed = part.plan
        batch = BatchAttention(part.groups, causal=part.causal)
    else:
        ids = torch.cat([part.ids.reshape(-1) for part in parts])[None]
        positions = torch.cat([part.positions.reshape(-1) for part in parts])[None]
        keep_at, offset = [], 0
        for part in parts:
            b, q = part.ids.shape
            kept = part.keep if part.keep is not None else torch.tensor([q - 1])
            keep_at.append((offset + q * torch.arange(b)[:, None] + kept[None, :]).reshape(-1))
            offset += b * q
        keep = torch.cat(keep_at)
        plan = Packed([part.plan for part in parts])
        batch = BatchAttention(segments=[
            Segment(part.plan, part.mask.to(rows_cache.device), BatchAttention(part.groups, causal=part.causal))
            for part in parts])
        mask = torch.ones(1, 1, offset, 1, dtype=torch.bool)  # a placeholder: each segment has its own
    ids, positions, mask = ids.to(rows_cache.device), positions.to(rows_cache.device), mask.to(rows_cache.device)
    keep = keep.to(rows_cache.device) if keep is not None else None
    rows = ids.shape[0] * (len(keep) if keep is not None else 1)  # rows the output layer computes
    rows_cache.plan, rows_cache.written, batch.cache = plan, None, rows_cache
    try:
        with engine_attention(model), fast_linears(model, ids.numel(), rows) as head_fast, \
                sliced_head(model, 0 if head_fast else rows):
            out = model(input_ids=ids, position_ids=positions, attention_mask=mask,
                             past_key_values=rows_cache, use_cache=True,
                             logits_to_keep=keep if keep is not None else 1, **{KWARG: batch})
    finally:
        rows_cache.plan = None
    if len(parts) == 1:
        return [out.logits]
    sizes = [part.ids.shape[0] * (len(part.keep) if part.keep is not None else 1) for part in parts]
    return [logits.reshape(part.ids.shape[0], -1, logits.shape[-1])
            for part, logits in zip(parts, out.logits[0].split(sizes))]

def _lean(model: Any, rows_cache: RowCache, part: Pass) -> torch.Tensor | None:
    """A decode pass's logits ``[B, V]`` through :mod:`.step` -- the model's weights walked directly, the
    attention this engine's (its rows' slots and shared prefixes) -- or None where the step does not know
    the model (then the pass runs through transformers' modules)."""
    plan = plan_for(model, part.ids.shape[0])
    if plan is None:
        return None
    batch = BatchAttention(part.groups)
    mask = part.mask.to(rows_cache.device)

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        keys, values = rows_cache.layers[index].update(k, v)
        out, _ = own_and_prefix_attention(index, batch, q, keys, values, mask, scale)
        return out.reshape(q.shape[0], -1)

    rows_cache.plan = part.plan
    try:
        return step_rows(plan, part.ids[:, 0].to(rows_cache.device), part.positions[:, 0].to(rows_cache.device), attend)
    finally:
        rows_cache.plan = None


def probe(model: Any, rows_cache: RowCache) -> None:
    """Check once that ``model`` routes attention through the registered function (one call per layer); the
    cache must hold at least one row of two slots."""
    batch = BatchAttention(cache=rows_cache)
    device = rows_cache.device
    rows_cache.plan, rows_cache.written = Plan(1, torch.zeros(1, dtype=torch.long, device=device), 2, 2, 0), None
    try:
        with torch.inference_mode(), engine_attention(model), fast_linears(model, 2, 1):
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                  position_ids=torch.arange(2, device=device)[None],
                  attention_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool, device=device).tril(),
                  past_key_values=rows_cache, use_cache=True, logits_to_keep=1, **{KWARG: batch})
    except (TypeError, AttributeError, RuntimeError) as err:
        raise ModelError(f"{type(model).__name__} cannot run in the batched engine: {err}",
                         "decode its agents one at a time (hf.generate)") from None
    except ModelError as err:
        raise ModelError(f"{type(model).__name__} cannot run in the batched engine: {err.message}",
                         "decode its agents one at a time (hf.generate)") from None
    finally:
        rows_cache.plan = None
    if batch.calls != len(rows_cache.layers):
        raise ModelError(f"{type(model).__name__} does not route attention through transformers' "
                         f"AttentionInterface ({batch.calls} of {len(rows_cache.layers)} layers did)",
                         "decode its agents one at a time (hf.generate)")


def attention_reach(config: Any) -> float:
    """The context length at which a token's attention costs as much as its linear layers: their
    multiply-adds per token over attention's per token and context token (scores and weighted sum,
    every query head). ~3,100 for the default model; ``inf`` where the config does not say."""
    text = config.get_text_config(decoder=True)
    try:
        hidden, heads, intermediate = text.hidden_size, text.num_attention_heads, text.intermediate_size
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        linear = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
        return linear / (2 * heads * head_dim)
    except (AttributeError, TypeError, ZeroDivisionError):  # no dense decoder sizes (e.g. experts)
        return float("inf")


def chunk_tokens(first: int, context: int, reach: float) -> int:
    """Tokens of a prefill chunk after ``context`` tokens, so that its pass costs what the first chunk
    (``first`` tokens from an empty context) costs: a token costs its linear layers plus attention over
    the context so far, ``1 + context / reach`` in units of its linear layers. Chunks shrink as the
    prompt grows, down to a quarter of the first, so that no pass stalls the running rows for longer
    than the first one did (a constant chunk's last pass attends over the whole prompt)."""
    if reach == float("inf"):
        return first
    budget = first * (1 + first / 2 / reach)  # the first chunk's cost
    # the largest n with n * (1 + (context + n / 2) / reach) <= budget
    a, b = 1 / (2 * reach), 1 + context / reach
    n = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
    return max(n, -(-first // 4), 1)


# Below this first chunk a long prompt's own time to first token more than doubles on a CPU while the
# running rows still stall for several decode steps a pass (BENCHMARKS.md, section 6): chunks are never smaller.
AUTO_FLOOR = 192


def chunk_for(step_s: float, fill_s: float, tokens: int, window: int | None, floor: int = AUTO_FLOOR) -> int | None:
    """The first prefill chunk ``prefill_chunk="auto"`` picks from two timings of the model: a decode step
    (``step_s``) and a prefill of ``tokens`` (``fill_s``). A pass that carries a chunk with the running rows'
    decode step costs about a step plus the chunk's tokens at the prefill's marginal rate; the chunk is what
    that rate adds in one more step's time (so a pass costs about two steps), and never under ``floor``.
    ``None`` (whole prefills) where it would cover the model's context window: where a prefill is about as
    cheap as a decode step (a small model on an accelerator), chunks only delay a long prompt."""
    per_token = max(fill_s - step_s, 0.0) / tokens
    chunk = step_s / per_token if per_token > 0 else math.inf
    if chunk == math.inf or (window is not None and chunk >= window):
        return None
    return max(floor, int(chunk))


@torch.inference_mode()
def auto_prefill_chunk(model: Any, tokens: int = 128) -> int | None:
    """The first prefill chunk for ``prefill_chunk="auto"``. On the CPU, :func:`chunk_for` on ``model`` as it runs
    here: a decode step and a ``tokens``-token prefill, each the median of two after a warm-up (under a second for
    the default model on a 2-core CPU). On an accelerator, whole prefills: a pass there costs about the same for
    one token or thousands (kernel launches, not arithmetic), so every chunk costs a long prompt a whole pass. On
    an NVIDIA H200 with the default model's shape, four streams decoding at 30 ms a step while a 3,000-token
    prompt joined: whole, they waited 84 ms once (2.8x a step) and the prompt's first token came in 47 ms; in
    chunks of 192 to 1,536 tokens they waited 1.4-1.7x a step but its first token took 3-21x as long
    (BENCHMARKS.md, section 6). A model large enough that a whole prefill stalls streams for long on a GPU wants
    an explicit ``prefill_chunk``."""
    from .cache import new_cache
    from .loading import context_window, model_device

    device = model_device(model)
    if device.type != "cpu":
        return None
    vocab = max(4, min(model.config.get_text_config(decoder=True).vocab_size, 10_000))
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)

    def timed(run: Any) -> float:
        start = time.perf_counter()
        float(run().logits[0, -1, 0])  # waits for the device
        return time.perf_counter() - start

    fills, steps = [], []
    for _ in range(3):
        cache = new_cache(model)
        fills.append(timed(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)))
        steps.append(timed(lambda: model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)))
    return chunk_for(statistics.median(steps[1:]), statistics.median(fills[1:]), tokens, context_window(model))
