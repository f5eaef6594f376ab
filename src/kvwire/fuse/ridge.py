"""The closed-form baseline: a ridge-regression projection of the sharer's K/V onto the receiver's.

Per receiver layer ``t`` that reads sharer layer ``s = layer_map[t]`` (terminal alignment
by default, as C2C), one linear map over all heads flattened, as C2C projects per layer::

    x = [k_s, v_s, 1]     the aligned sharer token's keys (RoPE stripped) and values   [N, 2 H_s D_s + 1]
    k_t ~ x W_k           the receiver's own keys (RoPE stripped) for the same token   [N, H_t D_t]
    v_t ~ x W_v                                                                        [N, H_t D_t]

fitted on real text both models read (standard library code asked about in a chat,
:mod:`kvwire.fuse.corpus`; each model reads it through its own chat template, as in fuse
mode, and tokens are aligned by :func:`kvwire.fuse.align.align_chat`). The normal equations ``X^T X`` and ``X^T Y`` are
accumulated in float64 as the texts stream through both models, and solved once per
layer: ``W = (X^T X + lambda D)^-1 X^T Y`` (``D`` leaves the bias unpenalized). Lambda is
chosen per layer, for keys and values separately, on a held-out share of the texts,
from ``alpha x mean diag(X^T X)`` over a grid; the held-out R^2 and relative error are
reported, then the map is refitted on all texts. Keys are projected position-free, so
the map never has to model two RoPE bases (1e6 vs 1e5); the projection is rotated to
the receiver token's position afterwards.

**Fusing** (:class:`RidgeProjector`, the :class:`~kvwire.fuse.projector.Projector`
interface): ``fused = own + weight x (projection - own)`` on mapped layers; ``weight = 1``
replaces the receiver's own K/V by the translated sharer K/V, ``0`` is the receiver
alone. Receiver layers the map leaves out keep their own K/V.

Saved in the shared checkpoint format (:mod:`kvwire.fuse.checkpoint`, kind ``"ridge"``):
the weights ``layers.<t>.key`` / ``layers.<t>.value`` ``[2 H_s D_s + 1, H_t D_t]`` and a
config naming both models' fingerprints, the alignment and the layer map; loading it
for another pair is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import hf
from ..wire import rope as rope_math
from ..errors import CheckpointError, FuserError
from ..wire.rope import RopeTable
from ..wire.spec import ModelSpec
from . import align, checkpoint, corpus
from .adapters import LayerStrategy, layer_map

log = logging.getLogger(__name__)

KV = tuple[torch.Tensor, torch.Tensor]
Progress = Callable[[str, int, int], None]  # (stage, done, total): stage "read" (texts) or "solve" (layers)


@dataclass(frozen=True)
class RidgeConfig:
    """How the ridge projector is fitted and applied."""

    layer_map: LayerStrategy = "terminal"
    samples: int = 24  # texts both models read
    chars: int = 1200  # characters of standard library code per text (~400 receiver tokens)
    holdout: float = 0.25  # share of the texts held out to choose lambda and report R^2
    alphas: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # lambda = alpha * mean diag(X^T X)
    weight: float = 1.0  # fusing: own + weight * (projection - own)
    seed: int = 0  # which texts
    scope: align.Scope = "chat"  # each model reads its own chat rendering ("text": both read the receiver's)

    def __post_init__(self) -> None:
        if self.samples < 2 or not 0 < self.holdout < 1:
            raise FuserError(f"ridge needs samples >= 2 and 0 < holdout < 1, got {self.samples}, {self.holdout}")
        if not self.alphas or any(a <= 0 for a in self.alphas):
            raise FuserError("ridge alphas must be positive")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["alphas"] = list(self.alphas)
        return data


class _Moments:
    """Running ``X^T X``, ``X^T Y`` and per-output sums of ``y`` and ``y^2`` (float64); X has a bias column."""

    def __init__(self, d_in: int, d_out: int) -> None:
        self.xtx = torch.zeros(d_in + 1, d_in + 1, dtype=torch.float64)
        self.xty = torch.zeros(d_in + 1, d_out, dtype=torch.float64)
        self.y_sum = torch.zeros(d_out, dtype=torch.float64)
        self.y_sq = torch.zeros(d_out, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)  # [N, d_in + 1]
        y = y.double()
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.y_sum += y.sum(0)
        self.y_sq += (y * y).sum(0)
        self.n += x.shape[0]

    def __iadd__(self, other: _Moments) -> _Moments:
        self.xtx += other.xtx
        self.xty += other.xty
        self.y_sum += other.y_sum
        self.y_sq += other.y_sq
        self.n += other.n
        return self

    def solve(self, alpha: float) -> torch.Tensor:
        """``W`` [d_in + 1, d_out] minimizing ``|XW - Y|^2 + lambda |W without bias row|^2``."""
        d = self.xtx.shape[0]
        scale = float(self.xtx.diagonal()[:-1].mean())
        penalty = torch.full((d,), alpha * scale, dtype=torch.float64)
        penalty[-1] = 0.0
        return torch.linalg.solve(self.xtx + torch.diag(penalty), self.xty)

    def errors(self, w: torch.Tensor) -> tuple[float, float]:
        """``(R^2, relative error)`` of ``w`` on the data these moments describe."""
        sse = float((w * (self.xtx @ w)).sum() - 2 * (w * self.xty).sum() + self.y_sq.sum())
        sst = float((self.y_sq - self.y_sum ** 2 / max(self.n, 1)).sum())
        return 1.0 - sse / sst, (max(sse, 0.0) / float(self.y_sq.sum())) ** 0.5


@dataclass
class LayerFit:
    """One receiver layer's fit: the chosen alphas and the held-out quality of keys and values."""

    layer: int
    sharer_layer: int
    key_alpha: float
    value_alpha: float
    key_r2: float
    value_r2: float
    key_rel_error: float
    value_rel_error: float


@dataclass
class RidgeFit:
    """A fitted projector and how it was made."""

    projector: RidgeProjector
    config: RidgeConfig
    layers: list[LayerFit]
    tokens: int  # receiver tokens fitted on (train + held out)
    held_out_tokens: int
    read_s: float  # both models reading the texts
    solve_s: float  # accumulating is inside read_s; this is lambda selection + final solves
    alignment: str
    corpus: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fit_s(self) -> float:
        return self.read_s + self.solve_s

    def report(self) -> dict[str, Any]:
        mean = {name: sum(getattr(f, name) for f in self.layers) / len(self.layers)
                for name in ("key_r2", "value_r2", "key_rel_error", "value_rel_error")}
        return {"tokens": self.tokens, "held_out_tokens": self.held_out_tokens, "read_s": self.read_s,
                "solve_s": self.solve_s, "fit_s": self.fit_s, "alignment": self.alignment, "corpus": self.corpus,
                "mean": mean, "layers": [asdict(f) for f in self.layers], "config": self.config.to_json()}


class RidgeProjector:
    """Per mapped receiver layer, ``W_k`` and ``W_v`` ``[2 H_s D_s + 1, H_t D_t]``; fuses as the module
    docstring says."""

    def __init__(self, layer_map: Sequence[int | None], weights: Mapping[int, KV], receiver_kv_heads: int,
                 receiver_head_dim: int, weight: float = 1.0) -> None:
        self.layer_map = tuple(layer_map)
        # one layout whatever the weights came from (a solve's column-major result, a checkpoint): the
        # product's blocking, and so its last bits, follow the layout, and a fitted projector and the
        # same one loaded from disk must fuse identically
        self.weights = {t: (k.contiguous(), v.contiguous()) for t, (k, v) in weights.items()}
        self.receiver_kv_heads, self.receiver_head_dim = receiver_kv_heads, receiver_head_dim
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
            raise FuserError(f"a ridge projector's weight must be a number in [0, 1], got {weight!r}",
                             "0 leaves the receiver's own cache, 1 uses the projection alone")
        self.weight = float(weight)
        mapped = {t for t, s in enumerate(self.layer_map) if s is not None}
        if set(self.weights) != mapped:
            raise FuserError(f"ridge weights for layers {sorted(self.weights)} do not match the mapped layers "
                             f"{sorted(mapped)}")

    def project(self, layer: int, sharer: KV) -> KV:
        """Aligned sharer ``(k, v)`` ``[B, H_s, N, D_s]`` (keys position-free) -> receiver-shaped
        ``(k, v)`` ``[B, H_t, N, D_t]`` (keys position-free)."""
        w_k, w_v = self.weights[layer]
        k_s, v_s = sharer
        B, _, N, _ = k_s.shape
        x = torch.cat([k_s.transpose(1, 2).flatten(2), v_s.transpose(1, 2).flatten(2)], dim=-1)  # [B, N, F]
        if x.shape[-1] + 1 != w_k.shape[0]:
            raise FuserError(f"receiver layer {layer}: sharer features {x.shape[-1]}, the projection expects "
                             f"{w_k.shape[0] - 1}")
        x = torch.cat([x, x.new_ones(B, N, 1)], dim=-1).to(w_k.dtype)  # [B, N, F + 1]
        H, D = self.receiver_kv_heads, self.receiver_head_dim
        k = (x @ w_k).view(B, N, H, D).transpose(1, 2)  # [B, H_t, N, D_t]
        v = (x @ w_v).view(B, N, H, D).transpose(1, 2)
        return k.to(k_s.dtype), v.to(v_s.dtype)

    def __call__(self, own_keys: Sequence[torch.Tensor], own_values: Sequence[torch.Tensor],
                 sharer: Mapping[int, KV], positions: torch.Tensor,
                 rope: RopeTable | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The :class:`~kvwire.fuse.projector.Projector` call: fused receiver keys and values per layer."""
        if len(own_keys) != len(self.layer_map):
            raise FuserError(f"the projector was fitted for a receiver of {len(self.layer_map)} layers, "
                             f"got a cache of {len(own_keys)}")
        if rope is None:
            raise FuserError("the ridge projector needs the receiver's RoPE table (keys are projected position-free)")
        keys, values = list(own_keys), list(own_values)
        for t, s in enumerate(self.layer_map):
            if s is None or self.weight == 0:
                continue
            if s not in sharer:
                raise FuserError(f"receiver layer {t} reads sharer layer {s}, which was not given")
            pk, pv = self.project(t, sharer[s])
            pk = rope_math.apply(pk, rope, positions)  # rotation is linear: mixing rotated keys = rotating the mix
            keys[t] = own_keys[t] + self.weight * (pk - own_keys[t])
            values[t] = own_values[t] + self.weight * (pv - own_values[t])
        return keys, values

    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for pair in self.weights.values() for w in pair)

    def parameter_count(self) -> int:
        return sum(w.numel() for pair in self.weights.values() for w in pair)


# -- fitting ---------------------------------------------------------------------------------------------


def fit(receiver: Any, sharer: Any, config: RidgeConfig = RidgeConfig(), progress: Progress | None = None,
        texts: Sequence[list[dict[str, str]]] | None = None) -> RidgeFit:
    """Fit a ridge projector from ``sharer`` to ``receiver`` (each a :class:`~kvwire.fuse.train.Party`:
    model, tokenizer, spec, name) on ``config.samples`` standard library texts (or ``texts``,
    chat messages both models read)."""
    source = "texts given" if texts is not None else corpus.corpus_id()
    if texts is None:
        chunks = corpus.stdlib_chunks(config.samples, config.chars, config.seed)
        texts = [corpus.instruction(chunk, i) for i, chunk in enumerate(chunks)]
    if len(texts) < 2:
        raise FuserError("ridge needs at least two texts (one to fit, one to hold out)")
    r_spec, s_spec = receiver.spec, sharer.spec
    mapping = layer_map(config.layer_map, s_spec.num_layers, r_spec.num_layers)
    d_in = 2 * s_spec.num_kv_heads * s_spec.head_dim
    d_out = r_spec.num_kv_heads * r_spec.head_dim
    mapped = [t for t, s in enumerate(mapping) if s is not None]
    start = time.perf_counter()
    train, held, method = _read(receiver, sharer, texts, config, mapping, (d_in, d_out), progress)
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    weights: dict[int, KV] = {}
    fits = []
    for done, t in enumerate(mapped):
        weights[t], (key, value) = _solve_layer(train[t], held[t], config.alphas, (d_in, d_out))
        fits.append(LayerFit(t, mapping[t], key[0], value[0], key[1], value[1], key[2], value[2]))  # type: ignore[arg-type]
        if progress:
            progress("solve", done + 1, len(mapped))
    solve_s = time.perf_counter() - start
    projector = RidgeProjector(mapping, weights, r_spec.num_kv_heads, r_spec.head_dim, config.weight)
    first = mapped[0]
    return RidgeFit(projector, config, fits, train[first].n + held[first].n, held[first].n, read_s, solve_s,
                    method, source)


def _read(receiver: Any, sharer: Any, texts: Sequence[list[dict[str, str]]], config: RidgeConfig,
          mapping: list[int | None], dims: tuple[int, int],
          progress: Progress | None) -> tuple[dict[int, _Moments], dict[int, _Moments], str]:
    """Both models read every text; each mapped receiver layer's moments gather the sharer's K|V rows
    (``dims[0]`` wide) against the receiver's (``2 * dims[1]``), every ``1 / holdout``-th text held out.
    Returns (training moments, held-out moments, by receiver layer; the alignment method)."""
    d_in, d_out = dims
    mapped = [t for t, s in enumerate(mapping) if s is not None]
    train = {t: _Moments(d_in, 2 * d_out) for t in mapped}
    held = {t: _Moments(d_in, 2 * d_out) for t in mapped}
    r_rope, s_rope = hf.rope_tables(receiver.model, receiver.spec), hf.rope_tables(sharer.model, sharer.spec)
    every = max(2, round(1 / config.holdout))
    held_out = {i for i in range(len(texts)) if i % every == every - 1} or {len(texts) - 1}
    method = ""
    for i, messages in enumerate(texts):
        alignment = _align(receiver, sharer, messages, config.scope)
        method = alignment.method
        own = _stripped(receiver.model, alignment.receiver_ids, r_rope)
        theirs = _stripped(sharer.model, alignment.sharer_ids, s_rope)
        target = held if i in held_out else train
        for t in mapped:
            k_s, v_s = (alignment.gather(x) for x in theirs[mapping[t]])  # type: ignore[index]
            x = torch.cat([_tokens(k_s), _tokens(v_s)], dim=1)  # [N, 2 H_s D_s]
            y = torch.cat([_tokens(own[t][0]), _tokens(own[t][1])], dim=1)  # [N, 2 H_t D_t]
            target[t].add(x, y)
        if progress:
            progress("read", i + 1, len(texts))
    return train, held, method


def _align(receiver: Any, sharer: Any, messages: list[dict[str, str]], scope: str) -> align.Alignment:
    if scope == "chat":
        return align.align_chat(receiver.tokenizer, sharer.tokenizer, messages)
    text = hf.render_chat(receiver.tokenizer, messages, add_generation_prompt=True)
    return align.align_texts(receiver.tokenizer, sharer.tokenizer, text)


AlphaChoice = tuple[float, float, float]  # (alpha, held-out R^2, held-out relative error)


def _solve_layer(train: _Moments, held: _Moments, alphas: Sequence[float],
                 dims: tuple[int, int]) -> tuple[KV, tuple[AlphaChoice, AlphaChoice]]:
    """One layer's key and value weights (``dims``: sharer K|V width, receiver K width): each with the
    alpha of best held-out R^2, then refit on the training and held-out rows together."""
    d_in, d_out = dims
    chosen = []
    for cols in (slice(0, d_out), slice(d_out, 2 * d_out)):  # keys, values
        best: AlphaChoice | None = None
        for alpha in alphas:
            r2, rel = _sub(held, cols).errors(train.solve(alpha)[:, cols])
            if best is None or r2 > best[1]:
                best = (alpha, r2, rel)
        chosen.append(best)
    key, value = chosen
    total = _Moments(d_in, 2 * d_out)
    total += train
    total += held
    w_k = total.solve(key[0])[:, :d_out].float()  # type: ignore[index]
    w_v = total.solve(value[0])[:, d_out:].float()  # type: ignore[index]
    return (w_k, w_v), (key, value)  # type: ignore[return-value]


def _sub(m: _Moments, cols: slice) -> _Moments:
    """The moments of a subset of the outputs."""
    out = _Moments(m.xtx.shape[0] - 1, cols.stop - cols.start)
    out.xtx, out.xty, out.y_sum, out.y_sq, out.n = m.xtx, m.xty[:, cols], m.y_sum[cols], m.y_sq[cols], m.n
    return out


def _tokens(kv: torch.Tensor) -> torch.Tensor:
    """``[1, H, N, D] -> [N, H * D]``: one row per token, heads flattened."""
    return kv[0].transpose(0, 1).flatten(1)


def _stripped(model: Any, ids: Sequence[int], tables: list[RopeTable]) -> list[KV]:
    """Each layer's position-free keys and values ``[1, H, N, D]`` of ``ids`` read from position 0."""
    keys, values = hf.context_kv(model, torch.tensor([list(ids)]))
    positions = torch.arange(len(ids))
    return [(rope_math.strip(k, tables[layer], positions), v) for layer, (k, v) in enumerate(zip(keys, values))]


# -- checkpoints -----------------------------------------------------------------------------------------


def save(path: str | Path, result: RidgeFit, receiver: checkpoint.ModelRef, sharer: checkpoint.ModelRef) -> Path:
    """Write ``result`` as a ridge checkpoint (shared format) for this pair."""
    p = result.projector
    module = {"receiver_kv_heads": p.receiver_kv_heads, "receiver_head_dim": p.receiver_head_dim,
              "sharer_kv_heads": sharer.spec.num_kv_heads, "sharer_head_dim": sharer.spec.head_dim,
              "weight": p.weight, "inputs": "keys+values", "rope_free": True}
    config = checkpoint.CheckpointConfig("ridge", receiver, sharer, result.alignment, p.layer_map, module,
                                         result.report())
    tensors = {f"layers.{t}.{name}": w for t, pair in p.weights.items() for name, w in zip(("key", "value"), pair)}
    return checkpoint.save(path, config, tensors)


def load(path: str | Path, receiver: ModelSpec, sharer: ModelSpec,
         weight: float | None = None) -> tuple[RidgeProjector, checkpoint.CheckpointConfig]:
    """A ridge projector from its checkpoint, refused unless made for exactly this receiver and sharer
    (specs and weight fingerprints). ``weight`` overrides the fusing weight it was saved with."""
    loaded = checkpoint.load(path, kind="ridge", receiver=receiver, sharer=sharer)
    config = loaded.config
    m = config.module
    try:
        heads, dim = int(m["receiver_kv_heads"]), int(m["receiver_head_dim"])
        saved_weight = float(m["weight"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the ridge settings in its config are invalid: {err}") from None
    d_in = 2 * sharer.num_kv_heads * sharer.head_dim + 1
    d_out = heads * dim
    weights = {}
    for t, s in enumerate(config.layer_map):
        if s is None:
            continue
        pair = []
        for name in ("key", "value"):
            w = loaded.weights.get(f"layers.{t}.{name}")
            if w is None or tuple(w.shape) != (d_in, d_out) or w.dtype != torch.float32:
                raise CheckpointError(f"{path}: tensor layers.{t}.{name} is missing or not float32 [{d_in}, {d_out}]")
            pair.append(w)
        weights[t] = (pair[0], pair[1])
    extra = set(loaded.weights) - {f"layers.{t}.{n}" for t in weights for n in ("key", "value")}
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {sorted(extra)[:4]}")
    projector = RidgeProjector(config.layer_map, weights, heads, dim, saved_weight if weight is None else weight)
    return projector, config
