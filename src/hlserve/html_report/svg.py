"""The report's charts as inline SVG written here: no plotting library, no JavaScript needed
to draw them (a report stays a few hundred KB and opens offline; Plotly's inlined bundle
alone is 4.8 MB, Bokeh's 1.3 MB). Each point is one element with a ``<title>`` (the
browser's own tooltip; the page's script turns it into a faster one) holding its
configuration.

- :func:`frontier_chart`: throughput against a p99 latency, one marker per served point
  (``class="pt"``), the frontier as a step line, 95% intervals as error bars, SLO targets as
  dashed lines;
- :func:`dist_chart`: a latency's distribution per point, one row per point
  (``class="dist-row"``): a line from the lowest to the highest quantile, a box p25–p75, a bar
  at the median, a dot at p99.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

from hlserve.html_report.model import DistGroup, Group, Pt

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
W, H = 520, 320
ML, MR, MT, MB = 72, 16, 14, 46


def colors(series: Sequence[str]) -> dict[str, str]:
    """A colour per legend entry, in order of first appearance, the same in every chart."""
    out: dict[str, str] = {}
    for s in series:
        out.setdefault(s, PALETTE[len(out) % len(PALETTE)])
    return out


# ---- scales ---------------------------------------------------------------------------------


class Scale:
    """Data to pixels on one axis: linear, or log where the values span 3x or more (as the
    sweep's PNG frontier: over less, a log axis shows one tick or none)."""

    def __init__(self, lo: float, hi: float, a: float, b: float, log: bool) -> None:
        if log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi <= lo:
            lo, hi = lo - 1, hi + 1
        self.lo, self.hi, self.a, self.b, self.log = lo, hi, a, b, log

    @classmethod
    def fit(cls, values: Sequence[float], a: float, b: float, zero: bool = False) -> Scale:
        vals = [v for v in values if math.isfinite(v)] or [0.0, 1.0]
        lo, hi = min(vals), max(vals)
        if not zero and lo > 0 and hi / lo >= 3:
            return cls(lo / 1.25, hi * 1.25, a, b, True)
        if zero:
            return cls(0.0, hi * 1.1 if hi > 0 else 1.0, a, b, False)
        pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
        return cls(max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad, a, b, False)

    def __call__(self, v: float) -> float:
        x = math.log10(max(v, 1e-12)) if self.log else v
        return self.a + (x - self.lo) / (self.hi - self.lo) * (self.b - self.a)

    def ticks(self) -> list[tuple[float, str]]:
        """Tick values and their text: 1, 2, 5 x 10^k on a log axis (decades only where
        those are too many), a 1-2-5 step on a linear one, written to the step's precision."""
        if self.log:
            out = [m * 10.0 ** e for e in range(math.floor(self.lo) - 1, math.ceil(self.hi) + 1)
                   for m in (1, 2, 5)]
            out = [t for t in out if self.lo <= math.log10(t) <= self.hi]
            out = out if len(out) <= 10 else [t for t in out if f"{t:g}"[0] == "1"]
            return [(t, f"{t:,.0f}" if t >= 1 else f"{t:g}") for t in out]
        span = self.hi - self.lo
        step = 10 ** math.floor(math.log10(span / 5))
        step *= next(m for m in (1, 2, 5, 10) if span / (step * m) <= 6)
        first = math.ceil(self.lo / step) * step
        digits = max(0, -math.floor(math.log10(step)))
        return [(t, f"{t:,.{digits}f}") for i in range(int((self.hi - first) / step) + 1)
                if (t := first + i * step) <= self.hi]


def tick_text(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 10 else f"{v:g}"


def _axes(x: Scale, y: Scale | None, xtitle: str, ytitle: str, h: int) -> list[str]:
    """Frame, grid, ticks and titles (``y`` None: a chart whose rows are labelled instead)."""
    out = [f'<rect x="{ML}" y="{MT}" width="{W - ML - MR}" height="{h - MT - MB}" '
           'class="frame"/>']
    for t, text in x.ticks():
        px = x(t)
        out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{MT}" y2="{h - MB}" class="grid"/>'
                   f'<text x="{px:.1f}" y="{h - MB + 15}" class="tick" '
                   f'text-anchor="middle">{text}</text>')
    out.append(f'<text x="{(ML + W - MR) / 2:.0f}" y="{h - 8}" class="axis" '
               f'text-anchor="middle">{escape(xtitle)}{", log scale" if x.log else ""}</text>')
    if y is not None:
        for t, text in y.ticks():
            py = y(t)
            out.append(f'<line x1="{ML}" x2="{W - MR}" y1="{py:.1f}" y2="{py:.1f}" '
                       f'class="grid"/><text x="{ML - 6}" y="{py + 4:.1f}" class="tick" '
                       f'text-anchor="end">{text}</text>')
        out.append(f'<text transform="translate(14,{(MT + h - MB) / 2:.0f}) rotate(-90)" '
                   f'class="axis" text-anchor="middle">{escape(ytitle)}</text>')
    return out


def clamp(v: float, lo: float, hi: float) -> float:
    return min(max(v, lo), hi)


def tip(lines: Sequence[str]) -> str:
    return f"<title>{escape(chr(10).join(lines))}</title>"


# ---- frontier -------------------------------------------------------------------------------


def drawable(points: Sequence[Pt], key: str, metric: str) -> list[Pt]:
    """The points a frontier draws: served, with the latency and a throughput."""
    return [p for p in points if p.served and math.isfinite(p.value(key))
            and math.isfinite(p.value(metric))]


def frontier_chart(group: Group, key: str, xtitle: str, metric: str, ytitle: str,
                   palette: Mapping[str, str], chart_id: str) -> str:
    pts = sorted(drawable(group.points, key, metric), key=lambda p: p.value(key))
    xs = [v for p in pts for v in (p.value(key), *(p.ci(key) or ()))]
    ys = [v for p in pts for v in (p.value(metric), *(p.ci(metric) or ()))]
    marks = [(v, name) for k, v, name in group.marks if k == key]
    x = Scale.fit(xs + [v for v, _ in marks], ML, W - MR)
    y = Scale.fit(ys, H - MB, MT, zero=True)
    out = [f'<svg id="{chart_id}" class="chart frontier" data-key="{key}" '
           f'data-expected="{len(pts)}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
           'xmlns="http://www.w3.org/2000/svg" role="img">', *_axes(x, y, xtitle, ytitle, H)]
    for i, (v, name) in enumerate(marks):  # staggered, so that close targets stay legible
        px = x(v)
        anchor = "end" if px > W - MR - 90 else "start"
        out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{MT}" y2="{H - MB}" class="mark"/>'
                   f'<text x="{px + (-3 if anchor == "end" else 3):.1f}" y="{MT + 11 + 11 * i}" '
                   f'class="marktext" text-anchor="{anchor}">{escape(name)} {tick_text(v)}'
                   "</text>")
    # the frontier: the best throughput among points with the latency at most x
    path: list[str] = []
    best = -math.inf
    for p in pts:
        px, v = x(p.value(key)), p.value(metric)
        path.append(f"H{px:.1f}" if path else f"M{px:.1f} {y(v):.1f}")
        if v > best:
            best = v
            path.append(f"V{y(v):.1f}")
    if path:
        out.append(f'<path d="{" ".join(path)} H{W - MR}" class="front"/>')
    for p in pts:
        cx, cy = x(p.value(key)), y(p.value(metric))
        color = palette.get(p.series, PALETTE[0])
        for ci, horiz in ((p.ci(key), True), (p.ci(metric), False)):
            if ci is not None:  # kept inside the frame (an interval may reach below 0)
                a, b = ((clamp(x(c), ML, W - MR) for c in ci) if horiz
                        else (clamp(y(c), MT, H - MB) for c in ci))
                out.append(f'<line class="err" stroke="{color}" ' + (
                    f'x1="{a:.1f}" x2="{b:.1f}" y1="{cy:.1f}" y2="{cy:.1f}"/>' if horiz
                    else f'x1="{cx:.1f}" x2="{cx:.1f}" y1="{a:.1f}" y2="{b:.1f}"/>'))
        out.append(f'<circle class="pt tip" cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{color}" '
                   f'data-label="{escape(p.label)}">{tip(p.config)}</circle>')
    out.append("</svg>")
    return "".join(out)


# ---- distributions --------------------------------------------------------------------------

ROW, LABEL_W = 20, 190


def dist_chart(dg: DistGroup, chart_id: str) -> str:
    """One row per point: the quantiles of ``dg.metric`` (ms) on a shared axis."""
    h = MT + MB + ROW * len(dg.rows)
    vals = [v for d in dg.rows for k, v in d.stats.items() if k.startswith("p")]
    left = ML + LABEL_W - 60
    x = Scale.fit([v for v in vals if v > 0] or vals, left, W - MR)
    axes = _axes(x, None, f"{dg.title} (ms)", "", h)
    axes[0] = (f'<rect x="{left}" y="{MT}" width="{W - MR - left}" height="{h - MT - MB}" '
               'class="frame"/>')
    out = [f'<svg id="{chart_id}" class="chart dist" data-metric="{dg.metric}" '
           f'data-expected="{len(dg.rows)}" viewBox="0 0 {W} {h}" width="{W}" height="{h}" '
           'xmlns="http://www.w3.org/2000/svg" role="img">', *axes]
    for i, d in enumerate(dg.rows):
        cy = MT + ROW * i + ROW / 2
        qs = {k: v for k, v in d.stats.items() if k.startswith("p")}
        lo, hi = min(qs.values()), max(qs.values())
        lines = [d.label, f"{dg.title} (ms), from {d.source}"
                 + (f", {d.stats['n']:.0f} values" if "n" in d.stats else "")]
        lines += [f"{k}: {v:,.1f}" for k, v in d.stats.items() if k != "n"]
        parts = [f'<line x1="{x(lo):.1f}" x2="{x(hi):.1f}" y1="{cy:.1f}" y2="{cy:.1f}" '
                 'class="whisker"/>']
        if "p25" in qs and "p75" in qs:
            parts.append(f'<rect x="{x(qs["p25"]):.1f}" y="{cy - 6:.1f}" height="12" '
                         f'width="{max(1.0, x(qs["p75"]) - x(qs["p25"])):.1f}" class="box"/>')
        if "p50" in qs:
            parts.append(f'<line x1="{x(qs["p50"]):.1f}" x2="{x(qs["p50"]):.1f}" '
                         f'y1="{cy - 7:.1f}" y2="{cy + 7:.1f}" class="median"/>')
        if "p99" in qs:
            parts.append(f'<circle cx="{x(qs["p99"]):.1f}" cy="{cy:.1f}" r="3.5" class="p99"/>')
        name = d.label if len(d.label) <= 26 else d.label[:25] + "…"
        out.append(f'<g class="dist-row tip" data-label="{escape(d.label)}">{tip(lines)}'
                   f'<rect x="4" y="{cy - ROW / 2:.1f}" width="{W - MR - 4}" height="{ROW}" '
                   f'class="rowbg"/><text x="{left - 6}" y="{cy + 4:.1f}" class="tick" '
                   f'text-anchor="end">{escape(name)}</text>{"".join(parts)}</g>')
    out.append("</svg>")
    return "".join(out)
