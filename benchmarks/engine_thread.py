"""Steps on the engine thread with the loading thread's OpenMP workers kept or given back.

A server builds its engine on the main thread and steps it on the engine thread. With GNU
OpenMP (torch's CPU wheels) each of the two threads then has a pool of workers, and once the
runtime manages more threads than there are CPUs it throttles every idle worker's spin to
100 iterations: the engine thread's worker sleeps between parallel regions and is woken by
futex at the next. ``server.api.serve`` gives the main thread's pool back once the engine is
built (``cpu_runtime.release_openmp_workers``). This script measures what that is worth.

The real ``TorchRunner`` (random 0.5B model, bf16) is built on the main thread; steps run on
a second, long-lived thread, as the server's engine thread. Each way, ``kept`` (the main
thread's pool present: a parallel op has just run on it) and ``released`` (given back), runs
``--steps`` steps of one batch, in A B B A order, ``--rounds`` times, alone on the machine.
The table gives each way's median ms per step and the process's CPU cores busy during it
(CPU time over wall time), and kept / released (median of the pairs' ratios, their range).

    python benchmarks/engine_thread.py
    python benchmarks/engine_thread.py --rounds 6 --steps 40
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hlserve.config import EngineConfig
from hlserve.cpu_runtime import release_openmp_workers
from hlserve.engine.batch import Batch
from hlserve.runner.torch_runner import TorchRunner
from step_breakdown import make_batch


class StepThread:
    """One long-lived thread that runs what it is given, as the server's engine thread: its
    OpenMP pool lives as long as it does."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, out = job
            out.put(fn())

    def call(self, fn: Callable[[], Any]) -> Any:
        out: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, out))
        return out.get()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def steps(runner: TorchRunner, batch: Batch, n: int) -> tuple[float, float]:
    """(median seconds per step, CPU cores busy) over ``n`` steps, run on the calling thread."""
    times = []
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        runner.execute(batch)
        times.append(time.perf_counter() - t)
    return statistics.median(times), (time.process_time() - c0) / (time.perf_counter() - w0)


def cell(runs: list[tuple[float, float]]) -> str:
    """A way's median ms per step and its median cores busy."""
    ms = statistics.median(r[0] for r in runs) * 1e3
    return f"{ms:,.1f} ({statistics.median(r[1] for r in runs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the random 0.5B)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="decode steps per way and round "
                    "(prefill steps: a fifth of them)")
    args = ap.parse_args()
    model_dir = args.model or Path("models") / "qwen2-0.5b-bfloat16"
    if args.model is None and not (model_dir / "config.json").exists():
        from hlserve.models.tiny import make_tiny_model

        make_tiny_model(model_dir, arch="qwen2", size="0.5b", dtype="bfloat16")
    runner = TorchRunner(EngineConfig(model=str(model_dir), dtype="bfloat16", num_pages=2000,
                                      page_size=16))
    rng = random.Random(0)
    cases = {
        "decode 8 x 600-1,700": (make_batch(runner, [600 + 157 * i for i in range(8)], [1] * 8,
                                            rng), args.steps),
        "prefill 512 over 512": (make_batch(runner, [512], [512], rng), max(2, args.steps // 5)),
    }
    engine = StepThread()
    probe = torch.ones(1 << 22)

    def way(name: str, batch: Batch, n: int) -> tuple[float, float]:
        if name == "kept":
            probe.add_(1)  # a parallel region on this (the loading) thread: its pool is back
        else:
            release_openmp_workers()
        return engine.call(lambda: steps(runner, batch, n))

    print(f"model {model_dir}, {torch.get_num_threads()} threads; A B B A x {args.rounds}")
    print("| batch | kept: ms per step (cores busy) | released: ms per step (cores busy) | "
          "kept / released (pairs) |")
    print("|---|---:|---:|---|")
    for label, (batch, n) in cases.items():
        engine.call(lambda b=batch: runner.execute(b))  # warm-up
        res: dict[str, list[tuple[float, float]]] = {"kept": [], "released": []}
        ratios = []
        for _ in range(args.rounds):
            a1, b1, b2, a2 = (way(w, batch, n) for w in ("kept", "released", "released", "kept"))
            res["kept"] += [a1, a2]
            res["released"] += [b1, b2]
            ratios.append((a1[0] + a2[0]) / (b1[0] + b2[0]))
        print(f"| {label} | {cell(res['kept'])} | {cell(res['released'])} | "
              f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) |",
              flush=True)
    engine.stop()


if __name__ == "__main__":
    main()
