"""A decode step's linears: oneDNN's packed bf16 GEMM against the decode-size kernel
(``linear_pairs.cpp``) by row count, on the 0.5B model's shapes.

One pass runs every linear of ``--layers`` layers (q/k/v merged, o, gate/up merged, down, each
layer its own weights, so they stream from memory as a model's do) and the vocabulary
projection, at ``--rows`` rows. For each row count the two ways run in A B B A order,
``--rounds`` times (each round the pair once forwards, once backwards), alone on the machine;
the table gives each way's median ms per pass and the weight bytes it streamed per second,
and the kernel's speedup (median of the pairs' ratios, with their range).

    python benchmarks/decode_linears.py
    python benchmarks/decode_linears.py --rows 8 16 --rounds 6
    python benchmarks/decode_linears.py --mlp --rows 7 128 1024   # the MLPs alone
    python benchmarks/decode_linears.py --against HEAD~1   # the kernel built from another
                                                           # revision instead of oneDNN

``--mlp`` times each layer's MLP instead, as the model runs it: oneDNN's gate/up GEMM, the
fused ``silu_mul`` op over its output and oneDNN's down GEMM, against the kernel's gate/up
GEMM with SiLU x up in its epilogue (``gate_up_silu``) and the kernel's down GEMM.

``--against REV`` puts the kernel compiled from a git revision (or a directory of kernel
sources) in oneDNN's place: the same passes, this checkout's kernel against that one's, in one
process, A B B A, so that a change to the kernel is timed against what it replaced.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_attention import kernels_at
from hlserve.models.cpu_kernels import fused_ops, gate_up_silu_op, pairs_linear_ops
from hlserve.models.packed_linear import interleave_gate_up

# another build's kernel ops: pack, linear, gate_up_silu (see --against)
KernelOps = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor],
                  Callable[..., torch.Tensor]]

HIDDEN, INTER, QKV = 896, 4864, 1152  # Qwen2.5-0.5B: q 896 + k 128 + v 128
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def weights(layers: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
           for _ in range(layers) for n, k in SHAPES]
    return [*out, (torch.randn(vocab, HIDDEN, generator=g) * 0.05).to(torch.bfloat16)]


def passes(ws: list[torch.Tensor], rows: int, other: KernelOps | None = None
           ) -> dict[str, Callable[[], None]]:
    """oneDNN's GEMM, or ``other``'s kernel, and this checkout's kernel over every weight."""
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (HIDDEN, INTER)}

    def kernel_run(pack: Callable[..., torch.Tensor], linear: Callable[..., torch.Tensor],
                   *_: object) -> Callable[[], None]:
        packed = [(pack(w), w.shape[0]) for w in ws]

        def run() -> None:
            for w, (p, n) in zip(ws, packed, strict=True):
                linear(xs[w.shape[1]], p, n, None)
        return run
    run_kernel = kernel_run(*pairs_linear_ops())
    if other is not None:
        return {"other": kernel_run(*other), "kernel": run_kernel}
    pack_dnn, lin_dnn = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    dnn = [pack_dnn(w, 16) for w in ws]

    def run_dnn() -> None:
        for w, p in zip(ws, dnn, strict=True):
            lin_dnn(xs[w.shape[1]], p, None, "none", [], "")
    return {"oneDNN": run_dnn, "kernel": run_kernel}


def mlp_weights(layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
            for _ in range(layers) for n, k in [(2 * INTER, HIDDEN), (HIDDEN, INTER)]]


def mlp_passes(ws: list[torch.Tensor], rows: int, other: KernelOps | None = None
               ) -> dict[str, Callable[[], None]]:
    """Each layer's MLP: oneDNN + ``silu_mul``, or ``other``'s kernel, and this checkout's."""
    x = torch.randn(rows, HIDDEN).to(torch.bfloat16)

    def kernel_run(pack: Callable[..., torch.Tensor], linear: Callable[..., torch.Tensor],
                   gate_up_silu: Callable[..., torch.Tensor]) -> Callable[[], None]:
        # gate/up with its 16-row blocks of gate and up alternating, as PackedLinear packs it
        packed = [pack(interleave_gate_up(w) if i % 2 == 0 else w) for i, w in enumerate(ws)]

        def run() -> None:
            for gate_up, down in zip(packed[::2], packed[1::2], strict=True):
                linear(gate_up_silu(x, gate_up, INTER, None), down, HIDDEN, None)
        return run
    run_kernel = kernel_run(*pairs_linear_ops(), gate_up_silu_op())
    if other is not None:
        return {"other": kernel_run(*other), "kernel": run_kernel}
    pack_dnn, lin_dnn = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    silu_mul = fused_ops().silu_mul  # type: ignore[union-attr]
    dnn = [pack_dnn(w, 16) for w in ws]

    def run_dnn() -> None:
        for gate_up, down in zip(dnn[::2], dnn[1::2], strict=True):
            y = lin_dnn(x, gate_up, None, "none", [], "")
            lin_dnn(silu_mul(y[:, :INTER], y[:, INTER:]), down, None, "none", [], "")
    return {"oneDNN": run_dnn, "kernel": run_kernel}


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 7, 8, 12, 16, 24, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--mlp", action="store_true",
                    help="the MLPs alone: oneDNN + silu_mul against the fused kernel")
    ap.add_argument("--against", metavar="REV",
                    help="time the kernel built from this git revision (or directory of "
                         "kernel sources) instead of oneDNN")
    args = ap.parse_args()
    if pairs_linear_ops() is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("needs AVX512_BF16 (the kernel) and oneDNN's bf16 GEMM")
    other: KernelOps | None = None
    if args.against:
        m = kernels_at(args.against)
        other = (m.pack_bf16_pairs, m.linear_bf16_pairs, m.gate_up_silu)  # type: ignore[attr-defined]
    base = f"kernel at {args.against}" if args.against else "oneDNN"
    ws = mlp_weights(args.layers) if args.mlp else weights(args.layers, args.vocab)
    make = mlp_passes if args.mlp else passes
    gb = sum(w.numel() * 2 for w in ws) / 1e9
    what = "MLPs" if args.mlp else f"layers + vocabulary {args.vocab}"
    print(f"{args.layers} {what}: {gb:.3f} GB of bf16 weights per "
          f"pass; {torch.get_num_threads()} threads; median of {args.rounds} A B B A rounds")
    print(f"| rows | {base} ms (GB/s) | kernel ms (GB/s) | kernel speedup (pairs) |\n"
          "|---:|---:|---:|---|")
    with torch.inference_mode():
        for rows in args.rows:
            ways = make(ws, rows, other)
            for fn in ways.values():  # warm-up
                fn()
            t: dict[str, list[float]] = {k: [] for k in ways}
            for _ in range(args.rounds):
                for name in [*ways, *reversed(ways)]:
                    t[name].append(timed(ways[name]))
            ratios = [a / b for a, b in zip(*t.values(), strict=True)]
            cells = [f"{1e3 * statistics.median(v):.1f} ({gb / statistics.median(v):.1f})"
                     for v in t.values()]
            print(f"| {rows} | {cells[0]} | {cells[1]} | {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
