"""The study over workload seeds: the human tax, the components and the latency of each point
as a mean with a 95% interval over seeds, so that a feasibility edge or a one-point delta is
told from noise.

Each seed is a whole study on its own workload (``hlserve study --repeats N`` or ``--seed S``):
the tax is computed per seed, exactly as for one seed (:func:`~hlserve.study.core.human_tax`),
and the seeds' taxes give the mean and a t interval; a gain of throughput mode over a
configuration is the paired ratio over seeds with its Fieller interval (hlserve.driver.stats). Only
points stored under every seed take part, so each seed's tax is over the same configurations.
``report`` writes ``seeds.md`` and ``seeds.json`` beside the study's other files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlserve.driver.points import meets_slo
from hlserve.driver.stats import RatioVerdict, clean, fmt_ci, mean_ci, ratio_verdict
from hlserve.study.core import METRIC, PRODUCTION_SLO, STRICT_SLO, human_tax, throughput

Rec = dict[str, Any]
PointKey = tuple[int, int, str, int | None]  # context, sessions, system, knob

# the latencies shown per point: the SLO's quantities and what a mean TPOT hides
LATENCIES = ("p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_longest_stall_ms")


def key(r: Rec) -> PointKey:
    p = r["point"]
    return p["context"], p["sessions"], p["system"], p["knob"]


def load_by_seed(out: Path) -> dict[int, list[Rec]]:
    """The stored records of ``out/points``, by workload seed, keeping only the points that
    every seed has (a seed's run still under way does not bias the others)."""
    by: dict[int, dict[PointKey, Rec]] = {}
    for path in sorted((Path(out) / "points").glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        by.setdefault(int(r.get("spec", {}).get("seed", 0)), {})[key(r)] = r
    if not by:
        return {}
    common = set.intersection(*(set(d) for d in by.values()))
    return {s: [d[k] for k in sorted(common, key=str)] for s, d in sorted(by.items())}


@dataclass(frozen=True)
class Interval:
    """A mean over seeds, its 95% t interval (None for one seed) and the per-seed values."""

    mean: float
    ci: tuple[float, float] | None
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float], bounds: tuple[float, float] | None = None) -> Interval:
        """Mean and t interval of the finite ``values`` (a NaN: that seed has no value);
        ``bounds`` clips the interval to what the quantity can be (a tax is in [0, 1])."""
        vs = tuple(values)
        m, ci = mean_ci(clean(vs))
        if ci is not None and bounds is not None:
            ci = (max(bounds[0], ci[0]), min(bounds[1], ci[1]))
        return cls(m, ci, vs)

    def pct(self) -> str:
        return fmt_ci(100 * self.mean, None if self.ci is None else
                      (100 * self.ci[0], 100 * self.ci[1]), "{:.1f}") + "%"

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "ci95": None if self.ci is None else list(self.ci),
                "values": list(self.values)}


def _at(recs: list[Rec], ctx: int, sessions: int | None) -> list[Rec]:
    return [r for r in recs if r["point"]["context"] == ctx
            and (sessions is None or r["point"]["sessions"] == sessions)]


def tax_over_seeds(by_seed: dict[int, list[Rec]], ctx: int, slo: tuple[float, float],
                   sessions: int | None = None, tpot_key: str = "p99_tpot_ms",
                   metric: str = METRIC) -> Interval:
    """The tax at ``slo`` per seed (concurrency free when ``sessions`` is None); ``tpot_key``
    ``p99_itl_ms`` holds the stream's gaps, not its mean pace, to the per-token target;
    ``metric`` is the throughput ranked (``COMPUTED_METRIC`` needs ``with_computed`` points)."""
    def tax(recs: list[Rec]) -> float:
        if not any(r["metrics"].get(tpot_key) is not None for r in recs):
            return math.nan  # a seed stored before the metric was recorded: not a 100% tax
        return human_tax(recs, *slo, tpot_key=tpot_key, metric=metric)[0]

    return Interval.of((tax(_at(recs, ctx, sessions)) for recs in by_seed.values()), (0.0, 1.0))


def best_over_seeds(by_seed: dict[int, list[Rec]], ctx: int, slo: tuple[float, float] | None,
                    sessions: int | None = None) -> tuple[Interval, list[str]]:
    """The best throughput (tok/s) meeting ``slo`` (or of all points, ``slo`` None) per seed,
    and which point it was in each seed ("none" where nothing met it)."""
    vals, who = [], []
    for recs in by_seed.values():
        _, met, top = human_tax(_at(recs, ctx, sessions), *(slo or (float("inf"),) * 2))
        best = top if slo is None else met
        vals.append(throughput(best) if best is not None else 0.0)
        who.append("none" if best is None else
                   f"{best['label']} @ {best['point']['sessions']}")
    return Interval.of(vals), who


def gain_over_seeds(by_seed: dict[int, list[Rec]], ours: PointKey, base: PointKey,
                    ) -> RatioVerdict | None:
    """Throughput of ``ours`` against ``base``, paired by seed (None if either is missing)."""
    a, b = [], []
    for recs in by_seed.values():
        by = {key(r): r for r in recs}
        if ours not in by or base not in by:
            return None
        a.append(throughput(by[base]))
        b.append(throughput(by[ours]))
    return ratio_verdict(a, b)


def meets_in(by_seed: dict[int, list[Rec]], point: PointKey, slo: tuple[float, float]) -> int:
    """In how many seeds ``point`` meets ``slo``."""
    return sum(meets_slo(r, *slo) for recs in by_seed.values() for r in recs if key(r) == point)


def point_intervals(by_seed: dict[int, list[Rec]], point: PointKey,
                    metrics: Iterable[str] = ("window_token_throughput", *LATENCIES),
                    ) -> dict[str, Interval]:
    out = {}
    for m in metrics:
        vals = []
        for recs in by_seed.values():
            r = next(r for r in recs if key(r) == point)
            v = r["metrics"].get(m)
            vals.append(float("nan") if v is None else float(v))
        out[m] = Interval.of(vals)
    return out


# ---- the report -----------------------------------------------------------------------------------

COMPONENT_BASES: tuple[tuple[str, str, int | None], ...] = (
    ("vs two-stage off: always mix", "hlserve-mix_always", None),
    ("vs two-stage off: prefill-first", "hlserve-prefill_first", None),
    ("vs sglang C=8192", "sglang", 8192),
    ("vs sarathi C=B=8192", "sarathi", 8192),
    ("vs vllm B=8192", "vllm", 8192),
)


def summarize_seeds(by_seed: dict[int, list[Rec]],
                    slos: tuple[tuple[float, float], ...] = (PRODUCTION_SLO, STRICT_SLO),
                    ) -> dict[str, Any]:
    recs = next(iter(by_seed.values()), [])
    contexts = sorted({r["point"]["context"] for r in recs})
    cells = sorted({(r["point"]["context"], r["point"]["sessions"]) for r in recs})
    out: dict[str, Any] = {"seeds": list(by_seed), "points_per_seed": len(recs), "taxes": [],
                           "components": [], "points": []}
    for ctx in contexts:
        for slo in slos:
            tax = tax_over_seeds(by_seed, ctx, slo)
            met, who_met = best_over_seeds(by_seed, ctx, slo)
            top, who_top = best_over_seeds(by_seed, ctx, None)
            itl = tax_over_seeds(by_seed, ctx, slo, tpot_key="p99_itl_ms")
            out["taxes"].append({"context": ctx, "ttft_p99_ms": slo[0], "tpot_p99_ms": slo[1],
                                 "tax": tax.to_json(), "best_meeting": met.to_json(),
                                 "best_meeting_points": who_met, "best": top.to_json(),
                                 "best_points": who_top, "tax_itl": itl.to_json()})
    for ctx, n in cells:
        for name, system, knob in COMPONENT_BASES:
            v = gain_over_seeds(by_seed, (ctx, n, "hlserve", None), (ctx, n, system, knob))
            if v is not None:
                out["components"].append({"context": ctx, "sessions": n, "against": name,
                                          "ratio": v.ratio, "ci95": v.ci,
                                          "within_noise": v.within_noise, "text": v.text()})
    for r in sorted(recs, key=lambda r: (key(r)[0], key(r)[1], -throughput(r))):
        k = key(r)
        ivs = point_intervals(by_seed, k)
        out["points"].append({"context": k[0], "sessions": k[1], "label": r["label"],
                              "meets_production": meets_in(by_seed, k, PRODUCTION_SLO),
                              **{m: iv.to_json() for m, iv in ivs.items()}})
    return out


def markdown(s: dict[str, Any]) -> str:
    n = len(s["seeds"])
    lines = [f"# The study over {n} workload seeds ({', '.join(map(str, s['seeds']))})", "",
             f"{s['points_per_seed']} points under every seed. Mean ± half-width of the 95% "
             "t interval over seeds; a tax whose interval holds 0, or a gain whose interval "
             "holds 1, is no difference.", "",
             "## Human tax, concurrency chosen freely", "",
             "| context | SLO (TTFT p99 / TPOT p99) | tax | best meeting it (tok/s) | best (tok/s) |"
             " best meeting it, per seed | tax with ITL p99 in TPOT's place |",
             "|---|---|---|---|---|---|---|"]
    for t in s["taxes"]:
        tax = Interval(t["tax"]["mean"], _ci(t["tax"]), tuple(t["tax"]["values"]))
        met = Interval(t["best_meeting"]["mean"], _ci(t["best_meeting"]), ())
        top = Interval(t["best"]["mean"], _ci(t["best"]), ())
        lines.append(f"| {t['context']} | {t['ttft_p99_ms']:.0f} ms / {t['tpot_p99_ms']:.0f} ms | "
                     f"{tax.pct()} | {fmt_ci(met.mean, met.ci)} | {fmt_ci(top.mean, top.ci)} | "
                     f"{'; '.join(t['best_meeting_points'])} | "
                     f"{Interval(t['tax_itl']['mean'], _ci(t['tax_itl']), ()).pct()} |")
    lines += ["", "## Throughput mode against other configurations (paired by seed)", "",
              "| context | sessions | against | gain of throughput mode |", "|---|---|---|---|"]
    for c in s["components"]:
        lines.append(f"| {c['context']} | {c['sessions']} | {c['against']} | {c['text']} |")
    lines += ["", "## Every point", "",
              "| context | sessions | config | tokens/s | TTFT p99 (ms) | TPOT p99 (ms) | "
              "ITL p99 (ms) | longest stall p99 (ms) | meets 2 s / 100 ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in s["points"]:
        cols = [fmt_ci(p[m]["mean"], _ci(p[m])) for m in ("window_token_throughput", *LATENCIES)]
        lines.append(f"| {p['context']} | {p['sessions']} | {p['label']} | " + " | ".join(cols)
                     + f" | {p['meets_production']} of {n} |")
    return "\n".join(lines) + "\n"


def _ci(d: dict[str, Any]) -> tuple[float, float] | None:
    ci = d.get("ci95")
    return None if ci is None else (ci[0], ci[1])


def report(out: Path) -> list[Path]:
    """``seeds.json`` and ``seeds.md`` in ``out`` when its points have two seeds or more."""
    by_seed = load_by_seed(out)
    if len(by_seed) < 2:
        return []
    s = summarize_seeds(by_seed)
    js, md = Path(out) / "seeds.json", Path(out) / "seeds.md"
    js.write_text(json.dumps(s, indent=1))
    md.write_text(markdown(s))
    return [js, md]
