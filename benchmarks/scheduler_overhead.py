"""Time per LPM scheduling pass: the incremental ranking against the full pass it replaced
(every waiting request scored afresh, tests/kv_support.FullPassLPM), and the plain
per-request radix walk of the common implementation.

Agent-shaped queue: 16 shared system prompts of 2K tokens, each waiting request extends one
with its own history (512-4K tokens), all over a warm prefix cache (half of the histories
cached too). Each order runs on its own copy of the queue and tree, built from one seed and
changed identically, one after the other (one copy in memory at a time: two would crowd
the caches and slow both), and the two must give the same order on every pass. Tree lookups
per pass are printed too: a request that joins the queue is walked once by either order,
and that walk is most of a pass where many join. Scenarios:

- ``unchanged``: the queue and the tree as they were at the last pass;
- ``steady``: between passes, 8 requests admitted from the head (their prompts cached as
  their prefill would), 8 arrive, 64 cached pages evicted (the realistic case);
- ``burst``: one pass after an eighth of the queue admitted, as many arrived, and 4 cached
  pages per waiting request evicted (at 4,096 waiting: 512, 512 and 16K).

The pool holds 400K pages: admitted prompts evict the oldest cached pages as it fills.
Medians over the passes; the minimum too (``--min``), which is what a loaded machine
distorts least.

    python benchmarks/scheduler_overhead.py
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.policies.lpm import LongestPrefixMatch
from hlserve.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the baselines
from kv_support import FullPassLPM, plain_radix_walk_order, release_cached

AGING = 4.0  # throughput mode's


def _cache(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    kv.admit(rid, tokens, len(tokens) - 1)
    assert kv.allocate(rid, len(tokens)), "the benchmark's pool is sized to hold it all"
    release_cached(kv, rid, tokens, len(tokens))


@dataclass
class World:
    """A waiting queue over a warm tree, ranked by one LPM order."""

    page_size: int
    seed: int
    incremental: bool
    kv: KVCacheManager = field(init=False)
    lpm: LongestPrefixMatch = field(init=False)
    waiting: list[Request] = field(default_factory=list)
    # admitted requests live on (as running ones do in the engine): freeing their tokens is
    # no part of a pass
    running: list[Request] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.kv = KVCacheManager(num_pages=400_000, page_size=self.page_size)
        self.systems = [[self.rng.randrange(32000) for _ in range(2048)] for _ in range(16)]
        order = LongestPrefixMatch if self.incremental else FullPassLPM
        self.lpm = order(self.kv, AGING, fcfs_fallback=None)
        self.arrived = 0

    def arrive(self, n: int) -> None:
        rng = self.rng
        for _ in range(n):
            i = self.arrived
            self.arrived += 1
            history = [rng.randrange(32000) for _ in range(rng.randint(512, 4096))]
            tokens = self.systems[i % 16] + history
            self.waiting.append(Request(prompt_token_ids=tokens, params=SamplingParams(max_tokens=64),
                                        request_id=f"r{i}", arrival_time=float(i)))
            # half of the queue has its history cached too (rounds of running sessions)
            _cache(self.kv, f"warm{i}", tokens if i % 2 == 0 else self.systems[i % 16])

    def admit(self, n: int) -> None:
        """The head of the order leaves the queue; its prompt enters the tree."""
        for req in list(self.lpm.order(self.waiting, self.step))[:n]:
            self.waiting.remove(req)
            self.lpm.forget(req)
            _cache(self.kv, f"ran-{req.request_id}", req.prompt_token_ids)
            self.running.append(req)

    def timed_pass(self) -> tuple[float, int, list[str]]:
        """One pass at the next step: seconds, tree lookups, the order (request ids)."""
        self.step += 1
        lookups = self.lpm.lookups
        t0 = time.perf_counter()
        ranked = list(self.lpm.order(self.waiting, self.step))
        elapsed = time.perf_counter() - t0
        return elapsed, self.lpm.lookups - lookups, [r.request_id for r in ranked]


def _unchanged(w: World) -> None:
    pass


def _steady(w: World) -> None:
    w.admit(8)
    w.arrive(8)
    w.kv.evict(64)


def _burst(w: World) -> None:
    n = len(w.waiting)
    w.admit(n // 8)
    w.arrive(n // 8)
    w.kv.evict(4 * n)


@dataclass
class Scenario:
    name: str
    passes: int
    change: Callable[[World], None]  # what happens before each pass


@dataclass
class Run:
    """One order through every scenario: per scenario (seconds, lookups) of each pass, and
    the order every pass gave (request ids)."""

    times: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)
    plain_walk_s: float | None = None


def run_order(incremental: bool, n: int, page_size: int, scenarios: list[Scenario],
              plain_walk: bool) -> Run:
    """Build the queue and the tree from the seed, then time this order's passes."""
    w = World(page_size, seed=n, incremental=incremental)
    w.arrive(n)
    w.timed_pass()  # first sight: every request is walked once
    run = Run()
    for sc in scenarios:
        run.times[sc.name] = []
        for _ in range(sc.passes):
            sc.change(w)
            elapsed, lookups, order = w.timed_pass()
            run.times[sc.name].append((elapsed, lookups))
            run.orders.append(order)
    if plain_walk:
        t0 = time.perf_counter()
        plain_radix_walk_order(w.kv, w.waiting)
        run.plain_walk_s = time.perf_counter() - t0
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5, help="passes per scenario (steady: 4x)")
    ap.add_argument("--min", action="store_true", help="minimum over the passes, not the median")
    ap.add_argument("--no-plain-walk", action="store_true", help="skip the slow plain-walk column")
    args = ap.parse_args()
    pick = min if args.min else statistics.median
    scenarios = [Scenario("unchanged", args.repeats, _unchanged),
                 Scenario("steady", 4 * args.repeats, _steady),
                 Scenario("burst", args.repeats, _burst)]
    print(f"{'waiting':>8} {'scenario':>10} {'old LPM (ms)':>13} {'new LPM (ms)':>13} "
          f"{'speed-up':>9} {'lookups old/new':>16} {'plain walk (ms)':>16}")
    for n in args.sizes:
        old = run_order(False, n, args.page_size, scenarios, not args.no_plain_walk)
        gc.collect()  # one world in memory at a time: the other's pages would crowd the caches
        new = run_order(True, n, args.page_size, scenarios, False)
        gc.collect()
        for i, (a, b) in enumerate(zip(old.orders, new.orders, strict=True)):
            assert a == b, f"{n} waiting: the orders differ at pass {i}"
        for sc in scenarios:
            t_old, l_old = (pick(x) for x in zip(*old.times[sc.name], strict=True))
            t_new, l_new = (pick(x) for x in zip(*new.times[sc.name], strict=True))
            walk = f"{1e3 * old.plain_walk_s:.2f}" if old.plain_walk_s and sc.name == "unchanged" else ""
            print(f"{n:>8} {sc.name:>10} {1e3 * t_old:>13.2f} {1e3 * t_new:>13.2f} "
                  f"{t_old / t_new:>8.1f}x {f'{l_old:.0f}/{l_new:.0f}':>16} {walk:>16}")


if __name__ == "__main__":
    main()
