"""Where one engine step goes: a decode step and a 2K-token prefill, by component.

The real ``TorchRunner`` on a random-weight model (Qwen2.5-0.5B shape, bf16 by default), a
batch built as the scheduler builds it (page tables over a shuffled pool, so no sequence's
pages are contiguous), and wall-clock timers on the parts of ``execute``:

- ``attention``: the paged attention call of every layer (KV gather, scores, softmax, values);
- ``linear``: every projection (qkv, o, gate_up, down: the runner merges q/k/v and gate/up;
  where gate_up computes SiLU x up in its epilogue, that is counted here too);
- ``lm_head``: the vocabulary projection of the rows that sample;
- ``other model``: embedding, norms, RoPE, activation, KV write, residual adds;
- ``host``: what ``execute`` spends outside the model (batch to tensors, sampling, results).

CPU ops run synchronously, so the timers are exact there (their own cost is a few us per
call, about 1% of a step). Each figure is the median of ``--repeats`` steps after a warm-up.

    python benchmarks/step_breakdown.py                       # decode 16 x 1.4K-3.8K, prefill 2K
    python benchmarks/step_breakdown.py --decodes 32 --prefill 4096 --prefill-context 2048
    python benchmarks/step_breakdown.py --prefill-path sdpa     # without the prefill kernel
    python benchmarks/step_breakdown.py --no-fused-ops          # norms, RoPE, SiLU unfused
    python benchmarks/step_breakdown.py --last-layer-ab         # kept rows against all rows

``--last-layer-ab`` times the prefill step with the last layer on the sampled row only (as the
runner runs it) and on every row (``kept_rows`` off, the "before"), A B B A in one process,
and prints each pair's ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hlserve.config import EngineConfig
from hlserve.engine.batch import Batch, ScheduledSeq
from hlserve.models import llama
from hlserve.request import Request, SamplingParams
from hlserve.runner.torch_runner import TorchRunner


class Timers:
    """Wall time per component, accumulated over one step; nested timers are subtracted."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # [start, time of children]

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        self._stack.append([time.perf_counter(), 0.0])
        try:
            yield
        finally:
            start, children = self._stack.pop()
            spent = time.perf_counter() - start
            self.total[name] += spent - children
            if self._stack:
                self._stack[-1][1] += spent


def instrument(runner: TorchRunner, timers: Timers) -> None:
    """Wrap the model's parts in timers (instance attributes: the class stays untouched)."""
    model = runner.model

    def wrap(fn: Callable, name: str) -> Callable:
        def timed(*a, **k):
            with timers.time(name):
                return fn(*a, **k)
        return timed

    for layer in model.model.layers:
        # the runner merged q/k/v and gate/up (CausalLM.merge_projections)
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            lin.forward = wrap(lin.forward, "linear")
            if getattr(lin, "fuses_silu_mul", False):  # gate/up with SiLU x up in its epilogue
                lin.silu_mul = wrap(lin.silu_mul, "linear")
    model.lm_head.forward = wrap(model.lm_head.forward, "lm_head")
    llama.paged_attention = wrap(llama.paged_attention, "attention")
    fwd = model.forward
    model.forward = wrap(fwd, "other model")
    runner.model = model
    ex = runner.execute
    runner.execute = wrap(ex, "host")


def make_batch(runner: TorchRunner, contexts: list[int], new_tokens: list[int],
               rng: random.Random) -> Batch:
    """One sequence per context: its pages drawn at random from the pool, ``new_tokens`` to
    compute on top of the cached ``context``."""
    ps = runner.page_size
    free = list(range(runner.num_pages))
    rng.shuffle(free)
    seqs = []
    vocab = min(runner.model_config.vocab_size, 4096)
    for ctx, n in zip(contexts, new_tokens, strict=True):
        total = ctx + n
        pages = [free.pop() for _ in range(-(-total // ps))]
        req = Request([rng.randrange(3, vocab) for _ in range(total)],
                      SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        req.num_computed = ctx
        seqs.append(ScheduledSeq(req, ctx, n, pages))
    return Batch(seqs)


def measure(runner: TorchRunner, timers: Timers, batch: Batch, repeats: int
            ) -> dict[str, float]:
    runner.execute(batch)  # warm-up
    runs: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        timers.total.clear()
        t0 = time.perf_counter()
        runner.execute(batch)
        runs["step"].append(time.perf_counter() - t0)
        for k, v in timers.total.items():
            runs[k].append(v)
    return {k: statistics.median(v) * 1e3 for k, v in runs.items()}


def last_layer_ab(runner: TorchRunner, batch: Batch, rounds: int) -> None:
    """One prefill step, the last layer on the kept rows (A) against every row (B), A B B A."""
    import hlserve.runner.torch_runner as torch_runner

    kept = torch_runner.kept_rows

    def step(all_rows: bool) -> float:
        torch_runner.kept_rows = (lambda *a: None) if all_rows else kept
        t0 = time.perf_counter()
        runner.execute(batch)
        return time.perf_counter() - t0

    step(False), step(True)  # warm-up
    ratios = []
    for _ in range(rounds):
        a1, b1, b2, a2 = step(False), step(True), step(True), step(False)
        ratios.append((b1 + b2) / (a1 + a2))
        print(f"kept rows {1e3 * (a1 + a2) / 2:,.1f} ms, every row {1e3 * (b1 + b2) / 2:,.1f} ms:"
              f" {ratios[-1]:.3f}x")
    torch_runner.kept_rows = kept
    print(f"every row / kept rows: median {statistics.median(ratios):.3f}x "
          f"(pairs {min(ratios):.3f}-{max(ratios):.3f}) over {rounds} A B B A rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the random 0.5B)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--context", type=int, nargs=2, default=[1400, 3800], metavar=("MIN", "MAX"))
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill step")
    ap.add_argument("--prefill-context", type=int, default=0,
                    help="cached tokens before the prefill (a later chunk / prefix hit)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-path", choices=["auto", "sdpa"], default="auto",
                    help="sdpa: prompt chunks through gather + SDPA even where the CPU "
                         "prefill kernel is built (the 'before' of that kernel)")
    ap.add_argument("--last-layer-ab", action="store_true",
                    help="the prefill step with the last layer on the kept rows against every "
                         "row, A B B A, --repeats rounds")
    ap.add_argument("--no-fused-ops", action="store_true",
                    help="norms, RoPE and SiLU x up in plain PyTorch even where the fused "
                         "CPU ops are built (the 'before' of those ops)")
    args = ap.parse_args()
    if args.no_fused_ops:
        import hlserve.models.fused as fused

        fused.fused_ops = lambda: None
    if args.prefill_path == "sdpa":
        import hlserve.runner.torch_runner as torch_runner

        torch_runner.prefill_op = lambda: None
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from hlserve.models.tiny import make_tiny_model

        model_dir = Path("models") / f"qwen2-0.5b-{args.dtype}"
        if not (model_dir / "config.json").exists():
            make_tiny_model(model_dir, arch="qwen2", size="0.5b", dtype=args.dtype)
    n = args.decodes
    lo, hi = args.context
    contexts = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    need = sum(c + 1 for c in contexts) + args.prefill + args.prefill_context
    pages = 2 * (need // args.page_size + n + 2)
    runner = TorchRunner(EngineConfig(model=str(model_dir), dtype=args.dtype, num_pages=pages,
                                      page_size=args.page_size))
    if args.last_layer_ab:
        batch = make_batch(runner, [args.prefill_context], [args.prefill], random.Random(0))
        last_layer_ab(runner, batch, args.repeats)
        return
    timers = Timers()
    instrument(runner, timers)
    rng = random.Random(0)
    cases = {
        f"decode {n} x {lo}-{hi}": make_batch(runner, contexts, [1] * n, rng),
        f"prefill {args.prefill} (+{args.prefill_context} cached)":
            make_batch(runner, [args.prefill_context], [args.prefill], rng),
    }
    print(f"model {model_dir} ({args.dtype}), {torch.get_num_threads()} threads, page size "
          f"{args.page_size}, median of {args.repeats}; decode attention {runner.decode_path}, "
          f"prefill attention {runner.prefill_path}, fused ops "
          f"{'off' if args.no_fused_ops else 'on where built'}")
    cols = ("step", "attention", "linear", "lm_head", "other model", "host")
    print("| step | " + " | ".join(f"{c} (ms)" for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, batch in cases.items():
        r = measure(runner, timers, batch, args.repeats)
        print(f"| {name} | " + " | ".join(f"{r.get(c, 0.0):,.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
