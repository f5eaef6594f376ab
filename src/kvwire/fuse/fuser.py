"""The learned fuser: the receiver's own K/V plus a gated projection of the sharer's (C2C's idea).

Every tensor here is in transformers' cache layout ``[B, H, N, D]`` (batch, KV heads,
tokens, head size); ``N`` counts *receiver* tokens: the sharer's K/V arrive already
aligned, one sharer token per receiver token (:func:`gather_sharer`). Per receiver
layer ``t`` that reads sharer layer ``s = layer_map[t]``::

    x      = cat(z(k_s), z(v_s), z(k_t), z(v_t))          heads flattened, standardized  [B, N, F]
    h      = silu(W_in x);  h = h + W_2 silu(W_1 rms(h))  (``blocks`` times)              [B, N, hidden]
    dk, dv = (W_k h) * sd_k, (W_v h) * sd_v               back in the receiver's units    [B, N, H_t * D_t]
    wk, wv = sigmoid(W_w h)                               a weight per token and head     [B, N, H_t] each
    k'     = k_t + g_k * wk * rope(dk)                    v' = v_t + g_v * wv * dv

- **Keys without RoPE**: both models' keys enter position-free (stripped exactly,
  :mod:`kvwire.wire.rope`) and the key projection is rotated to the receiver token's
  position before it is added, so the projector never has to learn two models'
  rotations (C2C's projector reads rotated keys).
- **Standardization** ``z`` and the output scales ``sd`` are per-channel statistics of
  both models' K/V, measured once on training data (:meth:`Fuser.calibrate`) and
  stored with the weights: Qwen-style keys carry large per-channel biases that would
  otherwise swamp the rest.
- **Gates** ``g``: one learned logit per layer for keys and one for values. Training
  samples them with Gumbel noise at a temperature annealed towards 0 (a soft,
  differentiable on/off; ``gate_noise = False``: the annealed sigmoid alone, no
  noise); at inference (``eval()``) a gate is hard: on iff its logit is positive. A layer whose
  gates are off returns the receiver's own K/V untouched (bit for bit), so a fuser with every
  gate off *is* the receiver alone.
- The output layers start at zero: an untrained fuser changes nothing.

Size, for SmolLM2-135M (receiver: 3 KV heads x 64) reading Qwen2.5-Coder-0.5B (2 x 64)
over 24 mapped layers: ``F = 640``; hidden 256 with one block is 12.7M parameters
(51 MB in fp32), hidden 128 with no block 3.2M (13 MB). :meth:`Fuser.parameter_count`
gives the exact figure. Pure torch: no transformers here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..wire import rope as rope_math
from ..errors import FuserError
from ..wire.rope import RopeTable

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FuserConfig:
    """Shapes and size of a fuser. ``layer_map[t]``: the sharer layer receiver layer ``t`` reads (None: not fused)."""

    receiver_kv_heads: int
    receiver_head_dim: int
    sharer_kv_heads: int
    sharer_head_dim: int
    layer_map: tuple[int | None, ...]
    hidden: int = 256  # width of each layer's projector
    blocks: int = 1  # residual feed-forward blocks after the input projection
    gate_init: float = 0.5  # initial gate logit (> 0: on)
    seed: int = 0  # initial weights

    def __post_init__(self) -> None:
        for name in ("receiver_kv_heads", "receiver_head_dim", "sharer_kv_heads", "sharer_head_dim", "hidden"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise FuserError(f"fuser config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.blocks < 0:
            raise FuserError(f"fuser config: blocks must be >= 0, got {self.blocks}")
        if not any(s is not None for s in self.layer_map):
            raise FuserError("fuser config: the layer map fuses no layer", "map at least one receiver layer")

    @property
    def fused_layers(self) -> tuple[int, ...]:
        return tuple(t for t, s in enumerate(self.layer_map) if s is not None)

    @property
    def sharer_layers(self) -> tuple[int, ...]:
        return tuple(sorted({s for s in self.layer_map if s is not None}))

    @property
    def in_features(self) -> int:
        return 2 * (self.sharer_kv_heads * self.sharer_head_dim + self.receiver_kv_heads * self.receiver_head_dim)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_map"] = list(self.layer_map)
        return data

    @classmethod
    def from_json(cls, data: Any) -> FuserConfig:
        if not isinstance(data, dict):
            raise FuserError("fuser config must be a JSON object")
        fields = {f: data[f] for f in cls.__dataclass_fields__ if f in data}
        missing = sorted(set(cls.__dataclass_fields__) - set(data))
        if missing:
            raise FuserError(f"fuser config is missing {missing}")
        layer_map = fields["layer_map"]
        if not isinstance(layer_map, list) or not all(s is None or isinstance(s, int) for s in layer_map):
            raise FuserError("fuser config: layer_map must be a list of ints and nulls")
        return cls(**{**fields, "layer_map": tuple(layer_map)})


class _Block(nn.Module):
    """Pre-norm residual feed-forward block: ``h + W2 silu(W1 rms(h))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=1e-6)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(nn.functional.silu(self.up(self.norm(h))))


class FuserLayer(nn.Module):
    """One receiver layer's projector, weights and gates (see the module docstring)."""

    def __init__(self, config: FuserConfig) -> None:
        super().__init__()
        c = config
        out = c.receiver_kv_heads * c.receiver_head_dim
        self.receiver_heads, self.receiver_dim = c.receiver_kv_heads, c.receiver_head_dim
        self.inp = nn.Linear(c.in_features, c.hidden)
        self.blocks = nn.ModuleList(_Block(c.hidden) for _ in range(c.blocks))
        self.key_out = nn.Linear(c.hidden, out)
        self.value_out = nn.Linear(c.hidden, out)
        self.weight_out = nn.Linear(c.hidden, 2 * c.receiver_kv_heads)
        for linear in (self.key_out, self.value_out):
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)
        self.gate_logits = nn.Parameter(torch.full((2,), float(c.gate_init)))  # keys, values
        # input standardization and output scales: measured by Fuser.calibrate, saved with the weights
        self.register_buffer("in_mean", torch.zeros(c.in_features))
        self.register_buffer("in_std", torch.ones(c.in_features))
        self.register_buffer("key_scale", torch.ones(out))
        self.register_buffer("value_scale", torch.ones(out))

    def gates_on(self) -> tuple[bool, bool]:
        """The hard (inference) gates: is the key / value projection added?"""
        return bool(self.gate_logits[0] > 0), bool(self.gate_logits[1] > 0)

    def features(self, own: KV, sharer: KV) -> torch.Tensor:
        """``[B, N, F]``: both models' K/V of each token, heads flattened, in that order."""
        parts = [x.transpose(1, 2).flatten(2) for x in (*sharer, *own)]  # each [B, N, H * D]
        return torch.cat(parts, dim=-1)

    def forward(self, own: KV, sharer: KV, temperature: float, generator: torch.Generator | None = None,
                noise: bool = True) -> KV:
        """The gated deltas ``(g_k * wk * dk, g_v * wv * dv)`` ``[B, H_t, N, D_t]`` to add to ``own``.

        ``own`` and ``sharer`` are K/V pairs with position-free keys; the caller rotates
        the key delta and adds it.
        """
        own_k, own_v = own
        B, H, N, D = own_k.shape
        x = (self.features(own, sharer) - self.in_mean) / self.in_std  # [B, N, F]
        h = nn.functional.silu(self.inp(x))  # [B, N, hidden]
        for block in self.blocks:
            h = block(h)
        dk = (self.key_out(h) * self.key_scale).view(B, N, H, D).transpose(1, 2)  # [B, H, N, D]
        dv = (self.value_out(h) * self.value_scale).view(B, N, H, D).transpose(1, 2)
        w = torch.sigmoid(self.weight_out(h)).view(B, N, 2, H).permute(2, 0, 3, 1)[..., None]  # [2, B, H, N, 1]
        gate = self._gates(B, H, N, temperature, generator, noise)  # [2, B, H, N, 1]
        return gate[0] * w[0] * dk, gate[1] * w[1] * dv

    def _gates(self, B: int, H: int, N: int, temperature: float, generator: torch.Generator | None,
               noise: bool) -> torch.Tensor:
        logits = self.gate_logits.view(2, 1, 1, 1, 1)
        if not self.training:
            return (logits > 0).to(logits.dtype).expand(2, B, H, N, 1)
        if not noise:  # an annealed sigmoid: smooth early, a step function by the end of training
            return torch.sigmoid(logits / max(temperature, 1e-6)).expand(2, B, H, N, 1)
        u = torch.rand((2, B, H, N, 1), generator=generator, dtype=logits.dtype).clamp(1e-6, 1 - 1e-6)
        noise = torch.log(u) - torch.log1p(-u)  # logistic noise: the difference of two Gumbels
        return torch.sigmoid((logits + noise) / max(temperature, 1e-6))


class Fuser(nn.Module):
    """Per fused receiver layer a :class:`FuserLayer`; :meth:`forward` fuses a whole cache."""

    def __init__(self, config: FuserConfig) -> None:
        super().__init__()
        self.config = config
        self.temperature = 1.0  # of the training gates; the trainer anneals it
        self.gate_noise = True  # training gates: Gumbel-sigmoid samples (True) or an annealed sigmoid
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.layers = nn.ModuleDict({str(t): FuserLayer(config) for t in config.fused_layers})

    # -- size --------------------------------------------------------------------------------------

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def nbytes(self) -> int:
        """Bytes of everything saved (parameters and calibration buffers)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def gates(self) -> dict[int, tuple[bool, bool]]:
        """Receiver layer -> (keys fused, values fused) at inference."""
        return {int(t): layer.gates_on() for t, layer in self.layers.items()}

    # -- fusing ------------------------------------------------------------------------------------

    def forward(self, own_keys: Sequence[torch.Tensor], own_values: Sequence[torch.Tensor],
                sharer: Mapping[int, KV], positions: torch.Tensor, rope: RopeTable | None = None,
                generator: torch.Generator | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fused cache: per receiver layer ``(keys, values)`` ``[B, H_t, N, D_t]``.

        ``own_keys`` / ``own_values``: the receiver's cache (keys rotated, as the model made
        them) for every layer; ``sharer``: sharer layer -> aligned K/V from
        :func:`gather_sharer` (keys position-free); ``positions`` ``[N]``: the receiver
        tokens' positions; ``rope``: the receiver's RoPE table.
        ``generator`` draws the training gates' noise. Unfused layers (and, at inference,
        layers whose gates are off) are returned as given.
        """
        c = self.config
        if len(own_keys) != len(c.layer_map) or len(own_values) != len(c.layer_map):
            raise FuserError(f"the fuser was built for a receiver of {len(c.layer_map)} layers, "
                             f"got a cache of {len(own_keys)}")
        if rope is None:
            raise FuserError("the fuser needs the receiver's RoPE table (kvwire.hf.rope_tables)")
        keys, values = list(own_keys), list(own_values)
        for t_name, layer in self.layers.items():
            t = int(t_name)
            if not self.training and layer.gates_on() == (False, False):
                continue
            k, v = own_keys[t], own_values[t]
            self._check(t, k, sharer.get(c.layer_map[t]))
            dk, dv = layer((rope_math.strip(k, rope, positions), v), sharer[c.layer_map[t]], self.temperature,
                           generator, self.gate_noise)
            dk = rope_math.apply(dk, rope, positions)  # the projection is position-free: rotate it into place
            keys[t] = k + dk if self.training or layer.gates_on()[0] else k
            values[t] = v + dv if self.training or layer.gates_on()[1] else v
        return keys, values

    def _check(self, t: int, own_k: torch.Tensor, sharer: KV | None) -> None:
        c = self.config
        if sharer is None:
            raise FuserError(f"receiver layer {t} reads sharer layer {c.layer_map[t]}, which was not given")
        B, H, N, D = own_k.shape
        if (H, D) != (c.receiver_kv_heads, c.receiver_head_dim):
            raise FuserError(f"receiver layer {t} has K/V [{B}, {H}, {N}, {D}]; the fuser expects "
                             f"{c.receiver_kv_heads} heads of {c.receiver_head_dim}")
        expected = (B, c.sharer_kv_heads, N, c.sharer_head_dim)
        for x in sharer:
            if tuple(x.shape) != expected:
                raise FuserError(f"sharer K/V for receiver layer {t} is {list(x.shape)}, expected {list(expected)} "
                                 "(aligned to the receiver's tokens)")

    # -- calibration -------------------------------------------------------------------------------

    @torch.no_grad()
    def calibrate(self, samples: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor],
                                                Mapping[int, KV], torch.Tensor]],
                  rope: RopeTable) -> None:
        """Set each layer's input standardization and output scales from ``samples``.

        Each sample is ``(own_keys, own_values, sharer, positions)`` as :meth:`forward`
        takes them. Channels are standardized over all samples' tokens; the output
        scales are the receiver's own per-channel spread, so the projector works in
        units where 1 is a typical deviation of the cache it adds to.
        """
        if not samples:
            raise FuserError("calibration needs at least one sample")
        c = self.config
        for t_name, layer in self.layers.items():
            t = int(t_name)
            feats = []
            for own_keys, own_values, sharer, positions in samples:
                own = (rope_math.strip(own_keys[t], rope, positions), own_values[t])
                feats.append(layer.features(own, sharer[c.layer_map[t]]).reshape(-1, c.in_features))
            x = torch.cat(feats).double()
            mean, std = x.mean(0), x.std(0, unbiased=False)
            std = torch.where(std > 1e-6 * (std.max() + 1e-12), std, torch.ones_like(std))
            layer.in_mean.copy_(mean.float())
            layer.in_std.copy_(std.float())
            out = c.receiver_kv_heads * c.receiver_head_dim
            own_std = std[-2 * out:]  # the receiver's keys then values, standardized last
            layer.key_scale.copy_(own_std[:out].float())
            layer.value_scale.copy_(own_std[out:].float())


def gather_sharer(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], index: torch.Tensor,
                  layers: Sequence[int], rope: Sequence[RopeTable] | None = None,
                  positions: torch.Tensor | None = None) -> dict[int, KV]:
    """The sharer's K/V of ``layers``, one sharer token per receiver token: ``{s: (k, v)}`` ``[B, H_s, N, D_s]``.

    ``keys`` / ``values``: the sharer's cache per layer ``[B, H_s, M, D_s]`` (keys rotated
    at ``positions`` ``[M]``, default ``0..M-1``); ``index`` ``[N]``: for each receiver
    token, the sharer token it reads (from the token alignment). With ``rope`` (the
    sharer's tables, one per layer) the keys are returned position-free.

    Example: receiver tokens ``["def", " f", "():"]``, sharer tokens ``["def", " f", "(", "):"]``,
    ``index = [0, 1, 3]``: each receiver token reads the sharer token that ends where it ends.
    """
    M = int(keys[0].shape[-2])
    if index.dim() != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= M)):
        raise FuserError(f"alignment index must be [N] with entries in 0..{M - 1}")
    positions = torch.arange(M) if positions is None else positions
    out = {}
    for s in layers:
        if not 0 <= s < len(keys):
            raise FuserError(f"sharer layer {s} out of range 0..{len(keys) - 1}")
        k = keys[s] if rope is None else rope_math.strip(keys[s], rope[s], positions)
        out[s] = (k[:, :, index].contiguous(), values[s][:, :, index].contiguous())
    return out
