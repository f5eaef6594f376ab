"""Shared-prefix ("cascade") attention and the per-row cache the batched engine decodes with.

Rows of a batch that share a context -- a received chain several agents read -- attend
to it *once per step*: the queries of every row that shares a prefix form one matrix,
multiplied with the prefix's keys in one batched matmul (Hydragen's idea; FlashInfer
calls it cascade attention), instead of every row holding and re-reading its own copy.
Each row's own part (its instruction tokens and what it generated) is attended to as
usual, and the two partial results are combined exactly with their log-sum-exp::

    out = (o_prefix * exp(lse_prefix - lse) + o_own * exp(lse_own - lse)),  lse = logaddexp(lse_prefix, lse_own)

Each part is one call of torch's fused CPU attention kernel, which returns the log-sum-exp
with the output (:func:`partial_attention`; elsewhere a direct fp32 computation).

Layouts (transformers' own; ``Hq = Hkv * G``, query head ``h`` reads KV head ``h // G``)::

    query           [B, Hq, q, D]        B rows, q new tokens per row (1 when decoding)
    own keys/values [B, Hkv, T, D]       what RowCache.update returns: each row's own slots
    attention_mask  [B, 1, q, T] bool    True = may attend (causal within the own part, and
                                         slots beyond a row's own length are masked)
    prefix keys     [1, Hkv, P, D]       one tensor per layer per shared prefix, never copied
    output          [B, q, Hq, D]        what the model's attention module expects back

Wired in through transformers' public extension points only: the function is registered
as attention implementation ``"kvwire"`` (:class:`transformers.AttentionInterface`, with
the sdpa mask function registered for it in :class:`transformers.AttentionMaskInterface`),
the per-row cache is a :class:`transformers.Cache`, and what the attention needs per step
(:class:`BatchAttention`) travels as the forward keyword argument ``kvwire_batch``, which
models pass down to their attention functions. A call without that argument is plain
sdpa (:func:`plain_attention`: transformers' function, with the same bits and without its
copies of grouped KV heads under a mask on the CPU), so a model whose implementation is
this one behaves exactly as under sdpa. :func:`~kvwire.hf.loading.load_model` switches the
models it loads for good (:func:`adopt`); for any other model the engine switches for its own
forward passes only (:func:`engine_attention`).

A *packed* pass (:class:`Packed`) runs several batches of the engine -- a decode step of the
running rows and a chunk of a long prompt's prefill -- as one sequence ``[1, N]``: each part's
tokens, row by row, one after the other. The linear layers then read their weights once for
all of them, while each part (a :class:`Segment`) is written to its own rows and slots and
attends under its own mask and prefix groups, exactly as it would alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..errors import ModelError

log = logging.getLogger(__name__)

NAME = "kvwire"  # the registered attention implementation
KWARG = "kvwire_batch"  # the forward keyword argument carrying a BatchAttention


@dataclass
class PrefixGroup:
    """Rows ``rows`` (indices into the batch) all read the prefix ``keys`` / ``values``
    (per layer ``[1, Hkv, P, D]``), which come before each row's own part."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    rows: torch.Tensor  # long [b]


@dataclass
class BatchAttention:
    """What the registered attention function needs for one forward pass of the engine."""

    groups: list[PrefixGroup] = field(default_factory=list)
    causal: bool = False  # the mask is plain causal (a prefill from slot 0, no padding): sdpa may skip it
    own_mask: torch.Tensor | None = None  # the mask in the form cascade attention uses (made by the first layer)
    calls: int = 0  # attention calls served (one per layer): proves the model routes through the interface
    segments: list[Segment] = field(default_factory=list)  # a packed pass: its parts, in token order
    cache: RowCache | None = None  # the engine's cache of this pass: which layer was just written, and with what


@dataclass
class Segment:
    """One part of a packed pass: buffer rows ``plan.first_row..`` with ``plan.q`` new tokens each (their
    tokens sit row by row in the packed sequence), attending under ``mask`` (``[b, 1, q, width]`` bool) and
    ``attention``'s prefix groups."""

    plan: Plan
    mask: torch.Tensor
    attention: BatchAttention


def cascade_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over shared prefixes once per group plus each row's own part (see the module docstring).

    Without ``kvwire_batch`` in ``kwargs`` this is transformers' sdpa attention (:func:`plain_attention`: the
    same bits, without its copies of grouped heads); with it but no prefix group (rows that hold everything
    themselves) it is sdpa under the engine's mask.
    """
    batch: BatchAttention | None = kwargs.pop(KWARG, None)
    if batch is None:
        return plain_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ModelError(f"{type(module).__name__} uses attention {name}; the batched engine does not",
                             "decode its agents one at a time")
    if kwargs.get("sliding_window") is not None:
        raise ModelError(f"{type(module).__name__} has sliding-window attention; the batched engine does not "
                         "support it", "decode its agents one at a time")
    layer = _written_layer(module, batch, key)
    batch.calls += 1
    if batch.segments:
        return _packed_attention(_Layer(layer), batch.segments, query, key, value, scaling, dropout, kwargs), None
    return _attend(_Layer(layer), batch, query, key, value, attention_mask, scaling, dropout, kwargs)


def plain_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, with grouped KV heads read in place under a mask on the CPU.

    transformers copies every KV head ``G`` times (``repeat_kv``) whenever a mask is given, because CUDA's
    fused kernels refuse masked GQA. The CPU's fused kernel takes ``enable_gqa`` with a mask and gives the
    same bits (tested), without the copy: for a prefill that continues a cache -- prefix mode's new tokens
    after a received chain -- the copy was most of the pass (31 tokens after 3,200 on the default model:
    10.5 -> 2.3 ms a layer). Elsewhere (no mask, another device, gradients, a position bias, attention
    weights asked for) it is transformers' function itself."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups <= 1 or query.device.type != "cpu" or query.requires_grad
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
            or key.shape[1] * groups != query.shape[1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _written_layer(module: Any, batch: BatchAttention, key: torch.Tensor) -> int:
    """The cache layer this attention call reads: the one just written, which is not always the module's
    ``layer_idx`` (HRM runs one stack of layers in several cycles, each writing its own cache slots). A model that
    attends with other keys than the ones it cached (JetMoE repeats them across its experts' heads after the
    update) is refused: the shared prefixes the engine reads hold the cached ones."""
    written = batch.cache.written if batch.cache is not None else None
    if written is None:
        return int(module.layer_idx)
    index, pointer, shape = written
    if key.data_ptr() != pointer or tuple(key.shape) != shape:
        raise ModelError(f"{type(module).__name__} attends with keys {list(key.shape)} other than the {list(shape)} "
                         f"it cached (layer {index}): the batched engine's shared prefixes hold the cached ones",
                         "decode its agents one at a time")
    return index


def _packed_attention(module: Any, segments: list[Segment], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float | None, dropout: float, kwargs: dict[str, Any]) -> torch.Tensor:
    """Attention of a packed pass (``query`` ``[1, Hq, N, D]``; ``key`` / ``value`` the whole buffer,
    ``[rows, Hkv, width, D]``): each segment's queries over its own rows, as if it ran alone."""
    _, Hq, _, D = query.shape
    outputs, offset = [], 0
    for segment in segments:
        plan = segment.plan
        n = plan.batch * plan.q
        mine = query[0, :, offset : offset + n].reshape(Hq, plan.batch, plan.q, D).transpose(0, 1)  # [b, Hq, q, D]
        rows = slice(plan.first_row, plan.first_row + plan.batch)
        out, _ = _attend(module, segment.attention, mine, key[rows, :, : plan.width], value[rows, :, : plan.width],
                         segment.mask, scaling, dropout, kwargs)  # [b, q, Hq, D]
        outputs.append(out.reshape(1, n, Hq, D))
        offset += n
    return torch.cat(outputs, dim=1)


class _Layer:
    """Stands in for the attention module where there is none: what the prefix groups read is its index."""

    def __init__(self, index: int) -> None:
        self.layer_idx = index


def own_and_prefix_attention(layer: int, batch: BatchAttention, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, None]:
    """The engine's attention for layer ``layer`` outside transformers' modules (:mod:`.step`'s decode
    passes): ``query`` ``[B, Hq, q, D]``, the rows' own ``key`` / ``value`` as :class:`RowCache` returns
    them, ``mask`` ``[B, 1, q, T]`` bool; the output ``[B, q, Hq, D]``."""
    batch.calls += 1
    return _attend(_Layer(layer), batch, query, key, value, mask, scale, 0.0, {})


def _attend(module: Any, batch: BatchAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, scaling: float | None, dropout: float,
            kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """One batch of rows: each row's own part, plus the prefix each group of rows shares."""
    if not batch.groups:  # no shared prefix in this pass: fused sdpa over each row's own part
        return _own_attention(query, key, value, None if batch.causal else attention_mask, scaling, dropout, kwargs)
    layer = module.layer_idx
    B, Hq, q, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    scale = scaling if scaling is not None else D**-0.5
    dtype = query.dtype
    qg = query.reshape(B, Hkv, G * q, D)  # [B, Hkv, G*q, D]: the G query heads of each KV head, stacked
    if batch.own_mask is None and attention_mask is not None:  # built once per forward pass, for every layer
        batch.own_mask = _additive(attention_mask, G, dtype)
    o_own, l_own = partial_attention(qg, key, value, batch.own_mask, scale)  # each row's own part

    for group in batch.groups:
        rows = group.rows
        b = int(rows.numel())
        every = b == B  # the common fan-out: every row reads this prefix (rows are 0..B-1)
        mine = qg if every else qg.index_select(0, rows)
        qr = mine.transpose(0, 1).reshape(1, Hkv, b * G * q, D)  # every row's queries as one matrix per KV head
        o_pre, l_pre = partial_attention(qr, group.keys[layer], group.values[layer], None, scale)  # read once
        o_pre = o_pre.view(Hkv, b, G * q, D).transpose(0, 1)  # back to [b, Hkv, G*q, *]
        l_pre = l_pre.view(Hkv, b, G * q).transpose(0, 1)
        if every:
            o_own, l_own = _merge(o_own, l_own, o_pre, l_pre)
            continue
        o_r, l_r = _merge(o_own.index_select(0, rows), l_own.index_select(0, rows), o_pre, l_pre)
        o_own, l_own = o_own.index_copy(0, rows, o_r), l_own.index_copy(0, rows, l_r)

    return o_own.to(dtype).reshape(B, Hq, q, D).transpose(1, 2).contiguous(), None  # [B, q, Hq, D]


def _additive(allowed: torch.Tensor, G: int, dtype: torch.dtype) -> torch.Tensor:
    """The engine's bool mask ``[B, 1, q, T]`` as an additive one for the stacked heads ``[B, 1, G*q, T]``."""
    B, _, q, T = allowed.shape
    allowed = allowed if q == 1 else allowed.repeat(1, 1, G, 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return mask.expand(B, 1, G * q, T)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
fused_partials = _FLASH_CPU is not None  # tests switch it off to check the fused kernel against the plain one


def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[N, H, Q, D]`` over one part of the context (``key`` / ``value``
    ``[N or 1, H, T, D]``, additive ``mask`` broadcastable to ``[N, 1, Q, T]``): the normalized
    output ``[N, H, Q, D]`` (fp32) and the log-sum-exp of the scores ``[N, H, Q]``, which is what
    combining it exactly with another part needs. On the CPU, torch's fused flash kernel returns
    both (no score matrix in memory); elsewhere it is computed directly in fp32."""
    if fused_partials and query.device.type == "cpu":
        if key.shape[0] != query.shape[0]:
            key, value = key.expand(query.shape[0], -1, -1, -1), value.expand(query.shape[0], -1, -1, -1)
        out, lse = _FLASH_CPU(query, key, value, 0.0, False, attn_mask=mask, scale=scale)
        return out.float(), lse.float()
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), value.float()), lse


def _merge(o_a: torch.Tensor, l_a: torch.Tensor, o_b: torch.Tensor,
           l_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint parts, combined exactly."""
    lse = torch.logaddexp(l_a, l_b)
    return o_a * torch.exp(l_a - lse)[..., None] + o_b * torch.exp(l_b - lse)[..., None], lse


def _own_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scaling: float | None, dropout: float, kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """sdpa over each row's own part under the engine's mask (``None``: causal, which lets the kernel
    skip the masked half), reading grouped KV heads in place.

    transformers' sdpa path copies every KV head ``G`` times (``repeat_kv``) whenever a mask is
    given, because CUDA's fused kernels refuse masked GQA; the CPU kernel takes ``enable_gqa``
    with a mask, and the copy was a fifth of a decode step at 8 rows of 400 tokens.
    """
    if kwargs.get("position_bias") is not None:
        raise ModelError("this model adds a position bias to attention; the batched engine does not",
                         "decode its agents one at a time")
    if query.device.type != "cpu":  # keep transformers' own dispatch where its kernels' rules differ
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cascade_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # calls not from the engine get sdpa's masks


def adopt(model: Any) -> bool:
    """Make ``model``'s attention this module's (:func:`cascade_attention`, plain calls :func:`plain_attention`)
    where it is transformers' sdpa, for good: the same results, without sdpa's copies of grouped KV heads under a
    mask on the CPU. Returns whether it did; a model that does not take a registered implementation keeps sdpa.
    :func:`load_model <kvwire.hf.loading.load_model>` calls it."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError) as err:
        log.debug("%s keeps sdpa attention: %s", type(model).__name__, err)
        return False
    return True


_switch = threading.Lock()
_switched: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def engine_attention(model: Any) -> Iterator[None]:
    """Route ``model``'s attention through :func:`cascade_attention` for the duration (the engine's
    forward passes), then restore the implementation it had.

    The first switch goes through ``set_attn_implementation`` (its checks, every sub-model); it
    records which configs that changed, and later switches flip just those (a walk over every
    module on each decode step cost ~3 ms, 8 % of a one-row step of the default model).
    """
    with _switch:
        configs = _switched.get(model)
        if configs is None:
            configs = _switched[model] = _configs_switched_by(model)
        before = [config._attn_implementation_internal for config in configs]
        for config in configs:
            config._attn_implementation_internal = NAME
        try:
            yield
        finally:
            for config, implementation in zip(configs, before):
                config._attn_implementation_internal = implementation


def _configs_switched_by(model: Any) -> list[Any]:
    """The configs (model's and sub-models') whose attention implementation ``set_attn_implementation``
    sets, found by switching once and restoring."""
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            configs.setdefault(id(config), config)
    before = {key: config._attn_implementation_internal for key, config in configs.items()}
    implementation = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        return [config for key, config in configs.items() if config._attn_implementation_internal != before[key]
                or config._attn_implementation_internal == NAME]
    finally:
        model.set_attn_implementation(implementation)
        for key, config in configs.items():
            config._attn_implementation_internal = before[key]


# -- the per-row cache ---------------------------------------------------------------------------


@dataclass
class Plan:
    """Where one forward pass writes: rows ``0..batch-1`` of the buffer, at per-row slot ``start``
    (``[batch]``), ``q`` new tokens each; the attention reads slots ``0..width-1``."""

    batch: int
    start: torch.Tensor  # long [batch]
    q: int
    width: int
    first_row: int = 0  # buffer row of batch row 0


@dataclass
class Packed:
    """Where a packed pass writes: each part's tokens (in order, row by row) as that part's :class:`Plan`
    says; the attention is given slots ``0..width-1`` of every buffer row and reads each part's own."""

    parts: list[Plan]

    @property
    def width(self) -> int:
        return max(part.width for part in self.parts)


class RowLayer(CacheLayerMixin):
    """One layer of a :class:`RowCache`: ``keys`` / ``values`` ``[rows, Hkv, capacity, D]``, written in place."""

    is_sliding = False

    def __init__(self, owner: RowCache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("RowCache layers are allocated by the engine")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.owner.plan
        if plan is None:
            raise RuntimeError("RowCache is written only by the engine's forward passes")
        keys, values = self._update(plan, key_states, value_states)
        self.owner.written = (self.index, keys.data_ptr(), tuple(keys.shape))  # what attention must be given
        return keys, values

    def _update(self, plan: Plan | Packed, key_states: torch.Tensor,
                value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(plan, Packed):  # [1, Hkv, N, D]: each part's tokens in turn, row by row
            offset = 0
            for part in plan.parts:
                n = part.batch * part.q
                shape = (key_states.shape[1], part.batch, part.q, key_states.shape[3])
                self._write(part, key_states[0, :, offset : offset + n].reshape(shape).transpose(0, 1),
                            value_states[0, :, offset : offset + n].reshape(shape).transpose(0, 1))
                offset += n
            return self.keys[:, :, : plan.width], self.values[:, :, : plan.width]
        self._write(plan, key_states, value_states)
        rows = slice(plan.first_row, plan.first_row + plan.batch)
        return self.keys[rows, :, : plan.width], self.values[rows, :, : plan.width]

    def _write(self, plan: Plan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write ``[batch, Hkv, q, D]`` new K/V where ``plan`` says."""
        rows = slice(plan.first_row, plan.first_row + plan.batch)
        keys, values = self.keys[rows], self.values[rows]  # views [batch, Hkv, capacity, D]
        if plan.q == 1:  # decode: row b writes its one new token at slot start[b]
            index = torch.arange(plan.batch, device=keys.device)
            start = plan.start.to(keys.device)
            keys[index, :, start] = key_states[:, :, 0]
            values[index, :, start] = value_states[:, :, 0]
        else:  # prefill of joining rows: all start at the same slot
            start = int(plan.start[0])
            keys[:, :, start : start + plan.q] = key_states
            values[:, :, start : start + plan.q] = value_states

    def get_seq_length(self) -> int:
        return 0 if self.owner.plan is None else self.owner.plan.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise RuntimeError("the engine passes its own 4D masks")

    def get_max_length(self) -> int:
        return -1


class RowCache(Cache):
    """Each row's own K/V, preallocated ``[rows, Hkv, capacity, D]`` per layer and written in place
    (no per-step ``torch.cat`` of the whole cache, as ``DynamicCache`` does). Rows ``0..n-1`` are
    the live ones; the engine sets :attr:`plan` before each forward pass."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(layers=[RowLayer(self, index) for index in range(num_layers)])
        self.written: tuple[int, int, tuple[int, ...]] | None = None  # the last layer's update: index, keys
        self.shape = (0, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.plan: Plan | Packed | None = None
        self.reserved = (0, 0)  # rows x slots kept allocated while no row is live (reserve)
        for layer in self.layers:
            layer.keys = torch.zeros(self.shape, dtype=dtype, device=device)
            layer.values = torch.zeros(self.shape, dtype=dtype, device=device)
            layer.is_initialized = True

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def capacity(self) -> int:
        return self.shape[2]

    def nbytes_for(self, rows: int, capacity: int) -> int:
        _, heads, _, dim = self.shape
        return 2 * len(self.layers) * rows * heads * capacity * dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.nbytes_for(self.rows, self.capacity)

    def grow(self, rows: int, capacity: int, live: int) -> None:
        """Reallocate to at least ``rows`` x ``capacity``, keeping the first ``live`` rows."""
        rows, capacity = max(rows, self.rows), max(capacity, self.capacity)
        if (rows, capacity) == (self.rows, self.capacity):
            return
        _, heads, old, dim = self.shape
        self.shape = (rows, heads, capacity, dim)
        for layer in self.layers:
            for name in ("keys", "values"):
                fresh = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
                fresh[:live, :, :old] = getattr(layer, name)[:live]
                setattr(layer, name, fresh)

    def reserve(self, rows: int, capacity: int) -> None:
        """Allocate ``rows`` x ``capacity`` now (no live rows) and keep at least that through :meth:`release`.
        Growing while rows decode pauses them all while the new pages are faulted in (five rows grown to 3,008
        slots, 693 MB: ~1 s on a 2-core VM); a reservation pays that once, up front."""
        self.reserved = (rows, capacity)
        self.release()

    def release(self) -> None:
        """Drop the buffers (no live rows), down to the reservation, which is kept as it is."""
        if (self.rows, self.capacity) == self.reserved:
            return
        self.shape = (0, self.shape[1], 0, self.shape[3])
        for layer in self.layers:
            layer.keys = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            layer.values = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        if self.reserved != (0, 0):
            self.grow(*self.reserved, 0)

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy row ``source``'s first ``length`` slots into row ``target`` (compacting after a row leaves)."""
        for layer in self.layers:
            layer.keys[target, :, :length] = layer.keys[source, :, :length]
            layer.values[target, :, :length] = layer.values[source, :, :length]

    def row_kv(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row ``row``'s first ``length`` slots, per layer ``[1, Hkv, length, D]``."""
        keys = [layer.keys[row : row + 1, :, :length].clone() for layer in self.layers]
        values = [layer.values[row : row + 1, :, :length].clone() for layer in self.layers]
        return keys, values

    def write_row(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write per-layer ``[1, Hkv, n, D]`` K/V into row ``row``'s first ``n`` slots."""
        for layer, k, v in zip(self.layers, keys, values):
            n = k.shape[-2]
            layer.keys[row, :, :n] = k[0]
            layer.values[row, :, :n] = v[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.plan is None else self.plan.width
