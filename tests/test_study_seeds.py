"""The study over seeds: taxes per seed with a t interval, paired gains, common points only."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats as sps

from hlserve.study.seeds import load_by_seed, report, summarize_seeds, tax_over_seeds


def rec(seed: int, system: str, knob: int | None, tput: float, ttft: float, tpot: float,
        sessions: int = 16) -> dict:
    label = system if knob is None else f"{system} C={knob}"
    return {"point": {"system": system, "knob": knob, "context": 32768, "sessions": sessions},
            "label": label, "spec": {"seed": seed},
            "metrics": {"completed": 40, "window_token_throughput": tput, "p99_ttft_ms": ttft,
                        "p99_tpot_ms": tpot, "p99_itl_ms": 10 * tpot,
                        "p99_longest_stall_ms": 20 * tpot}}


def write(tmp_path, recs: list[dict]) -> None:
    (tmp_path / "points").mkdir(exist_ok=True)
    for i, r in enumerate(recs):
        (tmp_path / "points" / f"p{i}.json").write_text(json.dumps(r))


def test_tax_per_seed_with_a_t_interval(tmp_path) -> None:
    # throughput mode is fastest but misses the SLO; sglang meets it at a seed-varying cost
    fast = [100.0, 104.0, 98.0]
    meets = [80.0, 78.0, 83.0]
    recs = []
    for s in range(3):
        recs += [rec(s, "hlserve", None, fast[s], 5000, 300),
                 rec(s, "sglang", 8192, meets[s], 1500, 80)]
    recs.append(rec(1, "vllm", 8192, 500.0, 100, 10))  # one seed only: left out
    write(tmp_path, recs)
    by = load_by_seed(tmp_path)
    assert list(by) == [0, 1, 2] and all(len(v) == 2 for v in by.values())
    tax = tax_over_seeds(by, 32768, (2000.0, 100.0))
    per_seed = [1 - m / f for m, f in zip(meets, fast, strict=True)]
    assert tax.values == pytest.approx(per_seed)
    lo, hi = sps.t.interval(0.95, 2, loc=sum(per_seed) / 3, scale=sps.sem(per_seed))
    assert tax.mean == pytest.approx(sum(per_seed) / 3)
    assert tax.ci == pytest.approx((lo, hi))
    # nothing meets a strict SLO in any seed: the tax is 1 in each
    strict = tax_over_seeds(by, 32768, (1000.0, 50.0))
    assert strict.values == (1.0, 1.0, 1.0) and strict.ci == pytest.approx((1.0, 1.0))

    # the same SLO on ITL p99 (10x TPOT here): sglang's 800 ms gaps miss it in every seed
    itl = tax_over_seeds(by, 32768, (2000.0, 100.0), tpot_key="p99_itl_ms")
    assert itl.values == (1.0, 1.0, 1.0)
    s = summarize_seeds(by)
    (prod,) = [t for t in s["taxes"] if t["tpot_p99_ms"] == 100.0]
    assert prod["tax_itl"]["mean"] == 1.0 and prod["tax"]["mean"] == pytest.approx(tax.mean)
    assert prod["best_meeting_points"] == ["sglang C=8192 @ 16"] * 3
    (gain,) = [c for c in s["components"] if c["against"] == "vs sglang C=8192"]
    assert gain["ratio"] == pytest.approx(sum(fast) / sum(meets))
    assert gain["within_noise"] is False and gain["ci95"][0] > 1
    (p,) = [p for p in s["points"] if p["label"] == "sglang C=8192"]
    assert p["meets_production"] == 3 and p["p99_itl_ms"]["mean"] == pytest.approx(800.0)
    paths = report(tmp_path)
    text = (tmp_path / "seeds.md").read_text()
    assert [x.name for x in paths] == ["seeds.json", "seeds.md"]
    assert f"{100 * tax.mean:.1f} ± {100 * (tax.ci[1] - tax.mean):.1f}%" in text


def test_one_seed_gives_no_seed_report_and_no_interval(tmp_path) -> None:
    write(tmp_path, [rec(0, "hlserve", None, 100.0, 5000, 300)])
    assert report(tmp_path) == []
    tax = tax_over_seeds(load_by_seed(tmp_path), 32768, (2000.0, 100.0))
    assert tax.ci is None and tax.mean == 1.0
    assert not math.isnan(tax.mean)


def test_a_seed_without_the_metric_does_not_count_as_a_full_tax(tmp_path) -> None:
    recs = []
    for s in range(3):
        recs += [rec(s, "hlserve", None, 100.0, 500, 90), rec(s, "sglang", 8192, 80.0, 500, 5)]
    for r in recs[:2]:  # seed 0 stored before ITL was recorded
        del r["metrics"]["p99_itl_ms"]
    write(tmp_path, recs)
    itl = tax_over_seeds(load_by_seed(tmp_path), 32768, (2000.0, 100.0), tpot_key="p99_itl_ms")
    # seeds 1 and 2: hlserve's gaps (900 ms) miss, sglang's (50 ms) meet: 20% each
    assert math.isnan(itl.values[0]) and itl.values[1:] == pytest.approx((0.2, 0.2))
    assert itl.mean == pytest.approx(0.2)
    assert 0.0 <= itl.ci[0] <= itl.ci[1] <= 1.0
