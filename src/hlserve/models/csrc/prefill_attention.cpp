// Paged prefill attention for the CPU: the new tokens of every prompt chunk in a batch,
// over the sequence's whole context (cached prefix, earlier chunks and the chunk itself), read
// in place from the head-major page pool. Query i of a chunk sees keys 0..context + i
// (lower-right causal); no mask tensor, no gather, no GQA expansion.
//
// out      [T, H, D]           the batch's attention output; only the chunks' rows are written
// q        [T, H, D]           the batch's queries (bf16)
// k_cache  [KVH, P, S, D]      the layer's page pool (v_cache the same; the chunk's own K/V
//                              already written to it)
// pages    [N] int64           the page tables of all chunks, concatenated
// page_lo  [C] int64           where chunk c's table starts in `pages`
// starts   [C] int64           chunk c's first row in q / out
// num_new  [C] int64           its new tokens
// ctx      [C] int64           tokens cached before it
//
// Flash-attention style: one task per (chunk, block of QB queries, KV head); the block's
// G x QB query rows (the G query heads of that KV head) walk the context in tiles of 32 keys,
// with an online softmax in fp32. Both products use bf16 dot-product instructions
// (AVX512_BF16: pairs of bf16 multiplied and summed into fp32), which is where the speed comes
// from: PyTorch's CPU flash kernel converts to fp32 and runs at fp32 GEMM speed (~125 GFLOP/s
// on two cores against ~400 for bf16). Each tile is repacked once for all the block's rows:
// keys as [D/2 pairs][16 keys] (a row's 16 scores are one vector), values as
// [16 key pairs][D] (two keys' values interleaved, weighted by one broadcast pair of P).
// Only built where the compiler targets AVX512_BF16; elsewhere prefill stays in PyTorch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512_math.h"

namespace {

constexpr int KT = 32;  // keys per tile: two 16-lane score vectors per row
constexpr int QB = 8;   // queries per task: G x QB rows share one repack of each tile

using hlserve_avx::exp_ps;  // e^x in fp32 (avx512_math.h)

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512bh bcast_pair(uint32_t pair) { return as_bh(_mm512_set1_epi32(static_cast<int>(pair))); }

inline __mmask16 lanes(int n) {  // the first n of 16 lanes (n clipped to 0..16)
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

// r[i] lane j <- r[j] lane i: a 16 x 16 transpose of 32-bit words in four shuffle rounds
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int b = 0; b < 16; b += 8)
    for (int i = 0; i < 4; ++i) {
      t[b + i] = _mm512_shuffle_i32x4(r[b + i], r[b + i + 4], 0x88);
      t[b + i + 4] = _mm512_shuffle_i32x4(r[b + i], r[b + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// One tile of keys and values repacked for the dot-product instructions.
template <int D>
struct Tile {
  alignas(64) uint32_t kt[2][D / 2][16];  // [half][pair of dims][key]: bf16 pairs of each key
  alignas(64) uint16_t vp[KT / 2][D * 2];  // [pair of keys][dim]: the two keys' values interleaved

  void load(const uint16_t* kbase, const uint16_t* vbase, const int64_t* table, int64_t S,
            int64_t l0, int nk) {
    const __m512i idx = interleave_index();
    // keys: each 16 x 16 block of (key, dimension pair) words is transposed in registers
    for (int half = 0; half < 2; ++half) {
      const uint16_t* rows[16];
      for (int j = 0; j < 16; ++j)
        rows[j] = row(kbase, table, S, l0 + 16 * half + j, 16 * half + j < nk);
      for (int pb = 0; pb < D / 32; ++pb) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 32 * pb) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(kt[half][16 * pb + i], r[i]);
      }
    }
    for (int j = 0; j < KT / 2; ++j) {
      const uint16_t* a = row(vbase, table, S, l0 + 2 * j, 2 * j < nk);
      const uint16_t* b = row(vbase, table, S, l0 + 2 * j + 1, 2 * j + 1 < nk);
      for (int c = 0; c < D / 16; ++c) {
        const __m512i va = a ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                   reinterpret_cast<const __m256i*>(a + 16 * c)))
                             : _mm512_setzero_si512();
        const __m512i vb = b ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                   reinterpret_cast<const __m256i*>(b + 16 * c)))
                             : _mm512_setzero_si512();
        _mm512_store_si512(vp[j] + 32 * c, _mm512_permutex2var_epi16(va, idx, vb));
      }
    }
  }

  static const uint16_t* row(const uint16_t* base, const int64_t* table, int64_t S, int64_t l,
                             bool valid) {
    return valid ? base + (table[l / S] * S + l % S) * D : nullptr;
  }

  static __m512i interleave_index() {  // lane 2i <- a[i], lane 2i + 1 <- b[i]
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 16; ++i) {
      idx[2 * i] = static_cast<uint16_t>(i);
      idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    }
    return _mm512_load_si512(idx);
  }
};

// Ask for the next tile's key and value rows while this one is computed: its pages are
// anywhere in the pool, so the hardware prefetcher cannot guess them.
template <int D>
inline void prefetch_tile(const uint16_t* kbase, const uint16_t* vbase, const int64_t* table,
                          int64_t S, int64_t l0, int64_t keys) {
  const int64_t end = std::min<int64_t>(keys, l0 + KT);
  for (int64_t l = l0; l < end; ++l) {
    const int64_t off = (table[l / S] * S + l % S) * D;
    for (int b = 0; b < D * 2; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kbase + off) + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vbase + off) + b, _MM_HINT_T0);
    }
  }
}

// Running state of one query row: output accumulator, max score, lane-wise sum of weights.
template <int D>
struct RowState {
  alignas(64) float o[D];
  alignas(64) float l[16];
  float m;
};

// Scores of NR rows (1 or 2) against a tile: two vectors of 16 keys per row. Each key vector
// loaded serves every row (loads, not multiplies, bound this loop on one row), and even and
// odd dimension pairs sum into separate registers so that the dot-product chains overlap.
template <int D, int NR>
inline void tile_scores(const uint32_t* const* qp, const Tile<D>& t, __m512 (&s)[NR][2]) {
  __m512 acc[NR][2][2];
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < 2; ++h) acc[r][h][0] = acc[r][h][1] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; p += 2) {
    for (int u = 0; u < 2; ++u) {
      const __m512bh k0 = as_bh(_mm512_load_si512(t.kt[0][p + u]));
      const __m512bh k1 = as_bh(_mm512_load_si512(t.kt[1][p + u]));
      for (int r = 0; r < NR; ++r) {
        const __m512bh qv = bcast_pair(qp[r][p + u]);
        acc[r][0][u] = _mm512_dpbf16_ps(acc[r][0][u], k0, qv);
        acc[r][1][u] = _mm512_dpbf16_ps(acc[r][1][u], k1, qv);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < 2; ++h) s[r][h] = _mm512_add_ps(acc[r][h][0], acc[r][h][1]);
}

// o[r] += P[r] (32 weights as 16 bf16 pairs) x the tile's values, for NR rows; the value
// vectors are loaded once for all rows, four 16-lane slices of D at a time (registers).
template <int D, int NR>
inline void tile_values(const uint32_t* const* pp, const Tile<D>& t, float* const* o) {
  constexpr int W = D / 16 < 4 ? D / 16 : 4;
  for (int c0 = 0; c0 < D / 16; c0 += W) {
    __m512 acc[NR][W];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < W; ++c) acc[r][c] = _mm512_load_ps(o[r] + 16 * (c0 + c));
    for (int j = 0; j < KT / 2; ++j) {
      __m512bh w[NR];
      for (int r = 0; r < NR; ++r) w[r] = bcast_pair(pp[r][j]);
      for (int c = 0; c < W; ++c) {
        const __m512bh v = as_bh(_mm512_load_si512(t.vp[j] + 32 * (c0 + c)));
        for (int r = 0; r < NR; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v, w[r]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < W; ++c) _mm512_store_ps(o[r] + 16 * (c0 + c), acc[r][c]);
  }
}

// Online softmax of one row's tile scores: rescale what was summed under an older maximum,
// add this tile's weights to the row's sum, and return them as 16 bf16 pairs in pp.
template <int D>
inline void softmax_tile(RowState<D>& st, __m512 s0, __m512 s1, int seen, float scale,
                         uint32_t* pp) {
  const __m512 vscale = _mm512_set1_ps(scale), low = _mm512_set1_ps(-1e30f);
  const __mmask16 m0 = lanes(seen), m1 = lanes(seen - 16);
  s0 = _mm512_mask_mul_ps(low, m0, s0, vscale);
  s1 = _mm512_mask_mul_ps(low, m1, s1, vscale);
  const float mx = std::max(st.m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  if (mx > st.m) {
    const __m512 alpha = _mm512_set1_ps(std::exp(st.m - mx));
    for (int c = 0; c < D; c += 16)
      _mm512_store_ps(st.o + c, _mm512_mul_ps(_mm512_load_ps(st.o + c), alpha));
    _mm512_store_ps(st.l, _mm512_mul_ps(_mm512_load_ps(st.l), alpha));
    st.m = mx;
  }
  const __m512 vm = _mm512_set1_ps(mx);
  const __m512 p0 = _mm512_maskz_mov_ps(m0, exp_ps(_mm512_sub_ps(s0, vm)));
  const __m512 p1 = _mm512_maskz_mov_ps(m1, exp_ps(_mm512_sub_ps(s1, vm)));
  _mm512_store_ps(st.l, _mm512_add_ps(_mm512_load_ps(st.l), _mm512_add_ps(p0, p1)));
  const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);
  _mm512_store_si512(pp, reinterpret_cast<const __m512i&>(pb));
}

template <int D, int NR>
inline void rows_tile(const uint32_t* const* qp, RowState<D>* const* st, const int* seen,
                      const Tile<D>& tile, float scale) {
  __m512 s[NR][2];
  tile_scores<D, NR>(qp, tile, s);
  alignas(64) uint32_t pp[NR][KT / 2];
  const uint32_t* pr[NR];
  float* o[NR];
  for (int r = 0; r < NR; ++r) {
    softmax_tile<D>(*st[r], s[r][0], s[r][1], seen[r], scale, pp[r]);
    pr[r] = pp[r];
    o[r] = st[r]->o;
  }
  tile_values<D, NR>(pr, tile, o);
}

template <int D>
void prefill_block(const uint16_t* q, const uint16_t* kbase, const uint16_t* vbase,
                   const int64_t* table, int64_t S, int64_t ctx, int64_t row0, int64_t q0,
                   int64_t nq, int64_t H, int64_t h, int64_t G, float scale, uint16_t* out,
                   std::vector<RowState<D>>& rows, Tile<D>& tile) {
  const int64_t R = nq * G;  // row r: query q0 + r / G of the chunk, head h * G + r % G
  rows.resize(R);
  for (auto& st : rows) {
    std::memset(st.o, 0, sizeof st.o);
    std::memset(st.l, 0, sizeof st.l);
    st.m = -1e30f;
  }
  const auto qrow = [&](int64_t r) {
    return reinterpret_cast<const uint32_t*>(q + ((row0 + q0 + r / G) * H + h * G + r % G) * D);
  };
  const int64_t keys = ctx + q0 + nq;  // the last query's keys
  for (int64_t l0 = 0; l0 < keys; l0 += KT) {
    const int nk = static_cast<int>(std::min<int64_t>(KT, keys - l0));
    tile.load(kbase, vbase, table, S, l0, nk);
    if (l0 + KT < keys) prefetch_tile<D>(kbase, vbase, table, S, l0 + KT, keys);
    // keys of this tile that row r's query sees (<= 0: the tile is in its future)
    const auto seen_by = [&](int64_t r) {
      return static_cast<int>(std::min<int64_t>(nk, ctx + q0 + r / G + 1 - l0));
    };
    for (int64_t r = 0; r < R;) {  // two rows at a time where both see this tile
      const int sa = seen_by(r), sb = r + 1 < R ? seen_by(r + 1) : 0;
      if (sa > 0 && sb > 0) {
        const uint32_t* qp[2] = {qrow(r), qrow(r + 1)};
        RowState<D>* st[2] = {&rows[r], &rows[r + 1]};
        const int seen[2] = {sa, sb};
        rows_tile<D, 2>(qp, st, seen, tile, scale);
        r += 2;
      } else {
        if (sa > 0) {
          const uint32_t* qp[1] = {qrow(r)};
          RowState<D>* st[1] = {&rows[r]};
          rows_tile<D, 1>(qp, st, &sa, tile, scale);
        }
        r += 1;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const RowState<D>& st = rows[r];
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(st.l)));
    uint16_t* dst = out + ((row0 + q0 + r / G) * H + h * G + r % G) * D;
    for (int c = 0; c < D; c += 16) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(st.o + c), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), reinterpret_cast<const __m256i&>(o));
    }
  }
}

// Task order: the blocks of a chunk alternate between its start and its end (0, n-1, 1,
// n-2, ...), so that the contiguous ranges at::parallel_for hands each thread mix short
// (early, less context) and long blocks.
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

template <int D>
void prefill(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* pages,
             const int64_t* page_lo, const int64_t* starts, const int64_t* num_new,
             const int64_t* ctx, uint16_t* out, int64_t C, int64_t H, int64_t KVH, int64_t P,
             int64_t S, float scale) {
  const int64_t G = H / KVH;
  std::vector<int64_t> first(C + 1, 0);  // tasks before chunk c
  for (int64_t c = 0; c < C; ++c) first[c + 1] = first[c] + (num_new[c] + QB - 1) / QB * KVH;
  at::parallel_for(0, first[C], 1, [&](int64_t begin, int64_t end) {
    std::vector<RowState<D>> rows;
    auto tile = std::make_unique<Tile<D>>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const int64_t blocks = (num_new[c] + QB - 1) / QB;
      const int64_t local = task - first[c];
      const int64_t h = local % KVH, b = zigzag(local / KVH, blocks);
      const int64_t q0 = b * QB, nq = std::min<int64_t>(QB, num_new[c] - q0);
      prefill_block<D>(q, kc + h * P * S * D, vc + h * P * S * D, pages + page_lo[c], S,
                       ctx[c], starts[c], q0, nq, H, h, G, scale, out, rows, *tile);
    }
  });
}

}  // namespace

bool prefill_attention_built() { return true; }

void prefill_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& pages,
                       const torch::Tensor& page_lo, const torch::Tensor& starts,
                       const torch::Tensor& num_new, const torch::Tensor& ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 only");
  for (const auto* t : {&pages, &page_lo, &starts, &num_new, &ctx})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous());
  const int64_t H = q.size(1), D = q.size(2), C = starts.size(0);
  const int64_t KVH = k_cache.size(0), P = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && page_lo.size(0) == C &&
              num_new.size(0) == C && ctx.size(0) == C);
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float s = static_cast<float>(scale);
  const int64_t* args[] = {pages.data_ptr<int64_t>(), page_lo.data_ptr<int64_t>(),
                           starts.data_ptr<int64_t>(), num_new.data_ptr<int64_t>(),
                           ctx.data_ptr<int64_t>()};
  const auto run = [&](auto d) {
    prefill<decltype(d)::value>(qd, kd, vd, args[0], args[1], args[2], args[3], args[4], od, C,
                                H, KVH, P, S, s);
  };
  switch (D) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 64: return run(std::integral_constant<int, 64>{});
    case 128: return run(std::integral_constant<int, 128>{});
    case 256: return run(std::integral_constant<int, 256>{});
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", D, " not built (32-256)");
  }
}

#else  // no AVX512_BF16: prefill attention stays in PyTorch

bool prefill_attention_built() { return false; }

void prefill_attention(torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       double) {
  TORCH_CHECK(false, "prefill_attention: built without AVX512_BF16");
}

#endif
