"""The one point format of ``hlserve sweep`` and ``hlserve study``, and the one SLO check and
human tax over such points.

A point is one configuration's run: a dict with its ``label`` and its ``metrics``, the summary
keyed as :func:`hlserve.driver.records.summarize` keys it (vLLM's ``bench serve`` names where
vLLM has the quantity: ``completed``, ``failed``, ``total_token_throughput``, ``p99_ttft_ms``,
``p99_tpot_ms``, ``p99_itl_ms``...), plus what its driver adds (the study's window
throughput; the sweep's ``knobs``, the study's ``point`` beside ``metrics``).

Missing values, one rule for both. A metric that is absent, None (a statistic of no values in
the JSON) or NaN is missing, and :func:`value` reads it as NaN:

- a point whose latency is missing does not meet a target on that latency. Nothing measured
  shows that it meets it, and NaN compares false with every target, an infinite one included
  (an inf, "infinitely slow", would meet an infinite target by accident); a target of None
  is no target, which every served point meets;
- a point that served nothing (no completed request) or dropped work (a failed request)
  meets no target and is not the best point of all either: it did not run the workload the
  others ran, so its throughput and latencies are not comparable with theirs;
- a tax that cannot be computed (no served point with a positive throughput) is NaN, printed
  as a dash: 1 would claim that the SLO cost all of a throughput that was never measured, 0
  that it cost none, and a missing value must not read as either. A tax of 1 is kept for what
  it says: some point has a throughput and none meets the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Point = dict[str, Any]


def value(point: Point, key: str) -> float:
    """The point's metric ``key``; NaN when it is missing (absent, None or NaN)."""
    v = point["metrics"].get(key)
    return math.nan if v is None else float(v)


def throughput(point: Point, metric: str) -> float:
    """The point's throughput ``metric`` for ranking points: 0 when it has none (a point with
    no throughput is beaten by every point that has one)."""
    v = value(point, metric)
    return 0.0 if math.isnan(v) else v


def served(point: Point) -> bool:
    """Whether the point completed requests and failed none (module docstring)."""
    failed = point["metrics"].get("failed") or 0
    return value(point, "completed") > 0 and not failed > 0


def meets_slo(point: Point, ttft_ms: float | None, tpot_ms: float | None,
              tpot_key: str = "p99_tpot_ms") -> bool:
    """Whether a served point has p99 TTFT <= ``ttft_ms`` and ``tpot_key`` <= ``tpot_ms``
    (None: no target on it); a missing latency meets no target (module docstring).
    ``tpot_key`` puts another per-token latency in TPOT's place (``p99_itl_ms``)."""
    if not served(point):
        return False
    if ttft_ms is not None and not value(point, "p99_ttft_ms") <= ttft_ms:
        return False
    return tpot_ms is None or value(point, tpot_key) <= tpot_ms


def human_tax(points: Sequence[Point], ttft_ms: float | None, tpot_ms: float | None,
              metric: str, tpot_key: str = "p99_tpot_ms",
              allowed: Callable[[Point], bool] | None = None,
              ) -> tuple[float, Point | None, Point | None]:
    """(tax, best point meeting the target, best point of all) among the served points, by
    ``metric``: tax = 1 − best meeting / best of all; 1 when nothing meets the target; NaN
    when no served point has a positive throughput. ``allowed`` restricts the points that may
    meet it (one system's own configurations), not the best of all."""
    ok = [p for p in points if served(p)]
    top = max(ok, key=lambda p: throughput(p, metric), default=None)
    best = max((p for p in ok if meets_slo(p, ttft_ms, tpot_ms, tpot_key)
                and (allowed is None or allowed(p))),
               key=lambda p: throughput(p, metric), default=None)
    if top is None or not throughput(top, metric) > 0:
        return math.nan, best, top
    met = throughput(best, metric) if best is not None else 0.0
    return 1.0 - met / throughput(top, metric), best, top


def slug(label: str) -> str:
    """A point's label as a file name (a sweep's ``points/<slug>.json``)."""
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)
