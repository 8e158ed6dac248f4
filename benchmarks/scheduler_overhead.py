"""Time per LPM scheduling pass: the incremental ranking against the full pass it replaced
(every waiting request scored afresh, tests/kv_support.FullPassLPM), and the plain
per-request radix walk of the common implementation.

Agent-shaped queue: 16 shared system prompts of 2K tokens, each waiting request extends one
with its own history (512-4K tokens), all over a warm prefix cache (half of the histories
cached too). Each order runs on its own copy of the queue and tree, built from one seed and
changed identically, so neither walks a tree the other has just warmed; the two must give
the same order on every pass. Tree lookups per pass are printed too: a request that joins
the queue is walked once by either order, and that walk is most of a pass where many join.
Scenarios:

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
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.policies import LongestPrefixMatch
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

    def timed_pass(self) -> tuple[float, int, list[str]]:
        """One pass at the next step: seconds, tree lookups, the order (request ids)."""
        self.step += 1
        lookups = self.lpm.lookups
        t0 = time.perf_counter()
        ranked = list(self.lpm.order(self.waiting, self.step))
        elapsed = time.perf_counter() - t0
        return elapsed, self.lpm.lookups - lookups, [r.request_id for r in ranked]


@dataclass
class Pair:
    """The two orders on their twin worlds, changed alike."""

    old: World
    new: World

    def both(self, change: Callable[[World], None]) -> None:
        change(self.old)
        change(self.new)

    def timed_pass(self) -> tuple[float, float, int, int]:
        """(old s, new s, old lookups, new lookups) of one pass each; which goes first
        alternates (the machine's caches)."""
        first, second = (self.old, self.new) if self.old.step % 2 else (self.new, self.old)
        a, b = first.timed_pass(), second.timed_pass()
        assert a[2] == b[2], f"the orders differ at step {self.old.step}"
        o, n = (a, b) if first is self.old else (b, a)
        return o[0], n[0], o[1], n[1]


def _passes(pair: Pair, passes: int, change: Callable[[World], None],
            pick: Callable[[list[float]], float]) -> tuple[float, ...]:
    runs = []
    for _ in range(passes):
        pair.both(change)
        runs.append(pair.timed_pass())
    return tuple(pick([r[i] for r in runs]) for i in range(4))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5, help="passes per scenario (steady: 4x)")
    ap.add_argument("--min", action="store_true", help="minimum over the passes, not the median")
    ap.add_argument("--no-plain-walk", action="store_true", help="skip the slow plain-walk column")
    args = ap.parse_args()
    pick = min if args.min else statistics.median
    print(f"{'waiting':>8} {'scenario':>10} {'old LPM (ms)':>13} {'new LPM (ms)':>13} "
          f"{'speed-up':>9} {'lookups old/new':>16} {'plain walk (ms)':>16}")
    for n in args.sizes:
        pair = Pair(*(World(args.page_size, seed=n, incremental=inc) for inc in (False, True)))
        pair.both(lambda w: w.arrive(n))  # noqa: B023
        pair.timed_pass()  # first sight: every request is walked once, by each order
        rows = [(name, _passes(pair, reps, change, pick)) for name, reps, change in
                [("unchanged", args.repeats, _unchanged), ("steady", 4 * args.repeats, _steady),
                 ("burst", args.repeats, _burst)]]
        walk = ""
        if not args.no_plain_walk:
            t0 = time.perf_counter()
            plain_radix_walk_order(pair.old.kv, pair.old.waiting)
            walk = f"{1e3 * (time.perf_counter() - t0):.2f}"
        for name, (t_old, t_new, l_old, l_new) in rows:
            print(f"{n:>8} {name:>10} {1e3 * t_old:>13.2f} {1e3 * t_new:>13.2f} "
                  f"{t_old / t_new:>8.1f}x {f'{l_old:.0f}/{l_new:.0f}':>16} "
                  f"{walk if name == 'unchanged' else '':>16}")


if __name__ == "__main__":
    main()
