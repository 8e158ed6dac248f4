// The CPU kernels' Python module: one extension, one function per kernel source.
#include <torch/extension.h>

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& pages,
                               const torch::Tensor& page_lo, const torch::Tensor& lens,
                               double scale);
void prefill_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& pages,
                       const torch::Tensor& page_lo, const torch::Tensor& starts,
                       const torch::Tensor& num_new, const torch::Tensor& ctx, double scale);
bool prefill_attention_built();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over the page pool");
  m.def("prefill_attention", &prefill_attention,
        "paged prefill attention over the page pool (bf16, AVX512_BF16), written into out");
  m.def("prefill_attention_built", &prefill_attention_built,
        "whether prefill_attention was compiled (the CPU has AVX512_BF16)");
}
