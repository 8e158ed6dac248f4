"""oneDNN's bf16 linear by row count: plain ``F.linear`` against the weight prepacked for
16, 512 and 2,048 rows (``models/packed_linear.py`` packs for 16).

For each of the 0.5B model's layer shapes and each row count in ``--rows``, the four ways
run in A B B A order (forwards, then backwards) ``--repeats`` times; each figure is the best
GFLOP/s over them, each time the median of ``--calls`` calls. It answers whether prefill,
whose rows are hundreds to thousands, loses anything to a weight packed for decode's 16
rows (on a Zen 4 host with AVX512_BF16: no, within 2%; docs/bench_results.md).

    python benchmarks/linear_packing.py
    python benchmarks/linear_packing.py --rows 16 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"gate/up 896 -> 4864": (4864, 896), "down 4864 -> 896": (896, 4864),
          "q/o 896 -> 896": (896, 896)}
HINTS = (16, 512, 2048)


def median_s(fn: Callable[[], object], calls: int) -> float:
    fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def ways(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    pack = torch.ops.mkldnn._reorder_linear_weight
    linear = torch.ops.mkldnn._linear_pointwise
    out: dict[str, Callable[[], object]] = {"plain": lambda: F.linear(x, w)}
    for h in HINTS:
        packed = pack(w, h)
        out[f"packed for {h}"] = lambda p=packed: linear(x, p, None, "none", [], "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 512, 2048])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("oneDNN has no bf16 kernels on this CPU (see linear_avx2.py)")
    torch.manual_seed(0)
    print(f"bf16, {torch.get_num_threads()} threads; GFLOP/s, best of {args.repeats} A B B A "
          f"rounds")
    print(f"{'shape':>20} | {'rows':>5} | " + " | ".join(["plain"] + [f"packed {h}" for h in HINTS]))
    for name, (n_out, k) in SHAPES.items():
        w = (torch.randn(n_out, k) * 0.02).bfloat16()
        for m in args.rows:
            fns = ways(torch.randn(m, k).bfloat16(), w)
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(args.repeats):
                for way in [*fns, *reversed(fns)]:  # A B B A
                    best[way] = min(best[way], median_s(fns[way], args.calls))
            cells = [f"{2 * m * n_out * k / best[way] / 1e9:8.0f}" for way in fns]
            print(f"{name:>20} | {m:5d} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
