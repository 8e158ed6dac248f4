"""A decoder layer's elementwise ops, each one call: C++ for bf16 on a CPU with AVX512_BF16,
the plain PyTorch below everywhere else (CUDA, fp32, fp16, other CPUs).

At decode batch sizes a layer's norms, RoPE and activation were ~35 small PyTorch ops, and
their dispatch, not their arithmetic, was most of the step's "other model" time; fused, they
are five calls. The PyTorch versions are the reference the C++ ones round like (to bf16 after
each op that PyTorch rounds after), so the two differ only in the order of a sum or the last
bit of an exp. ``HLSERVE_CPU_KERNELS=0`` turns the C++ ones off with the other kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hlserve.models.cpu_kernels import fused_ops


def _kernel(x: torch.Tensor, rows: bool = False) -> object | None:
    """The C++ ops where they apply to ``x``: a contiguous bf16 tensor on the CPU, or with
    ``rows``, one whose rows are contiguous at any row stride (a slice of a merged GEMM's
    output: q and k of qkv_proj, gate and up of gate_up_proj)."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return None
    if not (_contiguous_rows(x) if rows else x.is_contiguous()):
        return None
    return fused_ops()


def _contiguous_rows(x: torch.Tensor) -> bool:
    """Everything after the first dimension laid out as one contiguous block."""
    return x[0].is_contiguous() if x.shape[0] else x.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalised in fp32, cast back, then scaled by the weight."""
    op = _kernel(x)
    if op is not None and weight.dtype == torch.bfloat16:
        return op.rms_norm(x, weight, eps)  # type: ignore[attr-defined,no-any-return]
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` in plain PyTorch: what serves where the C++ op does not, and what it
    rounds like."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a, rms_norm(x + a)): the residual add and the next norm, in one pass. ``x`` may
    be overwritten (it is the residual stream, used by nothing else)."""
    op = _kernel(x)
    if op is not None and weight.dtype == torch.bfloat16 and a.is_contiguous() \
            and a.dtype == x.dtype:
        normed = op.add_rms_norm_(x, a, weight, eps)  # type: ignore[attr-defined]
        return x, normed
    x = x + a
    return x, rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate``, ``up`` [T, F] (the halves of gate_up_proj's output)."""
    op = _kernel(gate, rows=True)
    if op is not None and gate.dim() == 2 and _contiguous_rows(up) and up.dtype == gate.dtype:
        return op.silu_mul(gate, up)  # type: ignore[attr-defined,no-any-return]
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, heads, D] by fp32 ``cos``/``sin`` [T, D], cast to x's
    dtype as the reference does. The C++ op rotates ``x`` in place."""
    op = _kernel(x, rows=True)
    if op is not None and x.shape[-1] % 32 == 0 and cos.is_contiguous() and sin.is_contiguous():
        op.rope_(x, cos, sin)  # type: ignore[attr-defined]
        return x
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
