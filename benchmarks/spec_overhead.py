"""The scheduler's per-step cost with speculation (issue 24): does drafting fit in the LPM
pass budget?

Every decode step asks the speculator for each running request's draft, inside the
scheduler's pass. This times ``Scheduler.schedule()`` (the whole pass: ordering, admission,
budget, drafts) on the real engine code over the simulated runner (8xH20, Qwen2.5-32B, so
the forward costs no wall time) with ``--sessions`` requests decoding over prompts of
``--contexts`` tokens, in three arms:

- ``off``: throughput mode without speculation;
- ``ngram``: n-gram speculation (k = 3, fixed every step, so the lookup runs every step:
  throughput mode's adaptive k would stop asking once acceptance fell), the engine's
  :class:`~hlserve.engine.speculation.NgramSpeculator` (each request's context indexed as
  it grows);
- ``ngram-scan``: the same proposals from the definition, a scan of the whole context per
  request per step over ``all_token_ids`` (what the engine did before the index): the
  before of this change.

The simulated tokens are pseudo-random, so lookups rarely match: the worst case for a scan,
which reads the whole context before it gives up. Medians over ``--steps`` passes per run (the slowest pass too: where requests first draft,
their prompts are indexed, ~1 us a token once),
arms interleaved A B C C B A over ``--repeats``; the pass budget is the 2 ms the LPM pass is
held to (docs/bench_results.md, "Scheduler pass").

    python benchmarks/spec_overhead.py                       # 64/256 sessions x 2K/8K/32K
    python benchmarks/spec_overhead.py --sessions 64 --contexts 4096 --steps 20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hlserve.engine.args import make_config
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import Engine, VirtualClock
from hlserve.engine.speculation import NgramSpeculator, Speculator, ngram_propose
from hlserve.request import SamplingParams
from hlserve.sim.build import device_info
from hlserve.sim.hardware import get_hardware
from hlserve.sim.sim_runner import SimRunner

BUDGET_MS = 2.0
ARMS = ("off", "ngram", "ngram-scan")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}


class ScanSpeculator(Speculator):
    """vLLM's n-gram proposal by a scan of the joined context each step (the reference)."""

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        return ngram_propose(list(context), k, SPEC["prompt_lookup_min"], SPEC["prompt_lookup_max"])


def engine_for(arm: str, context: int, sessions: int) -> Engine:
    spec: dict[str, Any] = {} if arm == "off" else {
        "speculative_config": json.dumps(SPEC), "speculative_adaptive": False}
    hw = get_hardware("H20")
    config = make_config("Qwen2.5-32B", device_info=device_info(hw), mode="throughput",
                         max_model_len=context + 4096, max_num_seqs=max(256, sessions), **spec)
    # the real proposers over the simulated tokens
    speculator = None if arm == "off" else (NgramSpeculator(2, 5) if arm == "ngram"
                                            else ScanSpeculator())
    return build_engine(config, SimRunner(config, hw, 8), clock=VirtualClock(),
                        speculator=speculator)


def run(arm: str, context: int, sessions: int, steps: int, seed: int) -> dict[str, Any]:
    """Median seconds per schedule() pass once every request decodes."""
    engine = engine_for(arm, context, sessions)
    rng = random.Random(seed)
    for i in range(sessions):
        prompt = [rng.randrange(1, 150_000) for _ in range(context)]
        engine.add_request(prompt, SamplingParams(max_tokens=4096, ignore_eos=True),
                           request_id=f"r{i}")
    sched = engine.scheduler
    while any(r.num_computed < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        engine.step()  # prefills (virtual time), not timed
    times: list[float] = []
    inner = sched.schedule

    def timed() -> Any:
        t0 = time.perf_counter()
        batch = inner()
        times.append(time.perf_counter() - t0)
        return batch

    sched.schedule = timed  # type: ignore[method-assign]
    for _ in range(steps):
        engine.step()
    decodes = len(sched.running)
    return {"arm": arm, "context": context, "sessions": sessions, "decoding": decodes,
            "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--steps", type=int, default=10, help="timed passes per run")
    ap.add_argument("--repeats", type=int, default=2, help="A B C C B A cycles")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                    help="ngram-scan is slow past 8K x 256: it scans while the others prefill")
    ap.add_argument("--out", type=Path, default=None, help="JSON of every run")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    print("| sessions | context | arm | pass ms (median of runs) | runs | slowest pass ms | "
          "within 2 ms |")
    print("|---:|---:|---|---:|---|---:|---|")
    for sessions in args.sessions:
        for context in args.contexts:
            order = [*args.arms, *reversed(args.arms)] * args.repeats
            runs = [run(a, context, sessions, args.steps, seed=i // 2)
                    for i, a in enumerate(order)]
            rows += runs
            for arm in args.arms:
                ms = [r["median_ms"] for r in runs if r["arm"] == arm]
                mid = statistics.median(ms)
                worst = max(r["max_ms"] for r in runs if r["arm"] == arm)
                print(f"| {sessions} | {context} | {arm} | {mid:.2f} | "
                      f"{' / '.join(f'{m:.2f}' for m in ms)} | {worst:.1f} | "
                      f"{'yes' if mid <= BUDGET_MS else 'no'} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"budget_ms": BUDGET_MS, "spec": SPEC, "runs": rows},
                                       indent=1))


if __name__ == "__main__":
    main()
