"""The format a model's linear weights are kept and multiplied in: fp32, bf16, int8 or int4 weight-only.

A decode step reads every weight once for one token, so its time is the weights' bytes over
the memory bandwidth: the default model's 518 MB of fp32 linears take ~25 ms a token on a
~21 GB/s CPU before any arithmetic. Smaller weights are faster to read. Chosen at load
(``load_model(..., weights=...)``, ``--weights``); the embeddings, norms, attention and the
KV-cache stay fp32, so caches and packets keep their format and only the weights change. (Embeddings that are
exactly 8-bit block codes, as a GGUF's Q8_0 or Q6_K are, are held as those codes and looked up to the same fp32
bits: :mod:`.embeddings`.)

- ``fp32``: the weights as loaded (:mod:`.linears` picks the product per pass size).
- ``bf16``: each decoder linear and the output layer hold bf16 weights; a pass rounds its
  input to bf16 and computes in bf16 (fp32 accumulation, output rounded to bf16). Passes of
  up to :data:`THIN_ROWS` rows use the thin product ``(W @ x^T)^T``, longer ones ``F.linear`` where the
  CPU multiplies bf16 in hardware (:func:`bf16_native`), else an fp32 product over the weights widened
  to fp32 (the same exact products, 4-8x faster than oneDNN's emulated bf16 there):
  the two sum in different orders, so a row's output can differ in its last bf16 bit between
  a decode step and a prefill (bf16 is **not batch-invariant**; prefix mode stays exact
  against a text-mode run batched the same way, and greedy agreement is tested).
- ``int8``: weight-only int8 with one bf16 scale per output channel (symmetric, round to
  nearest, ``[-127, 127]``), multiplied in fp32 with nothing rounded to bf16 (W8A32): a row's output is
  ``scale * (x . q)``, the dot product of the fp32 input and the codes summed in fp32. Passes of up to
  :data:`INT8_ROWS` rows -- decode steps -- go through kvwire's own kernel (:mod:`.int8_product`: the
  codes widened in registers, one fixed summation order, the same bits whatever the batch); longer
  passes -- prefills -- through an fp32 product over the codes widened to fp32 (:mod:`.linears`), the
  same sums in another order. So int8 is the fp32 model of its weights up to summation order, as fp32
  is between a prefill and a decode step: its answers follow text mode's as fp32's do. (Until
  2026-12-07 int8 went through torch's packed kernel, which takes bf16 rows: rounding every linear's
  input to bf16 turned those fp32-sized differences into whole bf16 steps now and then, and a
  three-agent HumanEval pipeline's final answers matched text mode's on 82 % of tasks against fp32's
  100 %; BENCHMARKS section 11.)
- ``int4``: weight-only 4-bit, the GGUF ``Q4_1`` layout: per group of :data:`INT4_GROUP` inputs
  a bf16 scale and offset, ``w = (q - 8) * scale + zero`` with ``q`` in ``[0, 15]`` (the group's
  minimum and maximum set the step, as ``Q4_1``'s quantizer does, so a model converted from a
  ``Q4_1`` GGUF -- the bundled default -- gets its own 4-bit codes back, only the scales rounded
  to bf16). Passes of up to :data:`INT4_ROWS` rows use torch's packed CPU kernel
  (``aten._weight_int4pack_mm_for_cpu``: the same bits for a row whatever the batch), longer
  ones an fp32 product over the dequantized weights, rounded to bf16 (the kernel's bits on all but
  ~1e-3 of outputs; a bf16 product would be faster but round the weights themselves). A
  linear whose shape the kernel refuses (outputs not a multiple of 16, inputs not of 32) is kept in
  int8 instead. The output layer is int8 (per channel): the bundled GGUF stores it as 8-bit, and 4
  bits there cost the most fidelity. Those int8 layers take bf16 rows as int4's own do
  (:class:`Int8Bf16Linear`: torch's packed int8 kernel, as int8 itself did until it had its own).
  A layer's q/k/v and its gate/up keep their codes in one buffer each (:class:`Int4Group`), so a
  decode step (:mod:`.step`) multiplies each group in one product, with the same bits.

So bf16 and int4 give a row slightly different bits in a prefill and in a decode step, as bf16's thin and
long products do: rounding every linear's input to bf16 turns the fp32 rounding differences between a
prefill's attention and a decode step's into a whole bf16 step now and then. Short greedy runs are
token-identical across modes (tested), but a near-tie can flip (BENCHMARKS section 10: the 256-token
pipeline diverged in bf16 and not in fp32), so fp32 stays the default and the exactness tests' reference.
int8 rounds nothing to bf16, and its answers follow text mode's as fp32's do (BENCHMARKS section 11).

The format is part of the model's spec (``ModelSpec.weights``) and so of its fingerprint: a
cache made under int8 weights is refused by an fp32 agent, with both formats named.

Within :func:`exact_products` a compact linear multiplies its fp32 input by its weights as they are
(dequantized) in fp32, with no bf16 rounding: the model is then the fp32 model of the weights it holds.
Checks of the architecture itself (the RoPE probe, :mod:`.rotary`) run so, to tell what the model computes
from the format's rounding noise.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ModelError
from . import int8_product, linears
from .embeddings import code_embeddings
from ..wire.spec import WEIGHT_FORMATS as FORMATS
DEFAULT = "fp32"
log = logging.getLogger("kvwire")
THIN_ROWS = 32  # bf16: passes of up to this many rows use the thin product
INT8_ROWS = 8  # int4's int8 layers: passes of up to this many rows use torch's packed kernel (bf16 rows)
# int8: passes of up to this many rows use kvwire's kernel (int8_product), longer ones the fp32 product over the codes,
# by the kernel's code. The coder model's linears, 2-core Xeon, ms, kernel / fp32 product: AVX-512 16 rows 124 / 302,
# 48 rows 319 / 415, 64 rows 419 / 487; AVX2 16 rows 148 / 302, 48 rows 404 / 420, 64 rows 556 / 484 (BENCHMARKS
# section 13). On the AVX2-only EPYC the fp32 product (oneDNN) is faster, so AVX2 stops at 16.
KERNEL_ROWS = {"avx512": 48, "avx2": 16}
INT4_GROUP = 32  # int4: inputs sharing one scale and offset (GGUF Q4_1's block)
INT4_ROWS = 32  # int4: passes of up to this many rows use the packed kernel
_QUANTIZE_ROWS = 4096  # rows quantized (int8) or dequantized (exact products) at a time: one block's temporaries

_EXACT: contextvars.ContextVar[bool] = contextvars.ContextVar("kvwire_exact_products", default=False)


@contextlib.contextmanager
def exact_products() -> Iterator[None]:
    """Within this block (in this thread only), compact linears compute ``x @ W^T + b`` in fp32 over the weights
    they hold, with no bf16 rounding of inputs or outputs: what an fp32 model of the same weights computes. Slow
    (every pass dequantizes); for short checks that must not read the format's rounding as the model's."""
    token = _EXACT.set(True)
    try:
        yield
    finally:
        _EXACT.reset(token)


class _CompactLinear(torch.nn.Module):
    """What the compact formats share: fp32 in and out, an fp32 bias added after. A subclass holds its weights
    and gives :meth:`product` (``[rows, in]`` -> ``[rows, out]``); its input is rounded to bf16 first where the
    format's kernels take bf16 (:attr:`rounds_input`: bf16 and int4), and left fp32 where they do not (int8)."""

    rounds_input = True

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(),
                                                                         requires_grad=False)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The weights this layer multiplies by, in fp32 ``[out, in]``."""
        raise NotImplementedError

    def small(self) -> tuple[int, Any]:
        """``(rows, f)``: ``f(flat)`` is :meth:`product` for passes of 1 to ``rows`` contiguous rows (bf16 where
        :attr:`rounds_input`, else fp32), with no checks -- the decode step's (:mod:`.step`) way in."""
        return 0, self.product

    def dequantized_rows(self, rows: slice) -> torch.Tensor:
        """The output rows ``rows`` of :meth:`dequantized` (a subclass that can dequantize them alone does)."""
        return self.dequantized()[rows]

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` in fp32 over the weights held (:func:`exact_products`), dequantized a block of output
        rows at a time: an output layer dequantized whole held 1 GB of temporaries for a 151,936-token vocabulary."""
        flat = x.float()
        if self.out_features <= _QUANTIZE_ROWS:
            return F.linear(flat, self.dequantized(), self.bias).to(x.dtype)
        blocks = [slice(start, start + _QUANTIZE_ROWS) for start in range(0, self.out_features, _QUANTIZE_ROWS)]
        return torch.cat([F.linear(flat, self.dequantized_rows(rows), None if self.bias is None else self.bias[rows])
                          for rows in blocks], dim=-1).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _EXACT.get():
            return self.exact(x)
        flat = x.reshape(-1, self.in_features)
        # contiguous: bf16's thin product is a transposed view, and queries made from one sent sdpa to its slow
        # math kernel (a prefix-mode suffix of 31 tokens after 3,200: 312 against fp32's 275 ms)
        out = self.product(flat.to(torch.bfloat16) if self.rounds_input else flat.float()).to(
            x.dtype, memory_format=torch.contiguous_format)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Bf16Linear(_CompactLinear):
    """A linear layer with bf16 weights; fp32 in, fp32 out (see the module docstring)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def dequantized_rows(self, rows: slice) -> torch.Tensor:
        return self.weight[rows].float()

    def small(self) -> tuple[int, Any]:
        weight = self.weight
        return THIN_ROWS, lambda flat: torch.mm(weight, flat.T if flat.shape[0] > 1 else torch.cat([flat, flat]).T).T[
            : flat.shape[0]]

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        rows = flat.shape[0]
        if 0 < rows <= THIN_ROWS:
            columns = flat if rows > 1 else torch.cat([flat, flat])  # one column takes the slow vector path
            return torch.mm(self.weight, columns.T).T[:rows]
        if bf16_native():
            return F.linear(flat, self.weight)
        # bf16 x bf16 products are exact in fp32: the same sums, rounded once, at fp32's rate (oneDNN's bf16
        # product without bf16 hardware took 4-8x longer: a 256-row pass of a 576 -> 1536 layer 24 against 4 ms)
        return linears.matmul_t(flat.float(), self.weight.float()).to(torch.bfloat16)


class Int8Linear(_CompactLinear):
    """A linear layer with int8 weights and per-output-channel bf16 scales; fp32 in, fp32 out, nothing rounded to
    bf16 on the way (see the module docstring)."""

    rounds_input = False

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach()
        scales = torch.empty(self.out_features, dtype=torch.bfloat16, device=weight.device)
        q = torch.empty(self.out_features, self.in_features, dtype=torch.int8, device=weight.device)
        # a block of rows at a time: every row has its own scale, so the bits are the whole's, and the fp32
        # temporaries are one block's, not the layer's (an output layer's were 1.6 GB for a 151,936-token vocabulary)
        for start in range(0, self.out_features, _QUANTIZE_ROWS):
            rows = slice(start, start + _QUANTIZE_ROWS)
            block = weight[rows].float()  # a view where the weights are fp32: nothing below writes it
            scales[rows] = (block.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.bfloat16).tiny)
            q[rows] = torch.round(block / scales[rows].float()[:, None]).clamp_(-127, 127)
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.scales = torch.nn.Parameter(scales, requires_grad=False)
        # the scales as the products read them (bf16 values, exact in fp32); not saved: made from the above
        self.register_buffer("scales32", scales.float(), persistent=False)

    def dequantized(self) -> torch.Tensor:
        """The weights this layer multiplies by, in fp32 ``[out, in]``."""
        return self.dequantized_rows(slice(None))

    def dequantized_rows(self, rows: slice) -> torch.Tensor:
        return self.weight[rows].float() * self.scales[rows].float()[:, None]

    def small(self) -> tuple[int, Any]:
        if int8_product.available() is not None:
            _warn_no_kernel()
            return 0, self.product
        return kernel_rows(), int8_product.bound(self.weight, self.scales32)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """fp32 ``[rows, in]`` -> fp32 ``[rows, out]``: ``scale * (x . q)`` summed in fp32."""
        flat = flat.float()
        if 0 < flat.shape[0] <= kernel_rows() and flat.device.type == "cpu":
            if int8_product.available() is None:
                return int8_product.product(flat, self.weight, self.scales32)
            _warn_no_kernel()
        # an fp32 product over the codes widened to fp32: the kernel's sums in another order
        return linears.matmul_t(flat, self.weight.float()).mul_(self.scales32)


def kernel_rows() -> int:
    """The most rows an int8 pass multiplies through kvwire's kernel here (:data:`KERNEL_ROWS` by the code it runs;
    the AVX2 figure where it does not run, for the fp32 product then takes every pass)."""
    return KERNEL_ROWS.get(int8_product.variant() or "avx2", KERNEL_ROWS["avx2"])


class Int8Bf16Linear(Int8Linear):
    """int8 codes multiplied by bf16 rows, for the int4 format's int8 layers (its output layer, and linears whose
    shape the int4 kernel refuses): int4's own kernel takes bf16 rows, and these round theirs the same way, as
    int8 did before it had its own kernel. Up to :data:`INT8_ROWS` rows torch's packed kernel
    (``bf16(scale * (bf16(x) . q))``, a row the same bits whatever the batch), longer passes the same sums
    as a bf16 product where the CPU multiplies bf16 in hardware, else an fp32 product over the codes."""

    rounds_input = True

    def small(self) -> tuple[int, Any]:
        kernel, weight, scales = torch.ops.aten._weight_int8pack_mm, self.weight, self.scales
        return INT8_ROWS, lambda flat: kernel(flat, weight, scales)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        if 0 < flat.shape[0] <= INT8_ROWS:
            return torch.ops.aten._weight_int8pack_mm(flat.contiguous(), self.weight, self.scales)
        if bf16_native():  # exact bf16 x int8 products summed in fp32, rounded to bf16, scaled
            return F.linear(flat, self.weight.to(torch.bfloat16)).mul_(self.scales)
        return linears.matmul_t(flat.float(), self.weight.float()).mul_(self.scales32).to(torch.bfloat16)


class Int4Linear(_CompactLinear):
    """A linear layer with 4-bit weights, a bf16 scale and offset per group of :data:`INT4_GROUP` inputs;
    fp32 in, fp32 out (see the module docstring). :func:`int4_fits` says which shapes it takes."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach().float()
        out, inputs = weight.shape
        groups = weight.reshape(out, inputs // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        zero = (low + 8 * scale.float()).to(torch.bfloat16)  # the kernel's form: w = (q - 8) * scale + zero
        q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
        codes = q.reshape(out, inputs).to(torch.uint8)
        # the kernel's packing (its layout is torch's own), and ours for the longer passes: two codes a
        # byte, the even input's in the low nibble -- 1 byte a weight in all, against fp32's 4
        self.packed = torch.nn.Parameter(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2), requires_grad=False)
        self.nibbles = torch.nn.Parameter(codes[:, 0::2] | (codes[:, 1::2] << 4), requires_grad=False)
        # [groups, out, 2]: what the kernel reads
        self.scales_and_zeros = torch.nn.Parameter(torch.stack([scale.T, zero.T], dim=2).contiguous(),
                                                   requires_grad=False)

    @property
    def codes(self) -> torch.Tensor:
        """The 4-bit codes ``q``, uint8 ``[out, in]``."""
        return self._unpacked(torch.uint8)

    def _unpacked(self, dtype: torch.dtype) -> torch.Tensor:
        """The codes as ``dtype`` ``[out, in]``, each nibble written straight into the result."""
        codes = torch.empty(self.out_features, self.in_features // 2, 2, dtype=dtype)
        codes[..., 0] = self.nibbles & 15  # the even input's code sits in the low nibble
        codes[..., 1] = self.nibbles >> 4
        return codes.view(self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The weights this layer multiplies by, in fp32 ``[out, in]``: ``q * scale + (zero - 8 * scale)``, the same
        bits as ``(q - 8) * scale + zero`` (both products exact in fp32, one rounding), with the codes unpacked
        straight into the result (a prefill dequantizes every layer: this way costs half as much)."""
        out, inputs = self.out_features, self.in_features
        scales_and_zeros = self.scales_and_zeros.float()
        scale = scales_and_zeros[..., 0].T.unsqueeze(-1)  # [out, groups, 1]: broadcast, not repeated
        offset = (scales_and_zeros[..., 1] - 8 * scales_and_zeros[..., 0]).T.unsqueeze(-1)
        grouped = self._unpacked(torch.float32).view(out, inputs // INT4_GROUP, INT4_GROUP)
        return grouped.mul_(scale).add_(offset).view(out, inputs)

    def small(self) -> tuple[int, Any]:
        return INT4_ROWS, _int4_kernel(self.packed, self.scales_and_zeros)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        if 0 < flat.shape[0] <= INT4_ROWS:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, INT4_GROUP,
                                                               self.scales_and_zeros)
        # fp32 over the weights as they are: a bf16 product would round them, and a prefill would read other
        # weights than a decode step (~40 % of outputs a bf16 step away; the tiny models' greedy runs flip)
        return linears.matmul_t(flat.float(), self.dequantized()).to(torch.bfloat16)


class Int4Group:
    """Several :class:`Int4Linear` of one input (a layer's q/k/v, its gate/up) multiplied as one product: their
    kernel codes sit in one buffer, each layer's ``packed`` a view of its rows (torch's int4 packing is row by
    row, so the rows of a packed concatenation are each layer's own packing -- tested), nothing duplicated but
    the small scales. A row's outputs are each layer's bits side by side. Not a module: the layers stay the
    model's, and a step (:mod:`.step`) takes the group only while they are the layer's modules."""

    def __init__(self, members: Sequence[Int4Linear]) -> None:
        self.members = tuple(members)
        self.in_features = members[0].in_features
        self.out_features = sum(m.out_features for m in members)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.cat([m.codes for m in members]).to(torch.int32), 2)
        start = 0
        for member in members:  # the kernel packs rows in blocks: a member whose rows do not fill whole blocks
            if not torch.equal(packed[start: start + member.out_features], member.packed):  # is laid out
                raise ValueError("these layers' packed rows do not line up")  # otherwise in the whole
            start += member.out_features
        self.scales_and_zeros = torch.cat([m.scales_and_zeros.detach() for m in members], dim=1).contiguous()
        biases = [m.bias for m in members]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(m.out_features) for b, m in zip(biases, members)])
        start = 0
        for member in members:  # each layer now reads its rows of the one buffer
            member.packed = torch.nn.Parameter(packed[start: start + member.out_features], requires_grad=False)
            start += member.out_features
        self.packed = packed

    def intact(self) -> bool:
        """Every member still reads its rows of this group's buffer (no layer's codes were replaced)."""
        start = 0
        for member in self.members:
            if member.packed.data_ptr() != self.packed[start].data_ptr():
                return False
            start += member.out_features
        return True

    def small(self) -> tuple[int, Any]:
        return INT4_ROWS, _int4_kernel(self.packed, self.scales_and_zeros)


GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}  # what int4 groups


def groups_of(layer: Any) -> dict[str, Int4Group]:
    """The layer's intact :class:`Int4Group` by part (``"self_attn"``, ``"mlp"``); empty for other formats."""
    found = getattr(layer, "kvwire_int4_groups", None) or {}
    return {part: group for part, group in found.items()
            if group.members == tuple(getattr(getattr(layer, part, None), name, None) for name in GROUPS[part])
            and group.intact()}


def _group_int4(layer: Any) -> None:
    groups = {}
    for part, names in GROUPS.items():
        members = [getattr(getattr(layer, part, None), name, None) for name in names]
        if all(isinstance(m, Int4Linear) for m in members) and len({m.in_features for m in members}) == 1:
            try:
                groups[part] = Int4Group(members)
            except ValueError:  # e.g. 32-row members of a tiny model: each keeps its own product
                pass
    object.__setattr__(layer, "kvwire_int4_groups", groups)  # a plain attribute, not a submodule


def _int4_kernel(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> Any:
    """torch's packed int4 product over these codes, for 1 to :data:`INT4_ROWS` contiguous bf16 rows."""
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    return lambda flat: kernel(flat, packed, INT4_GROUP, scales_and_zeros)


@functools.cache
def _warn_no_kernel() -> None:
    """Once per process: int8's short passes run without their kernel, and why."""
    log.warning("int8 decode steps run several times slower here: %s", int8_product.available())


@functools.cache
def bf16_native() -> bool:
    """This CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX, through oneDNN): int8's longer passes
    are bf16 products then, at about twice the rate of fp32's (BENCHMARKS section 10). Elsewhere (AVX-512
    without BF16, AVX2, a CPU whose flags are unknown) oneDNN converts bf16 to fp32 to multiply, and those
    passes stay fp32 products."""
    if not {"avx512_bf16", "amx_bf16"} & linears.cpu_flags():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


def int4_fits(linear: torch.nn.Linear) -> bool:
    """Whether torch's int4 kernel takes ``linear``'s shape (outputs a multiple of 16, inputs of 32)."""
    return linear.out_features % 16 == 0 and linear.in_features % INT4_GROUP == 0


def _int4_or_int8(linear: torch.nn.Linear) -> _CompactLinear:
    return Int4Linear(linear) if int4_fits(linear) else Int8Bf16Linear(linear)


_MODULES = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": _int4_or_int8}
_HEADS = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int8Bf16Linear}


def check_format(weights: str) -> str:
    """``weights`` if this torch and CPU compute it, else :class:`ModelError` naming what is supported.
    Cheap (a few tiny products, once per process); call it before loading any weights."""
    if weights not in FORMATS:
        raise ModelError(f"unknown weight format {weights!r}", f"use one of {', '.join(supported())}")
    if weights not in supported():
        raise ModelError(f"weight format {weights} is not supported by this torch on this CPU",
                         f"use one of {', '.join(supported())}")
    return weights


@functools.cache
def supported() -> tuple[str, ...]:
    """The formats that work here: fp32 always; the others where a tiny product agrees with fp32 (its
    weights are whole steps of 0.01, so 4 bits hold them exactly and only the kernels are tested)."""
    out = ["fp32"]
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_((torch.randint(0, 16, (48, 64), generator=g) - 8) * 0.01)
        x = torch.randn(3, 64, generator=g)
        expected = linear(x)
        for name, module in _MODULES.items():
            try:
                got = module(linear)(x)
                if torch.allclose(got, expected, rtol=0.05, atol=0.05):
                    out.append(name)
            except (RuntimeError, AttributeError, NotImplementedError):
                pass
    return tuple(out)


def check_convertible(config: Any, weights: str) -> None:
    """Refuse ``--weights`` other than fp32 for a model stored quantized (its config names a
    ``quantization_config``) or in a dtype that is not a float: nothing to convert from."""
    if weights == "fp32":
        return
    quantized = getattr(config, "quantization_config", None)
    stored = getattr(config, "dtype", None)
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
        raise ModelError(f"the model is stored quantized ({method}); --weights {weights} converts float weights",
                         "load it with --weights fp32 (its own quantization), or give an unquantized model")
    if stored is not None and str(stored).replace("torch.", "") not in ("float32", "float16", "bfloat16", "float"):
        raise ModelError(f"the model's weights are stored as {stored}, which --weights {weights} cannot convert",
                         "give a model stored in float32, float16 or bfloat16")


def convert(model: Any, weights: str, fill: Callable[[str, torch.nn.Linear], None] | None = None) -> Any:
    """Replace ``model``'s decoder linears and output layer by ``weights``-format ones, in place (fp32:
    nothing changes); records the format as ``model.kvwire_weights``. Returns the model.

    ``fill(name, linear)``, where given, is called just before each linear (``name`` its qualified name in the
    model) is converted: a loader that gives each its weights then (:mod:`.loading`) never holds more than one
    layer's fp32 weights at a time."""
    check_format(weights)
    if weights == "fp32":
        model.kvwire_weights = "fp32"
        return model
    module_type = _MODULES[weights]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not layers:
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__}",
                         "use --weights fp32 for this model")
    names = {id(module): name for name, module in model.named_modules()}
    for layer in layers:
        for name, child in list(layer.named_modules()):
            if type(child) is torch.nn.Linear:
                if fill is not None:
                    fill(f"{names[id(layer)]}.{name}", child)
                parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
                setattr(parent, name.rsplit(".", 1)[-1], module_type(child))
        if weights == "int4":
            _group_int4(layer)
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        if fill is not None:
            fill(names[id(head)], head)
        model.set_output_embeddings(_HEADS[weights](head))  # unties it from the input embeddings, which stay fp32
        model.config.tie_word_embeddings = False
    code_embeddings(model)  # fp32 values, but as 8-bit block codes where they are exactly those (a GGUF's)
    model.kvwire_weights = weights
    return model


def format_of(model: Any) -> str:
    """The weight format ``model`` was loaded in (fp32 unless :func:`convert` changed it)."""
    return str(getattr(model, "kvwire_weights", "fp32"))
