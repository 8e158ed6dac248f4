"""Agents per node at SLO tiers: for each named tier (a p99 TTFT and a p99 TPOT target), the
most concurrent sessions a configuration serves while meeting it, its throughput there, and
the tax against the tier ``none`` (no target).

Read from points in the one point format (:mod:`hlserve.driver.points`), where one
configuration (a ``label``) is run at several concurrencies: the study's points carry it as
``point.sessions``, a bench or sweep point as ``metrics.max_concurrency`` (its closed-loop
sessions). Whether a point meets a tier is the one SLO check
(:func:`hlserve.driver.points.meets_slo`: a point that failed a request or served none meets
none, not even ``none``).

Per configuration and tier:

- ``sessions``: the largest concurrency at which the configuration's point meets the tier
  (None: no point of it does). The largest measured one, not the largest below which every
  one meets: a run measured is what it is, and a tier met at 64 but not at 32 is a noisy
  pair, which the table shows rather than hides;
- ``throughput``: the point's throughput there;
- ``tax_vs_none``: 1 − the configuration's best throughput among its points meeting the tier
  / its best throughput among all the points it served (the tier ``none``): the human tax
  of :func:`hlserve.driver.points.human_tax` with the concurrency chosen freely, so that
  never negative where an overloaded concurrency serves less than a lighter one. 1 where no
  point meets the tier; NaN where no point has a throughput.

The tier ``none``'s own row names the most sessions served at all, the throughput there,
and (``best_throughput``, ``best_sessions``) the best throughput and where it was served,
which every tax of the configuration is taken against.

The node's row (:data:`BEST`) pools every configuration: per tier, the point serving the
most sessions meeting it (the larger throughput breaking a tie), and the tax of the best
point meeting it against the best of all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hlserve.driver.points import Point, human_tax, meets_slo, throughput


@dataclass(frozen=True)
class Tier:
    """A named SLO: p99 TTFT and p99 TPOT targets in ms (None: no target)."""

    name: str
    ttft_ms: float | None
    tpot_ms: float | None

    def describe(self) -> str:
        if self.ttft_ms is None and self.tpot_ms is None:
            return "no target"
        def part(v: float | None, scale: float, unit: str) -> str:
            return "none" if v is None else f"{v / scale:g} {unit}"
        return f"{part(self.ttft_ms, 1e3, 's')} / {part(self.tpot_ms, 1.0, 'ms')}"


# The tiers of Artificial Analysis's kind (an interactive chat, a production agent, a batch
# agent), as p99 targets, then no target at all.
DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier("interactive", 500.0, 50.0),
    Tier("production", 2000.0, 100.0),
    Tier("relaxed", 10000.0, 250.0),
    Tier("none", None, None),
)


BEST = "best of all"  # the node's row: per tier, the configuration serving the most sessions


def parse_tiers(text: str) -> tuple[Tier, ...]:
    """``--slo-tiers name=TTFT_S/TPOT_MS,...`` (seconds and ms, ``none`` for no target); the
    tier ``none`` is added where it is not named, as every tax is taken against it."""
    tiers: list[Tier] = []
    for part in text.split(","):
        if not part.strip():
            continue
        name, eq, rest = part.partition("=")
        ttft, slash, tpot = rest.partition("/")
        if not eq or not slash or not name.strip():
            raise ValueError(f"--slo-tiers takes name=TTFT_S/TPOT_MS, got {part!r}")
        try:
            t = None if ttft.strip().lower() == "none" else 1e3 * float(ttft)
            p = None if tpot.strip().lower() == "none" else float(tpot)
        except ValueError:
            raise ValueError(f"--slo-tiers: not a number in {part!r}") from None
        tiers.append(Tier(name.strip(), t, p))
    if not any(t.ttft_ms is None and t.tpot_ms is None for t in tiers):
        tiers.append(Tier("none", None, None))
    return tuple(tiers)


def sessions_of(point: Point) -> int | None:
    """The point's concurrency: the study's ``point.sessions``, else the bench's
    ``max_concurrency`` (its closed-loop sessions); None when it has neither."""
    n = (point.get("point") or {}).get("sessions")
    if n is None:
        n = point["metrics"].get("max_concurrency")
    return None if n is None else int(n)


def _at_tier(points: Iterable[Point], tier: Tier, metric: str) -> Point | None:
    """The point meeting ``tier`` with the most sessions (the larger throughput on a tie)."""
    ok = [p for p in points if sessions_of(p) is not None and meets_slo(p, tier.ttft_ms,
                                                                       tier.tpot_ms)]
    return max(ok, key=lambda p: (sessions_of(p), throughput(p, metric)), default=None)


def _row(config: str, tier: Tier, pts: Sequence[Point], metric: str) -> dict[str, Any]:
    at = _at_tier(pts, tier, metric)
    tax, _, top = human_tax(pts, tier.ttft_ms, tier.tpot_ms, metric)
    return {"config": config, "tier": tier.name, "ttft_p99_ms": tier.ttft_ms,
            "tpot_p99_ms": tier.tpot_ms, "sessions": sessions_of(at) if at else None,
            "point": at["label"] if at else None,
            "throughput": throughput(at, metric) if at else math.nan,
            "tax_vs_none": tax,
            "best_throughput": throughput(top, metric) if top else math.nan,
            "best_sessions": sessions_of(top) if top else None,
            "best_point": top["label"] if top else None}


def tier_rows(points: Sequence[Point], tiers: Sequence[Tier] = DEFAULT_TIERS,
              metric: str = "total_token_throughput") -> list[dict[str, Any]]:
    """One row per configuration and tier, then the node's (``config`` :data:`BEST`): see the
    module docstring. Points without a concurrency are left out."""
    by_config: dict[str, list[Point]] = {}
    for p in points:
        if sessions_of(p) is not None:
            by_config.setdefault(p["label"], []).append(p)
    rows = [_row(config, t, pts, metric) for config, pts in by_config.items() for t in tiers]
    every = [p for pts in by_config.values() for p in pts]
    return rows + [_row(BEST, t, every, metric) for t in tiers]


def tier_table(rows: Sequence[dict[str, Any]], tiers: Sequence[Tier] = DEFAULT_TIERS,
               unit: str = "tok/s") -> str:
    """Markdown: one line per configuration, per tier its most sessions, the throughput there
    and the tax; under ``none``, where the best throughput (the taxes' base) was served if
    not at the most sessions."""
    head = "| config | " + " | ".join(f"{t.name} ({t.describe()})" for t in tiers) + " |"
    out = [head, "|---|" + "---:|" * len(tiers)]
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        if r["sessions"] is None:
            text = "none meets it"
        else:
            text = f"{r['sessions']} sessions, {r['throughput']:,.0f} {unit}"
            if r["config"] == BEST:
                text += f" ({r['point']})"
            if r["ttft_p99_ms"] is not None or r["tpot_p99_ms"] is not None:
                if not math.isnan(r["tax_vs_none"]):
                    text += f", tax {100 * r['tax_vs_none']:.0f}%"
            elif r["best_sessions"] != r["sessions"]:  # the tax's base, where it is elsewhere
                text += f"; best {r['best_throughput']:,.0f} at {r['best_sessions']}"
                text += f" ({r['best_point']})" if r["config"] == BEST else ""
        cells.setdefault(r["config"], {})[r["tier"]] = text
    for config, by_tier in cells.items():
        name = f"**{config}**" if config == BEST else config
        out.append(f"| {name} | " + " | ".join(by_tier.get(t.name, "—") for t in tiers) + " |")
    return "\n".join(out)
