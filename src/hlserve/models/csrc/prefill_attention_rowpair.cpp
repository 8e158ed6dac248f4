// The CPU prefill kernel that prefill_attention.cpp replaced, kept (and only reachable) as
// prefill_attention_rowpair for benchmarks/prefill_attention.py and HLSERVE_PREFILL_KERNEL=rowpair,
// so that the two are measured side by side on one build. Same arguments and results.
//
// One task per (chunk, block of QB = 8 queries, KV head); the block's G x QB rows walk the
// context in tiles of 32 keys, one or two rows at a time (a row pair shares each loaded key or
// value vector), with an online softmax in fp32 that reduces each row's maximum on every
// tile.
#include "bf16_tile.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__)
#include "avx512_math.h"

namespace {

using namespace hlserve_tile;
using hlserve_avx::exp_ps;

constexpr int KT = 32;  // keys per tile: two 16-lane score vectors per row
constexpr int QB = 8;   // queries per task: G x QB rows share one repack of each tile
template <int D>
using Tile = hlserve_tile::Tile<D, KT>;

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
    int64_t off[KT];
    key_offsets(table, S, D, l0, nk, off);
    tile.load(kbase, vbase, off, nk);
    if (l0 + KT < keys) {
      const int next = static_cast<int>(std::min<int64_t>(KT, keys - l0 - KT));
      key_offsets(table, S, D, l0 + KT, next, off);
      prefetch_keys<D>(kbase, vbase, off, next);
    }
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


struct Run {
  template <int D>
  void operator()(const PrefillArgs& a) const {
    prefill<D>(a.q, a.k, a.v, a.pages, a.page_lo, a.starts, a.num_new, a.ctx, a.out, a.C, a.H,
               a.KVH, a.P, a.S, a.scale);
  }
};

}  // namespace

void prefill_attention_rowpair(torch::Tensor& out, const torch::Tensor& q,
                               const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& pages, const torch::Tensor& page_lo,
                               const torch::Tensor& starts, const torch::Tensor& num_new,
                               const torch::Tensor& ctx, double scale) {
  dispatch_prefill("prefill_attention_rowpair", Run{}, out, q, k_cache, v_cache, pages, page_lo,
                   starts, num_new, ctx, scale);
}

#else  // no AVX512_BF16: prefill attention stays in PyTorch

void prefill_attention_rowpair(torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                               const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                               const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                               double) {
  TORCH_CHECK(false, "prefill_attention_rowpair: built without AVX512_BF16");
}

#endif
