// Vector math shared by the kernels: 16 lanes for the AVX512_BF16 ones (the prefill attention
// kernels, fused_ops.cpp, linear_pairs.cpp), 8 lanes for the AVX2 paths (decode_attention.cpp,
// linear_bf16.cpp).
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace hlserve_avx {

// e^x in fp32, Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial in r,
// scaled by 2^n; inputs are clamped to [-87, 88] (e^-87 is still a normal float)
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
                                 _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// 2^x in fp32 for finite x <= 88 (the tiled prefill kernel's softmax, in log2 units):
// x = n + f with |f| <= 1/2, Cephes' exp2f polynomial in f (~1 ulp), scaled by 2^n. A very
// negative x (a masked score) gives 0: f is 0 there and 2^n underflows.
inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f)), n);
}

// v rounded to bf16 (nearest even) and back to fp32: the value a bf16 tensor would hold
inline __m512 round_bf16(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(b)), 16));
}

// silu(g) * u for bf16 values g and u, with silu(g) rounded to bf16 as PyTorch's bf16 F.silu
// is (the caller rounds the product): fused_ops.cpp's silu_mul and linear_pairs.cpp's gate/up
// epilogue both use it, so the fused GEMM gives the unfused result to the bit
inline __m512 silu_mul_ps(__m512 g, __m512 u) {
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e))), u);
}

}  // namespace hlserve_avx

#endif

#if defined(__AVX2__) && defined(__FMA__)
// ---- 8 lanes (AVX2 + FMA; AVX-512 hosts take it too) -------------------------------------
// exp8 is exp_ps above in 8 lanes, for the decode softmax (a scalar std::exp per score was
// about a tenth of a decode call on an AVX2 host). Its arguments are s - max <= 0: below -87
// they are clamped (e^-87 ~ 1.6e-38, a weight of nothing), which keeps 2^n a normal float;
// a NaN stays NaN (max_ps returns its second operand on NaN). hmax and hsum reduce 8 lanes.
#include <immintrin.h>

namespace hlserve_avx2 {

inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace hlserve_avx2
#endif
