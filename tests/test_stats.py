"""Interval arithmetic (hlserve.driver.stats) against scipy on known samples, the t quantile's
fallback (for an install without scipy) against scipy's, and the repeat driver's interleaved
order (hlserve.driver.repeats)."""

from __future__ import annotations

import math

import pytest

from hlserve.driver import stats
from hlserve.driver.repeats import RepeatPlan, aggregate, run_repeats, schedule
from hlserve.driver.stats import (
    fmt_ci,
    mean_ci,
    ratio_ci,
    ratio_verdict,
    t_cdf,
    t_critical,
    t_ppf,
    t_ppf_fallback,
)

scipy_stats = pytest.importorskip("scipy.stats")

SAMPLES = [
    [1012.0, 998.5, 1030.2],
    [3.1, 2.9, 3.4, 3.0, 2.7, 3.3],
    [50.0, 51.0],
    [0.12, 0.5, 0.33, 0.41, 0.29, 0.38, 0.22, 0.47, 0.31, 0.36],
]


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 19, 29, 100, 2.5])
def test_t_quantile_fallback_and_cdf_match_scipy(df: float) -> None:
    for p in (0.5, 0.6, 0.9, 0.95, 0.975, 0.995, 0.025, 0.001):
        assert t_ppf(p, df) == float(scipy_stats.t.ppf(p, df))  # scipy's, where installed
        assert t_ppf_fallback(p, df) == pytest.approx(t_ppf(p, df), rel=1e-9, abs=1e-9)
    for t in (-7.0, -2.0, -0.3, 0.0, 0.8, 2.5, 12.0):
        assert t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("xs", SAMPLES)
def test_mean_interval_matches_scipy(xs: list[float]) -> None:
    m, ci = mean_ci(xs)
    lo, hi = scipy_stats.t.interval(0.95, len(xs) - 1, loc=scipy_stats.tmean(xs),
                                    scale=scipy_stats.sem(xs))
    assert m == pytest.approx(sum(xs) / len(xs))
    assert ci == pytest.approx((lo, hi), rel=1e-9)
    assert t_critical(len(xs)) == pytest.approx(scipy_stats.t.ppf(0.975, len(xs) - 1))


def test_without_scipy_the_intervals_come_from_the_fallback(monkeypatch) -> None:
    with_scipy = [mean_ci(xs)[1] for xs in SAMPLES]
    monkeypatch.setattr(stats, "_scipy_t", lambda: None)
    assert t_ppf(0.975, 4) == t_ppf_fallback(0.975, 4) != float(scipy_stats.t.ppf(0.975, 4))
    without = [mean_ci(xs)[1] for xs in SAMPLES]
    for a, b in zip(with_scipy, without, strict=True):
        assert a == pytest.approx(b, rel=1e-9)


def test_one_value_has_no_interval() -> None:
    assert mean_ci([3.0]) == (3.0, None)
    assert ratio_ci([2.0], [3.0]) == (1.5, None)
    assert fmt_ci(3.0, None) == "3"
    assert "n=1, no interval" in ratio_verdict([2.0], [3.0]).text()
    assert ratio_verdict([2.0], [3.0]).within_noise is None


def test_paired_difference_matches_scipy_paired_t() -> None:
    a, b = SAMPLES[1], [x + 0.2 + 0.05 * (i % 3) for i, x in enumerate(SAMPLES[1])]
    d = [y - x for x, y in zip(a, b, strict=True)]
    m, (lo, hi) = mean_ci(d)
    res = scipy_stats.ttest_rel(b, a)
    ci = res.confidence_interval(0.95)
    assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-9)
    assert m == pytest.approx(sum(d) / len(d))


@pytest.mark.parametrize("seed", range(4))
def test_fieller_ratio_ends_are_where_the_paired_t_test_is_at_5_percent(seed: int) -> None:
    """The paired Fieller interval is the set of R whose differences B - R*A a one-sample t test
    cannot reject at 5%: at each end, scipy's p value is exactly 0.05."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.normal(100, 6, 5 + seed)
    b = 1.1 * a + rng.normal(0, 4, len(a))
    r, (lo, hi) = ratio_ci(list(a), list(b))
    assert r == pytest.approx(b.mean() / a.mean())
    assert lo < r < hi
    for end in (lo, hi):
        assert scipy_stats.ttest_1samp(b - end * a, 0.0).pvalue == pytest.approx(0.05, rel=1e-6)
    inside = scipy_stats.ttest_1samp(b - r * a, 0.0).pvalue
    assert inside > 0.05


def test_ratio_contains_one_exactly_when_the_difference_contains_zero() -> None:
    a = [100.0, 104.0, 97.0, 101.0]
    for shift in (-8.0, -2.0, 0.5, 3.0, 9.0):
        b = [x + shift + (1.5 if i % 2 else -1.5) for i, x in enumerate(a)]
        v = ratio_verdict(a, b)
        _, (dlo, dhi) = mean_ci([y - x for x, y in zip(a, b, strict=True)])
        assert v.within_noise == (dlo <= 0 <= dhi)
        assert v.text().endswith("within noise") == v.within_noise


def test_unbounded_ratio_gives_no_interval() -> None:
    r, ci = ratio_ci([1.0, -1.0, 0.5], [2.0, 2.1, 1.9])  # the denominator's mean is ~0
    assert ci is None and math.isfinite(r)


def test_format() -> None:
    assert fmt_ci(1234.4, (1200.0, 1268.8)) == "1234 ± 34"
    assert fmt_ci(0.5, (0.25, 0.75), "{:.2f}") == "0.50 ± 0.25"
    assert fmt_ci(None, None) == "—"


# ---- the repeat driver ---------------------------------------------------------------------


def test_schedule_interleaves_abba_with_warmup_first_and_a_seed_per_repeat() -> None:
    runs = schedule({"A": 1, "B": 2}, RepeatPlan(repeats=3, base_seed=10, warmup=1))
    assert [(r.name, r.repeat, r.seed) for r in runs] == [
        ("A", -1, 13), ("A", 0, 10), ("B", 0, 10), ("B", 1, 11), ("A", 1, 11),
        ("A", 2, 12), ("B", 2, 12)]
    assert runs[0].warmup and not any(r.warmup for r in runs[1:])
    three = schedule({"A": 1, "B": 2, "C": 3}, RepeatPlan(repeats=2, warmup=0))
    assert [r.name for r in three] == ["A", "B", "C", "C", "B", "A"]


def test_abba_cancels_a_linear_drift_that_abab_does_not() -> None:
    """Two identical configurations on a machine that slows by 1% a run: mirrored, the pairs'
    mean ratio is 1 over any even number of repeats; A B A B would read B 1% slow."""
    runs = schedule({"A": 0, "B": 0}, RepeatPlan(repeats=4, warmup=0))
    speed = {id(r): 100.0 * (1 - 0.01 * t) for t, r in enumerate(runs)}
    a = [speed[id(r)] for r in runs if r.name == "A"]
    b = [speed[id(r)] for r in runs if r.name == "B"]
    assert sum(b) / sum(a) == pytest.approx(1.0, abs=1e-3)


def test_run_repeats_calls_in_order_and_excludes_the_warmup() -> None:
    calls: list[tuple[str, int]] = []

    def run(cfg: str, seed: int) -> dict:
        calls.append((cfg, seed))
        # the warm-up is an outlier: were it counted, the means below would move
        tput = 1e6 if len(calls) == 1 else {"A": 100.0, "B": 120.0}[cfg] + seed
        return {"total_token_throughput": tput, "output_throughput": tput / 10, "label": cfg,
                "completed": 6, "ok": True}

    res = run_repeats({"A": "A", "B": "B"}, run, RepeatPlan(repeats=3, base_seed=0, warmup=1))
    assert calls == [("A", 3), ("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2)]
    a, b = res["configs"]["A"], res["configs"]["B"]
    assert a["total_token_throughput"] == pytest.approx(101.0)
    assert a["repeat_values"]["total_token_throughput"] == [100.0, 101.0, 102.0]
    assert a["total_token_throughput_ci95"] == pytest.approx(
        list(scipy_stats.t.interval(0.95, 2, loc=101.0, scale=scipy_stats.sem([100, 101, 102]))))
    assert a["seeds"] == [0, 1, 2] and a["repeats"] == 3
    assert a["label"] == "A" and a["ok"] is True and "ok_ci95" not in a
    assert b["total_token_throughput"] == pytest.approx(121.0)
    ratio = res["ratios"]["B"]["total_token_throughput"]
    assert ratio["ratio"] == pytest.approx(121.0 / 101.0)
    assert ratio["within_noise"] is False and ratio["ci95"][0] > 1
    assert res["order"][0] == ["A", -1, 3]


def test_a_failing_repeat_is_reported_and_the_rest_kept() -> None:
    def run(cfg: str, seed: int) -> dict:
        if cfg == "B" and seed == 1:
            raise RuntimeError("boom")
        return {"total_token_throughput": 100.0 + seed}

    res = run_repeats({"A": "A", "B": "B"}, run, RepeatPlan(repeats=3, warmup=0))
    assert res["configs"]["B"]["repeats"] == 2 and res["configs"]["B"]["seeds"] == [0, 2]
    assert "boom" in res["errors"]["B"][0] and "seed 1" in res["errors"]["B"][0]
    assert res["ratios"]["B"]["total_token_throughput"]["n"] == 2  # pairs where both ran


def test_aggregate_of_one_repeat_keeps_the_values_and_gives_no_interval() -> None:
    out = aggregate([{"x": 3, "name": "a"}], [0])
    assert out["x"] == 3 and isinstance(out["x"], int) and out["x_ci95"] is None
    assert out["repeats"] == 1


def test_aggregate_averages_a_later_metric_over_the_repeats_that_have_it() -> None:
    # a study point's seed 0 stored before ITL was recorded, seeds 1 and 2 with it
    out = aggregate([{"x": 1.0}, {"x": 3.0, "itl": 10.0}, {"x": 5.0, "itl": 20.0}], [0, 1, 2])
    assert out["x"] == 3.0 and out["itl"] == 15.0
    assert out["repeat_values"]["itl"] == [None, 10.0, 20.0]
    lo, hi = out["itl_ci95"]
    assert lo < 15.0 < hi
