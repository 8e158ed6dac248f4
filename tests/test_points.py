"""The one point format and SLO check (hlserve.driver.points), as the sweep and the study both
read it: a missing latency meets no target (an infinite one included), a point that served
nothing or failed requests meets none and is not the best, a tax with no throughput is NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hlserve.bench import report
from hlserve.driver.points import human_tax, meets_slo, served
from hlserve.study import core

ROOT = Path(__file__).resolve().parents[1]


def pt(label: str, thr: float | None, ttft: float | None, tpot: float | None,
       completed: int = 5, failed: int = 0, system: str = "vllm") -> dict:
    return {"label": label, "point": {"system": system, "knob": None},
            "metrics": {"completed": completed, "failed": failed,
                        "total_token_throughput": thr, "window_token_throughput": thr,
                        "p99_ttft_ms": ttft, "p99_tpot_ms": tpot}}


def test_a_missing_latency_meets_no_target_not_even_an_infinite_one() -> None:
    p = pt("a", 100.0, 500.0, None)
    assert meets_slo(p, 1000.0, None)  # no target on TPOT
    assert not meets_slo(p, 1000.0, 100.0)
    assert not meets_slo(p, math.inf, math.inf)
    p["metrics"]["p99_tpot_ms"] = math.nan  # NaN reads as missing too
    assert not meets_slo(p, math.inf, math.inf)
    # the study's check is the same function: no second semantics
    assert not core.human_tax([p], math.inf, math.inf)[1]


def test_a_point_that_served_nothing_or_failed_meets_nothing_and_is_not_the_best() -> None:
    good, empty = pt("good", 100.0, 10.0, 1.0), pt("empty", 900.0, 1.0, 1.0, completed=0)
    broken = pt("broken", 900.0, 1.0, 1.0, failed=1)
    assert served(good) and not served(empty) and not served(broken)
    for points in ([good, empty, broken], [broken, empty, good]):
        tax, met, top = human_tax(points, None, None, "total_token_throughput")
        assert met is good and top is good and tax == 0.0


def test_a_tax_with_no_throughput_is_nan_in_the_sweep_and_the_study() -> None:
    zero = [pt("z", 0.0, 10.0, 1.0), pt("n", None, 10.0, 1.0)]
    row = report.tax_rows(zero, [(100.0, 10.0)])[0]
    assert math.isnan(row["human_tax"])
    assert "| 100 | 10 | z | 0 | — |" in report.tax_table([row])
    assert math.isnan(core.human_tax(zero, 100.0, 10.0)[0])
    # nothing meets the target, but there is a throughput: all of it is the tax
    some = [pt("a", 50.0, 900.0, 1.0)]
    assert report.tax_rows(some, [(100.0, 10.0)])[0]["human_tax"] == 1.0
    assert core.human_tax(some, 100.0, 10.0)[0] == 1.0


def test_sweep_and_study_agree_on_the_same_points() -> None:
    pts = [pt("fast", 1000.0, 5000.0, 300.0, system="hlserve"),
           pt("meets", 600.0, 900.0, 40.0, system="sglang"),
           pt("no tpot", 800.0, 900.0, None, system="sarathi")]
    for slo in ((1000.0, 50.0), (6000.0, 400.0), (100.0, 10.0)):
        row = report.tax_rows(pts, [slo])[0]
        tax, met, _ = core.human_tax(pts, *slo)
        assert row["human_tax"] == tax
        assert row["best_config"] == (met["label"] if met else None)


@pytest.mark.parametrize("path", ["docs/sweep/sweep.json", "docs/vllm_tax/sweep.json"])
def test_stored_sweeps_are_in_the_point_format_and_their_taxes_recompute(path: str) -> None:
    stored = json.loads((ROOT / path).read_text())
    assert all("metrics" in p and "result" not in p for p in stored["points"])
    targets = [(r["slo_p99_ttft_ms"], r["slo_p99_tpot_ms"]) for r in stored["tax"]]
    rows = report.tax_rows(stored["points"], targets)
    assert [(r["best_config"], r["human_tax"]) for r in rows] == \
        [(r["best_config"], r["human_tax"]) for r in stored["tax"]]
