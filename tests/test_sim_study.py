"""The study sweep: points, resumption, frontier and tax analysis, report files."""

from __future__ import annotations

import json
import math

import pytest

from hlserve.sim.cli import main as sim_main
from hlserve.sim.study import (
    Point,
    StudySpec,
    _done,
    human_tax,
    pareto,
    report,
    run_study,
    system_options,
)


def test_pareto_and_tax() -> None:
    assert pareto([1, 2, 3, 4], [10, 5, 20, 15]) == [0, 2]
    recs = [
        {"point": {"system": "hlserve", "knob": None}, "label": "hl",
         "metrics": {"total_token_throughput": 100.0, "p99_ttft_ms": 9000, "p99_tpot_ms": 300}},
        {"point": {"system": "sglang", "knob": 512}, "label": "sg",
         "metrics": {"total_token_throughput": 30.0, "p99_ttft_ms": 1500, "p99_tpot_ms": 80}},
        {"point": {"system": "vllm", "knob": 2048}, "label": "vl",
         "metrics": {"total_token_throughput": 60.0, "p99_ttft_ms": 3000, "p99_tpot_ms": 90}},
    ]
    tax, bc, bu = human_tax(recs, 2000, 100)
    assert tax == pytest.approx(0.7) and bc["label"] == "sg" and bu["label"] == "hl"
    assert human_tax(recs, 5000, 100)[0] == pytest.approx(0.4)
    assert human_tax(recs, math.inf, math.inf)[0] == 0
    assert human_tax(recs, 100, 10)[0] == 1.0  # nothing meets it
    assert human_tax(recs, 5000, 100, systems=["sglang"])[0] == pytest.approx(0.7)


def test_system_options() -> None:
    assert system_options("sarathi", 512) == {"preset": "sarathi", "chunk_size": 512, "token_budget": 512}
    assert system_options("hlserve-fcfs", None) == {"mode": "throughput", "order": "fcfs"}
    with pytest.raises(ValueError):
        system_options("nope", None)


def test_small_study_resumes_and_reports(tmp_path) -> None:
    spec = StudySpec(hardware="H100", tp=1, model="Qwen2.5-7B", contexts=(8192,), sessions=(8,),
                     systems=("hlserve", "sarathi"), chunks=(512,), duration=30.0, warmup=10.0,
                     rounds=3)
    files = run_study(spec, tmp_path, jobs=1, progress=False)
    assert len(files) == 2 and all(f.exists() for f in files)
    rec = json.loads(files[0].read_text())
    assert rec["spec"]["model"] == "Qwen2.5-7B" and rec["metrics"]["total_token_throughput"] > 0
    mtimes = [f.stat().st_mtime_ns for f in files]
    run_study(spec, tmp_path, jobs=1, progress=False)  # nothing left to do
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    # a changed spec recomputes
    spec2 = StudySpec(**{**spec.__dict__, "duration": 20.0})
    run_study(spec2, tmp_path, jobs=1, progress=False)
    assert json.loads(files[0].read_text())["spec"]["duration"] == 20.0
    # a point stored before output_mean was part of the fingerprint counts at its default,
    # and another output length is another point
    rec = json.loads(files[0].read_text())
    del rec["spec"]["output_mean"]
    files[0].write_text(json.dumps(rec))
    assert _done(files[0], spec2)
    assert not _done(files[0], StudySpec(**{**spec2.__dict__, "output_mean": 1000.0}))
    # the folder records both runs' specs (a run never hides what an earlier one wrote)
    runs = json.loads((tmp_path / "spec.json").read_text())["runs"]
    assert [r["duration"] for r in runs] == [30.0, 20.0]
    paths = report(tmp_path)
    names = {p.name for p in paths}
    assert {"frontier_8k.png", "tax.png", "summary.json", "table.md"} <= names
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0.0 <= summary["slos"][0]["tax"] <= 1.0
    assert "sarathi C=B=512" in (tmp_path / "table.md").read_text()
    assert Point("sglang", None, 32768, 64).label == "sglang C=inf"
    assert sim_main(["study", "--report-only", "--out", str(tmp_path)]) == 0
