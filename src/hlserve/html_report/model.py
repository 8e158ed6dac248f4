"""What an HTML report shows, whatever result it came from (a sweep, a study, a bench run):
the points grouped as the frontier draws them, the tax tables, the latency distributions per
point, the run's settings and its machine. :mod:`hlserve.html_report.load` fills it from a result;
:mod:`hlserve.html_report.page` draws it.

Points are in the one point format (:mod:`hlserve.driver.points`): ``label`` and ``metrics``;
the report adds what its hover shows (the configuration) and the legend entry it falls in.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hlserve.driver.points import served, value
from hlserve.driver.records import RequestRecord

# the per-token and first-token latencies a frontier is drawn against, where points have them
FRONTIER_KEYS = (("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"),
                 ("p99_itl_ms", "p99 ITL (ms)"))
# the latencies whose distribution is drawn per point: (metric name in the result, title)
DIST_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
# quantiles drawn from per-request records (box: p25..p75, whiskers p5..p95, p50, p99 marked)
QUANTILES = (1, 5, 25, 50, 75, 90, 95, 99)


@dataclass(frozen=True)
class Pt:
    """One point of the report: its record (``label``, ``metrics``), the legend entry it is
    coloured by, and its configuration as lines of text (what its hover shows)."""

    record: Mapping[str, Any]
    series: str
    config: tuple[str, ...]

    @property
    def label(self) -> str:
        return str(self.record["label"])

    def value(self, key: str) -> float:
        return value(dict(self.record), key)

    def ci(self, key: str) -> tuple[float, float] | None:
        ci = self.record["metrics"].get(f"{key}_ci95")
        if not ci or any(c is None for c in ci):
            return None
        return float(ci[0]), float(ci[1])

    @property
    def served(self) -> bool:
        return served(dict(self.record))


@dataclass(frozen=True)
class Group:
    """Points drawn on one frontier (a sweep: all of them; a study: one context length, every
    concurrency), and the SLO targets marked on it: ``(latency key, ms, name)``."""

    name: str
    points: tuple[Pt, ...]
    marks: tuple[tuple[str, float, str], ...] = ()

    def frontier_keys(self) -> list[tuple[str, str]]:
        """The latencies some served point of the group has."""
        return [(k, t) for k, t in FRONTIER_KEYS
                if any(p.served and math.isfinite(p.value(k)) for p in self.points)]


@dataclass(frozen=True)
class Table:
    """A table of text cells (numbers already formatted)."""

    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


@dataclass(frozen=True)
class Dist:
    """One point's distribution of one latency (ms): quantiles ``p1``..``p99`` (``p50`` the
    median), ``mean``, ``n`` values; from per-request records where the result kept them,
    else the percentiles the result stored (``source``)."""

    label: str
    stats: Mapping[str, float]
    source: str  # "requests" | "percentiles"


@dataclass(frozen=True)
class DistGroup:
    """One chart: a latency's distribution for each point of a group."""

    group: str
    metric: str
    title: str
    rows: tuple[Dist, ...]


@dataclass(frozen=True)
class ReportData:
    kind: str  # "sweep" | "study" | "bench"
    title: str
    source: str  # what it was read from
    metric: str  # the throughput the frontier and tax use
    metric_title: str
    groups: tuple[Group, ...]
    tax: tuple[Table, ...]
    points_table: Table
    distributions: tuple[DistGroup, ...]
    settings: tuple[tuple[str, str], ...]
    machine: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict)  # the summary as read

    @property
    def points(self) -> list[Pt]:
        return [p for g in self.groups for p in g.points]


# ---- formatting -----------------------------------------------------------------------------


def fmt(v: Any, spec: str = "{:,.0f}") -> str:
    """A number as the tables write it; a dash where it is missing."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, int | float) and not isinstance(v, bool):
        return spec.format(v)
    return str(v)


def fmt_metric(pt: Pt, key: str, spec: str = "{:,.0f}") -> str:
    """A metric of a point, with its 95% interval where the point was repeated."""
    v = pt.value(key)
    ci = pt.ci(key)
    text = fmt(v, spec)
    if ci is not None and not math.isnan(v):
        text += f" [{spec.format(ci[0])}, {spec.format(ci[1])}]"
    return text


def pct(v: float | None) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.0f}%"


def flat(d: Mapping[str, Any], skip: Iterable[str] = ()) -> list[str]:
    """``key=value`` of a mapping's entries, for a hover or a settings cell."""
    gone = set(skip)
    return [f"{k}={json.dumps(v) if isinstance(v, dict | list) else v}"
            for k, v in d.items() if k not in gone]


def metric_lines(pt: Pt, metric: str) -> list[str]:
    """What a hover says a point measured: throughput and the p99 latencies."""
    out = [f"{metric}: {fmt_metric(pt, metric)} tok/s"]
    for key, title in FRONTIER_KEYS:
        if not math.isnan(pt.value(key)):
            out.append(f"{title}: {fmt_metric(pt, key, '{:,.1f}')}")
    if not pt.served:
        m = pt.record["metrics"]
        out.append(f"not served: completed {m.get('completed')}, failed {m.get('failed')}"
                   + (f", {m['error']}" if m.get("error") else ""))
    return out


# ---- distributions --------------------------------------------------------------------------

_RECORD_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


def read_records(paths: Sequence[Path]) -> list[RequestRecord]:
    """The successful requests of per-request JSONL files (``--request-file``), pooled."""
    out = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    rec = RequestRecord(**{k: v for k, v in d.items() if k in _RECORD_FIELDS})
                    if rec.success:
                        out.append(rec)
    return out


def record_values(recs: Sequence[RequestRecord], metric: str) -> list[float]:
    """A latency of every request in ms, defined as the result's summary defines it
    (:class:`hlserve.driver.records.RequestRecord`)."""
    if metric == "itl":
        return [1e3 * g for r in recs for g in r.itls]
    vals = (getattr(r, metric) for r in recs)
    return [1e3 * v for v in vals if v is not None]


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """The quantiles a distribution row draws (numpy's linear interpolation, as the result's
    own percentiles), the mean and the count."""
    a = np.asarray(values, dtype=float)
    out = {f"p{q}": float(np.percentile(a, q)) for q in QUANTILES}
    out.update(mean=float(a.mean()), n=float(a.size))
    return out


def stored_percentiles(metrics: Mapping[str, Any], metric: str) -> dict[str, float]:
    """The percentiles a result stored for ``metric`` (``median_ttft_ms``, ``p99_ttft_ms``...),
    named as :func:`quantiles` names them."""
    out = {}
    for key, v in metrics.items():
        stat, _, rest = key.partition("_")
        if rest != f"{metric}_ms" or v is None or isinstance(v, list | dict | str):
            continue
        if stat == "median":
            out["p50"] = float(v)
        elif stat == "mean" or (stat.startswith("p") and stat[1:].isdigit()):
            out[stat] = float(v)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def distribution(pt: Pt, metric: str, recs: Sequence[RequestRecord] | None) -> Dist | None:
    """One point's distribution of ``metric``: from its records where it has them, else from
    its stored percentiles; None where it has neither."""
    if recs:
        vals = record_values(recs, metric)
        if vals:
            return Dist(pt.label, quantiles(vals), "requests")
    stats = stored_percentiles(pt.record["metrics"], metric)
    if any(k != "mean" for k in stats):
        return Dist(pt.label, stats, "percentiles")
    return None


def dist_groups(group: str, points: Sequence[Pt],
                records: Mapping[str, Sequence[RequestRecord]]) -> list[DistGroup]:
    """A chart per latency for the points of one group (a latency no point has is left out)."""
    out = []
    for metric, title in DIST_METRICS:
        rows = [d for p in points if (d := distribution(p, metric, records.get(p.label)))]
        if rows:
            out.append(DistGroup(group, metric, title, tuple(rows)))
    return out
