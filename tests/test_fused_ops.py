"""The fused bf16 layer ops (C++, AVX512_BF16) against the PyTorch code they replace, which
stays their fallback (models/fused.py): equal but for the last bit of a few elements (a sum
in another order, an exp approximated differently), on widths that do and do not fill a
16-lane vector; and the PyTorch path taken where the C++ one does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hlserve.models import fused
from hlserve.models.cpu_kernels import fused_ops

needs_fused = pytest.mark.skipif(fused_ops() is None,
                                 reason="the fused CPU ops are not built (no AVX512_BF16)")


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    c, s, half = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype), x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, share: float = 0.01,
                      steps: int = 1) -> None:
    """At most ``share`` of the elements differ, each by at most ``steps`` bf16 steps."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = got != want
    assert diff.float().mean().item() <= share
    if diff.any():
        ulp = want.float().abs().clamp(min=1e-30) * 2.0**-7  # a bf16 step at that size
        assert ((got.float() - want.float()).abs() <= ulp * steps * 1.01)[diff].all()


@needs_fused
@pytest.mark.parametrize("rows,width", [(1, 896), (16, 896), (300, 896), (5, 100), (3, 64)])
def test_rms_norm_and_the_residual_add(rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=g).bfloat16()
    a = torch.randn(rows, width, generator=g).bfloat16()
    w = torch.randn(width, generator=g).bfloat16()
    assert_bf16_close(fused.rms_norm(x, w, 1e-6), torch_norm(x, w, 1e-6))
    resid, normed = fused.add_rms_norm(x.clone(), a, w, 1e-6)
    assert torch.equal(resid, x + a)  # the residual add is exact PyTorch bf16 arithmetic
    assert_bf16_close(normed, torch_norm(x + a, w, 1e-6))


@needs_fused
@pytest.mark.parametrize("rows,width", [(16, 4864), (7, 100), (301, 100)])  # 301: threads split mid-row
def test_silu_mul(rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(width)
    gate = (torch.randn(rows, width, generator=g) * 4).bfloat16()
    up = torch.randn(rows, width, generator=g).bfloat16()
    # silu(gate) is rounded to bf16 before the product, as PyTorch does: a step there can
    # become two in the product
    assert_bf16_close(fused.silu_mul(gate, up), F.silu(gate) * up, steps=2)


@needs_fused
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rope_in_place(head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(9, 14, head_dim, generator=g).bfloat16()
    inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = (torch.arange(9).float() + 3000)[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    want = torch_rope(x, emb.cos(), emb.sin())
    got = fused.rope(x.clone(), emb.cos(), emb.sin())
    assert_bf16_close(got, want)


def test_other_dtypes_take_the_pytorch_path() -> None:
    """fp32 (the correctness tests' dtype) never reaches the C++ ops: bit-identical."""
    x, a, w = torch.randn(4, 96), torch.randn(4, 96), torch.randn(96)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), torch_norm(x, w, 1e-5))
    resid, normed = fused.add_rms_norm(x, a, w, 1e-5)
    assert torch.equal(resid, x + a) and torch.equal(normed, torch_norm(x + a, w, 1e-5))
    assert torch.equal(fused.silu_mul(x, a), F.silu(x) * a)
    q = torch.randn(3, 2, 32)
    cos, sin = torch.randn(3, 32), torch.randn(3, 32)
    assert torch.equal(fused.rope(q, cos, sin), torch_rope(q, cos, sin))


@needs_fused
def test_silu_mul_and_rope_read_the_halves_of_a_merged_gemm_output() -> None:
    """gate and up as the two halves of gate_up_proj's [T, 2F] output, q and k as column
    blocks of qkv_proj's: the C++ ops take those views (rows at the merged output's stride)
    and give exactly what they give on contiguous copies."""
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(37, 2 * 100, generator=g) * 4).bfloat16()
    gate, up = gate_up[:, :100], gate_up[:, 100:]
    assert fused._kernel(gate, rows=True) is not None  # the C++ path, not the fallback
    got = fused.silu_mul(gate, up)
    assert got.is_contiguous()
    assert torch.equal(got, fused.silu_mul(gate.contiguous(), up.contiguous()))
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=g).bfloat16()
    cos, sin = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    k = qkv[:, 256:384].view(5, 2, 64)
    want = fused.rope(k.contiguous(), cos, sin)
    before = qkv.clone()
    fused.rope(k, cos, sin)  # in place, through the view
    assert torch.equal(qkv[:, 256:384].view(5, 2, 64), want)
    assert torch.equal(qkv[:, :256], before[:, :256]) and torch.equal(qkv[:, 384:], before[:, 384:])
