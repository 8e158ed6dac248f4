"""The study's figures, drawn from its stored points (``hlserve study --out DIR --report-only``
redraws them without simulating):

- ``frontier_<ctx>k.png``: every configuration at every concurrency of one context on one
  pair of panels (throughput against TPOT p99 and against TTFT p99), the production SLO's
  targets drawn, the points meeting both targets filled, and the tax marked between the best
  point meeting them and the best point overall;
- ``tax.png``: the human tax against the TPOT p99 target, per concurrency and with
  concurrency free;
- ``components.png``: throughput mode's gain over each one-component ablation and each
  preset, one panel per context.

Colours are fixed mappings (a system, a concurrency), the same in every figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hlserve.driver.points import meets_slo
from hlserve.study.core import (
    PRODUCTION_SLO,
    components,
    human_tax,
    latency,
    pareto,
    throughput,
)

Groups = dict[tuple[int, int], list[dict[str, Any]]]

SYSTEM_COLORS = {"sglang": "#1f77b4", "sarathi": "#ff7f0e", "vllm": "#2ca02c",
                 "hlserve": "#d62728", "hlserve ablations": "#9467bd",
                 # the engines' own schedulers (hlserve.study.foreign), paler than the presets
                 "sglang-0.5.23": "#aec7e8", "sglang-0.5.23-mixed": "#ffbb78", "vllm-0.34-chunked": "#c49c94",
                 "vllm-0.34": "#98df8a", "vllm-0.34+hlserve": "#ff9896",
                 "sglang-0.5.23+hlserve": "#c5b0d5"}
SESSION_COLORS = {4: "#1b9e77", 8: "#d95f02", 16: "#7570b3", 32: "#e7298a", 64: "#66a61e",
                  128: "#a6761d"}
SESSION_MARKERS = {4: "v", 8: "^", 16: "o", 32: "s", 64: "D", 128: "P"}
OTHER_COLOR = "#7f7f7f"
FONT = 11


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": FONT, "axes.titlesize": FONT + 1, "legend.fontsize": FONT - 1})
    return plt


def _log_axis(axis: Any) -> None:
    """Log scale with ticks at 1, 2, 5 × 10^k written as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _thousands(axis: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:g}K"))


def system_family(system: str) -> str:
    """The colour group of a system: a preset, throughput mode, or one of its ablations."""
    if system == "hlserve":
        return "hlserve"
    return "hlserve ablations" if system.startswith("hlserve-") else system


def session_color(n: int) -> str:
    return SESSION_COLORS.get(n, OTHER_COLOR)


def _ctx_name(ctx: int) -> str:
    return f"{ctx // 1024}K"


def _point_name(r: dict[str, Any]) -> str:
    return f"{r['label']}, {r['point']['sessions']} sessions"


# ---- pooled frontiers ---------------------------------------------------------------------------


def _scatter_pooled(ax: Any, rs: list[dict[str, Any]], key: str, scale: float,
                    slo: tuple[float, float]) -> None:
    """Every point: colour by system, marker by concurrency, filled when it meets ``slo``."""
    for r in rs:
        ours = r["point"]["system"] == "hlserve"  # drawn on top, smaller: it often ties vllm
        color = SYSTEM_COLORS.get(system_family(r["point"]["system"]), OTHER_COLOR)
        filled = meets_slo(r, *slo)
        ax.scatter(latency(r, key) * scale, throughput(r),
                   marker=SESSION_MARKERS.get(r["point"]["sessions"], "x"), s=22 if ours else 46,
                   facecolors=color if filled else "none", edgecolors=color, linewidths=1.2,
                   alpha=0.85, zorder=5 if ours else 3)
    xs = [latency(r, key) * scale for r in rs]
    ys = [throughput(r) for r in rs]
    front = pareto(xs, ys)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "k--", lw=1, zorder=2)


def _mark_tax(ax: Any, rs: list[dict[str, Any]], key: str, scale: float,
              slo: tuple[float, float]) -> None:
    """The best point meeting ``slo`` and the best point overall, and the tax between them."""
    tax, bc, bu = human_tax(rs, *slo)
    assert bu is not None
    for r, style in ((bu, "-"), (bc, "--")):
        if r is None:
            continue
        ax.axhline(throughput(r), color="k", lw=0.8, ls=style, alpha=0.6, zorder=1)
        ax.scatter(latency(r, key) * scale, throughput(r), s=260, facecolors="none",
                   edgecolors="k", linewidths=1.6, zorder=4)
    lo = throughput(bc) if bc is not None else ax.get_ylim()[0]
    ax.annotate("", xy=(0.985, throughput(bu)), xytext=(0.985, lo),
                xycoords=("axes fraction", "data"),
                arrowprops={"arrowstyle": "<->", "color": "k", "lw": 1.4})
    ax.text(0.97, (throughput(bu) + lo) / 2, f"tax {100 * tax:.0f}%", ha="right", va="center",
            transform=ax.get_yaxis_transform(), fontsize=FONT,
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.6"})


def _tax_caption(rs: list[dict[str, Any]], slo: tuple[float, float]) -> str:
    tax, bc, bu = human_tax(rs, *slo)
    assert bu is not None
    met = (f"best meeting it (dashed): {_point_name(bc)}, {throughput(bc) / 1e3:.1f}K tok/s"
           if bc is not None else "nothing meets it")
    return (f"SLO TTFT p99 ≤ {slo[0] / 1e3:g} s, TPOT p99 ≤ {slo[1]:g} ms: {met}; best overall "
            f"(solid): {_point_name(bu)}, {throughput(bu) / 1e3:.1f}K tok/s; tax {100 * tax:.0f}%")


def _frontier_legend(fig: Any, rs: list[dict[str, Any]]) -> None:
    from matplotlib.lines import Line2D

    systems = sorted({system_family(r["point"]["system"]) for r in rs},
                     key=list(SYSTEM_COLORS).index)
    sessions = sorted({r["point"]["sessions"] for r in rs})
    handles = [Line2D([], [], ls="", marker="o", color=SYSTEM_COLORS[s], label=s) for s in systems]
    handles += [Line2D([], [], ls="", marker=SESSION_MARKERS.get(n, "x"), color="0.3",
                       label=f"{n} sessions") for n in sessions]
    handles += [Line2D([], [], ls="", marker="o", mfc="none", color="0.3",
                       label="hollow: misses the SLO"),
                Line2D([], [], ls="--", color="k", lw=1, label="Pareto front")]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 7),
               bbox_to_anchor=(0.5, 0.995), frameon=False)


def plot_frontier(rs: list[dict[str, Any]], ctx: int, out: Path,
                  slo: tuple[float, float] = PRODUCTION_SLO) -> Path:
    """One context's pooled frontier: all configurations and concurrencies on each panel."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(14, 6.4), sharey=True)
    for ax, (key, name, scale, target) in zip(axes, (
            ("p99_tpot_ms", "TPOT p99 (ms)", 1.0, slo[1]),
            ("p99_ttft_ms", "TTFT p99 (s)", 1e-3, slo[0] * 1e-3)), strict=True):
        _scatter_pooled(ax, rs, key, scale, slo)
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
        _thousands(ax.yaxis)
        ax.axvline(target, color="0.35", lw=1.2, ls=":")
        ax.text(target, 0.02, f" target {target:g}", transform=ax.get_xaxis_transform(),
                color="0.25", fontsize=FONT - 1, ha="left", va="bottom")
        _mark_tax(ax, rs, key, scale, slo)
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens/s served (prompt + output)")
    _frontier_legend(fig, rs)
    fig.text(0.5, 0.01, _tax_caption(rs, slo), ha="center", va="bottom", fontsize=FONT - 1,
             wrap=True)
    fig.suptitle(f"{_ctx_name(ctx)} context: every configuration at every concurrency",
                 y=0.885, fontsize=FONT + 2)
    fig.tight_layout(rect=(0, 0.05, 1, 0.87))
    p = out / f"frontier_{ctx // 1024}k.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_frontiers(groups: Groups, out: Path) -> list[Path]:
    """``frontier_<ctx>k.png`` for every context, each pooling all its points."""
    paths = []
    for ctx in sorted({c for c, _ in groups}):
        rs = [r for (c, _), g in sorted(groups.items()) if c == ctx for r in g]
        paths.append(plot_frontier(rs, ctx, out))
    return paths


# ---- tax against the TPOT target ----------------------------------------------------------------

TPOT_TARGETS = (25, 35, 50, 70, 100, 150, 200, 300, 500, 1000, 2000)
TTFT_STYLES = ((2000.0, "-", "TTFT p99 ≤ 2 s"), (math.inf, ":", "TTFT free"))


def _tax_curve(ax: Any, rs: list[dict[str, Any]], color: str, lw: float, ms: float) -> None:
    for ttft, style, _ in TTFT_STYLES:
        taxes = [100 * human_tax(rs, ttft, t)[0] for t in TPOT_TARGETS]
        ax.plot(TPOT_TARGETS, taxes, style, color=color, lw=lw, marker="o", ms=ms, alpha=0.9)


def _tax_legend(fig: Any, sessions: list[int]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="k", lw=2.6, label="concurrency free")]
    handles += [Line2D([], [], color=session_color(n), lw=1.6, label=f"{n} sessions")
                for n in sessions]
    handles += [Line2D([], [], color="0.3", ls=style, lw=1.6, label=name)
                for _, style, name in TTFT_STYLES]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
               bbox_to_anchor=(0.5, 0.0))


def plot_tax(groups: Groups, out: Path) -> Path:
    """The human tax against the TPOT p99 target, one panel per context."""
    plt = _plt()
    ctxs = sorted({c for c, _ in groups})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5.6 * len(ctxs), 5.0), squeeze=False,
                             sharey=True)
    for ax, ctx in zip(axes[0], ctxs, strict=True):
        for n in sorted(n for c, n in groups if c == ctx):
            _tax_curve(ax, groups[(ctx, n)], session_color(n), 1.4, 3)
        _tax_curve(ax, [r for (c, _), g in groups.items() if c == ctx for r in g], "k", 2.6, 4)
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
        ax.set_xlabel("TPOT p99 target (ms)")
        ax.set_ylim(-3, 103)
        ax.axvline(100, color="0.5", lw=0.8)
        ax.set_title(f"{_ctx_name(ctx)} context")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("human tax (% of throughput)")
    _tax_legend(fig, sorted({n for _, n in groups}))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    p = out / "tax.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


# ---- components ---------------------------------------------------------------------------------

COMPONENT_LABELS = {
    "hlserve-chunked": "greedy prefill\n(vs C=8192)",
    "hlserve-mix_always": "two-stage\n(vs always mix)",
    "hlserve-prefill_first": "two-stage\n(vs prefill-first)",
    "hlserve-ratchet": "EMA budget\n(vs ratchet)",
    "hlserve-no_budget": "EMA budget\n(vs none)",
    "hlserve-fcfs": "LPM\n(vs FCFS)",
    "vs sglang (C=8192)": "vs sglang\nC=8192",
    "vs sarathi (C=B=512)": "vs sarathi\nC=B=512",
    "vs best sarathi": "vs best\nsarathi",
}
COMPONENT_YLIM = (-15.0, 40.0)  # gains beyond it are drawn to the edge and printed


def _component_bars(ax: Any, groups: Groups, ctx: int) -> None:
    labels = list(COMPONENT_LABELS)
    ns = sorted(n for c, n in groups if c == ctx)
    width = 0.84 / len(ns)
    lo, hi = COMPONENT_YLIM
    for j, n in enumerate(ns):
        comp = components(groups[(ctx, n)])
        xs = [i - 0.42 + (j + 0.5) * width for i in range(len(labels))]
        vals = [100 * comp[k] if k in comp else math.nan for k in labels]
        shown = [min(hi, max(lo, v)) if math.isfinite(v) else math.nan for v in vals]
        ax.bar(xs, shown, width, color=session_color(n),
               label=f"{n} sessions")
        for x, v in zip(xs, vals, strict=True):
            if math.isfinite(v) and not lo <= v <= hi:
                ax.text(x, hi if v > hi else lo, f"{v:+.0f}%", ha="center",
                        va="top" if v > hi else "bottom", rotation=90, fontsize=FONT - 2,
                        color="white", fontweight="bold")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylim(lo, hi)
    ax.set_xticks(range(len(labels)))
    ax.set_ylabel("gain (%)")
    ax.set_title(f"{_ctx_name(ctx)} context", loc="left")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)


def plot_components(groups: Groups, out: Path) -> Path:
    """Gain of throughput mode over each one-component ablation and each preset, by context
    (bars by concurrency; a bar past the axis is printed with its value)."""
    plt = _plt()
    ctxs = sorted({c for c, _ in groups})
    fig, axes = plt.subplots(len(ctxs), 1, figsize=(15, 3.4 * len(ctxs)), squeeze=False,
                             sharex=True)
    for ax, ctx in zip(axes[:, 0], ctxs, strict=True):
        _component_bars(ax, groups, ctx)
    axes[-1][0].set_xticklabels(list(COMPONENT_LABELS.values()), fontsize=FONT - 1)
    fig.suptitle("throughput mode's gain over each ablation and preset (empty: not run)",
                 fontsize=FONT + 1)
    fig.tight_layout()
    p = out / "components.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
