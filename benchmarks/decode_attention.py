"""The CPU decode attention kernel at a decode step's shape: this checkout's build beside the
same kernel built from another git revision (``--against``), in one process, A B B A.

One call is one layer of a decode step: ``--batch`` sequences with contexts drawn from
``--contexts`` (Qwen2.5-0.5B heads by default: 14 query heads, 2 KV heads, head size 64,
bf16), pages shuffled over the pool as the scheduler leaves them. Printed per version: ms per
call (median of ``--repeats`` A B B A rounds, with their range), the KV bytes read per second
and the ratio of the two versions. Both outputs are compared, so a faster kernel that changes
the result is reported.

    python benchmarks/decode_attention.py                       # against HEAD
    python benchmarks/decode_attention.py --against HEAD~3 --batch 32 --contexts 4000,8000
    python benchmarks/decode_attention.py --against /tmp/variant   # sources in a directory
    python benchmarks/decode_attention.py --against prefill-kernel # the route bf16 decodes
                                        # take on AVX512_BF16 hosts: chunks of one query
    python benchmarks/decode_attention.py --kernel prefill --against HEAD  # that route, two builds
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hlserve.models import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


def kernels_at(rev: str) -> object:
    """This project's CPU kernel module compiled from ``rev``'s kernel sources: a git revision,
    or a directory holding the files being tried (this checkout's for the others). It has its
    own module name and build directory, so it loads beside this checkout's build. The build
    is kept in the kernel cache under a hash of the sources and flags, so timing against the
    same revision again (or another that did not change the kernels) does not recompile."""
    from torch.utils import cpp_extension

    texts: dict[str, str] = {}
    for path in [*cpu_kernels._SOURCES, *cpu_kernels._HEADERS]:
        if Path(rev).is_dir():  # a variant being tried: the files it has, this checkout's else
            own = Path(rev) / path.name
            texts[path.name] = (own if own.exists() else path).read_text()
            continue
        rel = path.relative_to(ROOT)
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True,
                              text=True)
        if text.returncode == 0:  # a header that revision did not have is not needed by it
            texts[path.name] = text.stdout
    key = cpu_kernels.build_key([f"{n}\n{t}" for n, t in texts.items()])
    src = cpu_kernels.cache_root() / f"cpu_kernels_at_{key}"
    src.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        if not (src / name).exists() or (src / name).read_text() != text:
            (src / name).write_text(text)
    if not any(src.glob("*.so")):
        print(f"building the kernels at {rev} (about a minute) ...", flush=True)
    with cpu_kernels.build_guard(src):
        return cpp_extension.load(
            name="hlserve_cpu_kernels_at_rev", extra_cflags=cpu_kernels._flags(),
            sources=[str(src / p.name) for p in cpu_kernels._SOURCES],
            extra_ldflags=["-fopenmp"], build_directory=str(src), verbose=False)


def build_at(rev: str, kernel: str) -> Callable[..., torch.Tensor]:
    """The decode op (``kernel`` "decode") or the prefill kernel called on decodes
    ("prefill") compiled from ``rev``'s kernel sources (:func:`kernels_at`)."""
    module = kernels_at(rev)
    if kernel == "prefill":
        return prefill_kernel_as_decode(module.prefill_attention)  # type: ignore[attr-defined]
    return module.decode_attention  # type: ignore[attr-defined,no-any-return]


def prefill_kernel_as_decode(op: Callable[..., object] | None = None
                             ) -> Callable[..., torch.Tensor]:
    """The tiled prefill kernel (this checkout's, or ``op``) called on decode inputs, as the
    runner sends bf16 decodes on an AVX512_BF16 host: each sequence a chunk of one new query
    over ``len - 1`` cached keys."""
    op = op or cpu_kernels.prefill_op()
    if op is None:
        raise SystemExit("the prefill kernel is not built here (it needs AVX512_BF16)")

    def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
               page_lo: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        b = q.shape[0]
        op(out, q, k, v, pages, page_lo, torch.arange(b), torch.ones(b, dtype=torch.long),
           lens - 1, scale)
        return out

    return decode


def step_inputs(args: argparse.Namespace) -> tuple[tuple[object, ...], int]:
    """One layer's decode inputs, and the K and V bytes a call reads."""
    rng = random.Random(0)
    torch.manual_seed(0)
    lo_ctx, hi_ctx = (int(x) for x in args.contexts.split(","))
    lens = [rng.randint(lo_ctx, hi_ctx) for _ in range(args.batch)]
    S, D, kvh = args.page_size, args.head_dim, args.kv_heads
    counts = [(n + S - 1) // S for n in lens]
    pool = list(range(sum(counts) + 64))
    rng.shuffle(pool)
    k_cache = torch.randn(kvh, len(pool), S, D).to(torch.bfloat16)
    v_cache = torch.randn(kvh, len(pool), S, D).to(torch.bfloat16)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    q = torch.randn(args.batch, args.heads, D).to(torch.bfloat16)
    inputs = (q, k_cache, v_cache, torch.tensor(pool[: sum(counts)]), torch.tensor(starts),
              torch.tensor(lens), D ** -0.5)
    return inputs, 2 * kvh * sum(lens) * D * 2


def mean_ms(fn: Callable[[], object], budget_s: float = 0.5) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < budget_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD",
                    help="git revision of the other build, a directory of kernel sources, or "
                         "prefill-kernel (this build's tiled prefill kernel on the same decodes)")
    ap.add_argument("--kernel", choices=("decode", "prefill"), default="decode",
                    help="the kernel of both builds: the decode kernel, or the tiled prefill "
                         "kernel on the same decodes")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", default="1400,3800", help="lo,hi context lengths")
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    here = cpu_kernels.decode_op() if args.kernel == "decode" else prefill_kernel_as_decode()
    if here is None:
        raise SystemExit("this checkout's decode kernel did not build")
    other = prefill_kernel_as_decode() if args.against == "prefill-kernel" \
        else build_at(args.against, args.kernel)
    inputs, kv_bytes = step_inputs(args)
    ops = {"this checkout": here, args.against: other}
    diff = (ops["this checkout"](*inputs).float() - other(*inputs).float()).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(args.repeats):
        order = list(ops) if r % 2 == 0 else list(ops)[::-1]
        for name in order + order[::-1]:  # A B B A
            times[name].append(mean_ms(lambda op=ops[name]: op(*inputs)))
    print(f"{args.kernel} kernel: {args.batch} sequences at {args.contexts} keys, {args.heads}/{args.kv_heads} heads, "
          f"head size {args.head_dim}, pages of {args.page_size}, bf16, "
          f"{torch.get_num_threads()} threads; {kv_bytes / 1e6:.1f} MB of K and V per call")
    print(f"{'kernel':>16} | ms per call (median) | range | KV GB/s")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>16} | {med:8.2f} | {min(ts):.2f}-{max(ts):.2f} | "
              f"{kv_bytes / med / 1e6:6.1f}")
    ratios = sorted(a / b for a, b in zip(times[args.against], times["this checkout"],
                                          strict=True))
    print(f"{args.against} / this checkout: {statistics.median(ratios):.2f}x "
          f"(pairs {ratios[0]:.2f}-{ratios[-1]:.2f}); max |difference| of outputs {diff:.2e}")


if __name__ == "__main__":
    main()
