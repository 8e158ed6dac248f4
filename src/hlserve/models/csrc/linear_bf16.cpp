// A bf16 linear for the few rows of a decode step, on a CPU without bf16 dot products (AVX2
// and FMA, no AVX512_BF16): y = x W^T + b with x [M, K], W [N, K] and y [M, N] in bf16.
//
// There PyTorch's bf16 linear runs a generic loop (about 6x slower than fp32's GEMM), and an
// fp32 copy of W doubles the bytes a decode step streams. This kernel reads W in bf16 once per
// call, widens each 8-lane slice in registers (a bf16 is the top half of an fp32) and
// accumulates in fp32, MR rows by NR weight rows at a time, the rows of x widened once into
// an fp32 buffer. One rounding at the end (bias added first), as PyTorch's bf16 linear does:
// the result differs from it only by fp32 summation order. Threads split N.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "avx512_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kNR = 3;  // weight rows per tile: 4 x 3 accumulators + 3 + 1 = 16 registers

inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float widen1(c10::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// acc[m][n] = sum_k x[m][k] w[n][k] for MR rows of x (fp32, stride K) and NR rows of w
template <int MR, int NR>
inline void tile(const float* x, const c10::BFloat16* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = widen8(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hlserve_avx2::hsum(acc[m][n]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * widen1(w[n * K + kk]);
      out[m * ldo + n] = s;
    }
}

template <int NR>
inline void rows(const float* x, const c10::BFloat16* w, int64_t M, int64_t K, float* out,
                 int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, NR>(x + m * K, w, K, out + m * ldo, ldo);
  switch (M - m) {
    case 3: tile<3, NR>(x + m * K, w, K, out + m * ldo, ldo); break;
    case 2: tile<2, NR>(x + m * K, w, K, out + m * ldo, ldo); break;
    case 1: tile<1, NR>(x + m * K, w, K, out + m * ldo, ldo); break;
    default: break;
  }
}

}  // namespace

bool linear_bf16_built() { return true; }

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16,
              "linear_bf16: bf16 x and weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_bf16: x [M, K] and weight [N, K]");
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  const torch::Tensor xf = xc.to(torch::kFloat32);  // each row of x widened once
  torch::Tensor acc = torch::empty({M, N}, xc.options().dtype(torch::kFloat32));
  const float* xp = xf.data_ptr<float>();
  const c10::BFloat16* wp = wc.data_ptr<c10::BFloat16>();
  float* ap = acc.data_ptr<float>();
  const int64_t tiles = (N + kNR - 1) / kNR;
  // grain: about 64 weight rows per task, so a thread streams long runs of W
  at::parallel_for(0, tiles, 21, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kNR, nr = std::min<int64_t>(kNR, N - n);
      const c10::BFloat16* wt = wp + n * K;
      if (nr == 3) rows<3>(xp, wt, M, K, ap + n, N);
      else if (nr == 2) rows<2>(xp, wt, M, K, ap + n, N);
      else rows<1>(xp, wt, M, K, ap + n, N);
    }
  });
  if (bias.has_value() && bias->defined()) acc.add_(bias->to(torch::kFloat32));
  return acc.to(torch::kBFloat16);  // round to nearest even, once
}

#else  // no AVX2/FMA: bf16 linears stay in PyTorch

bool linear_bf16_built() { return false; }

torch::Tensor linear_bf16(const torch::Tensor&, const torch::Tensor&,
                          const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "linear_bf16: built without AVX2 and FMA");
}

#endif
