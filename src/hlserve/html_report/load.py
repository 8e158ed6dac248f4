"""Reading a result into a :class:`~hlserve.html_report.model.ReportData`: a sweep's folder
(``sweep.json``, ``points/``), a study's folder (``spec.json``, ``summary.json``, ``points/``,
``seeds.json`` where it ran several seeds) or a bench result JSON (``--result-file``, its
per-request JSONL beside it). :func:`load` tells them apart by what they hold.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hlserve.driver.points import slug
from hlserve.html_report.model import (
    Group,
    Pt,
    ReportData,
    Table,
    dist_groups,
    flat,
    fmt,
    fmt_metric,
    metric_lines,
    pct,
    read_records,
)

SWEEP_METRIC = "total_token_throughput"


def load(path: str | Path) -> ReportData:
    """The report of the result at ``path``: a sweep's or a study's folder, a sweep's
    ``sweep.json`` or a bench result JSON."""
    path = Path(path)
    if path.is_dir():
        if (path / "sweep.json").is_file():
            return from_sweep(_json(path / "sweep.json"), path)
        if (path / "spec.json").is_file() and (path / "points").is_dir():
            return from_study(path)
        raise FileNotFoundError(f"{path}: not a sweep's folder (no sweep.json) nor a study's "
                                "(no spec.json and points/)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or folder")
    d = _json(path)
    if isinstance(d, dict) and "points" in d and "tax" in d:
        return from_sweep(d, path.parent, str(path))
    if isinstance(d, dict) and "completed" in d:
        return from_bench(d, path)
    raise ValueError(f"{path}: not a sweep, study or bench result (a sweep.json has points and "
                     "tax; a bench result has completed)")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None


# ---- shared pieces --------------------------------------------------------------------------


def points_table(pts: Sequence[Pt], metric: str,
                 lead: Sequence[tuple[str, Any]] = ()) -> Table:
    """Every point's throughput and latencies (95% intervals where repeated); ``lead``: the
    columns before them, (title, function of the point)."""
    cols: list[tuple[str, Any]] = [("config", lambda p: p.label), *lead,
                                   (f"{metric} (tok/s)", lambda p: fmt_metric(p, metric)),
                                   ("output tok/s", lambda p: fmt_metric(p, "output_throughput",
                                                                         "{:,.1f}"))]
    for key, title in (("median_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
                       ("median_tpot_ms", "TPOT p50 (ms)"), ("p99_tpot_ms", "TPOT p99 (ms)"),
                       ("p99_itl_ms", "ITL p99 (ms)"), ("sessions_per_hour", "sessions/h")):
        if any(k == key for p in pts for k in p.record["metrics"]):
            cols.append((title, lambda p, k=key: fmt_metric(p, k, "{:,.1f}")))
    cols.append(("failed", lambda p: fmt(p.record["metrics"].get("failed"))))
    return Table("Points", tuple(t for t, _ in cols),
                 tuple(tuple(str(f(p)) for _, f in cols) for p in pts),
                 "95% intervals over repeats in brackets, where the points were repeated.")


def machine_rows(machine: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    if not machine:
        return [("host", "not recorded in this result")]
    names = {"cpu_model": "CPU model (lscpu's Model name)", "logical_cpus": "logical CPUs",
             "platform": "platform", "python": "Python"}
    return [(names.get(k, k), str(v)) for k, v in machine.items()]


def _records(files: Sequence[Path]) -> Any:
    return read_records(files) if files else None


# ---- sweep ----------------------------------------------------------------------------------


def sweep_request_files(out: Path, point: Mapping[str, Any]) -> list[Path]:
    """A sweep point's per-request files: every repeat's, or the one run's; found in the
    sweep's ``points/`` (the path recorded is relative to where the sweep ran)."""
    pdir, s = out / "points", slug(point["label"])
    seeds = sorted(pdir.glob(f"{glob.escape(s)}.seed*.requests.jsonl"))
    if seeds:
        return seeds
    recorded = point["metrics"].get("request_file")
    for cand in (pdir / f"{s}.requests.jsonl",
                 *((pdir / Path(recorded).name, Path(recorded)) if recorded else ())):
        if cand.is_file():
            return [cand]
    return []


def sweep_config(p: Mapping[str, Any]) -> tuple[str, ...]:
    """What a sweep point's hover says it was: its knobs, its own flags, the engine options
    as resolved or the server command."""
    m, knobs = p["metrics"], p.get("knobs") or {}
    lines = [p["label"]]
    if p.get("args"):
        lines.append("flags: " + " ".join(p["args"]))
    else:
        lines.append(f"C (chunk size) = {knobs.get('chunk_size') or 'none'}, "
                     f"B (token budget) = {knobs.get('token_budget') or 'none'}")
    if m.get("engine_options"):
        lines.append("engine: " + ", ".join(flat(m["engine_options"])))
    if m.get("server_command"):
        lines.append("server: " + m["server_command"])
    return tuple(lines)


def sweep_tax(rows: Sequence[Mapping[str, Any]], metric: str) -> Table:
    def interval(r: Mapping[str, Any]) -> str:
        ci = r.get("human_tax_ci95")
        if ci:
            return f"[{pct(ci[0])}, {pct(ci[1])}]"
        return "—"

    def verdict(r: Mapping[str, Any]) -> str:
        noise = r.get("human_tax_within_noise")
        return {True: "within noise", False: "a tax beyond noise"}.get(noise, "—")

    body = tuple((fmt(r.get("slo_p99_ttft_ms")) if r.get("slo_p99_ttft_ms") is not None
                  else "none",
                  fmt(r.get("slo_p99_tpot_ms")) if r.get("slo_p99_tpot_ms") is not None
                  else "none",
                  r.get("best_config") or "none meets it", fmt(r.get("throughput")),
                  r.get("unconstrained_config") or "—", fmt(r.get("unconstrained")),
                  pct(r.get("human_tax")), interval(r), verdict(r)) for r in rows)
    return Table("Human tax per SLO target",
                 ("p99 TTFT ≤ (ms)", "p99 TPOT ≤ (ms)", "best config meeting it",
                  f"its {metric} (tok/s)", "best config of all", "its throughput",
                  "human tax", "95% interval", "verdict"), body,
                 "Tax = 1 − best throughput meeting the target / best throughput of any point. "
                 "The interval (repeated sweeps) is 1 − the paired ratio's interval over "
                 "seeds.")


def from_sweep(summary: Mapping[str, Any], out: Path, source: str | None = None) -> ReportData:
    pts = tuple(Pt(p, p["label"], sweep_config(p) + tuple(metric_lines(
        Pt(p, p["label"], ()), SWEEP_METRIC))) for p in summary["points"])
    recs = {p.label: _records(sweep_request_files(out, p.record)) for p in pts}
    first = next((p.record["metrics"] for p in pts if p.record["metrics"].get("completed")), {})
    settings = [("command", summary.get("command") or "—"), ("model", summary.get("model")),
                ("engine args", " ".join(summary.get("engine_args") or []) or "—"),
                ("server command", summary.get("server_cmd") or "— (in-process)"),
                ("simulated hardware", summary.get("sim") or "— (real runner)"),
                ("threads", summary.get("threads") or "default"),
                ("repeats", summary.get("repeats", 1)), ("clock", first.get("clock", "wall"))]
    for key in ("agent_workload", "coding_workload", "trace"):
        if first.get(key):
            settings.append((key.replace("_", " "), ", ".join(flat(first[key]))))
    if summary.get("plan"):
        settings.append(("repeat plan", ", ".join(flat(summary["plan"]))))
    machine = machine_rows(summary.get("machine"))
    if summary.get("sim"):
        machine.insert(0, ("measured on", f"simulated {summary['sim']} (virtual clock); the "
                                         "host below ran the simulation"))
    return ReportData(
        kind="sweep", title=f"Sweep: {summary.get('model')}", source=source or str(out),
        metric=SWEEP_METRIC, metric_title="total token throughput (tok/s)",
        groups=(Group("all points", pts),), tax=(sweep_tax(summary.get("tax", []),
                                                           SWEEP_METRIC),),
        points_table=points_table(pts, SWEEP_METRIC, (
            ("C", lambda p: fmt((p.record.get("knobs") or {}).get("chunk_size") or "none")),
            ("B", lambda p: fmt((p.record.get("knobs") or {}).get("token_budget") or "none")))),
        distributions=tuple(dist_groups("all points", pts, {k: v for k, v in recs.items() if v})),
        settings=tuple((k, str(v)) for k, v in settings), machine=tuple(machine), raw=summary)


# ---- bench ----------------------------------------------------------------------------------


BENCH_SETTINGS = ("label", "date", "backend", "base_url", "model_id", "workload", "num_prompts",
                  "request_rate", "max_concurrency", "prompt_format", "output_ids_source",
                  "server_max_model_len", "slo_ttft_ms", "slo_tpot_ms", "slo_e2el_ms",
                  "repeats", "seeds", "session_fields", "agent_workload", "coding_workload",
                  "trace", "notes")


def bench_request_files(res: Mapping[str, Any], path: Path | None) -> list[Path]:
    """A bench run's per-request files: every repeat's (``<stem>.seedN.requests.jsonl``),
    or the one recorded (as given, or beside the result)."""
    if path is not None:
        stem = path.with_suffix("").name
        seeds = sorted(path.parent.glob(f"{glob.escape(stem)}.seed*.requests.jsonl"))
        if seeds:
            return seeds
    recorded = res.get("request_file")
    if not recorded:
        return []
    cands = [Path(recorded)] + ([path.parent / Path(recorded).name] if path else [])
    return [c for c in cands if c.is_file()][:1]


def from_bench(res: Mapping[str, Any], path: Path | None = None) -> ReportData:
    label = res.get("label") or res.get("workload") or "run"
    rec = {"label": label, "metrics": dict(res)}
    config = (label, f"{res.get('workload', '?')} workload on {res.get('model_id', '?')} at "
                     f"{res.get('base_url', '?')}",
              f"max concurrency {res.get('max_concurrency')}")
    pt = Pt(rec, label, config + tuple(metric_lines(Pt(rec, label, ()), SWEEP_METRIC)))
    recs = _records(bench_request_files(res, path))
    settings = [(k, ", ".join(flat(res[k])) if isinstance(res[k], dict) else str(res[k]))
                for k in BENCH_SETTINGS if res.get(k) not in (None, [], {})]
    return ReportData(
        kind="bench", title=f"Bench: {label}", source=str(path) if path else "bench run",
        metric=SWEEP_METRIC, metric_title="total token throughput (tok/s)",
        groups=(Group("this run", (pt,)),), tax=(),
        points_table=points_table([pt], SWEEP_METRIC),
        distributions=tuple(dist_groups("this run", [pt], {label: recs} if recs else {})),
        settings=tuple(settings), machine=(
            ("measured from", "the benchmark client's host (below); the server's machine is "
                              "its own to report"), *machine_rows(res.get("machine"))),
        notes=("One run, one configuration: the human tax compares configurations "
               "(hlserve sweep or hlserve study).",), raw=res)


# ---- study ----------------------------------------------------------------------------------


def study_config(r: Mapping[str, Any]) -> tuple[str, ...]:
    p, m = r["point"], r["metrics"]
    lines = [r["label"], f"{p['system']}, knob {p['knob'] or 'none'}, context {p['context']}, "
                         f"{p['sessions']} sessions",
             "options: " + ", ".join(flat(r.get("options") or {}))]
    flags = [f for f in ("truncated", "transient", "stalled") if m.get(f)]
    if flags:
        lines.append("flags: " + ", ".join(flags))
    if m.get("seeds"):
        lines.append(f"seeds {m['seeds']}")
    return tuple(lines)


def _ctx(ctx: int) -> str:
    return f"{ctx // 1024}K context"


def study_tax(summary: Mapping[str, Any], seeds: Mapping[str, Any] | None) -> tuple[Table, ...]:
    """The study's tax tables (``summary.json``): concurrency chosen freely, with the tax's
    interval over seeds where ``seeds.json`` has it, then at each concurrency."""
    over = {(t["context"], t["ttft_p99_ms"], t["tpot_p99_ms"]): t["tax"]
            for t in (seeds or {}).get("taxes", []) if isinstance(t.get("tax"), dict)}

    def interval(s: Mapping[str, Any]) -> str:
        t = over.get((s["context"], s["ttft_p99_ms"], s["tpot_p99_ms"]))
        if not t:
            return "— (one seed)"
        ci = t.get("ci95")
        return f"{pct(t['mean'])} [{pct(ci[0])}, {pct(ci[1])}]" if ci else pct(t["mean"])

    def slo(s: Mapping[str, Any]) -> str:
        return f"{s['ttft_p99_ms']:,.0f} ms / {s['tpot_p99_ms']:,.0f} ms"

    free = tuple((_ctx(s["context"]), slo(s), pct(s["tax"]), interval(s),
                  f"{s['best_constrained'] or 'none'} ({fmt(s['constrained_throughput'])})",
                  f"{s['best_unconstrained']} ({fmt(s['best_throughput'])})")
                 for s in summary.get("slos_any_concurrency", []))
    fixed = tuple((_ctx(s["context"]), str(s["sessions"]), slo(s), pct(s["tax"]),
                   s["best_constrained"] or "none", s["best_unconstrained"] or "—")
                  for s in summary.get("slos", []))
    return (Table("Human tax, concurrency chosen freely (per node)",
                  ("context", "SLO (p99 TTFT / p99 TPOT)", "tax", "tax over seeds [95%]",
                   "best meeting it (tok/s)", "best overall (tok/s)"), free,
                  "Tax = 1 − best window throughput meeting the SLO / best of any point."),
            Table("Human tax at a given concurrency",
                  ("context", "sessions", "SLO (p99 TTFT / p99 TPOT)", "tax",
                   "best meeting it", "best overall"), fixed))


def from_study(out: Path) -> ReportData:
    from hlserve.study.core import METRIC, PRODUCTION_SLO, STRICT_SLO
    from hlserve.study.runs import load_points

    if not (out / "summary.json").is_file():
        raise FileNotFoundError(f"{out}: no summary.json (write it with hlserve study --out "
                                f"{out} --report-only)")
    recs = load_points(out)
    runs = _json(out / "spec.json")
    runs = runs.get("runs", [runs]) if isinstance(runs, dict) else []
    marks = tuple((k, v, name) for name, (ttft, tpot) in (("production", PRODUCTION_SLO),
                                                          ("strict", STRICT_SLO))
                  for k, v in (("p99_ttft_ms", ttft), ("p99_tpot_ms", tpot)))
    groups, dists = [], []
    for ctx in sorted({r["point"]["context"] for r in recs}):
        here = sorted((r for r in recs if r["point"]["context"] == ctx),
                      key=lambda r: (r["point"]["sessions"], r["label"]))
        pts = []
        for r in here:
            # the label drawn names the concurrency; the configuration's own is kept for tiers
            rec = {**r, "label": f"{r['label']} @ {r['point']['sessions']}",
                   "config_label": r["label"]}
            pt = Pt(rec, f"{r['point']['sessions']} sessions", ())
            pts.append(Pt(rec, pt.series, study_config(rec) + tuple(metric_lines(pt, METRIC))))
        groups.append(Group(_ctx(ctx), tuple(pts), marks))
        for n in sorted({p.record["point"]["sessions"] for p in pts}):
            cell = [p for p in pts if p.record["point"]["sessions"] == n]
            dists += dist_groups(f"{_ctx(ctx)}, {n} sessions", cell, {})
    seeds_path = out / "seeds.json"
    seeds = _json(seeds_path) if seeds_path.is_file() else None
    all_pts = [p for g in groups for p in g.points]
    settings = [(f"run {i + 1}", ", ".join(flat(r))) for i, r in enumerate(runs)]
    if seeds:
        settings.append(("seeds", str(seeds.get("seeds"))))
    hw = sorted({f"{r.get('hardware')} × TP{r.get('tp')}" for r in runs})
    return ReportData(
        kind="study", title=f"Study: {', '.join(sorted({str(r.get('model')) for r in runs}))}",
        source=str(out), metric=METRIC, metric_title="window token throughput (tok/s)",
        groups=tuple(groups), tax=study_tax(_json(out / "summary.json"), seeds),
        points_table=points_table(all_pts, METRIC, (
            ("context", lambda p: str(p.record["point"]["context"])),
            ("sessions", lambda p: str(p.record["point"]["sessions"])))),
        distributions=tuple(dists), settings=tuple(settings),
        machine=(("measured on", f"simulated {', '.join(hw)} (hlserve's cost model, virtual "
                                 "clock); no host measured"),),
        notes=("A simulated study stores percentiles (p50, p99) per point, not per-request "
               "records: its distributions show those.",),
        raw={"runs": runs})
