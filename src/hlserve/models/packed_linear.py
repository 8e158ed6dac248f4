"""bf16 linear layers on the CPU: weights prepacked for oneDNN, or computed in fp32 where
oneDNN has no bf16 kernels.

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
stream. So up to :data:`SMALL_ROWS` rows a :class:`PackedLinear` runs ``linear_pairs.cpp``
over a second copy of its weight in that kernel's layout (``cpu_kernels.pairs_linear_ops``,
AVX512_BF16 only): 1.1-1.7x faster at 1-16 rows (``benchmarks/decode_linears.py``). Its
output is the bf16 linear's but for fp32 summation order, as :class:`WideLinear`'s is. The
copy doubles the linears' memory; ``HLSERVE_CPU_SMALL_GEMM=0`` leaves it out (oneDNN at every
row count), and it is left out by itself where it would take more than a quarter of the
memory available when the model loads.

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

from hlserve.models.cpu_kernels import LinearOp, PairsLinear, linear_op, pairs_linear_ops

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


# Up to this many rows a PackedLinear with a pairs copy runs linear_pairs.cpp: at 1-16 rows it
# streams the weight 1.1-1.7x faster than oneDNN's GEMM, at 32 they are equal
# (benchmarks/decode_linears.py, Zen 4).
SMALL_ROWS = 16

PairsOps = tuple[Callable[[torch.Tensor], torch.Tensor], PairsLinear]


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over a weight packed once into oneDNN's layout and, given ``pairs``
    (``cpu_kernels.pairs_linear_ops()``), a second copy for ``linear_pairs.cpp``, which
    serves calls of up to :data:`SMALL_ROWS` rows."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 16,
                 pairs: PairsOps | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = _PACK(linear.weight.detach(), rows_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias
        self.pairs_op: PairsLinear | None = None
        if pairs is not None and self.in_features % 2 == 0:
            pack, self.pairs_op = pairs
            self.register_buffer("pairs_weight", pack(linear.weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.pairs_op is not None and rows <= SMALL_ROWS:
            y = self.pairs_op(x.reshape(rows, self.in_features), self.pairs_weight,
                              self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return _LINEAR(x, self.packed_weight, self.bias, "none", [], "")


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


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
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


def small_gemm_ops(model: nn.Module) -> PairsOps | None:
    """The decode-size kernel's ops for ``model``'s linears, or None where it is off
    (``HLSERVE_CPU_SMALL_GEMM=0``), not built, or its copy of the weights (their size again)
    would take more than a quarter of the memory available now."""
    if os.environ.get("HLSERVE_CPU_SMALL_GEMM", "1") == "0":
        return None
    ops = pairs_linear_ops()
    if ops is None:
        return None
    extra = sum(m.weight.numel() * m.weight.element_size()
                for m in model.modules() if isinstance(m, nn.Linear))
    available = _available_bytes()
    if available is not None and extra > available // 4:
        log.warning("decode-size linear kernel left out: its copy of the weights (%.1f GiB) "
                    "would take over a quarter of the available memory (%.1f GiB)",
                    extra / 2**30, available / 2**30)
        return None
    log.info("decode-size linear kernel up to %d rows: a second copy of the weights, %.2f GiB "
             "(HLSERVE_CPU_SMALL_GEMM=0 leaves it out)", SMALL_ROWS, extra / 2**30)
    return ops


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (with the
    decode-size kernel's copy where :func:`small_gemm_ops` allows it); returns how many."""
    pairs = small_gemm_ops(model)
    count = _replace_linears(model, lambda linear: PackedLinear(linear, pairs=pairs))
    log.info("prepacked %d linear layers for oneDNN (bf16, CPU)", count)
    return count


def widen_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`WideLinear`; returns how many."""
    op = linear_op() if os.environ.get("HLSERVE_CPU_LINEAR_KERNEL", "1") != "0" else None
    count = _replace_linears(model, lambda linear: WideLinear(linear, op))
    log.info("%d bf16 linear layers compute in fp32 (%s up to %d rows): this CPU's oneDNN has "
             "no bf16 kernels (HLSERVE_CPU_WIDE_LINEAR=0 keeps them in bf16)", count,
             "the AVX2 kernel" if op is not None else "fp32's GEMM", KERNEL_ROWS)
    return count
