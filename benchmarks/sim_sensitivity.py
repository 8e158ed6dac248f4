"""Sensitivity of the study to the H20 GEMM assumption (docs/study.md, section 5).

The H20's GEMM efficiency curve is the H100 fit with its half-saturation point at the same
fraction of the H20's ridge point (about 23 tokens). This reruns study points with H100's
absolute half-point (181 tokens) instead and prints both side by side:

    python benchmarks/sim_sensitivity.py                     # 32K, 64 sessions
    python benchmarks/sim_sensitivity.py --context 65536
"""

from __future__ import annotations

import argparse
import dataclasses

from hlserve.sim.hardware import get_hardware
from hlserve.sim.study.core import Point, StudySpec, run_point

SYSTEMS = (("hlserve", None), ("sglang", 8192), ("sarathi", 512))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--n-half", type=float, default=181.0, help="GEMM half-saturation, tokens")
    args = ap.parse_args()
    spec = StudySpec()
    base = get_hardware(spec.hardware)
    alt = dataclasses.replace(base, name=f"{base.name}-nhalf{args.n_half:.0f}",
                              gemm_ridge_frac=args.n_half / base.ridge)
    print(f"{spec.tp}x{base.name} {spec.model}, {args.context} context, {args.sessions} sessions; "
          f"GEMM half-point {base.gemm_n_half:.0f} vs {alt.gemm_n_half:.0f} tokens")
    thr: dict[tuple[str, str], float] = {}
    for system, knob in SYSTEMS:
        for hw in (base, alt):
            rec = run_point(dataclasses.replace(spec, hardware=hw),
                            Point(system, knob, args.context, args.sessions))
            thr[(system, hw.name)] = rec["metrics"]["window_token_throughput"]
        a, b = thr[(system, base.name)], thr[(system, alt.name)]
        print(f"  {system:8s} {knob or '':>5}: {a:8.0f} -> {b:8.0f} tok/s ({100 * (b / a - 1):+.1f}%)")
    for hw in (base, alt):
        ours = thr[("hlserve", hw.name)]
        gains = ", ".join(f"{100 * (ours / thr[(s, hw.name)] - 1):+.1f}% vs {s}" for s, _ in SYSTEMS[1:])
        print(f"  throughput mode on {hw.name}: {gains}")


if __name__ == "__main__":
    main()
