"""Sensitivity of the study to two cost-model assumptions (docs/study.md, section 5).

``--term gemm`` (the default): the H20's GEMM efficiency curve is the H100 fit with its
half-saturation point at the same fraction of the H20's ridge point (about 23 tokens). This
reruns study points with H100's absolute half-point (181 tokens) instead and prints both side
by side.

``--term allreduce``: the all-reduce latency at the study's 8 GPUs is Vidur's NCCL fit
(collectives launched one at a time from Python). The fidelity suite's one-client TurboMind
rows put the latency of an engine that launches them from C++ at 0.32x that fit at 2 GPUs
and 0.74x at 4 (docs/fidelity.md, item 6); no public row measures 8. This reruns throughput
mode at 16-128 sessions and ``sglang`` C = 8192 at 64 with the 8-GPU latency scaled by each
ratio (computed from the suite's fit, ~30 s) and prints the production tax over throughput
mode's points and its gain over ``sglang``, as docs/study.md section 7.6 counts them.

    python benchmarks/sim_sensitivity.py                     # 32K, 64 sessions
    python benchmarks/sim_sensitivity.py --context 65536
    python benchmarks/sim_sensitivity.py --term allreduce    # 32K, ~7 minutes
"""

from __future__ import annotations

import argparse
import dataclasses

from hlserve.sim.hardware import Hardware, get_hardware
from hlserve.study.core import PRODUCTION_SLO, StudyPoint, StudySpec, human_tax, run_point

SYSTEMS = (("hlserve", None), ("sglang", 8192), ("sarathi", 512))
TAX_SESSIONS = (16, 32, 64, 128)  # throughput mode's points the section 7.6 tax is over


def gemm(args: argparse.Namespace, spec: StudySpec, base: Hardware) -> None:
    alt = dataclasses.replace(base, name=f"{base.name}-nhalf{args.n_half:.0f}",
                              gemm_ridge_frac=args.n_half / base.ridge)
    print(f"{spec.tp}x{base.name} {spec.model}, {args.context} context, {args.sessions} sessions; "
          f"GEMM half-point {base.gemm_n_half:.0f} vs {alt.gemm_n_half:.0f} tokens")
    thr: dict[tuple[str, str], float] = {}
    for system, knob in SYSTEMS:
        for hw in (base, alt):
            rec = run_point(dataclasses.replace(spec, hardware=hw),
                            StudyPoint(system, knob, args.context, args.sessions))
            thr[(system, hw.name)] = rec["metrics"]["window_token_throughput"]
        a, b = thr[(system, base.name)], thr[(system, alt.name)]
        print(f"  {system:8s} {knob or '':>5}: {a:8.0f} -> {b:8.0f} tok/s ({100 * (b / a - 1):+.1f}%)")
    for hw in (base, alt):
        ours = thr[("hlserve", hw.name)]
        gains = ", ".join(f"{100 * (ours / thr[(s, hw.name)] - 1):+.1f}% vs {s}" for s, _ in SYSTEMS[1:])
        print(f"  throughput mode on {hw.name}: {gains}")


def fidelity_alpha_ratios() -> dict[int, float]:
    import fidelity as fid  # the sibling script (its directory leads sys.path when run)

    return {n: fitted / profile for n, (fitted, profile)
            in fid.turbomind_allreduce(fid.fit_corrections(fid.load())).items()}


def allreduce(args: argparse.Namespace, spec: StudySpec, base: Hardware) -> None:
    alpha = base.allreduce_params(spec.tp)[0]
    ratios = fidelity_alpha_ratios()
    print(f"{spec.tp}x{base.name} {spec.model}, {args.context} context; all-reduce latency at "
          f"{spec.tp} GPUs {alpha * 1e6:.1f} us, scaled by "
          + ", ".join(f"{r:.2f} (TurboMind at {n} GPUs)" for n, r in sorted(ratios.items())))
    for label, scale in [("shipped", 1.0)] + [(f"x{r:.2f}", r) for _, r in sorted(ratios.items())]:
        hw = base if scale == 1.0 else base.replace(
            name=f"{base.name}-ar{scale:.2f}", allreduce_alpha=((spec.tp, alpha * scale),))
        s = dataclasses.replace(spec, hardware=hw)
        ours = [run_point(s, StudyPoint("hlserve", None, args.context, n)) for n in TAX_SESSIONS]
        ref = run_point(s, StudyPoint("sglang", 8192, args.context, 64))
        tax, best_ok, _ = human_tax(ours, *PRODUCTION_SLO)
        at64 = ours[TAX_SESSIONS.index(64)]["metrics"]["window_token_throughput"]
        thr = " / ".join(f"{r['metrics']['window_token_throughput']:,.0f}" for r in ours)
        ok = best_ok["point"]["sessions"] if best_ok else "-"
        print(f"  {label:8s} ({alpha * scale * 1e6:5.1f} us): throughput mode at "
              f"{'/'.join(map(str, TAX_SESSIONS))} sessions {thr} tok/s; tax {100 * tax:.1f}% "
              f"(best meeting the pair: {ok} sessions); vs sglang 8192 at 64: "
              f"{100 * (at64 / ref['metrics']['window_token_throughput'] - 1):+.2f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--term", choices=("gemm", "allreduce"), default="gemm")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--sessions", type=int, default=64, help="--term gemm: the sessions")
    ap.add_argument("--n-half", type=float, default=181.0, help="GEMM half-saturation, tokens")
    args = ap.parse_args()
    spec = StudySpec()
    base = get_hardware(spec.hardware)
    (gemm if args.term == "gemm" else allreduce)(args, spec, base)


if __name__ == "__main__":
    main()
