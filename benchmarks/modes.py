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

from hlserve.bench.driver import compare_configs, format_comparison
from hlserve.models.default_model import default_model
from hlserve.workloads import AgentWorkload

CONFIGS: dict[str, dict[str, object]] = {
    "throughput": {"mode": "throughput"},
    "sglang": {"preset": "sglang"},
    "vllm": {"preset": "vllm"},
    "sarathi": {"preset": "sarathi"},
    "sarathi-relaxed": {"preset": "sarathi-relaxed"},
}


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
