"""Speculation on the simulated 8xH20 (issue 24): is it complementary with throughput mode?

Throughput mode with and without n-gram speculation (k draft tokens per decode), Qwen2.5-32B
on 8xH20, 32K and 64K contexts, by concurrency, over workload seeds. Speculation runs through
the real scheduler and KV cache (drafts take token budget and KV slots, rejected drafts'
pages go back the same step) with the cost model pricing the extra query rows; what the
drafts' acceptance is comes from a profile (sim/acceptance_profile.py):

- ``geo-A``: a geometric profile, each position accepted with probability A given the one
  before (``A, A^2, ...``), a draft at every decode step: the grid that says where speculation
  pays at all;
- the profiles measured on the real engine with the real model (``--profiles FILE``, written
  by ``benchmarks/speculation.py``: one per workload, with the share of steps that found a
  match): where the workloads lie on that grid.

Each variant is paired with the no-speculation point of the same seed; the gain is the mean
of the per-seed differences with its 95% interval ("no difference" when it includes 0).
Points are written as they finish and reused by a rerun.

    python benchmarks/study_speculation.py                        # 2 x 3 x 3 variants x 3 seeds
    python benchmarks/study_speculation.py --profiles docs/bench/speculation_profile.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hlserve.driver import points as shared
from hlserve.driver.stats import fmt_ci, mean_ci
from hlserve.sim.acceptance_profile import AcceptanceProfile
from hlserve.sim.build import SimOptions
from hlserve.study.core import PRODUCTION_SLO, StudyPoint, StudySpec, run_point, throughput

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs/study/h20-speculation"

Task = tuple[str, int, int, int]  # variant, context, sessions, seed


def profiles(args: argparse.Namespace) -> dict[str, AcceptanceProfile | None]:
    """Variant name -> acceptance profile (None: no speculation)."""
    out: dict[str, AcceptanceProfile | None] = {"off": None}
    for a in args.grid:
        out[f"geo-{a:g}"] = AcceptanceProfile(tuple(a ** (i + 1) for i in range(args.k)),
                                              1.0, f"geo-{a:g}")
    if args.profiles:
        data = json.loads(Path(args.profiles).read_text())["profiles"]
        for name in data:
            p = AcceptanceProfile.load(args.profiles, name)
            accept = (p.accept + (0.0,) * args.k)[:args.k]
            reach = (p.reach + (0.0,) * args.k)[:args.k] if p.reach else ()
            out[f"measured-{name}"] = AcceptanceProfile(accept, p.propose_rate, name, reach)
    return out


def point_file(out: Path, task: Task) -> Path:
    variant, ctx, n, seed = task
    return out / "points" / f"ctx{ctx}_n{n}_{variant}_seed{seed}.json"


def run_task(job: tuple[Task, dict[str, Any], str]) -> str:
    task, args, out = job
    variant, ctx, n, seed = task
    prof = profiles(argparse.Namespace(**args))[variant]
    spec = StudySpec(seed=seed, duration=args["duration"], warmup=args["warmup"])
    options = {} if prof is None else {"speculative_config": json.dumps(
        {"method": "ngram", "num_speculative_tokens": args["k"]})}
    rec = run_point(spec, StudyPoint("hlserve", None, ctx, n), options, SimOptions(acceptance=prof))
    rec["variant"] = variant
    rec["profile"] = None if prof is None else {"accept": prof.accept, "reach": prof.reach,
                                                 "propose_rate": prof.propose_rate}
    path = point_file(Path(out), task)
    path.write_text(json.dumps(rec, indent=1))
    return str(path)


def run_all(tasks: list[Task], args: argparse.Namespace, out: Path) -> None:
    (out / "points").mkdir(parents=True, exist_ok=True)
    todo = [t for t in tasks if not point_file(out, t).exists()]
    jobs = [(t, vars(args), str(out)) for t in todo]
    # the largest points first, so the pool does not end on one long point
    jobs.sort(key=lambda j: -j[0][1] * j[0][2])
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for _ in tqdm(pool.imap_unordered(run_task, jobs), total=len(jobs), desc="points"):
            pass


def summarize(tasks: list[Task], out: Path, seeds: list[int]) -> list[dict[str, Any]]:
    recs = {t: json.loads(point_file(out, t).read_text()) for t in tasks}
    rows = []
    for variant, ctx, n in sorted({t[:3] for t in tasks if t[0] != "off"},
                                  key=lambda v: (v[1], v[2], v[0])):
        on = [recs[(variant, ctx, n, s)] for s in seeds]
        off = [recs[("off", ctx, n, s)] for s in seeds]
        gains = [100 * (throughput(a) / throughput(b) - 1) for a, b in zip(on, off, strict=True)]
        mean, ci = mean_ci(gains)
        drafted = sum(r["metrics"]["spec_num_draft_tokens"] for r in on)
        rows.append({
            "variant": variant, "context": ctx, "sessions": n,
            "throughput_off": mean_ci([throughput(r) for r in off])[0],
            "throughput_on": mean_ci([throughput(r) for r in on])[0],
            "gain_pct": mean, "gain_ci": ci,
            "no_difference": ci is None or ci[0] <= 0 <= ci[1],
            "acceptance": (sum(r["metrics"]["spec_num_accepted_tokens"] for r in on)
                           / drafted if drafted else 0.0),
            "p99_tpot_ms_off": mean_ci([shared.value(r, "p99_tpot_ms") for r in off])[0],
            "p99_tpot_ms_on": mean_ci([shared.value(r, "p99_tpot_ms") for r in on])[0],
            "meets_production_slo_on": sum(shared.meets_slo(r, *PRODUCTION_SLO) for r in on),
            "retractions_on": sum(r["metrics"]["retractions"] for r in on),
            "drafting_steps_pct": drafting_share(on),
        })
    return rows


def drafting_share(recs: list[dict[str, Any]]) -> float | None:
    """The share of steps (%) at which throughput mode's adaptive k chose to draft (k > 0)."""
    by_k = [r["metrics"].get("spec_steps_by_k") for r in recs]
    if any(b is None for b in by_k):
        return None
    total = sum(sum(b) for b in by_k)
    return 100 * sum(sum(b[1:]) for b in by_k) / total if total else None


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}%"


def markdown(rows: list[dict[str, Any]], seeds: int) -> str:
    lines = [f"| context | sessions | profile | acceptance | tok/s off | tok/s on | gain % (95% CI, "
             f"{seeds} seeds) | TPOT p99 ms off -> on | steps drafting |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gain = fmt_ci(r["gain_pct"], r["gain_ci"], "{:+.1f}")
        if r["no_difference"]:
            gain += " (no difference)"
        lines.append(f"| {r['context'] // 1024}K | {r['sessions']} | {r['variant']} | "
                     f"{r['acceptance']:.2f} | {r['throughput_off']:,.0f} | "
                     f"{r['throughput_on']:,.0f} | {gain} | {r['p99_tpot_ms_off']:.0f} -> "
                     f"{r['p99_tpot_ms_on']:.0f} | "
                     f"{pct(r['drafting_steps_pct'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--sessions", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--k", type=int, default=3, help="draft tokens per decode (num_speculative_tokens)")
    p.add_argument("--grid", type=float, nargs="*", default=[0.5, 0.8],
                   help="geometric acceptance per position of the grid's profiles")
    p.add_argument("--profiles", default=None, help="measured profiles (benchmarks/speculation.py)")
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds measured")
    p.add_argument("--warmup", type=float, default=300.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    seeds = list(range(args.seeds))
    tasks = [(v, c, n, s) for v in profiles(args) for c in args.contexts for n in args.sessions
             for s in seeds]
    run_all(tasks, args, args.out)
    rows = summarize(tasks, args.out, seeds)
    table = markdown(rows, len(seeds))
    (args.out / "summary.json").write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "rows": rows}, indent=1))
    (args.out / "summary.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
