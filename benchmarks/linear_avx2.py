"""bf16 linears on a CPU without bf16 GEMMs (AVX2): PyTorch's bf16 ``F.linear``, fp32's GEMM
over an fp32 copy of the weight, and the AVX2 kernel ``linear_bf16`` (bf16 weight widened in
registers), side by side by row count, on the Qwen2.5-0.5B shapes.

Each figure is the median of the means over many calls, the ways interleaved A B C C B A,
``--repeats`` times (so 2 x repeats means each); the spread is their range. It picks
``models/packed_linear.KERNEL_ROWS``: the row count up to which the kernel is faster.

    python benchmarks/linear_avx2.py
    python benchmarks/linear_avx2.py --rows 1,16,64 --repeats 3 --no-bf16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hlserve.models.cpu_kernels import linear_op

SHAPES = {"qkv/o 896x896": (896, 896), "gate/up 896->4864": (896, 4864),
          "down 4864->896": (4864, 896), "lm_head 896->151936": (896, 151936)}


def mean_ms(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if time.perf_counter() - t0 > budget_s and n >= 3:
            return (time.perf_counter() - t0) / n * 1e3


def ways(op, x: torch.Tensor, w: torch.Tensor, w32: torch.Tensor, bf16: bool
         ) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {
        "kernel": lambda: op(x, w, None),
        "fp32": lambda: F.linear(x.float(), w32).to(torch.bfloat16)}
    if bf16:
        out["bf16"] = lambda: F.linear(x, w)
    return out


def measure(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """ms per call of each way, ``repeats`` times, interleaved A B C C B A."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    with torch.inference_mode():
        for _ in range(repeats):
            for way in order + order[::-1]:
                times[way].append(mean_ms(fns[way], 0.15))
    return times


def cell(times: dict[str, list[float]], way: str) -> str:
    if way not in times:
        return "-"
    v = times[way]
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-bf16", action="store_true", help="skip PyTorch's (slow) bf16 linear")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    op = linear_op()
    if op is None:
        raise SystemExit("the AVX2 kernel is not built here (no AVX2/FMA, or no compiler)")
    print(f"{torch.get_num_threads()} threads; ms per call, median of {2 * args.repeats} "
          "(range); GFLOP/s of the kernel")
    print("| shape | rows | kernel (ms) | fp32 copy (ms) | bf16 F.linear (ms) | fp32 / kernel "
          "| kernel GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
        w32 = w.float()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            times = measure(ways(op, x, w, w32, not args.no_bf16), args.repeats)
            med = {key: statistics.median(v) for key, v in times.items()}
            gflops = 2 * rows * k * n / med["kernel"] / 1e6
            print(f"| {name} | {rows} | {cell(times, 'kernel')} | {cell(times, 'fp32')} | "
                  f"{cell(times, 'bf16')} | {med['fp32'] / med['kernel']:.2f}x | {gflops:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
