"""``hlserve demo`` tells the truth: it claims a difference only where the interval supports one,
runs both modes interleaved on the real tiny model, and reports the simulated 32K tax."""

from __future__ import annotations

from pathlib import Path

from hlserve.bench.demo import DemoSpec, local_verdict, run_demo, sim_tax, sim_verdict
from hlserve.driver.repeats import ratios


def _res(a: list[float], b: list[float]) -> dict:
    reps = {"slo (vllm)": [{"total_token_throughput": x} for x in a],
            "throughput": [{"total_token_throughput": x} for x in b]}
    return {"ratios": ratios(reps, "slo (vllm)", ("total_token_throughput",))}


def test_verdict_says_no_difference_when_the_interval_contains_it() -> None:
    text = local_verdict(_res([100, 130, 90, 120], [110, 115, 100, 118]))
    assert "within noise" in text and "shows no difference" in text
    assert "tax" not in text


def test_verdict_claims_a_difference_only_when_the_interval_excludes_zero() -> None:
    text = local_verdict(_res([100, 102, 99, 101], [120, 123, 118, 121]))
    assert "within noise" not in text and "serves more" in text and "excludes 0" in text


def test_verdict_with_one_repeat_makes_no_claim() -> None:
    text = local_verdict(_res([100], [150]))
    assert "no interval" in text and "no claim" in text and "serves" not in text


def test_sim_tax_picks_the_best_meeting_the_slo_and_gives_its_interval() -> None:
    def cfg(thr: list[float], ttft: float, tpot: float) -> dict:
        return {"repeats": len(thr), "completed": 40.0, "window_token_throughput": sum(thr) / len(thr),
                "p99_ttft_ms": ttft, "p99_tpot_ms": tpot,
                "repeat_values": {"window_token_throughput": thr}}

    configs = {"16": cfg([32000, 31500, 32500], 1500, 70),
               "64": cfg([37000, 36800, 37900], 1700, 200)}
    t = sim_tax(configs, (2000.0, 100.0))
    assert t["best"] == "16" and t["top"] == "64"
    assert abs(t["tax"] - (1 - 32000 / 37233.33)) < 1e-3
    lo, hi = t["ci95"]
    assert 0 < lo < t["tax"] < hi
    assert "16" in sim_verdict({"tax": t})


def test_demo_runs_both_modes_interleaved_on_the_real_model(tiny_llama: Path) -> None:
    spec = DemoSpec(model=str(tiny_llama), sessions=2, rounds=1, system_prompt_len=32,
                    repeats=2, sim=False)
    lines: list[str] = []
    out = run_demo(spec, {"dtype": "float32", "max_model_len": 512, "num_pages": 64},
                   log=lines.append)
    local = out["local"]
    assert local["order"] == [["slo (vllm)", -1, 2], ["slo (vllm)", 0, 0], ["throughput", 0, 0],
                              ["throughput", 1, 1], ["slo (vllm)", 1, 1]]  # A B B A
    for s in local["configs"].values():
        assert s["repeats"] == 2 and s["total_token_throughput_ci95"] is not None
    assert any("throughput mode against SLO mode" in line for line in lines)
