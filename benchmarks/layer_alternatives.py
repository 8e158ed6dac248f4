"""Two ways to speed up a decoder layer on the CPU, measured on one layer's weights.

1. **Fused projections**: q, k and v as one GEMM (their weights concatenated), gate and up
   as one, against separate oneDNN-prepacked GEMMs (``models/packed_linear.py``). One
   layer's weights, called again and again, stay in cache: this found no difference at
   decode rows. With the weights streamed from memory as a model's are, merging saves 6-8%
   of a decode step's linear time (``benchmarks/merged_projections.py``), and the model now
   runs merged (``CausalLM.merge_projections``).
2. **torch.compile** (Inductor with freezing, so its linears are prepacked too; dynamic
   shapes, as a serving step's token count varies) of the layer's second half: residual add,
   RMSNorm, gate/up, SiLU x up, down, residual add. Against the plain PyTorch of that block
   and against hlserve's eager path (prepacked linears and the fused C++ ops of
   ``models/csrc/fused_ops.cpp``). Also printed: the share of elements where the compiled
   block's output differs from plain PyTorch's (Inductor keeps intermediates in fp32 where
   PyTorch rounds to bf16, so compiled output is not that of the reference forward).

Qwen2.5-0.5B shape, bf16, random weights; each figure is the best of 5 means over many calls.

    python benchmarks/layer_alternatives.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hlserve.models import fused
from hlserve.models.packed_linear import PackedLinear, can_prepack

HIDDEN, Q_OUT, KV_OUT, INTER = 896, 896, 128, 4864  # Qwen2.5-0.5B: 14 query, 2 KV heads of 64


def best_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        fn()
    means = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls)
    return 1e3 * min(means)


def linear(out_features: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(HIDDEN, out_features, bias=bias).to(torch.bfloat16)


def fused_projections(rows: list[int]) -> None:
    print("| rows | q, k, v: 3 GEMMs (ms) | qkv: 1 GEMM (ms) | gate, up: 2 GEMMs (ms) | gate-up: 1 GEMM (ms) |")
    print("|---:|---:|---:|---:|---:|")
    q, k, v = (PackedLinear(linear(n, True)) for n in (Q_OUT, KV_OUT, KV_OUT))
    qkv = PackedLinear(linear(Q_OUT + 2 * KV_OUT, True))
    gate, up = PackedLinear(linear(INTER)), PackedLinear(linear(INTER))
    gate_up = PackedLinear(linear(2 * INTER))
    for n in rows:
        x = torch.randn(n, HIDDEN, dtype=torch.bfloat16)
        calls = 200 if n <= 64 else 20
        cols = [best_ms(lambda x=x: (q(x), k(x), v(x)), calls),
                best_ms(lambda x=x: qkv(x).split([Q_OUT, KV_OUT, KV_OUT], -1), calls),
                best_ms(lambda x=x: (gate(x), up(x)), calls),
                best_ms(lambda x=x: gate_up(x).chunk(2, -1), calls)]
        print(f"| {n} | " + " | ".join(f"{c:.3f}" for c in cols) + " |")


class SecondHalf(nn.Module):
    """x + r, its RMSNorm, the MLP, the residual: plain PyTorch, as the reference forward."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = linear(INTER), linear(INTER)
        self.down = nn.Linear(INTER, HIDDEN, bias=False).to(torch.bfloat16)
        self.weight = nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        x = x + r
        h = fused.rms_norm_reference(x, self.weight, 1e-6)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class SecondHalfHlserve(nn.Module):
    """The same block as hlserve's model runs it: prepacked linears, fused C++ ops."""

    def __init__(self, ref: SecondHalf) -> None:
        super().__init__()
        self.gate, self.up, self.down = (PackedLinear(m) for m in (ref.gate, ref.up, ref.down))
        self.weight = ref.weight

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        x, h = fused.add_rms_norm(x, r, self.weight, 1e-6)
        return x + self.down(fused.silu_mul(self.gate(h), self.up(h)))


def compiled_block(rows: list[int]) -> None:
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # constant weights: Inductor prepacks them for oneDNN
    ref = SecondHalf().eval()
    ours = SecondHalfHlserve(ref)
    t0 = time.perf_counter()
    compiled = torch.compile(ref, dynamic=True)
    x = torch.randn(16, HIDDEN, dtype=torch.bfloat16)
    compiled(x, x)
    print(f"compile time (dynamic shapes, one block): {time.perf_counter() - t0:.1f} s; fused C++ "
          f"ops {'on' if fused.fused_ops() is not None else 'not built (PyTorch fallback)'}")
    print("| rows | plain PyTorch (ms) | hlserve eager (ms) | torch.compile (ms) | elements differing from plain: hlserve / compiled |")
    print("|---:|---:|---:|---:|---:|")
    for n in rows:
        x, r = (torch.randn(n, HIDDEN, dtype=torch.bfloat16) for _ in range(2))
        want = ref(x, r)
        # on clones: hlserve's fused add writes the sum into its first input, as the model
        # lets it (the timing loops below let it too: the values it grows do not change speed)
        diff = [f"{(f(x.clone(), r) != want).float().mean().item():.1%}" for f in (ours, compiled)]
        calls = 200 if n <= 64 else 20
        cols = [best_ms(lambda f=f, x=x, r=r: f(x, r), calls) for f in (ref, ours, compiled)]
        print(f"| {n} | " + " | ".join(f"{c:.3f}" for c in cols) + f" | {diff[0]} / {diff[1]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512],
                    help="tokens in the step: a decode batch, or a prompt chunk")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("this CPU's oneDNN has no bf16 GEMMs: nothing to compare")
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, bf16, Qwen2.5-0.5B shape")
    with torch.inference_mode():
        fused_projections(args.rows)
        print()
        compiled_block(args.rows)


if __name__ == "__main__":
    main()
