"""Two-stage mixing's hysteresis at 64K context on the simulated 8xH20 (docs/study.md,
section 3): throughput mode with its default thresholds (decode-only above 90% KV use until
use falls below 70%), with narrower ones, and with mixing always. Each variant is a study
point (``hlserve.study.core.run_point``) with the engine options changed.

    python benchmarks/sim_two_stage.py                  # 128 sessions: overload
    python benchmarks/sim_two_stage.py --sessions 64
"""

from __future__ import annotations

import argparse
from typing import Any

from hlserve.study.core import StudyPoint, StudySpec, run_point

VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("two-stage 0.90 / 0.70 (default)", {}),
    ("two-stage 0.90 / 0.85", {"two_stage_low": 0.85}),
    ("two-stage 0.97 / 0.90", {"two_stage_high": 0.97, "two_stage_low": 0.90}),
    ("always mix", {"mixing": "always"}),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=128)
    ap.add_argument("--context", type=int, default=65536)
    args = ap.parse_args()
    spec = StudySpec()
    print(f"{spec.tp}x{spec.hardware} {spec.model}, {args.context} context, {args.sessions} sessions, "
          f"throughput mode")
    for label, opts in VARIANTS:
        m = run_point(spec, StudyPoint("hlserve", None, args.context, args.sessions), opts)["metrics"]
        switches = m["stage_switches"]
        print(f"  {label:32s} {m['window_token_throughput']:8.0f} tok/s   TTFT p50 "
              f"{m['median_ttft_ms'] / 1e3:6.1f} s   TPOT p99 {m['p99_tpot_ms']:5.0f} ms   "
              f"stage switches {'-' if switches is None else switches}   ({m['wall_s']:.0f} s wall)",
              flush=True)


if __name__ == "__main__":
    main()
