"""Agent sessions with tool time on the simulated machine (issue 25): does keeping a session's
KV between its rounds, and admitting its next round first, finish jobs sooner?

Steady-state closed loop (the study's: ``hlserve.study.core.run_point``) on 8 x H20 with
Qwen2.5-32B at 32K context by default, sessions 32 / 64 / 128, a lognormal tool call between a
session's rounds (medians 0.5 s, 5 s, 30 s; ``--sigma`` its log's spread), throughput mode
with one of four arms:

- ``hold+program``: ``retain+program`` with ``--session-hold on``: a new session's first
  round does not evict retained pages while other requests run (Continuum's pinning);
- ``retain+program``: ``--session-ttl`` (``--ttl-factor`` x the median tool time, fixed
  policy, or ``--ttl-policy learned``) and ``--order program``;
- ``lpm``: no retention, throughput mode's own order (longest prefix match);
- ``fcfs``: no retention, first come first served.

Per point: session completion p50 / p90 / p99 (a session's first round sent to its last round
done, tool calls included, sessions started and ended inside the window) and the window's
token throughput, as mean and 95% Student-t interval over ``--seeds`` workload seeds
(``hlserve.driver.stats.mean_ci``), and each arm's throughput and p50 completion against ``lpm``'s,
paired by seed (``ratio_ci``). Records go to ``--out`` as they come; a rerun resumes. The full
grid (3 medians x 3 concurrencies x 4 arms x 3 seeds = 108 points of 30 simulated minutes) is
long: run it with ``--jobs`` on a machine of its own. A smoke run:

    python benchmarks/study_sessions.py --gpu H100 --tp 1 --model Qwen2.5-7B --context 8192 \\
        --sessions 4 --tool-medians 0.5 --seeds 2 --duration 30 --warmup 10 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hlserve.driver.session_arms import SESSION_ARMS, session_arm_options
from hlserve.driver.stats import clean, fmt_ci, mean_ci, ratio_ci
from hlserve.study.core import StudyPoint, StudySpec, run_point

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "study_sessions.json"
ARMS = SESSION_ARMS
BASELINE = "lpm"
METRICS = ("session_completion_p50_s", "session_completion_p90_s", "session_completion_p99_s",
           "window_token_throughput")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One simulated point: a tool-time median, a concurrency, an arm, a seed."""

    median: float
    sessions: int
    arm: str
    seed: int

    @property
    def key(self) -> str:
        return f"tool{self.median:g}_n{self.sessions}_{self.arm}_seed{self.seed}"


def run_cell(args: tuple[dict[str, Any], Cell]) -> tuple[str, dict[str, Any]]:
    """One point's record (module level: it runs in a worker process)."""
    conf, cell = args
    spec = StudySpec(hardware=conf["gpu"], tp=conf["tp"], model=conf["model"],
                     duration=conf["duration"], warmup=conf["warmup"], rounds=conf["rounds"],
                     wall_limit=conf["wall_limit"], seed=cell.seed,
                     tool_time=f"lognormal:{cell.median:g}:{conf['sigma']:g}")
    opts = session_arm_options(cell.arm, cell.median, conf["ttl_factor"], conf["ttl_policy"])
    rec = run_point(spec, StudyPoint("hlserve", None, conf["context"], cell.sessions), opts)
    rec["cell"] = dataclasses.asdict(cell)
    return cell.key, rec


def summarize_cells(records: dict[str, dict[str, Any]], cells: list[Cell]) -> list[dict[str, Any]]:
    """Per (median, sessions, arm): each metric's mean and interval over the seeds, and the
    arm's throughput and p50 completion against the baseline's, paired by seed."""
    groups: dict[tuple[float, int, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.median, c.sessions, c.arm), []).append(c)
    rows = []
    for (median, n, arm), cs in groups.items():
        done = [c for c in cs if c.key in records]
        row: dict[str, Any] = {"median": median, "sessions": n, "arm": arm, "seeds": len(done)}
        for m in METRICS:
            # a seed with no session completed inside the window has no percentile: left out
            mean, ci = mean_ci(clean([_metric(records[c.key], m) for c in done]))
            row[m] = {"mean": mean, "ci95": ci}
        if arm != BASELINE:
            for m in ("window_token_throughput", "session_completion_p50_s"):
                pairs = [(x, y) for c in done
                         if (b := dataclasses.replace(c, arm=BASELINE)).key in records
                         and math.isfinite(x := _metric(records[b.key], m))
                         and math.isfinite(y := _metric(records[c.key], m))]
                ratio, ci = ratio_ci([p[0] for p in pairs], [p[1] for p in pairs])
                row[f"{m}_vs_{BASELINE}"] = {"ratio": ratio, "ci95": ci}
        rows.append(row)
    return rows


def _metric(rec: dict[str, Any], key: str) -> float:
    v = rec["metrics"].get(key)
    return float("nan") if v is None else float(v)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown: completion percentiles and throughput, mean ± half-width."""
    head = ("| tool median (s) | sessions | arm | seeds | completion p50 (s) | p90 (s) | p99 (s) "
            f"| throughput (tok/s) | throughput / {BASELINE} | p50 / {BASELINE} |")
    lines = [head, "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [fmt_ci(r[m]["mean"], r[m]["ci95"], "{:.1f}") for m in METRICS[:3]]
        cells.append(fmt_ci(r["window_token_throughput"]["mean"],
                            r["window_token_throughput"]["ci95"], "{:,.0f}"))
        for m in ("window_token_throughput", "session_completion_p50_s"):
            v = r.get(f"{m}_vs_{BASELINE}")
            cells.append("-" if v is None else fmt_ci(v["ratio"], v["ci95"], "{:.3f}"))
        lines.append(f"| {r['median']:g} | {r['sessions']} | {r['arm']} | {r['seeds']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--gpu", default="H20")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--model", default="Qwen2.5-32B")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--sessions", type=ints, default=[32, 64, 128])
    ap.add_argument("--tool-medians", type=floats, default=[0.5, 5.0, 30.0],
                    help="medians of the lognormal tool time, seconds")
    ap.add_argument("--sigma", type=float, default=1.0, help="the tool time's log spread")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--ttl-factor", type=float, default=3.0,
                    help="retain+program: --session-ttl = this x the median tool time")
    ap.add_argument("--ttl-policy", choices=["fixed", "learned"], default="fixed")
    ap.add_argument("--seeds", type=int, default=3, help="workload seeds 0..n-1")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--duration", type=float, default=1200.0, help="simulated seconds measured")
    ap.add_argument("--warmup", type=float, default=600.0)
    ap.add_argument("--wall-limit", type=float, default=1800.0, help="wall seconds per point")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--out", type=Path, default=OUT, help="records and summary (resumed)")
    return ap.parse_args()


def _results(todo: list[tuple[dict[str, Any], Cell]], jobs: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """The points' records as they finish: in this process, or in ``jobs`` workers."""
    if jobs <= 1:
        yield from map(run_cell, todo)
        return
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        yield from pool.imap_unordered(run_cell, todo)


def main() -> None:
    args = parse_args()
    conf = {k: getattr(args, k) for k in ("gpu", "tp", "model", "context", "sigma", "ttl_factor",
                                          "ttl_policy", "rounds", "duration", "warmup",
                                          "wall_limit")}
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        session_arm_options(a, 1.0, args.ttl_factor, args.ttl_policy)  # an unknown arm fails now
    cells = [Cell(m, n, a, s) for m in args.tool_medians for n in args.sessions for a in arms
             for s in range(args.seeds)]
    state: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    if state.get("conf") != conf:
        state = {"conf": conf, "records": {}}
    records = state["records"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    todo = [(conf, c) for c in cells if c.key not in records]
    print(f"{len(cells) - len(todo)} of {len(cells)} points stored; running {len(todo)}",
          flush=True)
    for key, rec in _results(todo, args.jobs):
        records[key] = rec
        m = rec["metrics"]
        print(f"  {key}: completion p50 {m.get('session_completion_p50_s') or float('nan'):.1f}"
              f" s, {m['window_token_throughput']:,.0f} tok/s ({m['wall_s']:.0f} s)", flush=True)
        args.out.write_text(json.dumps(state, default=float))
    state["summary"] = summarize_cells(records, cells)
    args.out.write_text(json.dumps(state, indent=1, default=float))
    print("\n" + table(state["summary"]))


if __name__ == "__main__":
    main()
