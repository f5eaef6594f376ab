"""How the linear layers of an inference pass are computed on the CPU: the fastest exact fp32 product for its rows.

Every token of a pass is a row multiplied by each weight matrix. ``F.linear(x, W)`` hands
``x @ W^T`` to MKL's sgemm; two other products give the same fp32 dot products, summed in
another blocked order (equal within float rounding, ~1e-6 relative, as batching rows
already is):

- **thin**: ``(W @ x^T)^T``, a product of a few *columns*. For a handful of rows MKL reads
  the weights this way at about twice the rate of ``x @ W^T``. One row is given as two
  columns (the row twice): a single column falls back to the slow matrix-vector path.
- **oneDNN**: ``torch.ops.mkldnn._linear_pointwise`` on the weights as they are (no copy),
  the fp32 matrix product torch's own compiler uses for CPU linears. MKL picks its kernels
  by the CPU's vendor, and on non-Intel CPUs its sgemm runs AVX2 code at about half the
  rate oneDNN's AVX-512 code reaches.

Which one a pass uses is a :class:`Policy`, chosen once per process from the CPU (or
``KVWIRE_LINEARS``), never timed at run time, so two processes on one machine compute
every pass the same way:

- ``mkl`` (Intel CPUs): thin for passes of 1 to 32 rows -- every decode step and short
  prefills -- ``F.linear`` above. Measured on a 2-core Xeon, the 210 decoder linears of the
  default model (SmolLM2-135M, fp32), ``F.linear`` against thin, ms: 1 row 26.9 / 14.2,
  4: 39.6 / 17.4, 8: 40.8 / 30.1, 32: 72.1 / 57.4, 48: 70.3 / 69.5, 64: 87.0 / 90.0.
- ``onednn`` (other x86 CPUs): thin for 1 to 4 rows, oneDNN for every longer pass,
  prefills included. Measured on a 2-core AMD EPYC (same linears, median of 7), ms,
  ``F.linear`` / thin / oneDNN: 1 row 28.1 / 14.3 / 17.8, 2: 40.3 / 13.5 / 20.1,
  4: 41.5 / 21.4 / 23.8, 8: 33.4 / 45.9 / 24.5, 16: 45.3 / 37.8 / 27.0, 32: 61.1 / 54.4 /
  35.5, 128: 162.6 / 155.7 / 84.1; the output layer (49,152 x 576) at 8 rows 12.3 / 12.1 /
  6.0. A 1,700-token prefill: 3.0 -> 1.9 s.
- ``off``: ``F.linear`` everywhere (also where torch has neither MKL nor oneDNN).

``KVWIRE_LINEARS`` = ``auto`` (the default: the CPU decides), ``mkl``, ``onednn`` or
``off``. Only plain fp32 ``nn.Linear`` modules on the CPU, and only where no gradient is
wanted; anything else runs as before. Nothing is copied or kept: the weights are read in
place, so a weight changed or replaced is used as it is. The exactness tests compare
passes computed this way against a recomputation that keeps ``F.linear``
(``generate(use_cache=False)``). :func:`using` and :func:`disabled` set the policy for a
block (tests, and the benchmarks' before-and-after).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ModelError

ENV = "KVWIRE_LINEARS"
CHOICES = ("auto", "mkl", "onednn", "off")


@dataclass(frozen=True)
class Policy:
    """Which product a pass of ``rows`` rows (tokens) uses: thin for ``1..thin_rows`` rows, then oneDNN
    (``onednn``) or ``F.linear``."""

    name: str
    thin_rows: int
    onednn: bool

    def kernel(self, rows: int) -> str | None:
        """``"thin"``, ``"onednn"``, or None for ``F.linear``."""
        if rows < 1:
            return None
        if rows <= self.thin_rows:
            return "thin"
        return "onednn" if self.onednn else None


POLICIES = {
    "mkl": Policy("mkl", 32, False),
    "onednn": Policy("onednn", 4, True),
    "off": Policy("off", 0, False),
}

_forced: Policy | None = None


@functools.cache
def _has_mkl() -> bool:
    return bool(torch.backends.mkl.is_available())


@functools.cache
def _has_onednn() -> bool:
    """torch has oneDNN's fp32 linear on plain weights, and it agrees with ``F.linear`` (with and without bias)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(6, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
        with torch.inference_mode():
            ok = all(torch.allclose(_onednn(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
                     for bias in (None, b))
        return bool(ok)
    except (RuntimeError, AttributeError, TypeError):
        return False


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo (``vendor_id``, ``flags``), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_vendor() -> str:
    return _cpuinfo("vendor_id") or platform.processor()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (``avx512_bf16``, ``amx_bf16``, ...); empty where unknown."""
    return frozenset(_cpuinfo("flags").split())


def _auto() -> Policy:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and "intel" not in _cpu_vendor().lower() and _has_onednn():
        return POLICIES["onednn"]
    return POLICIES["mkl"] if _has_mkl() else POLICIES["off"]


@functools.cache
def _from_env(value: str) -> Policy:
    name = value.strip().lower() or "auto"
    if name not in CHOICES:
        raise ModelError(f"{ENV}={value!r} is not a way to compute linear layers",
                         f"set it to one of {', '.join(CHOICES)}, or unset it (auto)")
    if name == "auto":
        return _auto()
    if name == "onednn" and not _has_onednn():
        raise ModelError(f"{ENV}=onednn, but this torch has no working oneDNN fp32 linear",
                         f"unset {ENV} (auto) or set it to mkl or off")
    if name == "mkl" and not _has_mkl():
        raise ModelError(f"{ENV}=mkl, but this torch runs CPU products without MKL",
                         f"unset {ENV} (auto) or set it to off")
    return POLICIES[name]


def policy() -> Policy:
    """The policy passes use now: the one :func:`using` set, else ``KVWIRE_LINEARS``'s (read when first asked)."""
    return _forced if _forced is not None else _from_env(os.environ.get(ENV, "auto"))


def supported() -> bool:
    """Some pass size is computed other than by ``F.linear`` here (the policy is not ``off``)."""
    return policy().name != "off"


@contextlib.contextmanager
def using(name: str) -> Iterator[Policy]:
    """Within the block every pass uses the named policy (``mkl``, ``onednn`` or ``off``)."""
    global _forced
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
    if name == "onednn" and not _has_onednn():
        raise ModelError("this torch has no working oneDNN fp32 linear", "use mkl or off")
    before, _forced = _forced, POLICIES[name]
    try:
        yield _forced
    finally:
        _forced = before


def disabled() -> contextlib.AbstractContextManager[Policy]:
    """Within the block every pass keeps ``F.linear`` (to measure what the other products gain)."""
    return using("off")


def _eligible(m: Any) -> bool:
    return type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32


_linears_of: weakref.WeakKeyDictionary[Any, tuple[Any, list[torch.nn.Linear]]] = weakref.WeakKeyDictionary()


def _decoder_linears(model: Any) -> list[torch.nn.Linear]:
    """The plain fp32 linears of ``model``'s decoder layers, listed once per layer list (a walk over every
    module cost ~2 ms a pass, 5 % of a decode step). A linear swapped out later is patched in vain and its
    replacement keeps ``F.linear`` -- slower, never wrong; adapters that wrap a linear (peft's LoRA) call it."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None) or ()
    known = _linears_of.get(model)
    if known is None or known[0] is not layers:
        known = _linears_of[model] = (layers, [m for layer in layers for m in layer.modules() if _eligible(m)])
    return known[1]


def _head(model: Any) -> torch.nn.Linear | None:
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return head if _eligible(head) else None


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = linear.weight, linear.bias
    if weight.dtype != torch.float32 or x.dtype != weight.dtype or weight.device.type != "cpu" or \
            x.device != weight.device or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight, bias)  # checked per call: a listed layer may have been moved or cast since
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    kernel = policy().kernel(rows)
    if kernel == "thin":
        columns = flat if rows > 1 else torch.cat([flat, flat])  # one column would take the slow matrix-vector path
        out = torch.mm(weight, columns.T).T[:rows].contiguous()
        if bias is not None:
            out = out + bias
    elif kernel == "onednn":
        out = _onednn(flat.contiguous(), weight, bias)
    else:
        return F.linear(x, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for fp32 ``x`` ``[rows, in]`` and ``weight`` ``[out, in]``: oneDNN where the policy
    computes a pass of these rows so, else ``torch.mm``. The compact formats' longer passes
    (:mod:`.weights`) multiply their dequantized weights this way, so that on a CPU where MKL's sgemm is
    slow they run at the rate fp32's own passes do (a 1,643-token int4 prefill on a 2-core AMD EPYC:
    BENCHMARKS section 10)."""
    if policy().kernel(x.shape[0]) == "onednn" and not (torch.is_grad_enabled() and x.requires_grad):
        return _onednn(x.contiguous(), weight.contiguous(), None)
    return torch.mm(x, weight.T)


@contextlib.contextmanager
def fast_linears(model: Any, rows: int, head_rows: int = 0) -> Iterator[bool]:
    """Within the block, ``model``'s decoder linears use the policy's product for a pass of ``rows`` rows
    (tokens), and its output layer for the ``head_rows`` it computes, where that is not ``F.linear``;
    otherwise nothing changes. Yields whether the output layer is handled so (callers that would slice
    it leave it alone then). Cheap enough to wrap every forward pass."""
    pick = policy()
    layers = pick.kernel(rows) is not None
    head_on = pick.kernel(head_rows) is not None
    if not (layers or head_on) or torch.is_grad_enabled():
        yield False
        return
    head = _head(model) if head_on else None
    chosen = [*(_decoder_linears(model) if layers else ()), *((head,) if head is not None else ())]  # a new list:
    # the decoder's is cached per model, and appending the head to it grew it by one every pass
    for linear in chosen:  # an instance attribute: nn.Module.__call__ finds it before the class's forward
        linear.__dict__["forward"] = functools.partial(_forward, linear)
    try:
        yield head is not None
    finally:
        for linear in chosen:
            linear.__dict__.pop("forward", None)
