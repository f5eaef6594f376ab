"""int8 weights times fp32 rows, in fp32 (W8A32), for short passes: kvwire's own kernel, built on first use.

``product(x, q, scales)`` is ``scales * (x @ q^T)`` with nothing rounded to bf16: the int8 codes are widened
to fp32 in registers and multiplied into fp32 sums, one fixed summation order per output whatever the
number of rows (``kernels/int8_product.c``), so a row's output is the same bits alone or batched. torch's
own int8 kernel (``aten._weight_int8pack_mm``) is fast only for bf16 rows: it rounds every linear's input
to bf16, which turned the fp32-sized differences between a prefill and a decode step into whole bf16 steps
now and then (BENCHMARKS section 11: int8's consistency with text mode 0.82 where fp32's is 1.0).

Measured on the AVX2-only AMD EPYC of BENCHMARKS section 11 (2 cores, the coder model's 168 decoder
linears and output layer, best of 5, ms): 1 row 58 (torch's kernel, with its bf16 rounding) / 39 (this
one); 4 rows 85 / 70; 8 rows 172 / 112.

Where the CPU has AVX-512 (F and DQ) the kernel runs its AVX-512 code: the same bits (every output lane sees the
same fused multiply-adds in the same order, two columns side by side in one register), and on a 2-core Xeon
(BENCHMARKS section 13; the coder model's linears, ms, AVX2 / AVX-512) 1 row 38.7 / 31.6, 3 rows 46.8 / 38.4,
4 rows 52.2 / 45.8, 8 rows 90.4 / 70.4. ``KVWIRE_INT8_KERNEL=avx2`` keeps the AVX2 code (``auto``, the default,
takes the widest the CPU runs); :func:`variant` says which runs.

The kernel is C with AVX2 and FMA intrinsics (and AVX-512 ones in functions compiled for it alone), compiled
once with the system's C compiler (``$CC``, else ``cc``) and OpenMP into ``$KVWIRE_HOME/kernels/`` (named by a
hash of its source, flags and compiler), and loaded with ctypes. Where it cannot be (not x86-64 with AVX2 and
FMA, no compiler, a failed build), :func:`available` says why, and :class:`~kvwire.hf.weights.Int8Linear` takes
the same fp32 product over the codes widened to fp32 -- the same numbers up to summation order, several times
slower a decode step -- after one warning naming the cause and the fix.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ModelError
from . import linears

log = logging.getLogger("kvwire")

SOURCE = Path(__file__).with_name("kernels") / "int8_product.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
SYMBOL = "kvwire_int8_product"
VARIANTS = {"avx2": SYMBOL, "avx512": "kvwire_int8_product_avx512"}
ENV = "KVWIRE_INT8_KERNEL"


class Unavailable(Exception):
    """Why the kernel cannot run here (one line, with what to do)."""


def product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """``scales * (x @ q^T)`` in fp32: x fp32 ``[M, K]``, q int8 ``[N, K]``, scales fp32 ``[N]`` (all on the CPU), by
    the kernel's ``variant`` (default: :func:`variant`). Raises :class:`Unavailable` where the kernel cannot be
    built (see :func:`available`) or this CPU does not run the variant."""
    function, reason, _ = _load()
    if function is None:
        raise Unavailable(reason)
    if variant is not None:
        function = _variants()[0].get(variant)
        if function is None:
            raise Unavailable(f"this CPU does not run the {variant} code of kvwire's int8 kernel")
    if x.dtype != torch.float32 or q.dtype != torch.int8 or scales.dtype != torch.float32:
        raise TypeError(f"want fp32 rows, int8 codes and fp32 scales, got {x.dtype}, {q.dtype}, {scales.dtype}")
    if {x.device.type, q.device.type, scales.device.type} != {"cpu"}:
        raise ValueError("kvwire's int8 kernel multiplies tensors on the CPU only")
    if x.dim() != 2 or q.dim() != 2 or q.shape[1] != x.shape[1] or scales.shape != (q.shape[0],):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, q {tuple(q.shape)}, scales {tuple(scales.shape)}")
    (rows, inputs), outputs = x.shape, q.shape[0]
    x, q, scales = x.contiguous(), q.contiguous(), scales.contiguous()
    y = torch.empty(rows, outputs, dtype=torch.float32)
    function(x.data_ptr(), rows, inputs, q.data_ptr(), scales.data_ptr(), outputs, y.data_ptr(),
             torch.get_num_threads())
    return y


def bound(q: torch.Tensor, scales: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(x)`` = ``product(x, q, scales)`` without the checks, for fp32 CPU rows of ``q``'s width: a
    decode step's way in (:mod:`.step`), ~170 calls a step. ``q`` and ``scales`` are checked here, once, and kept
    alive by ``f``."""
    product(torch.zeros(1, q.shape[1]), q, scales)  # the checks, and the kernel built
    function = _load()[0]
    q, scales = q.contiguous(), scales.contiguous()
    inputs, outputs, q_at, scales_at = q.shape[1], q.shape[0], q.data_ptr(), scales.data_ptr()

    def f(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # itself when it is (a step's attention output may be a view)
        y = torch.empty(x.shape[0], outputs, dtype=torch.float32)
        function(x.data_ptr(), x.shape[0], inputs, q_at, scales_at, outputs, y.data_ptr(), torch.get_num_threads())
        return y

    f.keep = (q, scales)  # type: ignore[attr-defined]  # the memory the pointers point into
    return f


def available() -> str | None:
    """None where the kernel runs here, else why not (one line naming the fix). Builds it on first call."""
    return _load()[1]


def variant() -> str | None:
    """Which code the kernel runs here: ``"avx512"`` or ``"avx2"`` (None where it does not run)."""
    return _load()[2]


def wanted() -> str:
    """``KVWIRE_INT8_KERNEL``'s choice, ``auto`` or ``avx2``; any other value is one clear
    :class:`~kvwire.errors.ModelError` (checked when a model loads, before its weights)."""
    return _wanted(os.environ.get(ENV, ""))


@functools.cache
def _wanted(value: str) -> str:
    choice = value.strip().lower() or "auto"
    if choice not in ("auto", "avx2"):
        raise ModelError(f"{ENV}={value!r} is not a choice of kvwire's int8 kernel",
                         f"set {ENV} to auto (the widest code this CPU runs) or avx2, or unset it")
    return choice


def _load() -> tuple[ctypes._CFuncPtr | None, str | None, str | None]:  # type: ignore[name-defined]
    """(the kernel, None, its variant), or (None, why not, None): built and loaded once per process (every pass of
    an int8 prefill asks, so this is a lookup)."""
    return _chosen(wanted())


@functools.cache
def _chosen(choice: str) -> tuple[ctypes._CFuncPtr | None, str | None, str | None]:  # type: ignore[name-defined]
    functions, reason = _variants()
    if not functions:
        return None, reason, None
    name = "avx512" if choice == "auto" and "avx512" in functions else "avx2"
    return functions[name], None, name


@functools.cache
def _variants() -> tuple[dict[str, ctypes._CFuncPtr], str | None]:  # type: ignore[name-defined]
    """({variant: the kernel} for every variant this CPU runs, None), or ({}, why not): once per process."""
    try:
        library = ctypes.CDLL(str(_built()))
    except Unavailable as error:
        return {}, str(error)
    except OSError as error:
        return {}, f"kvwire's int8 kernel does not load ({error}): delete it from $KVWIRE_HOME/kernels to rebuild"
    library.kvwire_int8_has_avx512.restype = ctypes.c_int
    names = ["avx2", "avx512"] if library.kvwire_int8_has_avx512() else ["avx2"]
    functions = {}
    for name in names:
        function = getattr(library, VARIANTS[name])
        function.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
        function.restype = None
        functions[name] = function
    return functions, None


def _built() -> Path:
    """The compiled kernel, built into kvwire's cache folder on first use (atomically: a half-written
    library is never loaded, and two processes building at once both end with a whole one)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not {"avx2", "fma"} <= linears.cpu_flags():
        raise Unavailable(f"this CPU ({platform.machine()}) lacks AVX2 and FMA, which kvwire's int8 kernel needs")
    compiler = os.environ.get("CC") or "cc"
    found = shutil.which(compiler)
    if found is None:
        raise Unavailable(f"no C compiler to build kvwire's int8 kernel ({compiler!r} is not on PATH): "
                          "install one (apt-get install gcc), or set CC to it")
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise Unavailable(f"the C compiler {found} does not run ({error}): install gcc, or set CC to one that works")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + repr((FLAGS, version, found)).encode()).hexdigest()[:16]
    from ..home import home
    try:
        folder = home() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
    except (ModelError, OSError) as error:
        raise Unavailable(f"no folder to build kvwire's int8 kernel in ({error}): set KVWIRE_HOME to a writable one")
    target = folder / f"int8_product-{digest}.so"
    if target.exists():
        return target
    log.info("building kvwire's int8 kernel into %s (once)", target)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        partial = Path(tmp) / target.name
        try:
            done = subprocess.run([found, *FLAGS, "-o", str(partial), str(SOURCE)], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            raise Unavailable(f"building kvwire's int8 kernel failed ({error}): install gcc, or set CC to one that "
                              "works")
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise Unavailable(f"building kvwire's int8 kernel with {found} failed: {last} (install gcc with OpenMP, "
                              "or set CC to one)")
        os.replace(partial, target)
    return target
