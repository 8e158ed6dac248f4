"""Replay a public Mooncake trace on a simulated machine (open loop, by its timestamps).

    python benchmarks/sim_mooncake.py                         # conversation trace, first 10 min
    python benchmarks/sim_mooncake.py --time-scale 0.2        # arrivals 5x slower
    python benchmarks/sim_mooncake.py --trace PATH.jsonl      # any Mooncake-format trace

The default trace is the Mooncake conversation trace shipped in the package (``src/hlserve/data``).

Runs the same arrivals through SGLang's, vLLM's and Sarathi's presets and throughput mode on
8xH20 serving Qwen2.5-32B (the study's machine), and prints throughput, latency percentiles
and the prefix-cache hit ratio. The hit ratio is a check of the replay and the radix cache
together: the trace's own hash ids fix how much of each prompt an earlier request shared
(Mooncake reports 40% for the conversation trace, 66% for the synthetic one), and a pool
large enough to keep everything would hit exactly that.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hlserve.driver.workloads import BLOCK, MooncakeTrace, trace_arrivals
from hlserve.sim.build import build_sim_engine
from hlserve.sim.fitting import find_data_dir
from hlserve.study.drive import run_open_loop

DEFAULT_TRACE = find_data_dir() / "mooncake_conversation_trace.jsonl"
SYSTEMS = (("sglang", {"preset": "sglang"}), ("vllm", {"preset": "vllm"}),
           ("sarathi", {"preset": "sarathi"}), ("throughput", {"mode": "throughput"}))


def trace_hit_ratio(trace: MooncakeTrace) -> float:
    """Share of prompt tokens in blocks an earlier request already had: the ratio a cache
    that forgets nothing would reach (the last, partial block of a prompt never counts)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace.requests:
        total += r.input_length
        for k, h in enumerate(r.hash_ids):
            full = (k + 1) * BLOCK <= r.input_length
            if h in seen and full:
                hit += BLOCK
            seen.add(h)
    return hit / max(1, total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--minutes", type=float, default=10.0, help="replay this much of the trace")
    ap.add_argument("--time-scale", type=float, default=1.0, help="2: arrivals twice as fast")
    ap.add_argument("--hardware", default="H20")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--model", default="Qwen2.5-32B")
    args = ap.parse_args()
    trace = MooncakeTrace.load(args.trace, duration=args.minutes * 60, vocab=(3, 150000))
    print(f"{Path(args.trace).name}: {len(trace)} requests in {args.minutes:g} min, "
          f"{trace.stats()['mean_input']:.0f} input tokens on average; the trace's own prefix sharing: "
          f"{100 * trace_hit_ratio(trace):.0f}% of prompt tokens")
    print(f"{'system':12s} {'wall s':>7s} {'tok/s':>8s} {'TTFT p50/p99 s':>16s} "
          f"{'TPOT p50/p99 ms':>16s} {'cache hit':>9s} {'retractions':>11s}")
    for name, opts in SYSTEMS:
        engine = build_sim_engine(args.model, args.hardware, args.tp, max_model_len=131072, **opts)
        t = time.perf_counter()
        res = run_open_loop(engine, trace_arrivals(trace, args.time_scale), progress=True)
        wall = time.perf_counter() - t
        s = res.summary()
        hit = s["cached_tokens"] / max(1, s["total_input_tokens"])
        print(f"{name:12s} {wall:7.1f} {s['total_token_throughput']:8.0f} "
              f"{s['median_ttft_ms'] / 1e3:7.2f} / {s['p99_ttft_ms'] / 1e3:6.2f} "
              f"{s['median_tpot_ms']:7.0f} / {s['p99_tpot_ms']:6.0f} {100 * hit:8.0f}% "
              f"{engine.num_retractions:11d}", flush=True)


if __name__ == "__main__":
    main()
