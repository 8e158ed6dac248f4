"""Simulator speed: simulated seconds per wall second of a closed-loop agent run on a
simulated 8xH20 (TP 8) serving Qwen2.5-32B, with the real Scheduler and KV cache.

    python benchmarks/sim_speed.py                      # 1 simulated hour, 64 sessions, 32K
    python benchmarks/sim_speed.py --hours 0.1 --profile   # where the wall time goes

Prints one line for the chosen mode or preset (``--mode``): simulated seconds, wall seconds,
their ratio, iterations and microseconds of wall time per iteration.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from hlserve.driver.workloads import AgentWorkload
from hlserve.sim.build import build_sim_engine
from hlserve.study.drive import run_agent_steady


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768, help="context sessions grow to")
    ap.add_argument("--hardware", default="H20")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--model", default="Qwen2.5-32B")
    ap.add_argument("--mode", default="throughput", help="a preset name or 'throughput'")
    ap.add_argument("--profile", action="store_true", help="cProfile the run, print the top 25")
    args = ap.parse_args()
    opts = {"mode": "throughput"} if args.mode == "throughput" else {"preset": args.mode}
    engine = build_sim_engine(args.model, args.hardware, args.tp,
                              max_model_len=args.context + 8192, **opts)
    workload = AgentWorkload.for_context(args.context, args.sessions, vocab=(3, 150000))
    prof = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    res = run_agent_steady(engine, workload, duration=args.hours * 3600)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t
    sim = engine.clock()
    steps = engine.stats.steps
    s = res.summary()
    print(f"{args.mode}: {args.sessions} sessions, {args.context} context, {args.tp}x{args.hardware} "
          f"{args.model}: simulated {sim:.0f}s in {wall:.1f}s wall = {sim / wall:.0f} simulated-s per "
          f"wall-s; {steps} iterations, {1e6 * wall / max(1, steps):.0f} us/iteration; "
          f"{s['completed']} requests, {s['total_token_throughput']:.0f} tok/s, "
          f"{engine.num_retractions} retractions")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
