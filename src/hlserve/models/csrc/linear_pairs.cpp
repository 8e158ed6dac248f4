// A bf16 linear for the few rows of a decode step on a CPU with AVX512_BF16: y = x W^T + b,
// x [M, K], W [N, K], y [M, N], over a copy of W packed once for the dot-product instruction.
//
// A decode step's linears are bound by reading the weights, and oneDNN's bf16 GEMM streams
// them at 24 GB/s at 8 rows and 18 GB/s at 16 on a 2-core Zen 4 whose memory gives more
// (benchmarks/decode_linears.py). Here W is stored as [N/32 pairs of column blocks][K/2 pairs
// of k][2 blocks][16 columns][2] (an odd last block alone, [K/2][16][2]): one 64-byte load is
// 16 columns x one pair of k, which vdpbf16ps multiplies by a broadcast pair of one row of x
// and adds into 16 fp32 sums. A task takes a pair of column blocks (32 columns) and walks all
// of K once per group of up to 8 rows (the last group a tile of its own size), the blocks'
// weights read from memory for the first group and from L2 for the others; 8 rows x 2 blocks
// are 16 accumulators. The sums are fp32, rounded once to bf16 (nearest even, after the
// bias), as PyTorch's bf16 linear does: the result differs from it only by fp32 summation
// order. Threads split the column blocks.
//
// The two blocks of a task lie interleaved by pair of k, so that a thread reads its weights
// as one sequential stream, and its first row group prefetches that stream kPrefetch bytes
// ahead into L2: the hardware prefetcher alone does not keep up once 7 rows of dot products
// slow the demand loads. Neither change did much alone; together a 2-core Zen 4 streams a
// decode step's weights at ~50 GB/s at 1-7 rows instead of 31-34, ~1.5x faster, prompt-sized
// calls unchanged (benchmarks/decode_linears.py --against; docs/bench.md).
//
// gate_up_silu is the same GEMM over an MLP's merged gate/up weight packed with its gate and
// up blocks interleaved (gate columns 16j..16j+15, then the same up columns): a task's two
// blocks are then one gate block and its up block, and the tile writes
// bf16(bf16(silu(gate)) * up) instead of both, as silu_mul (fused_ops.cpp) does on the bf16
// GEMM output. The [rows, 2 x intermediate] output and the pass over it are gone, and the
// result is the unfused one to the bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512_math.h"

namespace {

constexpr int64_t kCols = 16;  // columns per block: one vector of fp32 sums
constexpr int kRows = 8;       // rows per register block: 8 x 2 blocks = 16 accumulators
// how far ahead the first row group prefetches its weights into L2: 2 KB was slower than
// none, 4 KB and 8-16 KB no faster than 6 KB (at 7 rows, 2 threads, Zen 4)
constexpr int64_t kPrefetch = 6144;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// The output pointers and sizes of one call.
struct Out {
  uint16_t* y;
  int64_t ldy;  // the output's columns: N, or the intermediate size for kSiluMul
  const float* bias;  // fp32 in the packed column order, padded to whole blocks, or nullptr
};

// What a tile does with its sums: store every block's columns, or (two blocks: a gate block
// and its up block) store bf16(bf16(silu(gate)) * up) in the gate block's columns / 2.
enum class Epi { kStore, kSiluMul };

inline __mmask16 first_lanes(int64_t left) {
  return left >= kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// rows m0..m0+R-1 of x against NB column blocks starting at block b (KP pairs of k each),
// their weights interleaved by pair of k (NB x 16 columns per pair); the first row group
// (kFetch) prefetches the stream ahead
template <int R, int NB, Epi E, bool kFetch>
inline void tile(const uint32_t* x, int64_t KP, const uint32_t* w, int64_t b, int64_t N,
                 const Out& o) {
  __m512 acc[R][NB];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const uint32_t* wb = w + b * KP * kCols;
  for (int64_t kp = 0; kp < KP; ++kp) {
    const uint32_t* wk = wb + kp * NB * kCols;
    if constexpr (kFetch) {  // past the weight's end it is harmless: a prefetch never faults
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wk + j * kCols) + kPrefetch, _MM_HINT_T1);
    }
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_load_si512(wk + j * kCols);
    for (int m = 0; m < R; ++m) {
      const __m512bh xv = as_bh(_mm512_set1_epi32(static_cast<int>(x[m * KP + kp])));
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, as_bh(wv[j]));
    }
  }
  __m512 bias[NB];
  for (int j = 0; j < NB; ++j)
    bias[j] = o.bias ? _mm512_loadu_ps(o.bias + (b + j) * kCols) : _mm512_setzero_ps();
  if constexpr (E == Epi::kSiluMul) {
    static_assert(NB == 2, "a gate block and its up block");
    // the GEMM's bf16 outputs, then silu_mul's arithmetic on them (fused_ops.cpp)
    using hlserve_avx::round_bf16;
    const int64_t col = b / 2 * kCols;
    const __mmask16 mask = first_lanes(N / 2 - col);
    for (int m = 0; m < R; ++m) {
      const __m512 g = round_bf16(_mm512_add_ps(acc[m][0], bias[0]));
      const __m512 u = round_bf16(_mm512_add_ps(acc[m][1], bias[1]));
      const __m256bh v = _mm512_cvtneps_pbh(hlserve_avx::silu_mul_ps(g, u));
      _mm256_mask_storeu_epi16(o.y + m * o.ldy + col, mask, reinterpret_cast<const __m256i&>(v));
    }
  } else {
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (b + j) * kCols;
      const __mmask16 mask = first_lanes(N - col);
      for (int m = 0; m < R; ++m) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], bias[j]));
        _mm256_mask_storeu_epi16(o.y + m * o.ldy + col, mask,
                                 reinterpret_cast<const __m256i&>(v));
      }
    }
  }
}

// rows (1..R) of x against NB column blocks as one tile of exactly that many rows: a
// batch's rows past its 8-row groups walk K once, where split 4 + 2 + 1 they walked it up to
// three times, each walk bound by its loads' latency (5-7 rows ran at oneDNN's speed)
template <int NB, Epi E, bool kFetch, int R = kRows>
inline void tile_of(int64_t rows, const uint32_t* x, int64_t KP, const uint32_t* w, int64_t b,
                    int64_t N, const Out& o) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<NB, E, kFetch, R - 1>(rows, x, KP, w, b, N, o);
  }
  tile<R, NB, E, kFetch>(x, KP, w, b, N, o);
}

// every row of x (M rows) against NB column blocks from block b, in groups of up to kRows
template <int NB, Epi E = Epi::kStore>
void blocks(const uint32_t* x, int64_t M, int64_t KP, const uint32_t* w, int64_t b, int64_t N,
            const Out& o) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {  // later groups find the weights in L2
    const Out om{o.y + m0 * o.ldy, o.ldy, o.bias};
    const int64_t rows = std::min<int64_t>(kRows, M - m0);
    if (m0 == 0)
      tile_of<NB, E, true>(rows, x, KP, w, b, N, om);
    else
      tile_of<NB, E, false>(rows, x + m0 * KP, KP, w, b, N, om);
  }
}

}  // namespace

bool linear_pairs_built() { return true; }

torch::Tensor pack_bf16_pairs(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "pack_bf16_pairs: a bf16 weight [N, K] with K even");
  const torch::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NBk = (N + kCols - 1) / kCols;
  // sized [N/16, K/2, 16, 2], laid out as the header says (pairs of blocks interleaved)
  torch::Tensor out = torch::zeros({NBk, K / 2, kCols, 2}, wc.options());
  const uint32_t* s = reinterpret_cast<const uint32_t*>(wc.data_ptr<at::BFloat16>());
  uint32_t* d = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());
  const int64_t KP = K / 2;
  at::parallel_for(0, NBk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      // block b is the (b % 2)th of its pair, interleaved with the other by pair of k; an odd
      // last block is a pair's first with no second
      const int64_t nb = (b / 2 * 2 + 1 < NBk) ? 2 : 1;
      uint32_t* db = d + (b / 2 * 2 * KP) * kCols + (b % 2) * kCols;
      for (int64_t c = 0; c < kCols && b * kCols + c < N; ++c)
        for (int64_t kp = 0; kp < KP; ++kp) db[kp * nb * kCols + c] = s[(b * kCols + c) * KP + kp];
    }
  });
  return out;
}

namespace {

// x as contiguous rows, once x and the packed weight are checked for the kernel named `name`
torch::Tensor checked_rows(const torch::Tensor& x, const torch::Tensor& packed, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              name, ": bf16 x [M, K] and a weight from pack_bf16_pairs");
  return x.contiguous();
}

const uint32_t* words(const torch::Tensor& t) {  // a bf16 tensor as pairs of values
  return reinterpret_cast<const uint32_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

torch::Tensor linear_bf16_pairs(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                const c10::optional<torch::Tensor>& bias) {
  const torch::Tensor xc = checked_rows(x, packed, "linear_bf16_pairs");
  const int64_t M = xc.size(0), KP = packed.size(1), NBk = packed.size(0);
  TORCH_CHECK(xc.size(1) == 2 * KP && n > (NBk - 1) * kCols && n <= NBk * kCols,
              "linear_bf16_pairs: x's K or n does not match the packed weight");
  torch::Tensor y = torch::empty({M, n}, xc.options());
  torch::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear_bf16_pairs: bias of n elements");
    b32 = torch::zeros({NBk * kCols}, xc.options().dtype(torch::kFloat32));
    b32.narrow(0, 0, n).copy_(*bias);
  }
  const uint32_t *xp = words(xc), *w = words(packed);
  const Out o{reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), n,
              b32.defined() ? b32.data_ptr<float>() : nullptr};
  if (M == 0) return y;
  const int64_t pairs = NBk / 2;
  at::parallel_for(0, pairs, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) blocks<2>(xp, M, KP, w, 2 * p, n, o);
  });
  if (NBk % 2) blocks<1>(xp, M, KP, w, NBk - 1, n, o);
  return y;
}

torch::Tensor gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, int64_t inter,
                           const c10::optional<torch::Tensor>& bias) {
  const torch::Tensor xc = checked_rows(x, packed, "gate_up_silu");
  const int64_t M = xc.size(0), KP = packed.size(1), NBk = packed.size(0);
  TORCH_CHECK(inter % kCols == 0 && NBk * kCols == 2 * inter && xc.size(1) == 2 * KP,
              "gate_up_silu: x's K or the intermediate size (a multiple of 16) does not match "
              "the packed weight");
  torch::Tensor y = torch::empty({M, inter}, xc.options());
  torch::Tensor b32;
  if (bias.has_value() && bias->defined()) {  // [gate | up] -> the packed blocks' order
    TORCH_CHECK(bias->numel() == 2 * inter, "gate_up_silu: bias of 2 x inter elements");
    b32 = bias->to(torch::kFloat32).view({2, inter / kCols, kCols}).transpose(0, 1).contiguous();
  }
  const uint32_t *xp = words(xc), *w = words(packed);
  const Out o{reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), inter,
              b32.defined() ? b32.data_ptr<float>() : nullptr};
  if (M == 0) return y;
  at::parallel_for(0, NBk / 2, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) blocks<2, Epi::kSiluMul>(xp, M, KP, w, 2 * p, 2 * inter, o);
  });
  return y;
}

#else  // no AVX512_BF16: oneDNN (or WideLinear) serves every row count

bool linear_pairs_built() { return false; }

torch::Tensor pack_bf16_pairs(const torch::Tensor&) {
  TORCH_CHECK(false, "pack_bf16_pairs: built without AVX512_BF16");
}

torch::Tensor linear_bf16_pairs(const torch::Tensor&, const torch::Tensor&, int64_t,
                                const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "linear_bf16_pairs: built without AVX512_BF16");
}

torch::Tensor gate_up_silu(const torch::Tensor&, const torch::Tensor&, int64_t,
                           const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "gate_up_silu: built without AVX512_BF16");
}

#endif
