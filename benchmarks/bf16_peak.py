"""This CPU's bf16 dot-product peak beside oneDNN's bf16 GEMM, in one run.

The peak is what the core's AVX512_BF16 instruction delivers with nothing else in the loop:
16 independent ``vdpbf16ps`` (16 lanes x 2 bf16 products, 64 FLOP each) per iteration on
registers, in as many threads as torch uses, each thread timed on its own. Beside it, at the
peers model's shapes (the MLP's [rows, 896] x [896, 4864], its down projection
[rows, 4864] x [4864, 896] and the attention output's [rows, 896] x [896, 896]):

- ``GEMM``: ``torch.nn.functional.linear`` in bf16, which oneDNN runs, reordering the weight
  on every call (so it understates a prepacked GEMM at small row counts);
- ``engine``: the projection as the runner builds it (``packed_linear.prepack_linears``: the
  ``linear_pairs.cpp`` kernel where the CPU has no AMX, oneDNN's prepacked GEMM past 16 rows
  where it has).

Printed: GFLOP/s of each and its share of the peak, the median of ``--repeats`` rounds (all
cases alternate, A B B A) with their range.

    python benchmarks/bf16_peak.py
    python benchmarks/bf16_peak.py --rows 512 2048 --repeats 5

Why it exists: whether the linear layers have headroom decides whether a faster GEMM is a
lever for engine speed (docs/bench_results.md). The instruction peak needs AVX512_BF16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils import cpp_extension

from hlserve.models.packed_linear import prepack_linears

_SOURCE = r"""
#include <torch/extension.h>
#include <chrono>
#include <thread>
#include <vector>

// 16 independent accumulators (zmm0-15) against two fixed operands: no loads, no dependency
// chain shorter than 16 instructions, so the loop runs at the instruction's throughput.
static double one_thread(int64_t iters) {
  asm volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" :::
               "xmm30", "xmm31");
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i)
    asm volatile(
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm0\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm1\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm2\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm3\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm4\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm5\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm6\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm7\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm8\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm9\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm10\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm11\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm12\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm13\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm14\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm15\n\t" :::
        "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return iters * 16.0 * 64.0 / s / 1e9;
}

// GFLOP/s of `threads` threads running the loop at once (each thread's own rate, summed).
double peak_gflops(int64_t threads, int64_t iters) {
  std::vector<double> rate(threads);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back([&, t] { rate[t] = one_thread(iters); });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double r : rate) sum += r;
  return sum;
}
"""


def _peak_op():  # type: ignore[no-untyped-def]
    with open("/proc/cpuinfo") as f:
        has_bf16 = "avx512_bf16" in f.read()
    if not has_bf16:
        raise SystemExit("this CPU has no AVX512_BF16: the instruction peak is not measured")
    print("building the peak loop ...", flush=True)
    module = cpp_extension.load_inline(
        name="hlserve_bf16_peak", cpp_sources=_SOURCE, functions=["peak_gflops"],
        extra_cflags=["-O2", "-mavx512f", "-mavx512bf16"], verbose=False)
    return module.peak_gflops


def _gflops(call: Callable[[], object], flops: float, calls: int) -> float:
    """GFLOP/s of ``calls`` calls of ``call`` (``flops`` each), after two warm-up calls."""
    for _ in range(2):
        call()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return flops * calls / (time.perf_counter() - t0) / 1e9


def gemm_gflops(rows: int, out_features: int, calls: int = 10) -> float:
    x = torch.randn(rows, 896, dtype=torch.bfloat16)
    w = torch.randn(out_features, 896, dtype=torch.bfloat16)
    return _gflops(lambda: torch.nn.functional.linear(x, w), 2 * rows * 896 * out_features, calls)


def engine_gflops(rows: int, in_features: int, out_features: int, calls: int = 10
                  ) -> Callable[[], float]:
    """A timer of the projection as the runner builds it, the weight packed once."""
    model = torch.nn.Sequential(
        torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16))
    prepack_linears(model)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    return lambda: _gflops(lambda: model(x), 2 * rows * in_features * out_features, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=3, help="A B B A rounds")
    args = ap.parse_args()
    peak = _peak_op()
    threads = torch.get_num_threads()
    cases = {"peak": lambda: peak(threads, 20_000_000)}
    for rows in args.rows:
        for n, what in ((4864, "MLP"), (896, "o_proj")):
            cases[f"GEMM {what} {rows} x 896 x {n}"] = lambda r=rows, n=n: gemm_gflops(r, n)
        for k, n, what in ((896, 4864, "MLP"), (4864, 896, "down"), (896, 896, "o_proj")):
            cases[f"engine {what} {rows} x {k} x {n}"] = engine_gflops(rows, k, n)
    rates: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order + order[::-1]:
            rates[name].append(cases[name]())
    top = statistics.median(rates["peak"])
    print(f"{threads} threads; median of {2 * args.repeats} runs (range)")
    print(f"{'case':>30} | GFLOP/s | range | share of peak")
    for name, rs in rates.items():
        med = statistics.median(rs)
        print(f"{name:>30} | {med:7.1f} | {min(rs):.1f}-{max(rs):.1f} | {med / top:6.1%}")


if __name__ == "__main__":
    main()
