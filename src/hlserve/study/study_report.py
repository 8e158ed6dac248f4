"""The study's report from its stored points, without simulating anything (``hlserve study
--out DIR --report-only``): the figures of plots.py (pooled frontiers with the SLO targets and
the tax marked, the tax against the TPOT target, the components), ``table.md``,
``summary.json``, and the study over seeds (seeds.py) where the points have several.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hlserve.driver.tiers import DEFAULT_TIERS, Tier, tier_rows, tier_table
from hlserve.study import seeds
from hlserve.study.core import (
    ABLATIONS,
    METRIC,
    PRODUCTION_SLO,
    STRICT_SLO,
    SWEEPS,
    components,
    group,
    human_tax,
    latency,
    tax_within_systems,
    throughput,
)
from hlserve.study.plots import plot_components, plot_frontiers, plot_tax
from hlserve.study.runs import load_points


def plots(groups: dict[tuple[int, int], list[dict[str, Any]]], out: Path) -> list[Path]:
    """Every figure of the study from the points (plots.py): pooled frontiers, the tax
    against the TPOT target, the components."""
    return [*plot_frontiers(groups, out), plot_tax(groups, out), plot_components(groups, out)]


def tiers(recs: list[dict[str, Any]], tiers: tuple[Tier, ...] = DEFAULT_TIERS,
          ) -> dict[str, list[dict[str, Any]]]:
    """Agents per node at each SLO tier (:mod:`hlserve.driver.tiers`), per context: each
    configuration over the concurrencies it was run at, on the window throughput."""
    by_ctx: dict[int, list[dict[str, Any]]] = {}
    for r in recs:
        by_ctx.setdefault(r["point"]["context"], []).append(r)
    return {str(ctx): tier_rows(rs, tiers, METRIC) for ctx, rs in sorted(by_ctx.items())}


def tiers_markdown(rows: dict[str, list[dict[str, Any]]],
                   tiers: tuple[Tier, ...] = DEFAULT_TIERS) -> str:
    lines = ["# Agents per node at SLO tiers", "",
             "Per tier (p99 TTFT / p99 TPOT), the most concurrent sessions a configuration "
             "serves while meeting it, its window throughput there, and the tax against the "
             "tier none (its throughput at the most sessions it served at all). The last row "
             "is the node's: the configuration serving the most sessions at each tier.", ""]
    for ctx, rs in rows.items():
        lines += [f"## Context {int(ctx) // 1024}K", "", tier_table(rs, tiers), ""]
    return "\n".join(lines)


def write_tiers(out: Path, tiers_: tuple[Tier, ...] = DEFAULT_TIERS) -> list[Path]:
    """``tiers.md`` and ``tiers.json`` from the stored points alone (``hlserve study --out DIR
    --tiers-only``): the tier table, without rewriting the rest of the report."""
    recs = load_points(Path(out))
    if not recs:
        raise FileNotFoundError(f"no study points in {Path(out) / 'points'}")
    rows = tiers(recs, tiers_)
    md, js = Path(out) / "tiers.md", Path(out) / "tiers.json"
    md.write_text(tiers_markdown(rows, tiers_))
    js.write_text(json.dumps(rows, indent=1) + "\n")
    return [md, js]


def report(out: Path, slos: tuple[tuple[float, float], ...] = (PRODUCTION_SLO, STRICT_SLO),
           tiers_: tuple[Tier, ...] = DEFAULT_TIERS) -> list[Path]:
    """Frontier plots, tax plot, markdown table, the tier table and summary.json from the
    stored points."""
    out = Path(out)
    recs = load_points(out)
    if not recs:
        raise FileNotFoundError(f"no study points in {out / 'points'}")
    groups = group(recs)
    paths = plots(groups, out)
    summary: dict[str, Any] = {"slos": [], "components": {}, "tiers": tiers(recs, tiers_)}
    for (ctx, n), rs in sorted(groups.items()):
        for ttft, tpot in slos:
            tax, bc, bu = human_tax(rs, ttft, tpot)
            per_sys = tax_within_systems(rs, ttft, tpot)
            summary["slos"].append({
                "context": ctx, "sessions": n, "ttft_p99_ms": ttft, "tpot_p99_ms": tpot,
                "tax": tax, "best_constrained": bc["label"] if bc else None,
                "best_unconstrained": bu["label"] if bu else None,
                "best_throughput": throughput(bu) if bu else None,
                "constrained_throughput": throughput(bc) if bc else 0.0, "tax_within_system": per_sys,
            })
        summary["components"][f"{ctx}/{n}"] = components(rs)
    # the operator's view: the concurrency a node serves is a choice too
    summary["slos_any_concurrency"] = []
    for ctx in sorted({c for c, _ in groups}):
        rs = [r for (c, _), g in groups.items() if c == ctx for r in g]
        for ttft, tpot in slos:
            tax, bc, bu = human_tax(rs, ttft, tpot)
            summary["slos_any_concurrency"].append({
                "context": ctx, "ttft_p99_ms": ttft, "tpot_p99_ms": tpot, "tax": tax,
                "tax_within_system": tax_within_systems(rs, ttft, tpot),
                "best_constrained": f"{bc['label']} @ {bc['point']['sessions']} sessions" if bc else None,
                "best_unconstrained": f"{bu['label']} @ {bu['point']['sessions']} sessions" if bu else None,
                "constrained_throughput": throughput(bc) if bc else 0.0,
                "best_throughput": throughput(bu) if bu else None,
            })
    sp = out / "summary.json"
    sp.write_text(json.dumps(summary, indent=1))
    tp = out / "table.md"
    tp.write_text(markdown(groups, summary))
    return [*paths, sp, tp, *write_tiers(out, tiers_), *seeds.report(out)]


def _pct(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.0f}%"


WITHIN_HEADER = "tax within sglang / sarathi / vllm (each against its own best)"
WITHIN_NOTE = ("\"Tax within\" a preset is 1 − its best configuration meeting the SLO / its own "
               "best configuration, both among that preset's points only.")


def _within(s: dict[str, Any]) -> str:
    return " / ".join(_pct(s.get("tax_within_system", {}).get(k)) for k in SWEEPS)


def markdown(groups: dict[tuple[int, int], list[dict[str, Any]]], summary: dict[str, Any]) -> str:
    lines = ["# Study points", ""]
    lines += ["## Human tax, concurrency chosen freely (per node)", "", WITHIN_NOTE, "",
              "| context | SLO (TTFT p99 / TPOT p99) | tax | best meeting it | best overall | "
              f"{WITHIN_HEADER} |", "|---|---|---|---|---|---|"]
    for s in summary.get("slos_any_concurrency", []):
        lines.append(f"| {s['context']} | {s['ttft_p99_ms']:.0f} ms / {s['tpot_p99_ms']:.0f} ms | "
                     f"{_pct(s['tax'])} | {s['best_constrained'] or 'none'} "
                     f"({s['constrained_throughput']:.0f} tok/s) | {s['best_unconstrained']} "
                     f"({s['best_throughput']:.0f} tok/s) | {_within(s)} |")
    lines += ["", "## Human tax at a given concurrency", "",
              "| context | sessions | SLO (TTFT p99 / TPOT p99) | tax | best meeting it | best overall | "
              f"{WITHIN_HEADER} |", "|---|---|---|---|---|---|---|"]
    for s in summary["slos"]:
        within = _within(s)
        lines.append(f"| {s['context']} | {s['sessions']} | {s['ttft_p99_ms']:.0f} ms / "
                     f"{s['tpot_p99_ms']:.0f} ms | {_pct(s['tax'])} | {s['best_constrained'] or 'none'} | "
                     f"{s['best_unconstrained']} | {within} |")
    lines += ["", "## Throughput mode by component (gain of throughput mode over each)", "",
              "| context/sessions | " + " | ".join([*ABLATIONS, "vs sglang (C=8192)",
                                                     "vs sarathi (C=B=512)", "vs best sglang",
                                                     "vs best sarathi"]) + " |",
              "|---|" + "---|" * (len(ABLATIONS) + 4)]
    for key, comp in summary["components"].items():
        cols = [*ABLATIONS, "vs sglang (C=8192)", "vs sarathi (C=B=512)", "vs best sglang",
                "vs best sarathi"]
        lines.append(f"| {key} | " + " | ".join(
            f"{100 * comp[c]:+.1f}%" if c in comp else "-" for c in cols) + " |")
    lines += ["", "## All points", "",
              "| context | sessions | config | tokens/s (window) | output tok/s (window) | TTFT p50 / p99 (s) | "
              "TPOT p50 / p99 (ms) | sessions/h ended | retractions | iterations (mixed) | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (ctx, n), rs in sorted(groups.items()):
        for r in sorted(rs, key=lambda r: -throughput(r)):
            m = r["metrics"]
            trunc = " (cut)" if m.get("truncated") else ""
            trunc += " (transient)" if m.get("transient") else ""
            # sessions ended in the window wherever they started, where the point has it
            per_hour = m.get("sessions_ended_per_hour", m.get("sessions_per_hour", 0))
            lines.append(
                f"| {ctx} | {n} | {r['label']}{trunc} | {throughput(r):.0f} | {throughput(r, 'window_output_throughput'):.0f} | "
                f"{latency(r, 'median_ttft_ms') / 1e3:.2f} / {latency(r, 'p99_ttft_ms') / 1e3:.2f} | "
                f"{latency(r, 'median_tpot_ms'):.0f} / {latency(r, 'p99_tpot_ms'):.0f} | "
                f"{per_hour:.0f} | {m.get('retractions', 0)} | "
                f"{m.get('iterations', 0)} ({m.get('mixed_iterations', 0)}) | {m.get('wall_s', 0):.0f} |")
    return "\n".join(lines) + "\n"
