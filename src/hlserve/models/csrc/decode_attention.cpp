// Paged decode attention for the CPU: one query token per sequence, read in place from the
// head-major page pool (no gather, no copy of the context).
//
// q        [B, H, D]           one query row per decoding sequence
// k_cache  [KVH, P, S, D]      the layer's page pool (v_cache the same)
// pages    [N] int64           the page tables of all B sequences, concatenated
// page_lo  [B] int64           where sequence b's table starts in `pages`
// lens     [B] int64           keys sequence b attends to (its context and itself)
//
// One task per (sequence, KV head): the G = H / KVH query heads of that KV head are scored
// against each page's rows as they are read (K and V each read once per task), in fp32.
// Exact softmax in two passes over a [G, L] score buffer. Built at first use by
// hlserve.models.cpu_kernels with -O3 -march=native: explicit AVX-512 or AVX2 (+ FMA) paths
// where the CPU has them, portable loops (vectorised by the compiler) elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

#include "avx512_math.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_rows(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// The rows of one sequence's context in order, read through its page table: the page and the
// offset in it advance with the row, so no row pays a 64-bit division (l / S, l % S). Each
// row read prefetches the same row of the next page: pages lie anywhere in the pool, so the
// hardware prefetchers, which follow one address stream, miss every page's start, and the
// kernel waited on memory for most of its time on an AVX2 host. (A whole page prefetched at
// its first row stalled on the CPU's outstanding-miss limit.)
template <typename T>
struct RowCursor {
  const T* base;
  const int64_t* table;
  int64_t S, D, num_pages, page = 0, off = 0;
  const T* next() {
    if (page + 1 < num_pages) {
      const char* ahead = reinterpret_cast<const char*>(base + (table[page + 1] * S + off) * D);
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
        __builtin_prefetch(ahead + b, 0, 3);
    }
    const T* row = base + (table[page] * S + off) * D;
    if (++off == S) off = 0, ++page;
    return row;
  }
};

#if defined(__AVX512F__)
// ---- AVX-512 path (bf16 / fp16 / fp32 pools, head_dim a multiple of 16) -------------------
// Scores: a tile of 16 keys is converted to fp32 once; each query row's 16 dot products are
// summed into one vector by a transpose-reduce (no horizontal add per key). Values: blocks
// of 16 keys into an fp32 [G][D] accumulator in L1, G accumulators in registers per 16-lane
// slice. Both passes read rows through RowCursor (page walk without division, prefetch).
#include <immintrin.h>

namespace avx {

constexpr int64_t LANES = 16;  // fp32 lanes per vector: head_dim must be a multiple

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// v[0..15] -> one vector whose lane pos(r) is the sum of v[r]'s lanes (see row_lane)
inline __m512 transpose_reduce(__m512* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88),
                         _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[i], v[i + 2], 0x44),
                         _mm512_shuffle_ps(v[i], v[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

// the lane that transpose_reduce puts row r's sum in
inline int row_lane(int r) {
  const int quarter[4] = {0, 2, 1, 3};  // row bits 2-3 (offsets 0, 4, 8, 12) -> quarter
  const int within[4] = {0, 2, 1, 3};   // row bits 0-1 -> lane within the quarter
  return 4 * quarter[(r >> 2) & 3] + within[r & 3];
}

template <typename T>
void scores_pass(const float* __restrict qf, const T* __restrict kbase,
                 const int64_t* __restrict table, int64_t len, int64_t S, int64_t G,
                 int64_t D, float* __restrict scores /* [G][len] */) {
  alignas(64) float tile[16 * 256];
  int lane_of[16];
  for (int r = 0; r < 16; ++r) lane_of[r] = row_lane(r);
  __m512i perm;
  {
    alignas(64) int idx[16];
    for (int r = 0; r < 16; ++r) idx[r] = lane_of[r];  // out lane r <- reduced lane of row r
    perm = _mm512_load_si512(idx);
  }
  const int64_t C = D / 16;
  RowCursor<T> keys{kbase, table, S, D, (len + S - 1) / S};
  for (int64_t l0 = 0; l0 < len; l0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - l0);
    for (int64_t r = 0; r < 16; ++r) {
      float* dst = tile + r * D;
      if (r < n) {
        const T* kr = keys.next();
        for (int64_t c = 0; c < C; ++c) _mm512_store_ps(dst + 16 * c, load16(kr + 16 * c));
      } else {
        for (int64_t c = 0; c < C; ++c) _mm512_store_ps(dst + 16 * c, _mm512_setzero_ps());
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_load_ps(tile + r * D));
      for (int64_t c = 1; c < C; ++c) {
        const __m512 qc = _mm512_loadu_ps(qg + 16 * c);
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_fmadd_ps(qc, _mm512_load_ps(tile + r * D + 16 * c), acc[r]);
      }
      const __m512 s = _mm512_permutexvar_ps(perm, transpose_reduce(acc));
      float* out = scores + g * len + l0;
      if (n == 16) _mm512_storeu_ps(out, s);
      else _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), s);
    }
  }
}

// acc[g][0..D) += sum over the block's n rows of w[g][ls[r]] * v[r], for GT rows g: per
// 16-lane slice of head_dim, the GT accumulators stay in registers over the block's rows
template <typename T, int GT>
inline void values_slices(const float* __restrict w, int64_t len, const T* const* rows,
                          const int64_t* ls, int64_t n, int64_t D, float* __restrict acc) {
  for (int64_t c = 0; c < D; c += 16) {
    __m512 a[GT];
    for (int g = 0; g < GT; ++g) a[g] = _mm512_loadu_ps(acc + g * D + c);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 v = load16(rows[r] + c);
      for (int g = 0; g < GT; ++g)
        a[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * len + ls[r]]), v, a[g]);
    }
    for (int g = 0; g < GT; ++g) _mm512_storeu_ps(acc + g * D + c, a[g]);
  }
}

}  // namespace avx
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// ---- AVX2 path (bf16 / fp16 / fp32 pools, head_dim a multiple of 8) ----------------------
// The AVX-512 path's shape in 8 lanes. Scores: a tile of 8 keys is widened to fp32 once;
// each query row's 8 dot products are summed into one vector by a horizontal-add transpose.
// Values: blocks of up to 16 keys (from any pages) into an fp32 [G][D] accumulator that
// stays in L1, one 8-lane slice of head_dim at a time, G accumulators in registers.
#include <immintrin.h>

namespace avx2 {

constexpr int64_t LANES = 8;  // fp32 lanes per vector: head_dim must be a multiple

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// v[0..7] -> one vector whose lane r is the sum of v[r]'s lanes
inline __m256 transpose_reduce(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <typename T>
void scores_pass(const float* __restrict qf, const T* __restrict kbase,
                 const int64_t* __restrict table, int64_t len, int64_t S, int64_t G,
                 int64_t D, float* __restrict scores /* [G][len] */) {
  alignas(32) float tile[8 * 256];
  const int64_t C = D / 8;
  RowCursor<T> keys{kbase, table, S, D, (len + S - 1) / S};
  for (int64_t l0 = 0; l0 < len; l0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - l0);
    for (int64_t r = 0; r < 8; ++r) {
      float* dst = tile + r * D;
      if (r < n) {
        const T* kr = keys.next();
        for (int64_t c = 0; c < C; ++c) _mm256_store_ps(dst + 8 * c, load8(kr + 8 * c));
      } else {
        for (int64_t c = 0; c < C; ++c) _mm256_store_ps(dst + 8 * c, _mm256_setzero_ps());
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 acc[8];
      const __m256 q0 = _mm256_loadu_ps(qg);
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_mul_ps(q0, _mm256_load_ps(tile + r * D));
      for (int64_t c = 1; c < C; ++c) {
        const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
        for (int r = 0; r < 8; ++r)
          acc[r] = _mm256_fmadd_ps(qc, _mm256_load_ps(tile + r * D + 8 * c), acc[r]);
      }
      const __m256 sums = transpose_reduce(acc);
      if (n == 8) {
        _mm256_storeu_ps(scores + g * len + l0, sums);
      } else {  // the last tile: memcpy of a few floats is a rep movs, too slow per tile
        alignas(32) float tail[8];
        _mm256_store_ps(tail, sums);
        std::memcpy(scores + g * len + l0, tail, n * sizeof(float));
      }
    }
  }
}

// acc[g][c..c+8] += sum over the block's rows of w[g][row] * v[row][c..c+8], for GT rows g
template <typename T, int GT>
inline void values_slices(const float* __restrict w, int64_t len, const T* const* rows,
                          const int64_t* ls, int64_t n, int64_t D, float* __restrict acc) {
  for (int64_t c = 0; c < D; c += 8) {
    __m256 a[GT];
    for (int g = 0; g < GT; ++g) a[g] = _mm256_loadu_ps(acc + g * D + c);
    for (int64_t r = 0; r < n; ++r) {
      const __m256 v = load8(rows[r] + c);
      for (int g = 0; g < GT; ++g)
        a[g] = _mm256_fmadd_ps(_mm256_set1_ps(w[g * len + ls[r]]), v, a[g]);
    }
    for (int g = 0; g < GT; ++g) _mm256_storeu_ps(acc + g * D + c, a[g]);
  }
}

}  // namespace avx2
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
namespace simd = avx;
#else
namespace simd = avx2;
#endif

// Values in blocks of 16 rows read through the page table once (RowCursor's walk and
// prefetch) into an fp32 [G][D] accumulator that stays in L1; each block's rows go through
// simd::values_slices, G accumulators in registers per slice of head_dim. (The AVX-512 path
// walked the context once per 16-lane slice before, with no prefetch: D / 16 passes over V.)
template <typename T>
void values_pass(const float* w, const T* vbase, const int64_t* table, int64_t len, int64_t S,
                 int64_t G, int64_t D, const float* inv, float* acc /* [G][D] */, T* out) {
  std::fill(acc, acc + G * D, 0.f);
  const T* rows[16];
  int64_t ls[16];
  RowCursor<T> values{vbase, table, S, D, (len + S - 1) / S};
  for (int64_t l0 = 0; l0 < len; l0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - l0);
    for (int64_t r = 0; r < n; ++r) {
      ls[r] = l0 + r;
      rows[r] = values.next();
    }
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
      const float* wg = w + g0 * len;
      float* ag = acc + g0 * D;
      switch (std::min<int64_t>(8, G - g0)) {
        case 1: simd::values_slices<T, 1>(wg, len, rows, ls, n, D, ag); break;
        case 2: simd::values_slices<T, 2>(wg, len, rows, ls, n, D, ag); break;
        case 3: simd::values_slices<T, 3>(wg, len, rows, ls, n, D, ag); break;
        case 4: simd::values_slices<T, 4>(wg, len, rows, ls, n, D, ag); break;
        case 5: simd::values_slices<T, 5>(wg, len, rows, ls, n, D, ag); break;
        case 6: simd::values_slices<T, 6>(wg, len, rows, ls, n, D, ag); break;
        case 7: simd::values_slices<T, 7>(wg, len, rows, ls, n, D, ag); break;
        default: simd::values_slices<T, 8>(wg, len, rows, ls, n, D, ag); break;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = static_cast<T>(acc[g * D + i] * inv[g]);
}
#endif


// rows of ``scores`` [G][len] -> exp(s - max) in place; inv[g] = 1 / their sum
inline void softmax_rows(float* __restrict scores, int64_t G, int64_t len, float* __restrict inv) {
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict sg = scores + g * len;
    int64_t j = 0;
    float m = sg[0], sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t len8 = len & ~int64_t{7};
    if (len8) {
      __m256 vm = _mm256_loadu_ps(sg);
      for (j = 8; j < len8; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + j));
      m = hlserve_avx2::hmax(vm);
    }
    for (j = len8; j < len; ++j) m = std::max(m, sg[j]);
    const __m256 vmax = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (j = 0; j < len8; j += 8) {
      const __m256 e = hlserve_avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vmax));
      _mm256_storeu_ps(sg + j, e);
      vs = _mm256_add_ps(vs, e);
    }
    sum = hlserve_avx2::hsum(vs);
#else
    for (j = 1; j < len; ++j) m = std::max(m, sg[j]);
    j = 0;
#endif
    for (; j < len; ++j) {
      sg[j] = std::exp(sg[j] - m);
      sum += sg[j];
    }
    inv[g] = 1.f / sum;
  }
}


// D as a template parameter: the compiler unrolls the row loops into whole vectors.
template <typename T, int64_t D>
void decode(const T* q, const T* kc, const T* vc, const int64_t* pages, const int64_t* page_lo,
            const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t P,
            int64_t S, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), rows(S * D), acc(G * D), inv(G), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, len = lens[b];
      const int64_t* table = pages + page_lo[b];
      const int64_t num_pages = (len + S - 1) / S;
      scores.resize(G * len);
      const T* qb = q + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(qb[i]) * scale;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      if constexpr (D % simd::LANES == 0 && !std::is_same_v<T, double>) {
        const T* kbase = kc + h * P * S * D;
        const T* vbase = vc + h * P * S * D;
        simd::scores_pass<T>(qf.data(), kbase, table, len, S, G, D, scores.data());
        softmax_rows(scores.data(), G, len, inv.data());
        values_pass<T>(scores.data(), vbase, table, len, S, G, D, inv.data(), acc.data(),
                       out + (b * H + h * G) * D);
        continue;
      }
#endif
      for (int64_t p = 0; p < num_pages; ++p) {
        const int64_t n = std::min(S, len - p * S);
        load_rows(kc + (h * P + table[p]) * S * D, rows.data(), n * D);
        for (int64_t r = 0; r < n; ++r) {
          const float* kr = rows.data() + r * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
            for (int64_t i = 0; i < D; ++i) s += qg[i] * kr[i];
            scores[g * len + p * S + r] = s;
          }
        }
      }
      softmax_rows(scores.data(), G, len, inv.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < num_pages; ++p) {
        const int64_t n = std::min(S, len - p * S);
        load_rows(vc + (h * P + table[p]) * S * D, rows.data(), n * D);
        for (int64_t r = 0; r < n; ++r) {
          const float* vr = rows.data() + r * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * len + p * S + r];
            float* ag = acc.data() + g * D;
            for (int64_t i = 0; i < D; ++i) ag[i] += w * vr[i];
          }
        }
      }
      T* ob = out + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D; ++i) ob[g * D + i] = static_cast<T>(acc[g * D + i] * inv[g]);
    }
  });
}

template <typename T>
void dispatch_d(int64_t d, const T* q, const T* kc, const T* vc, const int64_t* pages,
                const int64_t* page_lo, const int64_t* lens, T* out, int64_t B, int64_t H,
                int64_t KVH, int64_t P, int64_t S, float scale) {
  switch (d) {
    case 64: return decode<T, 64>(q, kc, vc, pages, page_lo, lens, out, B, H, KVH, P, S, scale);
    case 128: return decode<T, 128>(q, kc, vc, pages, page_lo, lens, out, B, H, KVH, P, S, scale);
    case 32: return decode<T, 32>(q, kc, vc, pages, page_lo, lens, out, B, H, KVH, P, S, scale);
    case 16: return decode<T, 16>(q, kc, vc, pages, page_lo, lens, out, B, H, KVH, P, S, scale);
    case 8: return decode<T, 8>(q, kc, vc, pages, page_lo, lens, out, B, H, KVH, P, S, scale);
    case 256: return decode<T, 256>(q, kc, vc, pages, page_lo, lens, out, B, H, KVH, P, S, scale);
    default: TORCH_CHECK(false, "decode_attention: head_dim ", d, " not built");
  }
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& pages,
                               const torch::Tensor& page_lo, const torch::Tensor& lens,
                               double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(pages.scalar_type() == at::kLong && page_lo.scalar_type() == at::kLong &&
              lens.scalar_type() == at::kLong);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), P = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && page_lo.size(0) == B && lens.size(0) == B);
  auto out = torch::empty_like(q);
  auto pg = pages.contiguous(), lo = page_lo.contiguous(), ln = lens.contiguous();
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    dispatch_d<scalar_t>(D, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                         v_cache.data_ptr<scalar_t>(), pg.data_ptr<int64_t>(),
                         lo.data_ptr<int64_t>(), ln.data_ptr<int64_t>(),
                         out.data_ptr<scalar_t>(), B, H, KVH, P, S, s);
  });
  return out;
}
