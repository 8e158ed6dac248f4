"""``--repeats`` and ``--ray`` on ``hlserve sweep`` (simulated, so seconds): ``*_ci95`` on every
point, the same numbers from Ray tasks as from the local run, and a failing point reported
without losing the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlserve.cli import main

SWEEP = ["sweep", "--sim", "H20", "--tp", "8", "--model", "Qwen2.5-32B",
         "--chunk-sizes", "2048,none", "--repeats", "2", "--sessions", "4", "--rounds", "2",
         "--no-progress"]
VARIES = ("wall_s", "wall_s_ci95", "request_file")  # wall-clock seconds, and paths


def _points(out: Path) -> dict[str, dict]:
    summary = json.loads((out / "sweep.json").read_text())
    return {p["label"]: p["metrics"] for p in summary["points"]}


def _same(res: dict) -> dict:
    out = {k: v for k, v in res.items() if k not in VARIES}
    out["repeat_values"] = {k: v for k, v in out["repeat_values"].items() if k not in VARIES}
    return out


def test_sweep_repeats_write_intervals_and_ray_gives_the_same_numbers(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    assert main([*SWEEP, "--out", str(tmp_path / "local")]) == 0
    local = _points(tmp_path / "local")
    assert list(local) == ["C=2048", "C=none"]
    for res in local.values():
        assert res["repeats"] == 2 and res["seeds"] == [0, 1]
        numeric = [k for k, v in res.items() if isinstance(v, int | float)
                   and not isinstance(v, bool) and not k.endswith("_ci95")
                   and k not in ("repeats",)]
        assert numeric and all(f"{k}_ci95" in res for k in numeric)
        lo, hi = res["total_token_throughput_ci95"]
        assert lo <= res["total_token_throughput"] <= hi and lo < hi  # two seeds differ
        vals = res["repeat_values"]["total_token_throughput"]
        assert res["total_token_throughput"] == pytest.approx(sum(vals) / 2)
        for seed in (0, 1):
            one = json.loads((tmp_path / "local" / "points"
                              / f"{res['label']}.seed{seed}.json").read_text())
            assert one["total_token_throughput"] == vals[seed]
    summary = json.loads((tmp_path / "local" / "sweep.json").read_text())
    assert summary["order"] == [["C=2048", 0, 0], ["C=none", 0, 0], ["C=none", 1, 1],
                                ["C=2048", 1, 1]]  # A B B A; simulated: no warm-up
    assert "±" in (tmp_path / "local" / "tax.md").read_text()

    assert main([*SWEEP, "--out", str(tmp_path / "ray"), "--ray"]) == 0
    remote = _points(tmp_path / "ray")
    for label, res in local.items():
        assert _same(remote[label]) == _same(res)


def test_a_failing_point_on_ray_is_reported_and_the_others_kept(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture
                                                               ) -> None:
    pytest.importorskip("ray")
    argv = ["sweep", "--sim", "H20", "--tp", "8", "--model", "Qwen2.5-32B", "--chunk-sizes",
            "2048", "--add-point", "bad=--mixing no-such-mixing", "--sessions", "2",
            "--rounds", "1", "--no-progress", "--ray", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1
    res = _points(tmp_path)
    assert res["C=2048"]["completed"] == 2 and res["C=2048"]["total_token_throughput"] > 0
    assert res["bad"]["completed"] == 0 and "no-such-mixing" in res["bad"]["error"]
    assert "points with failures: bad" in capsys.readouterr().err


STUDY = ["study", "--contexts", "8192", "--sessions", "4", "--systems", "hlserve,vllm",
         "--chunks", "8192", "--duration", "40", "--warmup", "20", "--rounds", "2",
         "--repeats", "2", "--jobs", "1"]


def test_study_repeats_store_a_record_per_seed_and_ray_writes_the_same(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from hlserve.study.runs import load_points

    assert main([*STUDY, "--out", str(tmp_path / "local")]) == 0
    names = sorted(p.name for p in (tmp_path / "local" / "points").glob("*.json"))
    assert names == ["ctx8192_n4_hlserve_inf.json", "ctx8192_n4_hlserve_inf.seed1.json",
                     "ctx8192_n4_vllm_8192.json", "ctx8192_n4_vllm_8192.seed1.json"]
    merged = load_points(tmp_path / "local")
    assert len(merged) == 2
    for r in merged:
        m = r["metrics"]
        assert m["seeds"] == [0, 1] and m["window_token_throughput_ci95"] is not None
        assert len(m["repeat_values"]["window_token_throughput"]) == 2
    assert (tmp_path / "local" / "table.md").exists()

    assert main([*STUDY, "--out", str(tmp_path / "ray"), "--ray"]) == 0
    for name in names:
        a = json.loads((tmp_path / "local" / "points" / name).read_text())
        b = json.loads((tmp_path / "ray" / "points" / name).read_text())
        a["metrics"].pop("wall_s"), b["metrics"].pop("wall_s")
        assert a == b
