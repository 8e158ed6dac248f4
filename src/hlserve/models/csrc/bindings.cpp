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
void prefill_attention_rowpair(torch::Tensor& out, const torch::Tensor& q,
                               const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& pages, const torch::Tensor& page_lo,
                               const torch::Tensor& starts, const torch::Tensor& num_new,
                               const torch::Tensor& ctx, double scale);
bool prefill_attention_built();
bool fused_ops_built();
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& w,
                            double eps);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
bool linear_bf16_built();
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                          const c10::optional<torch::Tensor>& bias);
bool linear_pairs_built();
torch::Tensor pack_bf16_pairs(const torch::Tensor& w);
torch::Tensor linear_bf16_pairs(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                const c10::optional<torch::Tensor>& bias);
torch::Tensor gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, int64_t inter,
                           const c10::optional<torch::Tensor>& bias);

// A kernel runs without the GIL, as torch's own operators do: held, every kernel call (the
// whole of a step's linears and attention) stopped the server's event loop and its prep
// threads, and /health waited up to a second behind a step.
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, nogil(),
        "paged decode attention over the page pool");
  m.def("prefill_attention", &prefill_attention, nogil(),
        "paged prefill attention over the page pool (bf16, AVX512_BF16), written into out");
  m.def("prefill_attention_rowpair", &prefill_attention_rowpair, nogil(),
        "the kernel prefill_attention replaced (same arguments), kept for benchmarks");
  m.def("prefill_attention_built", &prefill_attention_built,
        "whether prefill_attention was compiled (the CPU has AVX512_BF16)");
  m.def("fused_ops_built", &fused_ops_built, "whether the fused bf16 ops were compiled");
  m.def("rms_norm", &rms_norm, nogil(), "RMSNorm of bf16 rows");
  m.def("add_rms_norm_", &add_rms_norm_, nogil(), "x += a in place, then RMSNorm of x");
  m.def("silu_mul", &silu_mul, nogil(), "silu(gate) * up in bf16");
  m.def("rope_", &rope_, nogil(), "rotary embedding of [T, heads, D] in place");
  m.def("linear_bf16_built", &linear_bf16_built,
        "whether linear_bf16 was compiled (the CPU has AVX2 and FMA)");
  m.def("linear_bf16", &linear_bf16, nogil(),
        "x W^T + b for bf16 x and W, fp32 math, AVX2 (few rows)");
  m.def("linear_pairs_built", &linear_pairs_built,
        "whether linear_bf16_pairs was compiled (the CPU has AVX512_BF16)");
  m.def("pack_bf16_pairs", &pack_bf16_pairs, nogil(),
        "a bf16 weight [N, K] as [N/16, K/2, 16, 2], each two blocks interleaved by pair of k");
  m.def("linear_bf16_pairs", &linear_bf16_pairs, nogil(),
        "x W^T + b over a weight from pack_bf16_pairs (bf16, AVX512_BF16)");
  m.def("gate_up_silu", &gate_up_silu, nogil(),
        "silu(gate) * up of x over an MLP's gate/up weight packed with its blocks interleaved");
}
