"""``--repeats N`` and ``--ray`` for ``hlserve sweep`` and ``hlserve bench``: every point (and
every repeat) through :mod:`hlserve.driver.repeats`, locally or as Ray tasks
(:mod:`hlserve.driver.cluster`), summarized with ``*_ci95`` intervals.

A sweep's points are run interleaved (every point's repeat i, then every point's repeat i + 1),
repeat i on workload seed ``--seed + i``. A wall-clock sweep starts with one excluded warm-up
run; a simulated one does not (its virtual clock does not drift), nor does one on Ray (each
task runs in its own worker, a warm-up there would warm another process).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from hlserve.bench.serve_bench import BenchSpec, run_bench
from hlserve.driver.repeats import RepeatPlan, Run, ratios, run_repeats
from hlserve.driver.stats import fmt_ci, ratio_verdict

THROUGHPUT = "total_token_throughput"


def _stem(path: str | Path) -> str:
    return str(Path(path).with_suffix(""))


# ---- hlserve sweep ------------------------------------------------------------------------------


def _sweep_run(sw: Any, run: Callable[[Any, BenchSpec], dict[str, Any]], point: Any,
               seed: int) -> dict[str, Any]:
    """One repeat of one point (module-level, so that it pickles into a Ray task)."""
    path = sw.point_file(point.label, f".seed{seed}.json")
    spec = replace(sw.bench, label=point.label, result_file=str(path), seed=seed,
                   progress=sw.bench.progress and sw.ray is None)
    t = time.perf_counter()
    res = run(point, spec)
    res["wall_s"] = time.perf_counter() - t
    res["seed"] = seed
    return res


def _log_run(sw: Any, log: Any, r: Run[Any], res: dict[str, Any] | BaseException) -> None:
    tag = "warm-up, excluded" if r.warmup else f"repeat {r.repeat + 1}/{sw.repeats}"
    if isinstance(res, BaseException):
        log(f"    point {r.name} ({tag}, seed {r.seed}) failed: {type(res).__name__}: {res}")
        return
    if sw.server_cmd is None and not r.warmup:  # a server point's run_bench wrote its own
        path = sw.point_file(r.name, f".seed{r.seed}.json")
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    if res.get("completed"):
        log(f"    {r.name} ({tag}, seed {r.seed}): {res[THROUGHPUT]:.0f} tok/s total; p99 TTFT "
            f"{res['p99_ttft_ms']:.0f} ms, p99 TPOT {res['p99_tpot_ms'] or float('nan'):.0f} ms; "
            f"{res['wall_s']:.0f}s")


def run_points_repeated(sw: Any, run: Callable[[Any, BenchSpec], dict[str, Any]],
                        execute: Any = None, log: Any = print,
                        ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every point of the sweep ``sw`` (a ``SweepSpec``) ``sw.repeats`` times, interleaved,
    each run by ``run(point, spec)`` (``execute``: Ray's executor, None for local runs);
    returns the sweep's point list (each point's metrics the repeats' summary, with
    ``*_ci95``) and the ratio of every point's throughput to the best point's."""
    plan = RepeatPlan(repeats=sw.repeats, base_seed=sw.bench.seed,
                      warmup=0 if sw.sim or sw.ray is not None else 1)
    configs = {p.label: p for p in sw.points}
    per_repeat: dict[str, list[dict[str, Any] | None]] = {n: [None] * sw.repeats for n in configs}

    def on_run(r: Run[Any], res: dict[str, Any] | BaseException) -> None:
        _log_run(sw, log, r, res)
        if not r.warmup and not isinstance(res, BaseException):
            per_repeat[r.name][r.repeat] = res

    out = run_repeats(configs, partial(_sweep_run, sw, run), plan, ratio_metrics=(),
                      execute=execute, on_run=on_run)
    results = []
    for p in sw.points:
        res = out["configs"][p.label]
        errs = out["errors"].get(p.label)
        if not res.get("repeats"):
            res = {"completed": 0, "failed": None, "error": "; ".join(errs or ["no repeat ran"]),
                   "repeats": 0}
        elif errs:
            res["repeat_errors"] = errs
        sw.point_file(p.label).write_text(json.dumps(res, indent=2, default=str) + "\n")
        results.append({"label": p.label, "knobs": p.knobs, "args": p.args, "metrics": res})
    ok = [p for p in results if p["metrics"].get("completed")]
    top = max(ok, key=lambda p: p["metrics"][THROUGHPUT], default=None)
    rat = ratios(per_repeat, top["label"], (THROUGHPUT,)) if top else {}
    return results, {"plan": out["plan"], "order": out["order"], "ratios_to_best": rat}


def add_tax_intervals(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> None:
    """The human tax's interval, per row: 1 - the paired ratio interval of the best point
    meeting the target to the best point of all (the two chosen on their means)."""
    vals = {p["label"]: p["metrics"] for p in points}
    for row in rows:
        b, u = row.get("best_config"), row.get("unconstrained_config")
        row["human_tax_ci95"] = None
        if b is None or u is None or b == u:
            row["human_tax_within_noise"] = None if b is None else True
            continue
        pairs = _paired(vals[u], vals[b])
        v = ratio_verdict([x for x, _ in pairs], [y for _, y in pairs])
        if v.ci is not None:
            row["human_tax_ci95"] = [1 - v.ci[1], 1 - v.ci[0]]
        row["human_tax_within_noise"] = v.within_noise


def _paired(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[float, float]]:
    """(A_i, B_i) throughputs of the seeds both points ran."""
    av = dict(zip(a.get("seeds", []), a.get("repeat_values", {}).get(THROUGHPUT, []), strict=False))
    bv = dict(zip(b.get("seeds", []), b.get("repeat_values", {}).get(THROUGHPUT, []), strict=False))
    return [(av[s], bv[s]) for s in av if s in bv and av[s] is not None and bv[s] is not None]


# ---- hlserve bench ------------------------------------------------------------------------------


def _bench_run(spec: BenchSpec, repeats: int, _: Any, seed: int) -> dict[str, Any]:
    warm = seed >= spec.seed + repeats  # the warm-up's seed: no file for it
    tag = "warmup" if warm else f"seed{seed}"
    rf = f"{_stem(spec.result_file)}.{tag}.json" if spec.result_file and not warm else None
    qf = f"{_stem(spec.request_file)}.{tag}.jsonl" if spec.request_file and not warm else None
    label = f"{spec.label or spec.workload} ({'warm-up' if warm else f'seed {seed}'})"
    return run_bench(replace(spec, seed=seed, result_file=rf, request_file=qf, label=label))


def run_bench_repeated(spec: BenchSpec, repeats: int) -> dict[str, Any]:
    """``hlserve bench --repeats N``: one excluded warm-up, then N runs on seeds ``seed + i``
    against the same server; the summary (``*_ci95``) goes to ``--result-file``."""
    plan = RepeatPlan(repeats=repeats, base_seed=spec.seed, warmup=1)
    name = spec.label or spec.workload
    out = run_repeats({name: None}, partial(_bench_run, spec, repeats), plan, ratio_metrics=())
    res = out["configs"][name]
    if not res.get("repeats"):
        raise RuntimeError("; ".join(out["errors"].get(name, ["no repeat ran"])))
    res["label"] = spec.label
    res["repeat_errors"] = out["errors"].get(name, [])
    if spec.result_file:
        Path(spec.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(spec.result_file).write_text(json.dumps(res, indent=2, default=str) + "\n")
    return res


REPEAT_ROWS = (
    ("Session completion p50/p90/p99 (s):", ("session_completion_p50_s",
                                             "session_completion_p90_s",
                                             "session_completion_p99_s"), "{:.2f}"),
    ("Total token throughput (tok/s):", "total_token_throughput", "{:.1f}"),
    ("Output token throughput (tok/s):", "output_throughput", "{:.1f}"),
    ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
    ("Sessions per hour:", "sessions_per_hour", "{:.1f}"),
    ("Session time p50 (s):", "median_session_time_s", "{:.2f}"),
    ("TTFT p50 / p99 (ms):", ("median_ttft_ms", "p99_ttft_ms"), "{:.0f}"),
    ("TPOT p50 / p99 (ms):", ("median_tpot_ms", "p99_tpot_ms"), "{:.1f}"),
    ("ITL p99 (ms):", "p99_itl_ms", "{:.1f}"),
    ("E2EL p99 (ms):", "p99_e2el_ms", "{:.0f}"),
    ("SLO attainment:", "slo_attainment", "{:.3f}"),
)


def format_repeats(res: dict[str, Any]) -> str:
    """The repeats' means with their 95% intervals (``mean ± half-width``)."""
    n = res.get("repeats", 0)
    lines = ["{:=^72}".format(f" Over {n} repeats (seeds {res.get('seeds')}), mean ± 95% CI "
                              f"half-width ")]
    for title, keys, fmt in REPEAT_ROWS:
        ks = (keys,) if isinstance(keys, str) else keys
        if all(res.get(k) is None for k in ks):
            continue
        text = " / ".join(fmt_ci(res.get(k), res.get(f"{k}_ci95"), fmt) for k in ks)
        lines.append(f"{title:<36}{text:>36}")
    if n < 2:
        lines.append("one repeat: no interval")
    lines.append("=" * 72)
    return "\n".join(lines)
