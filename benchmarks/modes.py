"""Throughput mode against each preset on one closed-loop agent workload, side by side.

N concurrent sessions, several rounds each; each round's prompt is the shared system prompt
plus the session's history plus a new tool output; the next round is sent the moment the last
completes. Real engine, real model (the embedded tiny one by default), one process, one run.

    python benchmarks/modes.py
    python benchmarks/modes.py --model DIR --sessions 32 --rounds 6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hlserve.driver.closed_loop import run_agent_sessions
from hlserve.driver.workloads import AgentWorkload
from hlserve.llm import LLM
from hlserve.models.default_model import default_model

CONFIGS: dict[str, dict[str, object]] = {
    "throughput": {"mode": "throughput"},
    "sglang": {"preset": "sglang"},
    "vllm": {"preset": "vllm"},
    "sarathi": {"preset": "sarathi"},
    "sarathi-relaxed": {"preset": "sarathi-relaxed"},
}


def compare_configs(model: str, configs: dict[str, dict[str, object]], workload: AgentWorkload,
                    progress: bool = True, **common: object) -> dict[str, dict[str, float]]:
    """Run the same closed-loop workload under each named engine configuration, one after
    the other in this process, and return each run's summary."""
    results = {}
    for name, options in configs.items():
        engine = LLM(model, **{**common, **options}).engine
        summary = run_agent_sessions(engine, workload, progress=progress).summary()
        summary["retractions"] = engine.num_retractions
        summary["iterations"] = engine.stats.steps
        results[name] = summary
    return results


def format_comparison(results: dict[str, dict[str, float]], baseline: str) -> str:
    """A side-by-side table; throughput ratios are against ``baseline``."""
    base = results[baseline]["total_token_throughput"]
    head = (f"{'config':<18}{'tok/s':>9}{'ratio':>7}{'out tok/s':>10}{'session p50/p99 s':>19}"
            f"{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}{'retract':>8}")
    rows = [head]
    for name, s in results.items():
        rows.append(
            f"{name:<18}{s['total_token_throughput']:>9.0f}"
            f"{s['total_token_throughput'] / base:>7.2f}{s['output_throughput']:>10.1f}"
            f"{s['median_session_time_s']:>10.1f}/{s['p99_session_time_s']:<8.1f}"
            f"{s['median_ttft_ms']:>9.0f}/{s['p99_ttft_ms']:<8.0f}"
            f"{s['median_tpot_ms']:>9.0f}/{s['p99_tpot_ms']:<8.0f}{s['retractions']:>8.0f}"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--result-file", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(default_model())
    workload = AgentWorkload(sessions=args.sessions, rounds=args.rounds,
                             system_prompt_len=args.system_prompt_len)
    results = compare_configs(model, {k: CONFIGS[k] for k in args.configs}, workload,
                              dtype=args.dtype)
    print(f"\nmodel {model}; {args.sessions} sessions x {args.rounds} rounds; ratio = total token "
          "throughput against throughput mode")
    print(format_comparison(results, baseline=args.configs[0]))
    if args.result_file:
        args.result_file.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
