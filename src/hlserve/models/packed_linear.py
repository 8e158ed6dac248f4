"""bf16 linear layers on the CPU: weights packed for bf16 dot products (``linear_pairs.cpp``)
or for oneDNN, or computed in fp32 where oneDNN has no bf16 kernels.

A plain bf16 ``F.linear`` on the CPU reorders its weight into oneDNN's blocked layout on every
call; at decode batch sizes that reorder streams the weight twice and halves the layer's
speed (measured, 0.5B shape, 16 rows: 0.90 ms plain, 0.53 ms prepacked per 4864x896 GEMM;
the vocabulary projection 28 ms against 16 ms). Packing once at load time is what
``torch.compile``'s CPU freezing pass does; here it is done directly, without compiling.
The result is bit-identical to ``F.linear`` (tests/test_attention.py), and the packed
weight has the same size as the original, which it replaces (a tied ``lm_head`` keeps its own
packed copy, since the embedding still needs the plain one).

At the few rows of a decode step oneDNN's GEMM streams the weight well below what memory
gives (24 GB/s at 8 rows, 18 at 16, on a 2-core Zen 4), and a decode step is bound by that
stream. So a :class:`PackedLinear` runs ``linear_pairs.cpp`` over a copy of its weight in that
kernel's layout (``cpu_kernels.pairs_linear_ops``, AVX512_BF16 only): 1.1-1.9x faster at 1-32
rows (~50 GB/s at 1-7 rows), and 1.00-1.07x at 64-2,048 (``benchmarks/decode_linears.py``). Its output is the bf16
linear's but for fp32 summation order, as :class:`WideLinear`'s is. Where the CPU has no AMX
the kernel takes every row count and oneDNN's copy is not made; an MLP's merged gate/up
projection then writes SiLU x up from the kernel's epilogue (:meth:`PackedLinear.silu_mul`,
the unfused result to the bit), which made the MLP of a 1,024-row prompt 1.09-1.14x faster
than oneDNN's GEMM and the separate activation pass. Where the CPU has AMX, oneDNN's AMX GEMM
serves calls past :data:`SMALL_ROWS` rows and the kernel's copy is a second one, doubling the
linears' memory: it is left out by itself where it would take more than a quarter of the
memory available when the model loads. ``HLSERVE_CPU_SMALL_GEMM=0`` leaves the kernel out
(oneDNN at every row count).

Where oneDNN has no bf16 kernels (an x86 CPU without AVX512_BF16 or AMX, e.g. AVX2 only),
a bf16 ``F.linear`` falls to a generic loop that runs about 6x slower than fp32's GEMM on the
same core (measured on an AVX2 EPYC, 256 x 896 x 4864: 8.7 against 52.5 GFLOP/s on one
thread). There :class:`WideLinear` computes in fp32 over the bf16 values: PyTorch's bf16
linear also accumulates in fp32 and rounds once, so the output is the same bf16 tensor but
for fp32 summation order (to the bit at one row; elsewhere a few elements in ten thousand,
near zero, within the dot product's error bound; tests/test_attention.py). Few rows (a
decode step's) go to the AVX2 kernel ``linear_bf16`` (``cpu_kernels.linear_op``), which
reads the bf16 weight once and widens it in registers; more rows to fp32's GEMM over an fp32
copy of the weight, so a layer holds three times its bf16 bytes. ``HLSERVE_CPU_WIDE_LINEAR=0``
turns it off; ``HLSERVE_CPU_LINEAR_KERNEL=0`` keeps it but leaves the kernel out (fp32's GEMM
at every row count, for side-by-side measurement).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hlserve.models import fused
from hlserve.models.cpu_kernels import (
    GateUpSilu,
    LinearOp,
    PairsLinear,
    gate_up_silu_op,
    linear_op,
    pairs_linear_ops,
)

log = logging.getLogger("hlserve.models")

_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing applies to bf16 on a CPU whose oneDNN has bf16 kernels."""
    if device.type != "cpu" or dtype != torch.bfloat16 or _PACK is None or _LINEAR is None:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def can_widen(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 linears compute in fp32 on a CPU whose oneDNN has no bf16 kernels (unless
    ``HLSERVE_CPU_WIDE_LINEAR=0``)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if os.environ.get("HLSERVE_CPU_WIDE_LINEAR", "1") == "0":
        return False
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return True


# Where the CPU has AMX, a PackedLinear with a pairs copy runs linear_pairs.cpp up to this many
# rows and oneDNN (whose AMX GEMM outruns bf16 dot products on many rows) past them. Elsewhere
# the kernel takes every row count: on a 2-core Zen 4 it streams a decode step's weights
# 1.1-1.9x faster at 1-32 rows and matches or beats oneDNN's GEMM at 64-2,048 (1.00-1.07x;
# benchmarks/decode_linears.py), so oneDNN's copy is not kept at all.
SMALL_ROWS = 16
ALL_ROWS = 1 << 62

PairsOps = tuple[Callable[[torch.Tensor], torch.Tensor], PairsLinear]


def pairs_rows() -> int:
    """How many rows of a call the decode-size kernel takes on this CPU (see SMALL_ROWS)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return SMALL_ROWS if amx is not None and amx() else ALL_ROWS


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over a weight packed once into oneDNN's layout and, given ``pairs``
    (``cpu_kernels.pairs_linear_ops()``), a copy for ``linear_pairs.cpp``, which serves calls
    of up to ``max_pairs_rows`` rows (past them oneDNN; with ``ALL_ROWS`` no oneDNN copy is
    made).

    Given ``gate_up_silu`` (``cpu_kernels.gate_up_silu_op()``), the layer is an MLP's merged
    gate/up projection ([gate; up] by rows, each ``out_features / 2``, a multiple of 16): its
    pairs copy holds the 16-row blocks of gate and up alternately, and :meth:`silu_mul`
    returns ``silu(gate) * up`` from the kernel's epilogue, without the [rows, 2 x inter]
    output or a pass over it (``forward`` still returns [gate | up])."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 16,
                 pairs: PairsOps | None = None, max_pairs_rows: int = SMALL_ROWS,
                 gate_up_silu: GateUpSilu | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.pairs_op: PairsLinear | None = None
        self.pairs_rows = 0
        self.gate_up_op: GateUpSilu | None = None
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if pairs is not None and self.in_features % 2 == 0:
            pack, self.pairs_op = pairs
            self.pairs_rows = max_pairs_rows
            if gate_up_silu is not None and self.out_features % 32 == 0:
                self.gate_up_op = gate_up_silu
                weight = interleave_gate_up(weight)
                if bias is not None:
                    bias = interleave_gate_up(bias[:, None])[:, 0]
            self.register_buffer("pairs_weight", pack(weight), persistent=False)
        # the bias in the pairs copy's column order
        self.register_buffer("pairs_bias", bias, persistent=False)
        packed = None if self.pairs_rows >= ALL_ROWS else _PACK(linear.weight.detach(), rows_hint)
        self.register_buffer("packed_weight", packed, persistent=False)

    @property
    def fuses_silu_mul(self) -> bool:
        return self.gate_up_op is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.pairs_op is not None and rows <= self.pairs_rows:
            y = self.pairs_op(x.reshape(rows, self.in_features), self.pairs_weight,
                              self.out_features, self.pairs_bias)
            if self.gate_up_op is not None:  # blocks of gate and up alternate: [gate | up]
                y = y.view(rows, -1, 2, 16).transpose(1, 2).reshape(rows, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        return _LINEAR(x, self.packed_weight, self.bias, "none", [], "")

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a merged gate/up layer for 2-D ``x``: the unfused result
        (``fused.silu_mul`` over ``forward``'s bf16 output) to the bit."""
        assert self.gate_up_op is not None, "silu_mul needs a gate/up layer with the kernel"
        rows, inter = x.shape[0], self.out_features // 2
        if rows <= self.pairs_rows:
            return self.gate_up_op(x, self.pairs_weight, inter, self.bias)
        gate_up = self.forward(x)
        return fused.silu_mul(gate_up[:, :inter], gate_up[:, inter:])


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows -> 16 gate rows, the same 16 up rows, the next 16 gate rows, ...: the
    order ``cpu_kernels.gate_up_silu_op()`` reads a packed gate/up weight in."""
    n, k = weight.shape
    return weight.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)


# up to this many rows the AVX2 kernel is at least as fast as fp32's GEMM over the fp32 copy (it
# streams half the bytes, 2-7x faster at 1-16 rows; equal at 64): benchmarks/linear_avx2.py
KERNEL_ROWS = 64


class WideLinear(nn.Module):
    """``y = x W^T + b`` for bf16 ``x``, ``W`` and ``y``, computed in fp32: the same result as
    the bf16 linear, at fp32 speed (the AVX2 kernel for few rows, fp32's GEMM for more)."""

    def __init__(self, linear: nn.Linear, op: LinearOp | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.op = op
        self.register_buffer("weight", linear.weight.detach(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(),
                             persistent=False)
        self.register_buffer("weight32", linear.weight.detach().float(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias32", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.op is not None and rows <= KERNEL_ROWS:
            y = self.op(x.reshape(rows, self.in_features), self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        # one rounding, at the end, as PyTorch's bf16 linear (fp32 accumulation) does
        return F.linear(x.float(), self.weight32, self.bias32).to(self.out_dtype)


def _replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(name, child))
                count += 1
    return count


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def small_gemm_ops(model: nn.Module, rows: int) -> PairsOps | None:
    """The kernel's ops for ``model``'s linears, or None where it is off
    (``HLSERVE_CPU_SMALL_GEMM=0``) or not built, or where it serves only up to ``rows`` <
    ``ALL_ROWS`` rows (:func:`pairs_rows`) beside oneDNN's copy and its own copy (the
    weights' size again) would take more than a quarter of the memory available now.
    Serving every row count, it replaces oneDNN's copy and costs nothing."""
    if os.environ.get("HLSERVE_CPU_SMALL_GEMM", "1") == "0":
        return None
    ops = pairs_linear_ops()
    if ops is None:
        return None
    extra = sum(m.weight.numel() * m.weight.element_size()
                for m in model.modules() if isinstance(m, nn.Linear))
    available = _available_bytes()
    if rows < ALL_ROWS and available is not None and extra > available // 4:
        log.warning("decode-size linear kernel left out: its copy of the weights (%.1f GiB) "
                    "would take over a quarter of the available memory (%.1f GiB)",
                    extra / 2**30, available / 2**30)
        return None
    if rows < ALL_ROWS:
        log.info("decode-size linear kernel up to %d rows: a second copy of the weights, "
                 "%.2f GiB (HLSERVE_CPU_SMALL_GEMM=0 leaves it out)", rows, extra / 2**30)
    else:
        log.info("bf16 linears in linear_pairs.cpp at every row count, SiLU x up in the gate/up "
                 "GEMM (HLSERVE_CPU_SMALL_GEMM=0: oneDNN)")
    return ops


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (with the
    decode-size kernel's copy where :func:`small_gemm_ops` allows it, and SiLU x up fused into
    each ``gate_up_proj``); returns how many."""
    rows = pairs_rows()
    pairs = small_gemm_ops(model, rows)
    silu = gate_up_silu_op() if pairs is not None else None

    def make(name: str, linear: nn.Linear) -> nn.Module:
        return PackedLinear(linear, pairs=pairs, max_pairs_rows=rows,
                            gate_up_silu=silu if name == "gate_up_proj" else None)
    count = _replace_linears(model, make)
    log.info("prepacked %d linear layers for %s (bf16, CPU)", count,
             "linear_pairs.cpp" if pairs is not None and rows >= ALL_ROWS else "oneDNN")
    return count


def widen_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`WideLinear`; returns how many."""
    op = linear_op() if os.environ.get("HLSERVE_CPU_LINEAR_KERNEL", "1") != "0" else None
    count = _replace_linears(model, lambda _, linear: WideLinear(linear, op))
    log.info("%d bf16 linear layers compute in fp32 (%s up to %d rows): this CPU's oneDNN has "
             "no bf16 kernels (HLSERVE_CPU_WIDE_LINEAR=0 keeps them in bf16)", count,
             "the AVX2 kernel" if op is not None else "fp32's GEMM", KERNEL_ROWS)
    return count
