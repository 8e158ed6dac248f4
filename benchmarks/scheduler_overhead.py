"""Time per scheduling pass: hlserve's incremental LPM against a plain per-request radix walk.

Agent-shaped queue: 16 shared system prompts of 2K tokens, each waiting request extends one
with its own history (512-4K tokens), all over a warm prefix cache. Both orderings run on the
same queue and cache, side by side, in one process; the ratio is what to read.

    python benchmarks/scheduler_overhead.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.policies import LongestPrefixMatch
from hlserve.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the baseline walk
from kv_support import plain_radix_walk_order


def build(n_waiting: int, page_size: int, seed: int) -> tuple[KVCacheManager, list[Request]]:
    rng = random.Random(seed)
    kv = KVCacheManager(num_pages=400_000, page_size=page_size)
    systems = [[rng.randrange(32000) for _ in range(2048)] for _ in range(16)]
    waiting = []
    for i in range(n_waiting):
        history = [rng.randrange(32000) for _ in range(rng.randint(512, 4096))]
        tokens = systems[i % 16] + history
        waiting.append(Request(prompt_token_ids=tokens, params=SamplingParams(max_tokens=64),
                               arrival_time=float(i)))
        # half of the queue has its history cached too (rounds of running sessions)
        cached = tokens if i % 2 == 0 else systems[i % 16]
        rid = f"warm{i}"
        kv.admit(rid, cached, len(cached) - 1)
        kv.allocate(rid, len(cached))
        kv.commit(rid, cached, len(cached))
        kv.release(rid)
    return kv, waiting


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'waiting':>8} {'hlserve LPM (ms)':>18} {'plain walk (ms)':>16} {'speed-up':>9}")
    for n in args.sizes:
        kv, waiting = build(n, args.page_size, seed=n)
        lpm = LongestPrefixMatch(kv, aging=1.0, fcfs_fallback=None)
        list(lpm.order(waiting, 0))  # first sight: every request is walked once
        step = iter(range(1, 10**9))
        t_lpm = timed(lambda: list(lpm.order(waiting, next(step))), args.repeats)  # noqa: B023
        t_walk = timed(lambda: plain_radix_walk_order(kv, waiting), args.repeats)  # noqa: B023
        print(f"{n:>8} {1e3 * t_lpm:>18.2f} {1e3 * t_walk:>16.2f} {t_walk / t_lpm:>8.1f}x")


if __name__ == "__main__":
    main()
