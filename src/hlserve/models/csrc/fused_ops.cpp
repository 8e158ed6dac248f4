// Fused elementwise ops of a decoder layer for bf16 on the CPU: RMSNorm (with the residual
// add before it), SiLU(gate) x up, and RoPE. Each replaces 2-8 PyTorch ops (and as many passes
// over memory and dispatches) by one; at decode batch sizes the dispatches were most of the
// "other model" time of a step (docs/bench.md).
//
// Each op rounds to bf16 where the PyTorch code it replaces does (models/fused.py keeps that
// code as the fallback), so results differ from it only by the order of a sum or by the
// last bit of an exp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512_math.h"

namespace {

using hlserve_avx::exp_ps;
using hlserve_avx::round_bf16;

inline __m512 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_bf16_n(const uint16_t* p, int n) {  // the first n (< 16) lanes, zeros after
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m256i to_bf16(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return reinterpret_cast<const __m256i&>(b);
}
inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store_bf16_n(uint16_t* p, __m512 v, int n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), to_bf16(v));
}


const uint16_t* cbf(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
uint16_t* mbf(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_rows(const torch::Tensor& x, int64_t width) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(-1) == width,
              "fused op: a contiguous bf16 tensor of width ", width, " expected");
}

// out row = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) over a row of n values, in fp32
void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load_bf16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < n) {
    const __m512 v = load_bf16_n(x + i, static_cast<int>(n - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
  const __m512 vr = _mm512_set1_ps(r);
  for (i = 0; i + 16 <= n; i += 16)
    store_bf16(out + i, _mm512_mul_ps(load_bf16(w + i),
                                      round_bf16(_mm512_mul_ps(load_bf16(x + i), vr))));
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_bf16_n(out + i, _mm512_mul_ps(load_bf16_n(w + i, m),
                                        round_bf16(_mm512_mul_ps(load_bf16_n(x + i, m), vr))), m);
  }
}

}  // namespace

bool fused_ops_built() { return true; }

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const int64_t n = w.numel();
  check_rows(x, n);
  check_rows(w, n);
  auto out = torch::empty_like(x);
  const uint16_t *xd = cbf(x), *wd = cbf(w);
  uint16_t* od = mbf(out);
  at::parallel_for(0, x.numel() / n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xd + r * n, wd, od + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// x <- bf16(x + a) in place (the residual stream), returns rms_norm(x)
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& w,
                            double eps) {
  const int64_t n = w.numel();
  check_rows(x, n);
  check_rows(a, n);
  check_rows(w, n);
  TORCH_CHECK(a.numel() == x.numel());
  auto out = torch::empty_like(x);
  uint16_t* xd = mbf(x);
  const uint16_t *ad = cbf(a), *wd = cbf(w);
  uint16_t* od = mbf(out);
  at::parallel_for(0, x.numel() / n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      uint16_t* xr = xd + r * n;
      const uint16_t* ar = ad + r * n;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) store_bf16(xr + i, _mm512_add_ps(load_bf16(xr + i), load_bf16(ar + i)));
      if (i < n) {
        const int m = static_cast<int>(n - i);
        store_bf16_n(xr + i, _mm512_add_ps(load_bf16_n(xr + i, m), load_bf16_n(ar + i, m)), m);
      }
      norm_row(xr, wd, od + r * n, n, static_cast<float>(eps));
    }
  });
  return out;
}

// gate, up [T, F] -> bf16(bf16(silu(gate)) * up), out [T, F] contiguous. gate and up may be
// the two halves of one [T, 2F] GEMM output (gate_up_proj): rows contiguous, any row stride.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() &&
              gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16 &&
              gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: bf16 gate and up [T, F] with contiguous rows");
  const int64_t T = gate.size(0), F = gate.size(1);
  auto out = torch::empty({T, F}, gate.options());
  const uint16_t *g = cbf(gate), *u = cbf(up);
  const int64_t gs = gate.stride(0), us = up.stride(0);
  uint16_t* o = mbf(out);
  const int64_t per_row = (F + 15) / 16;
  // a chunk's vectors, walked by (row, column) from its first: a 64-bit division per
  // vector to find them cost a fifth of the op (507 x 4,864: 0.85 ms, 0.69 ms without)
  at::parallel_for(0, T * per_row, 1024, [&](int64_t b, int64_t e) {
    int64_t t = b / per_row, i = (b % per_row) * 16;
    for (int64_t c = b; c < e; ++c) {
      const int m = static_cast<int>(std::min<int64_t>(16, F - i));
      const uint16_t *gp = g + t * gs + i, *up_ = u + t * us + i;
      const __m512 gv = m == 16 ? load_bf16(gp) : load_bf16_n(gp, m);
      const __m512 uv = m == 16 ? load_bf16(up_) : load_bf16_n(up_, m);
      const __m512 r = hlserve_avx::silu_mul_ps(gv, uv);
      if (m == 16) store_bf16(o + t * F + i, r);
      else store_bf16_n(o + t * F + i, r, m);
      if ((i += 16) >= F) i = 0, ++t;
    }
  });
  return out;
}

// x [T, heads, D] <- bf16(bf16(x * c) + bf16(rot(x) * s)) in place, c = bf16(cos), s = bf16(sin)
// from fp32 cos/sin [T, D] (rot(x) = [-x[D/2:], x[:D/2]]), as apply_rope in bf16 does. x's
// heads contiguous within a token, tokens at any stride (q or k as a view of one qkv GEMM)
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 &&
              x.stride(1) == x.size(2), "rope_: bf16 x [T, heads, D], heads contiguous");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t xs = x.stride(0);
  TORCH_CHECK(D % 32 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && cos.size(1) == D);
  uint16_t* xd = mbf(x);
  const float *cd = cos.data_ptr<float>(), *sd = sin.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *ct = cd + t * D, *st = sd + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* row = xd + t * xs + h * D;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 lo = load_bf16(row + i), hi = load_bf16(row + half + i);
          const __m512 c0 = round_bf16(_mm512_loadu_ps(ct + i));
          const __m512 c1 = round_bf16(_mm512_loadu_ps(ct + half + i));
          const __m512 s0 = round_bf16(_mm512_loadu_ps(st + i));
          const __m512 s1 = round_bf16(_mm512_loadu_ps(st + half + i));
          // first half: x_lo c - x_hi s; second half: x_hi c + x_lo s (each product rounded)
          const __m512 a0 = round_bf16(_mm512_mul_ps(lo, c0));
          const __m512 b0 = round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), s0));
          const __m512 a1 = round_bf16(_mm512_mul_ps(hi, c1));
          const __m512 b1 = round_bf16(_mm512_mul_ps(lo, s1));
          store_bf16(row + i, _mm512_add_ps(a0, b0));
          store_bf16(row + half + i, _mm512_add_ps(a1, b1));
        }
      }
    }
  });
}

#else  // no AVX512_BF16: these ops stay in PyTorch

bool fused_ops_built() { return false; }
torch::Tensor rms_norm(const torch::Tensor&, const torch::Tensor&, double) {
  TORCH_CHECK(false, "fused ops: built without AVX512_BF16");
}
torch::Tensor add_rms_norm_(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, double) {
  TORCH_CHECK(false, "fused ops: built without AVX512_BF16");
}
torch::Tensor silu_mul(const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "fused ops: built without AVX512_BF16");
}
void rope_(torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "fused ops: built without AVX512_BF16");
}

#endif
