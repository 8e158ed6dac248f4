"""q/k/v and gate/up as one GEMM each (``CausalLM.merge_projections``) against the separate
GEMMs, with the weights streamed from memory as a model's are.

A decode step reads every weight of the model once; one layer's weights called again and
again sit in cache and hide what merging saves (``benchmarks/layer_alternatives.py`` measured
it that way and found nothing). Here each pass walks ``--layers`` distinct layers' weights
(24: Qwen2.5-0.5B's, 360 MB, several times the last-level cache), so the GEMMs stream them
from DRAM:

1. **Decode rows** (1-16): a pass over every layer's q/k/v/o/gate/up/down GEMMs, separate
   (7 per layer) against merged (4 per layer).
2. **Prompt rows** (512-4,096): the MLP block (gate/up, SiLU x up, down) over 8 layers:
   separate, merged in one pass, and merged in ``CPU_MLP_ROWS``-row passes (what the model
   runs on the CPU). Outputs are checked equal to the bit.

Each figure is the median of ``--repeats`` rounds of A B B A (one pass each); the ratio's
range is over the rounds' pairs. bf16, prepacked for oneDNN, random weights.

    python benchmarks/merged_projections.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from hlserve.models import fused
from hlserve.models.llama import CPU_MLP_ROWS
from hlserve.models.packed_linear import PackedLinear, can_prepack

HIDDEN, Q_OUT, KV_OUT, INTER = 896, 896, 128, 4864  # Qwen2.5-0.5B: 14 query, 2 KV heads of 64


def weight(out_features: int, in_features: int) -> torch.Tensor:
    return (torch.randn(out_features, in_features) * 0.03).bfloat16()


def packed(w: torch.Tensor) -> PackedLinear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    return PackedLinear(lin)


class Layer:
    """One layer's linears, separate and merged (the same weights)."""

    def __init__(self) -> None:
        q, k, v = weight(Q_OUT, HIDDEN), weight(KV_OUT, HIDDEN), weight(KV_OUT, HIDDEN)
        gate, up = weight(INTER, HIDDEN), weight(INTER, HIDDEN)
        self.q, self.k, self.v, self.gate, self.up = (packed(w) for w in (q, k, v, gate, up))
        self.o, self.down = packed(weight(HIDDEN, Q_OUT)), packed(weight(HIDDEN, INTER))
        self.qkv, self.gate_up = packed(torch.cat([q, k, v])), packed(torch.cat([gate, up]))


def decode_pass(layers: list[Layer], merged: bool, x: torch.Tensor, xi: torch.Tensor) -> None:
    for lay in layers:
        if merged:
            lay.qkv(x), lay.gate_up(x)
        else:
            lay.q(x), lay.k(x), lay.v(x), lay.gate(x), lay.up(x)
        lay.o(x), lay.down(xi)


def mlp(lay: Layer, x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "separate":
        return lay.down(fused.silu_mul(lay.gate(x), lay.up(x)))
    if how == "merged" or x.shape[0] <= CPU_MLP_ROWS:
        gu = lay.gate_up(x)
        return lay.down(fused.silu_mul(gu[:, :INTER], gu[:, INTER:]))
    return torch.cat([mlp(lay, x[i : i + CPU_MLP_ROWS], "merged")
                      for i in range(0, x.shape[0], CPU_MLP_ROWS)])


def rounds(fns: dict[str, Callable[[], object]], base: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per pass of each fn, in A B B A order against ``base`` (after a warm-up)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    others = [n for n in fns if n != base]
    for _ in range(repeats):
        for name in [base, *others, *reversed(others), base]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def report(label: str, times: dict[str, list[float]], base: str) -> str:
    med = {n: statistics.median(t) for n, t in times.items()}
    cells = []
    for name, t in times.items():
        cell = f"{1e3 * med[name]:.1f}"
        if name != base:  # pairs: round r's two base passes against its two of this one
            b = times[base]
            ratios = [(b[2 * i] + b[2 * i + 1]) / (t[2 * i] + t[2 * i + 1]) for i in range(len(b) // 2)]
            cell += f" ({med[base] / med[name]:.2f}x, pairs {min(ratios):.2f}-{max(ratios):.2f})"
        cells.append(cell)
    return f"| {label} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--decode-rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--prompt-rows", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("this CPU's oneDNN has no bf16 GEMMs: nothing to compare")
    torch.manual_seed(0)
    with torch.inference_mode():
        layers = [Layer() for _ in range(args.layers)]
        print(f"{torch.get_num_threads()} threads; {args.layers} layers of the Qwen2.5-0.5B shape, "
              f"bf16; median ms per pass of {args.repeats} A B B A rounds\n")
        print("| decode rows | 7 GEMMs per layer | 4 GEMMs per layer (merged) |")
        print("|---:|---:|---:|")
        for n in args.decode_rows:
            x, xi = torch.randn(n, HIDDEN).bfloat16(), torch.randn(n, INTER).bfloat16()
            times = rounds({"separate": lambda x=x, xi=xi: decode_pass(layers, False, x, xi),
                            "merged": lambda x=x, xi=xi: decode_pass(layers, True, x, xi)},
                           "separate", args.repeats)
            print(report(str(n), times, "separate"))
        print(f"\n| prompt rows | MLP, separate gate and up | merged, one pass | merged, "
              f"{CPU_MLP_ROWS}-row passes |")
        print("|---:|---:|---:|---:|")
        few = layers[:8]
        for n in args.prompt_rows:
            x = torch.randn(n, HIDDEN).bfloat16() * 0.5
            want = mlp(few[0], x, "separate")
            for how in ("merged", "chunked"):
                assert torch.equal(mlp(few[0], x, how), want), how
            fns = {how: (lambda how=how, x=x: [mlp(lay, x, how) for lay in few])
                   for how in ("separate", "merged", "chunked")}
            print(report(str(n), rounds(fns, "separate", max(2, args.repeats // 2)), "separate"))


if __name__ == "__main__":
    main()
