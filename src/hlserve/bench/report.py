"""Tables and plots of benchmark and sweep results: the SLO frontier and the human tax.

Frontier: for an SLO target (p99 TTFT ≤ x, p99 TPOT ≤ y), the best throughput among the
configurations that meet it. Human tax at that target = 1 − best_constrained /
best_unconstrained, best_unconstrained being the best throughput of any configuration. A
sweep's points are in the one point format, checked against a target by the one SLO check
(:mod:`hlserve.driver.points`, where what a missing value means is said).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hlserve.driver.points import human_tax, served, value
from hlserve.driver.stats import fmt_ci

THROUGHPUT = "total_token_throughput"


def default_targets(points: Sequence[dict[str, Any]]) -> list[tuple[float | None, float | None]]:
    """One target per configuration: the p99 TTFT and p99 TPOT that it achieves ("an SLO as
    tight as this configuration's"), from tightest TTFT to loosest, then no target."""
    targets = []
    for p in points:
        r = p["metrics"]
        if r.get("completed") and r.get("p99_ttft_ms") is not None:
            # rounded up, so that a configuration meets its own target
            targets.append((float(math.ceil(r["p99_ttft_ms"])), None if r.get("p99_tpot_ms")
                            is None else float(math.ceil(r["p99_tpot_ms"]))))
    targets = sorted(set(targets), key=lambda t: (t[0], t[1] or 0))
    return [*targets, (None, None)]


def tax_rows(points: Sequence[dict[str, Any]],
             targets: Sequence[tuple[float | None, float | None]] | None = None,
             metric: str = THROUGHPUT) -> list[dict[str, Any]]:
    """One row per SLO target: its best configuration and the human tax, by the one tax
    function (:func:`hlserve.driver.points.human_tax`: over the points that completed with no
    failure; NaN where no point has a throughput)."""
    rows = []
    for ttft, tpot in targets if targets is not None else default_targets(points):
        tax, b, top = human_tax(points, ttft, tpot, metric)
        rows.append({"slo_p99_ttft_ms": ttft, "slo_p99_tpot_ms": tpot,
                     "best_config": b["label"] if b else None,
                     "throughput": value(b, metric) if b else math.nan,
                     "unconstrained": value(top, metric) if top else math.nan,
                     "unconstrained_config": top["label"] if top else None,
                     "human_tax": tax})
    return rows


def _ms(v: float | None) -> str:
    return "none" if v is None else f"{v:,.0f}"


def tax_table(rows: Sequence[dict[str, Any]], metric: str = THROUGHPUT) -> str:
    unit = "tok/s"
    out = [f"| SLO: p99 TTFT ≤ (ms) | p99 TPOT ≤ (ms) | best config | {metric} ({unit}) | "
           "human tax |", "|---:|---:|---|---:|---:|"]
    for r in rows:
        thr = "—" if math.isnan(r["throughput"]) else f"{r['throughput']:,.0f}"
        tax = "—" if math.isnan(r["human_tax"]) else f"{100 * r['human_tax']:.0f}%"
        if r.get("human_tax_ci95"):  # repeated: the paired interval, and whether it shows a tax
            lo, hi = r["human_tax_ci95"]
            tax += f" [{100 * lo:.0f}%, {100 * hi:.0f}%]"
            tax += ", within noise" if r.get("human_tax_within_noise") else ""
        out.append(f"| {_ms(r['slo_p99_ttft_ms'])} | {_ms(r['slo_p99_tpot_ms'])} | "
                   f"{r['best_config'] or 'none meets it'} | {thr} | {tax} |")
    return "\n".join(out)


def points_table(points: Sequence[dict[str, Any]]) -> str:
    out = ["| config | C | B | total tok/s | output tok/s | sessions/h | session p50 / p90 (s) | "
           "TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | cached in | failed |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def g(r: dict[str, Any], k: str, fmt: str = "{:,.0f}") -> str:
        v = r.get(k)
        if v is not None and r.get(f"{k}_ci95"):  # repeated: mean ± half-width
            return fmt_ci(v, r[f"{k}_ci95"], fmt)
        return "—" if v is None else fmt.format(v)

    for p in points:
        r, knobs = p["metrics"], p.get("knobs", {})
        cached = r.get("total_cached_tokens")
        share = (f"{100 * cached / r['total_input_tokens']:.0f}%"
                 if cached is not None and r.get("total_input_tokens") else "—")
        out.append(
            f"| {p['label']} | {knobs.get('chunk_size') or 'none'} | "
            f"{knobs.get('token_budget') or 'none'} | {g(r, 'total_token_throughput')} | "
            f"{g(r, 'output_throughput', '{:,.1f}')} | {g(r, 'sessions_per_hour')} | "
            f"{g(r, 'median_session_time_s', '{:.1f}')} / {g(r, 'p90_session_time_s', '{:.1f}')} | "
            f"{g(r, 'median_ttft_ms')} / {g(r, 'p99_ttft_ms')} | "
            f"{g(r, 'median_tpot_ms')} / {g(r, 'p99_tpot_ms')} | {share} | {r.get('failed', '—')} |")
    return "\n".join(out)


def _err(point: dict[str, Any], key: str) -> list[list[float]] | None:
    """The asymmetric error bar [[below], [above]] of ``key`` from its 95% interval."""
    v, ci = value(point, key), point["metrics"].get(f"{key}_ci95")
    if math.isnan(v) or not ci or any(c is None for c in ci):
        return None
    return [[max(0.0, v - float(ci[0]))], [max(0.0, float(ci[1]) - v)]]


def frontier_plot(points: Sequence[dict[str, Any]], path: str | Path, title: str = "",
                  metric: str = THROUGHPUT) -> Path:
    """Two panels: throughput against p99 TTFT and against p99 TPOT, one marker per
    configuration, and the frontier (best throughput with the latency at most x) as a step
    line, with the human tax written at each point on it. Repeated points (``<metric>_ci95``
    in their metrics) carry their 95% intervals as error bars on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [p for p in points if served(p)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), constrained_layout=True)
    colors = {p["label"]: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(points)}
    top = human_tax(ok, None, None, metric)[2]
    top_v = value(top, metric) if top else math.nan
    for ax, key, name in ((axes[0], "p99_ttft_ms", "p99 TTFT (ms)"),
                          (axes[1], "p99_tpot_ms", "p99 TPOT (ms)")):
        pts = sorted(((value(p, key), value(p, metric), p["label"]) for p in ok),
                     key=lambda t: t[0])
        pts = [t for t in pts if not math.isnan(t[0])]
        by_label = {p["label"]: p for p in ok}
        for x, y, label in pts:
            ax.scatter([x], [y], s=45, zorder=3, color=colors[label], label=label)
            xerr, yerr = (_err(by_label[label], k) for k in (key, metric))
            if xerr is not None or yerr is not None:
                ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="none", ecolor=colors[label],
                            elinewidth=1, capsize=3, alpha=0.8, zorder=2)
        # frontier: the best throughput among points with latency <= x; the tax is written
        # where the frontier steps up (the points on it)
        fx, fy, run = [], [], -math.inf
        for x, y, _ in pts:
            if y > run and top_v > 0:
                ax.annotate(f"tax {100 * (1 - y / top_v):.0f}%", (x, y),
                            textcoords="offset points", xytext=(4, -13), fontsize=7,
                            color="dimgray")
            run = max(run, y)
            fx.append(x)
            fy.append(run)
        if fx:
            ax.step(fx, fy, where="post", color="black", lw=1.2, alpha=0.7, label="frontier")
        xs = [x for x, _, _ in pts if x > 0]
        # a log axis only where the latencies span a wide range: over less than 3x it would
        # show one tick or none (matplotlib labels decades and a few minor ticks only)
        log = bool(xs) and max(xs) / min(xs) >= 3
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(
                matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
                lambda v, _: f"{v:,.0f}" if f"{v:.0f}"[0] in "23457" else ""))
        else:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(6))
            ax.xaxis.set_major_formatter(
                matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_xlabel(f"SLO target: {name}" + (", log scale" if log else ""))
        ax.set_ylabel(f"{metric.replace('_', ' ')} (tok/s)")
        highs = [y + (_err(by_label[label], metric) or [[0.0], [0.0]])[1][0]
                 for _, y, label in pts]
        ax.set_ylim(bottom=0, top=1.1 * max(highs, default=1.0))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=10)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
