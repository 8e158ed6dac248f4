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
// hlserve.models.cpu_kernels with -O3 -march=native so the loops vectorise.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        const float m = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = std::exp(sg[j] - m);
          sum += sg[j];
        }
        inv[g] = 1.f / sum;
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over the page pool");
}
