"""The CPU prefill attention kernels side by side, beside the machine's bf16 GEMM.

One layer's attention (Qwen2.5-0.5B shape by default: 14 query heads over 2 KV heads,
head_dim 64, bf16) over a pool of shuffled 16-token pages, as the engine calls it: every
prompt length in ``--lengths`` over every cached context in ``--contexts``, and a batch of
16 decodes over 1.4K-3.8K keys (the runner sends bf16 decodes through the prefill kernel).
For each case the two kernels run in A B B A order (``rowpair``, the kernel the tiled one
replaced, then ``tiled`` twice, then ``rowpair``), ``--repeats`` times; each run is the
median of ``--calls`` calls after one warm-up call.

Throughput is GFLOP/s of the products the causal mask keeps: 4 x head_dim x heads per
(query, visible key) pair (q.k and p.v, a multiply and an add each). Beside it, measured in
the same rounds:

- ``GEMM, same products``: ``torch.matmul`` in bf16 of the same two products per KV head,
  unmasked over the whole context ([G x n, D] x [D, L], then [G x n, L] x [L, D]), on
  contiguous K/V: what a dense GEMM library does with the attention's shapes;
- ``GEMM peak``: ``torch.matmul`` of the model's MLP shape ([2048, 896] x [896, 4864], bf16),
  where the linear layers run.

Figures are the median over the runs, with their range. Only ratios within one run of this
script compare: the machine's speed drifts between hours.

    python benchmarks/prefill_attention.py
    python benchmarks/prefill_attention.py --lengths 512 2048 --contexts 0 --repeats 5
    python benchmarks/prefill_attention.py --lengths 128 --contexts 0 --repeats 1 --calls 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hlserve.models.cpu_kernels import prefill_op

KERNELS = ("rowpair", "tiled")  # A, B
PAGE = 16


@dataclass(frozen=True)
class Case:
    """One call's inputs: the batch's queries, the pool and the chunks' page tables."""

    name: str
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [KVH, P, PAGE, D]
    v_cache: torch.Tensor
    chunks: tuple[tuple[int, int], ...]  # (context, new tokens) of each chunk
    meta: tuple[torch.Tensor, ...]  # pages, page_lo, starts, num_new, context
    scale: float

    @property
    def flops(self) -> float:
        heads, d = self.q.shape[1], self.q.shape[2]
        pairs = sum(n * ctx + n * (n + 1) // 2 for ctx, n in self.chunks)
        return 4.0 * d * heads * pairs


def make_case(name: str, chunks: list[tuple[int, int]], heads: int, kv_heads: int, d: int,
              seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + n) // PAGE) for ctx, n in chunks]
    order = list(range(sum(need) + 8))
    random.Random(seed).shuffle(order)  # no sequence's pages are contiguous
    kc = torch.randn(kv_heads, len(order), PAGE, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(kv_heads, len(order), PAGE, d, generator=g).to(torch.bfloat16)
    tokens = sum(n for _, n in chunks)
    q = torch.randn(tokens, heads, d, generator=g).to(torch.bfloat16)
    pages, page_lo, starts, t = [], [], [], 0
    for (_, n), k in zip(chunks, need, strict=True):
        page_lo.append(len(pages))
        pages.extend(order[len(pages) : len(pages) + k])
        starts.append(t)
        t += n
    meta = tuple(torch.tensor(x) for x in (pages, page_lo, starts, [n for _, n in chunks],
                                           [c for c, _ in chunks]))
    return Case(name, q, kc, vc, tuple(chunks), meta, d**-0.5)


def gemm_call(case: Case) -> Callable[[], object]:
    """The same two products per KV head as dense bf16 GEMMs, unmasked, on contiguous K/V."""
    kvh, _, _, d = case.k_cache.shape
    group = case.q.shape[1] // kvh
    work = []
    for (ctx, n), start in zip(case.chunks, case.meta[2].tolist(), strict=True):
        length = ctx + n
        q = case.q[start : start + n].view(n, kvh, group, d).permute(1, 0, 2, 3)
        q = q.reshape(kvh, n * group, d).contiguous()
        k = case.k_cache[:, : -(-length // PAGE)].reshape(kvh, -1, d)[:, :length].contiguous()
        v = case.v_cache[:, : -(-length // PAGE)].reshape(kvh, -1, d)[:, :length].contiguous()
        p = torch.empty(kvh, n * group, length, dtype=torch.bfloat16)
        work.append((q, k.transpose(1, 2), v, p))

    def run() -> None:
        for q, kt, v, p in work:
            torch.matmul(q, kt, out=p)
            torch.matmul(p, v)

    return run


def gemm_flops(case: Case) -> float:
    d = case.q.shape[2]
    return 4.0 * d * case.q.shape[1] * sum(n * (ctx + n) for ctx, n in case.chunks)


def seconds(fn: Callable[[], object], calls: int) -> float:
    """Median wall time of ``calls`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_call(name: str, case: Case, out: torch.Tensor) -> Callable[[], object]:
    op = prefill_op(name)
    assert op is not None
    return lambda: op(out, case.q, case.k_cache, case.v_cache, *case.meta, case.scale)


def measure(case: Case, repeats: int, calls: int) -> dict[str, list[float]]:
    """GFLOP/s of each kernel (A B B A per repeat) and of the GEMM of the same products."""
    out = torch.zeros_like(case.q)
    runs = {name: kernel_call(name, case, out) for name in KERNELS}
    rates: dict[str, list[float]] = {name: [] for name in (*KERNELS, "gemm")}
    gemm = gemm_call(case)
    a, b = KERNELS
    for _ in range(repeats):
        for name in (a, b, b, a):
            rates[name].append(case.flops / seconds(runs[name], calls) / 1e9)
        rates["gemm"].append(gemm_flops(case) / seconds(gemm, calls) / 1e9)
    return rates


def max_difference(case: Case) -> float:
    """The largest difference between the two kernels' outputs (bf16 rounding, ~1e-2)."""
    outs = []
    for name in KERNELS:
        out = torch.zeros_like(case.q)
        kernel_call(name, case, out)()
        outs.append(out.float())
    return float((outs[0] - outs[1]).abs().max())


def gemm_peak(repeats: int, calls: int) -> list[float]:
    x = torch.randn(2048, 896).to(torch.bfloat16)
    w = torch.randn(896, 4864).to(torch.bfloat16)
    flops = 2.0 * 2048 * 896 * 4864
    return [flops / seconds(lambda: torch.matmul(x, w), calls) / 1e9 for _ in range(repeats)]


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.0f} [{min(xs):,.0f}–{max(xs):,.0f}]"


def cases(args: argparse.Namespace) -> list[Case]:
    shape = (args.heads, args.kv_heads, args.head_dim)
    out = [make_case(f"{n:,} over {ctx:,}", [(ctx, n)], *shape, seed=n + ctx)
           for ctx in args.contexts for n in args.lengths]
    if args.decodes:
        rng = random.Random(0)
        decodes = [(rng.randrange(1400, 3800), 1) for _ in range(args.decodes)]
        out.append(make_case(f"{args.decodes} decodes over 1.4K–3.8K", decodes, *shape, seed=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096],
                    help="prompt (chunk) lengths")
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 2048],
                    help="tokens cached before each prompt")
    ap.add_argument("--decodes", type=int, default=16,
                    help="decodes in the decode case (0: no decode case)")
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="A B B A rounds per case")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per run (median)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if prefill_op() is None:
        raise SystemExit("the CPU prefill kernels are not built here (no AVX512_BF16, "
                         "HLSERVE_CPU_KERNELS=0, or the build failed)")
    print(f"{args.heads} heads over {args.kv_heads} KV heads, head_dim {args.head_dim}, bf16, "
          f"{PAGE}-token shuffled pages, {args.threads} threads; GFLOP/s, median [range] of "
          f"{2 * args.repeats} kernel runs / {args.repeats} GEMM runs of {args.calls} calls\n")
    print("| case | rowpair (before) | tiled (after) | tiled / rowpair | GEMM, same products |"
          " max diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in cases(args):
        rates = measure(case, args.repeats, args.calls)
        ratio = statistics.median(rates["tiled"]) / statistics.median(rates["rowpair"])
        print(f"| {case.name} | {spread(rates['rowpair'])} | {spread(rates['tiled'])} | "
              f"{ratio:.2f}x | {spread(rates['gemm'])} | {max_difference(case):.3f} |",
              flush=True)
    peak = gemm_peak(args.repeats, args.calls)
    print(f"\nbf16 GEMM peak ([2048, 896] x [896, 4864], torch.matmul): {spread(peak)} GFLOP/s")


if __name__ == "__main__":
    main()
