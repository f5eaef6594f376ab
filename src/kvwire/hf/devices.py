"""Where a model may run: :func:`check_device`, before any weights load (torch alone: no transformers)."""

from __future__ import annotations

import torch

from ..errors import ModelError

__all__ = ["check_device"]


def check_device(device: str | torch.device, weights: str = "fp32") -> torch.device:
    """``device`` as a ``torch.device`` if a model can run there with ``weights``, else :class:`ModelError` saying
    what is available. Cheap; call it before loading any weights. The compact formats (:mod:`.weights`) are
    CPU kernels, so an accelerator takes fp32 weights."""
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelError(f"unknown device {str(device)!r}", "use cpu, cuda, cuda:N or mps") from None
    kind = where.type
    if kind == "cpu":
        return where
    if kind == "meta":
        raise ModelError("the meta device holds no weights and computes nothing", "use cpu, cuda, cuda:N or mps")
    backend = torch.backends.mps if kind == "mps" else getattr(torch, kind, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        build = f"this torch {torch.__version__}" + (" (a CPU-only build)" if kind == "cuda" and
                                                    torch.version.cuda is None else "")
        raise ModelError(f"no {kind} device here: {build} sees none", "use --device cpu (the default)")
    count = getattr(backend, "device_count", None)
    if where.index is not None and count is not None and where.index >= count():
        raise ModelError(f"no device {where}: torch sees {count()} {kind} device(s), numbered from 0",
                         f"use {kind}:0..{count() - 1}")
    if weights != "fp32":
        raise ModelError(f"--weights {weights} runs on the CPU only (its products are torch's CPU kernels), "
                         f"not on {where}", f"use --weights fp32 on {where}, or --device cpu")
    return where
