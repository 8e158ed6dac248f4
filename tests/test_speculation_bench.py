"""benchmarks/speculation.py runs whole at tiny sizes on the tiny Llama (a smoke run, no
timed assertion): both workloads, every arm, interleaved A B B A, the metrics, ratios with
intervals, the acceptance profile and identical greedy outputs across arms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlserve.sim.acceptance_profile import AcceptanceProfile
from support import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    return load_benchmark("speculation")


def test_the_benchmark_runs_at_tiny_sizes(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    bench = _bench()
    out = tmp_path / "spec.json"
    res = bench.main(["--model", str(tiny_llama), "--sessions", "1", "2", "--rounds", "2",
                      "--max-tokens", "8", "--fixed-k", "--engine-args",
                      "--dtype float32 --num-pages 256", "--no-progress", "--out", str(out)])
    assert json.loads(out.read_text())["points"] == json.loads(json.dumps(res["points"]))
    points = res["points"]
    assert [(p["workload"], p["sessions"]) for p in points] == [
        ("agent", 1), ("agent", 2), ("coding", 1), ("coding", 2)]
    for p in points:
        assert not p["errors"] and set(p["configs"]) == {"off", "spec", "spec-fixed"}
        # A B C, C B A: each arm twice, repeat i of every arm on seed i
        assert [(name, i) for name, i, _ in p["order"]] == [
            ("off", 0), ("spec", 0), ("spec-fixed", 0), ("spec-fixed", 1), ("spec", 1),
            ("off", 1)]
        assert p["same_outputs"] is True  # greedy: speculation changes no token
        off, spec = p["configs"]["off"], p["configs"]["spec"]
        assert off["repeats"] == spec["repeats"] == 2
        assert spec["tokens_per_step_ci95"] is not None and spec["drafts"] > 0
        assert 0 <= spec["acceptance_rate"] <= 1
        assert spec["output_tokens"] == off["output_tokens"]
        assert "adaptive_steps_by_k" in spec and "adaptive_steps_by_k" not in \
            p["configs"]["spec-fixed"]
        ratio = p["ratios"]["spec"]["tokens_per_step"]
        assert ratio["n"] == 2
        assert ratio["ratio"] == pytest.approx(spec["tokens_per_step"] / off["tokens_per_step"])
    for workload in ("agent", "coding"):
        prof = res["acceptance_profile"][workload]["spec"]
        assert len(prof) == 3 and all(0 <= x <= 1 for x in prof)
        # the simulator's form: non-increasing (a prefix is accepted), with the match rate,
        # read back as the simulated study reads it
        sim = AcceptanceProfile.load(out, workload)
        assert list(sim.accept) == sorted(sim.accept, reverse=True)
        assert sim.accept[0] == pytest.approx(prof[0]) and 0 < sim.propose_rate <= 1
    table = capsys.readouterr().out
    assert table.count("| coding |") == 4 and "| tokens/step off |" in table
