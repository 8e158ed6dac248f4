// The pieces both CPU prefill kernels share (prefill_attention.cpp, the tiled kernel, and
// prefill_attention_rowpair.cpp, the one it replaced, kept for benchmarks/prefill_attention.py):
// a tile of keys and values read through a page table and repacked for AVX512_BF16 dot
// products, its prefetch, and the checks and head_dim dispatch of the Python entry point.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace hlserve_tile {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512bh bcast_pair(uint32_t pair) {
  return as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
}

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

// Where keys l0 .. l0 + n - 1 of a sequence are in a KV head's pool (element offsets, the
// same for K and V): one division for the first, then a walk along the page table (a
// division per key was a measurable share of a tile's work).
inline void key_offsets(const int64_t* table, int64_t S, int64_t D, int64_t l0, int n,
                        int64_t* off) {
  int64_t page = l0 / S, slot = l0 % S;
  for (int i = 0; i < n; ++i) {
    off[i] = (table[page] * S + slot) * D;
    if (++slot == S) slot = 0, ++page;
  }
}

// Ask for one key's or value's D elements, into L2 (T1: see prefetch_keys for why not L1).
template <int D>
inline void prefetch_row(const uint16_t* row) {
  for (int b = 0; b < D * 2; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T1);
}

// One tile of KT keys and values repacked for the dot-product instructions: keys as
// [16-key group][D/2 pairs of dims][16 keys] (16 scores of a row are one vector), values as
// [KT/2 pairs of keys][D dims x the two keys] (two keys' values interleaved, weighted by one
// broadcast pair of softmax weights). Keys past the tile's end are zeros.
//
// `load` also asks for the next tile's rows (into L2, as prefetch_keys does), a 16-key group's
// keys before that group's transpose and a key pair's values before that pair's interleave,
// so the requests go out spread over the repack. Issued all at once after it
// (prefetch_keys), 256 prefetches at head_dim 64 held the loop: perf put 47% of the kernel's
// own samples on that prefetch loop in a decode step; spread out, a decode step's attention
// took ~9% less time (7 decodes over 500-1,600 keys, docs/bench.md).
template <int D, int KT>
struct Tile {
  static_assert(D % 32 == 0 && KT % 16 == 0, "whole 16 x 16 word blocks");
  alignas(64) uint32_t kt[KT / 16][D / 2][16];
  alignas(64) uint16_t vp[KT / 2][D * 2];

  // the tile's first nk keys at element offsets off (key_offsets) of the pools' heads; the
  // next tile's first next_n keys (offsets next_off) are prefetched on the way
  void load(const uint16_t* kbase, const uint16_t* vbase, const int64_t* off, int nk,
            const int64_t* next_off = nullptr, int next_n = 0) {
    const __m512i idx = interleave_index();
    // keys: each 16 x 16 block of (key, dimension pair) words is transposed in registers
    for (int grp = 0; grp < KT / 16; ++grp) {
      for (int j = 16 * grp; j < std::min(16 * grp + 16, next_n); ++j)
        prefetch_row<D>(kbase + next_off[j]);
      const uint16_t* rows[16];
      for (int j = 0; j < 16; ++j)
        rows[j] = 16 * grp + j < nk ? kbase + off[16 * grp + j] : nullptr;
      for (int pb = 0; pb < D / 32; ++pb) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 32 * pb) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(kt[grp][16 * pb + i], r[i]);
      }
    }
    for (int j = 0; j < KT / 2; ++j) {
      for (int i = 2 * j; i < std::min(2 * j + 2, next_n); ++i)
        prefetch_row<D>(vbase + next_off[i]);
      const uint16_t* a = 2 * j < nk ? vbase + off[2 * j] : nullptr;
      const uint16_t* b = 2 * j + 1 < nk ? vbase + off[2 * j + 1] : nullptr;
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

  static __m512i interleave_index() {  // lane 2i <- a[i], lane 2i + 1 <- b[i]
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 16; ++i) {
      idx[2 * i] = static_cast<uint16_t>(i);
      idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    }
    return _mm512_load_si512(idx);
  }
};

// Ask for the next tile's key and value rows (n keys at offsets off) while this one is
// computed, all at once (the row-pair kernel; the tiled one asks through Tile::load): its
// pages are anywhere in the pool, so the hardware prefetcher cannot guess them.
// Into L2 (T1), not L1: a tile is 256 lines at head_dim 64, and T0 requests for all of them
// at once filled the core's few L1 miss slots, stalling the loop on its own prefetches. On
// Zen 4 a decode step's attention (16 sequences, 1.4-3.8K keys) ran 1.3-1.6x faster with T1,
// prefills unchanged (benchmarks/decode_attention.py --kernel prefill --against).
template <int D>
inline void prefetch_keys(const uint16_t* kbase, const uint16_t* vbase, const int64_t* off,
                          int n) {
  for (int i = 0; i < n; ++i) {
    prefetch_row<D>(kbase + off[i]);
    prefetch_row<D>(vbase + off[i]);
  }
}

// The raw arguments of one prefill call, checked (see prefill_attention.cpp for the layout).
struct PrefillArgs {
  const uint16_t *q, *k, *v;
  const int64_t *pages, *page_lo, *starts, *num_new, *ctx;
  uint16_t* out;
  int64_t C, H, KVH, P, S;
  float scale;
};

// Checks the tensors and calls run.template operator()<D>(args) for the head_dim D.
template <typename Run>
void dispatch_prefill(const char* name, Run run, torch::Tensor& out, const torch::Tensor& q,
                      const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& pages, const torch::Tensor& page_lo,
                      const torch::Tensor& starts, const torch::Tensor& num_new,
                      const torch::Tensor& ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              name, ": bf16 only");
  for (const auto* t : {&pages, &page_lo, &starts, &num_new, &ctx})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous());
  const int64_t H = q.size(1), D = q.size(2), C = starts.size(0);
  const int64_t KVH = k_cache.size(0), P = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && page_lo.size(0) == C &&
              num_new.size(0) == C && ctx.size(0) == C);
  const auto bf = [](const torch::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  };
  const PrefillArgs a{bf(q), bf(k_cache), bf(v_cache), pages.data_ptr<int64_t>(),
                      page_lo.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                      num_new.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(),
                      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), C, H, KVH, P, S,
                      static_cast<float>(scale)};
  switch (D) {
    case 32: return run.template operator()<32>(a);
    case 64: return run.template operator()<64>(a);
    case 128: return run.template operator()<128>(a);
    case 256: return run.template operator()<256>(a);
    default: TORCH_CHECK(false, name, ": head_dim ", D, " not built (32-256)");
  }
}

}  // namespace hlserve_tile

#endif
