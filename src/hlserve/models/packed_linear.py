"""bf16 linear layers on the CPU: weights prepacked for oneDNN, or computed in fp32 where
oneDNN has no bf16 kernels.

A plain bf16 ``F.linear`` on the CPU reorders its weight into oneDNN's blocked layout on every
call; at decode batch sizes that reorder streams the weight twice and halves the layer's
speed (measured, 0.5B shape, 16 rows: 0.90 ms plain, 0.53 ms prepacked per 4864x896 GEMM;
the vocabulary projection 28 ms against 16 ms). Packing once at load time is what
``torch.compile``'s CPU freezing pass does; here it is done directly, without compiling.
The result is bit-identical to ``F.linear`` (tests/test_packed_linear.py), and the packed
weight has the same size as the original, which it replaces (a tied ``lm_head`` keeps its own
packed copy, since the embedding still needs the plain one).

Where oneDNN has no bf16 kernels (an x86 CPU without AVX512_BF16 or AMX, e.g. AVX2 only),
a bf16 ``F.linear`` falls to a generic loop that runs about 6x slower than fp32's GEMM on the
same core (measured on an AVX2 EPYC, 256 x 896 x 4864: 8.7 against 52.5 GFLOP/s on one
thread). There :class:`WideLinear` keeps the weight in fp32 (the bf16 values, exactly) and
computes in fp32: PyTorch's bf16 linear also accumulates in fp32 and rounds once, so the
output is the same bf16 tensor (bit-identical up to 16 rows; at 200 rows a few elements in
ten thousand differ by one ulp, from summation order; tests/test_attention.py). The price is
twice the weights' memory; ``HLSERVE_CPU_WIDE_LINEAR=0`` turns it off.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

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


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over a weight packed once into oneDNN's layout."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = _PACK(linear.weight.detach(), rows_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR(x, self.packed_weight, self.bias, "none", [], "")


class WideLinear(nn.Module):
    """``y = x W^T + b`` for bf16 ``x`` and ``y``, computed in fp32 over an fp32 copy of a
    bf16 weight: the same result as the bf16 linear, at fp32 GEMM speed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.register_buffer("weight32", linear.weight.detach().float(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias32", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one rounding, at the end, as PyTorch's bf16 linear (fp32 accumulation) does
        return F.linear(x.float(), self.weight32, self.bias32).to(self.out_dtype)


def _replace_linears(model: nn.Module, make: type[nn.Module]) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
                count += 1
    return count


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear`; returns how many."""
    count = _replace_linears(model, PackedLinear)
    log.info("prepacked %d linear layers for oneDNN (bf16, CPU)", count)
    return count


def widen_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`WideLinear`; returns how many."""
    count = _replace_linears(model, WideLinear)
    log.info("%d bf16 linear layers compute in fp32: this CPU's oneDNN has no bf16 kernels "
             "(HLSERVE_CPU_WIDE_LINEAR=0 keeps them in bf16)", count)
    return count
