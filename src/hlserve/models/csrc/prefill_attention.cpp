// Paged prefill attention for the CPU: the new tokens of every prompt chunk in a batch,
// over the sequence's whole context (cached prefix, earlier chunks and the chunk itself), read
// in place from the head-major page pool. Query i of a chunk sees keys 0..context + i
// (lower-right causal); no mask tensor, no gather, no GQA expansion. A decode is a chunk of
// one query.
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
// Tiled like a GEMM (flash attention's loop order): one task per (chunk, KV head, block of
// queries); threads take the tasks one at a time, the most expensive first. A block is ~64
// rows (its queries x the G query heads of that KV head), which walk the context in tiles of
// KT = 64 keys, each tile read through the page table and repacked once for all of them
// (bf16_tile.h). Per tile the rows go through in
// register blocks of up to 6: their scores against the tile's four 16-key vectors (6 x 4 fp32
// accumulators, one key vector load and one broadcast query pair per 6 or 4 bf16 dot-product
// instructions), the online softmax of those scores in registers, then the weights times the
// values into the rows' fp32 outputs (6 x 4 accumulators over 64 dims). AVX512_BF16's
// vdpbf16ps does both products: pairs of bf16 multiplied and summed into fp32. The weights
// are rounded to bf16 for the value product, as flash attention does on GPUs.
//
// Work the causal mask would throw away is skipped: rows whose query precedes the whole tile
// are not visited, and on the diagonal a register block stops at the last 16-key vector its
// latest query sees. The softmax works in log2 units (one FMA scales and shifts a score) and
// rescales a row's output only when a score passes its running maximum by more than 2^8,
// which any maximum allows (the final division by the sum cancels it): past the first tiles
// that test is one compare per row and tile, no horizontal reduction.
// Only built where the compiler targets AVX512_BF16; elsewhere prefill stays in PyTorch.
#include "bf16_tile.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__)
#include "avx512_math.h"

namespace {

using namespace hlserve_tile;
using hlserve_avx::exp2_ps;

constexpr int KT = 64;              // keys per tile: four 16-key score vectors per row
constexpr int MR = 6;               // rows per register block (6 x 4 accumulators)
constexpr int ROWS = 64;            // rows per task that share each repacked tile
constexpr float RESCALE_AT = 8.0f;  // log2 units a score may pass the running max unrescaled
constexpr float LOW = -1e30f;       // a masked score (finite: -ffast-math assumes no inf)
constexpr float LOG2E = 1.4426950408889634f;

template <int D>
using Tile = hlserve_tile::Tile<D, KT>;

// One query row of a task: its query as bf16 pairs, output accumulator, lane-wise sum of
// weights, running max (of raw q.k scores) and this tile's rescale of o.
template <int D>
struct Row {
  alignas(64) float o[D];
  alignas(64) float l[16];
  alignas(64) uint32_t q[D / 2];
  float m;
  float alpha;
};

// s[r][v] = row r's scores against keys 16v..16v+15 of the tile.
template <int D, int R, int NV>
inline void scores(const Row<D>* rows, const Tile<D>& t, __m512 (&s)[R][NV]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) s[r][v] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh k[NV];
    for (int v = 0; v < NV; ++v) k[v] = as_bh(_mm512_load_si512(t.kt[v][p]));
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = bcast_pair(rows[r].q[p]);
      for (int v = 0; v < NV; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], k[v], qv);
    }
  }
}

// Online softmax of one row's scores over the first `seen` keys (all 16 * NV unless masked):
// the weights as bf16 pairs in pb, their sum added to the row's, and the row's rescale.
template <int D, int NV>
inline void softmax_row(Row<D>& row, __m512 (&s)[NV], int seen, bool masked, float c,
                        float rescale_raw, uint32_t* pb) {
  if (masked)
    for (int v = 0; v < NV; ++v)
      s[v] = _mm512_mask_mov_ps(_mm512_set1_ps(LOW), lanes(seen - 16 * v), s[v]);
  __m512 mx = s[0];
  for (int v = 1; v < NV; ++v) mx = _mm512_max_ps(mx, s[v]);
  row.alpha = 1.0f;
  if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(row.m + rescale_raw), _CMP_GT_OQ)) {
    const float m = std::max(row.m, _mm512_reduce_max_ps(mx));
    row.alpha = std::exp2((row.m - m) * c);
    _mm512_store_ps(row.l, _mm512_mul_ps(_mm512_load_ps(row.l), _mm512_set1_ps(row.alpha)));
    row.m = m;
  }
  const __m512 vc = _mm512_set1_ps(c), shift = _mm512_set1_ps(-row.m * c);
  __m512 p[NV];
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < NV; ++v) {
    p[v] = exp2_ps(_mm512_fmadd_ps(s[v], vc, shift));  // masked lanes: 2^-huge = 0
    sum = _mm512_add_ps(sum, p[v]);
  }
  _mm512_store_ps(row.l, _mm512_add_ps(_mm512_load_ps(row.l), sum));
  for (int v = 0; v < NV; v += 2) {  // key pair j = keys 2j, 2j + 1
    if (v + 1 < NV) {
      const __m512bh b = _mm512_cvtne2ps_pbh(p[v + 1], p[v]);
      _mm512_store_si512(pb + 8 * v, reinterpret_cast<const __m512i&>(b));
    } else {
      const __m256bh b = _mm512_cvtneps_pbh(p[v]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb + 8 * v),
                         reinterpret_cast<const __m256i&>(b));
    }
  }
}

// o[r] = o[r] * alpha[r] + P[r] x V over the tile's first 8 * NV key pairs, 64 dims at a time.
template <int D, int R, int NV>
inline void values(Row<D>* rows, const Tile<D>& t, const uint32_t (*pb)[KT / 2]) {
  constexpr int W = D / 16 < 4 ? D / 16 : 4;
  for (int c0 = 0; c0 < D / 16; c0 += W) {
    __m512 acc[R][W];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(rows[r].alpha);
      for (int c = 0; c < W; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_load_ps(rows[r].o + 16 * (c0 + c)), a);
    }
    for (int j = 0; j < 8 * NV; ++j) {
      __m512bh v[W];
      for (int c = 0; c < W; ++c) v[c] = as_bh(_mm512_load_si512(t.vp[j] + 32 * (c0 + c)));
      for (int r = 0; r < R; ++r) {
        const __m512bh w = bcast_pair(pb[r][j]);
        for (int c = 0; c < W; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], w);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) _mm512_store_ps(rows[r].o + 16 * (c0 + c), acc[r][c]);
  }
}

// One register block of R rows against the tile's first NV key vectors.
template <int D, int R, int NV>
void register_block(Row<D>* rows, const Tile<D>& t, const int* seen, bool masked, float c,
                    float rescale_raw) {
  __m512 s[R][NV];
  scores<D, R, NV>(rows, t, s);
  alignas(64) uint32_t pb[R][KT / 2];
  for (int r = 0; r < R; ++r)
    softmax_row<D, NV>(rows[r], s[r], seen[r], masked, c, rescale_raw, pb[r]);
  values<D, R, NV>(rows, t, pb);
}

template <int D>
using BlockFn = void (*)(Row<D>*, const Tile<D>&, const int*, bool, float, float);

template <int D, int R>
BlockFn<D> pick_nv(int nv) {
  switch (nv) {
    case 1: return &register_block<D, R, 1>;
    case 2: return &register_block<D, R, 2>;
    case 3: return &register_block<D, R, 3>;
    default: return &register_block<D, R, 4>;
  }
}

template <int D>
BlockFn<D> pick(int rows, int nv) {
  switch (rows) {
    case 1: return pick_nv<D, 1>(nv);
    case 2: return pick_nv<D, 2>(nv);
    case 3: return pick_nv<D, 3>(nv);
    case 4: return pick_nv<D, 4>(nv);
    case 5: return pick_nv<D, 5>(nv);
    default: return pick_nv<D, MR>(nv);
  }
}

// Where one task's rows are: chunk rows row0 + q0 .. + nq, KV head h (query heads h*G..).
struct Block {
  const int64_t* table;
  int64_t ctx, row0, q0, nq, h;
};

template <int D>
void init_rows(const PrefillArgs& a, const Block& b, int64_t G, std::vector<Row<D>>& rows) {
  rows.resize(b.nq * G);  // row r: query q0 + r / G of the chunk, head h * G + r % G
  for (size_t r = 0; r < rows.size(); ++r) {
    Row<D>& row = rows[r];
    std::memset(row.o, 0, sizeof row.o);
    std::memset(row.l, 0, sizeof row.l);
    std::memcpy(row.q, a.q + ((b.row0 + b.q0 + r / G) * a.H + b.h * G + r % G) * D, D * 2);
    row.m = LOW;
  }
}

template <int D>
void finish_rows(const PrefillArgs& a, const Block& b, int64_t G,
                 const std::vector<Row<D>>& rows) {
  for (size_t r = 0; r < rows.size(); ++r) {
    const Row<D>& row = rows[r];
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(row.l)));
    uint16_t* dst = a.out + ((b.row0 + b.q0 + r / G) * a.H + b.h * G + r % G) * D;
    for (int c = 0; c < D; c += 16) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(row.o + c), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                          reinterpret_cast<const __m256i&>(o));
    }
  }
}

template <int D>
void attend_block(const PrefillArgs& a, const Block& b, int64_t G, std::vector<Row<D>>& rows,
                  Tile<D>& tile) {
  init_rows<D>(a, b, G, rows);
  const int64_t R = b.nq * G;
  const int64_t before = b.ctx + b.q0;  // keys before the block's first query
  const float c = a.scale * LOG2E, rescale_raw = RESCALE_AT / c;
  const uint16_t* kbase = a.k + b.h * a.P * a.S * D;
  const uint16_t* vbase = a.v + b.h * a.P * a.S * D;
  const int64_t keys = before + b.nq;  // the last query's keys
  int64_t off[2][KT];  // this tile's key offsets and the next one's (for the prefetch)
  key_offsets(b.table, a.S, D, 0, static_cast<int>(std::min<int64_t>(KT, keys)), off[0]);
  for (int64_t l0 = 0, i = 0; l0 < keys; l0 += KT, i ^= 1) {
    const int nk = static_cast<int>(std::min<int64_t>(KT, keys - l0));
    const int next = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(KT, keys - l0 - KT)));
    if (next > 0) key_offsets(b.table, a.S, D, l0 + KT, next, off[i ^ 1]);
    tile.load(kbase, vbase, off[i], nk, off[i ^ 1], next);  // prefetching the next tile
    // rows before the first query at or past l0 see none of this tile
    for (int64_t r = std::max<int64_t>(0, l0 - before) * G; r < R;) {
      const int64_t left = R - r;  // split what is left into blocks of at most MR, evenly
      const int n = static_cast<int>(left <= MR ? left : left >= 2 * MR ? MR : (left + 1) / 2);
      int seen[MR];  // keys of the tile each row sees (>= 1, rising with r)
      for (int i = 0; i < n; ++i)
        seen[i] = static_cast<int>(std::min<int64_t>(nk, before + (r + i) / G + 1 - l0));
      const int nv = (seen[n - 1] + 15) / 16;
      pick<D>(n, nv)(&rows[r], tile, seen, seen[0] < 16 * nv, c, rescale_raw);
      r += n;
    }
  }
  finish_rows<D>(a, b, G, rows);
}

// One task: chunk c's queries q0 .. q0 + nq - 1 against KV head h; cost ~ rows x keys.
struct Task {
  int64_t c, q0, nq, h, cost;
};

// Every task of the call, the most expensive first (a chunk's last blocks see the most keys).
inline std::vector<Task> tasks_of(const PrefillArgs& a, int64_t G, int64_t QB) {
  std::vector<Task> tasks;
  for (int64_t c = 0; c < a.C; ++c)
    for (int64_t q0 = 0; q0 < a.num_new[c]; q0 += QB) {
      const int64_t nq = std::min<int64_t>(QB, a.num_new[c] - q0);
      for (int64_t h = 0; h < a.KVH; ++h)
        tasks.push_back({c, q0, nq, h, nq * G * (a.ctx[c] + q0 + nq)});
    }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return tasks;
}

struct Run {
  template <int D>
  void operator()(const PrefillArgs& a) const {
    const int64_t G = a.H / a.KVH, QB = std::max<int64_t>(1, ROWS / G);
    const std::vector<Task> tasks = tasks_of(a, G, QB);
    const int64_t n = static_cast<int64_t>(tasks.size());
    // each thread takes the next task when it is done with one (longest first): a static
    // split of tasks whose costs differ by the context they see leaves threads idle
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      std::vector<Row<D>> rows;
      auto tile = std::make_unique<Tile<D>>();
      for (int64_t i = next++; i < n; i = next++) {
        const Task& t = tasks[i];
        const Block b{a.pages + a.page_lo[t.c], a.ctx[t.c], a.starts[t.c], t.q0, t.nq, t.h};
        attend_block<D>(a, b, G, rows, *tile);
      }
    });
  }
};

}  // namespace

bool prefill_attention_built() { return true; }

void prefill_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& pages,
                       const torch::Tensor& page_lo, const torch::Tensor& starts,
                       const torch::Tensor& num_new, const torch::Tensor& ctx, double scale) {
  dispatch_prefill("prefill_attention", Run{}, out, q, k_cache, v_cache, pages, page_lo, starts,
                   num_new, ctx, scale);
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
