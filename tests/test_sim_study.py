"""The study sweep: points, resumption, frontier and tax analysis, report files."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from hlserve.cli.simulate import main as sim_main
from hlserve.study.core import StudyPoint, StudySpec, human_tax, pareto, system_options
from hlserve.study.runs import _done, run_study
from hlserve.study.study_report import report


def test_pareto_and_tax() -> None:
    assert pareto([1, 2, 3, 4], [10, 5, 20, 15]) == [0, 2]
    recs = [
        {"point": {"system": "hlserve", "knob": None}, "label": "hl",
         "metrics": {"completed": 9, "window_token_throughput": 100.0, "p99_ttft_ms": 9000,
                     "p99_tpot_ms": 300}},
        {"point": {"system": "sglang", "knob": 512}, "label": "sg",
         "metrics": {"completed": 9, "window_token_throughput": 30.0, "p99_ttft_ms": 1500,
                     "p99_tpot_ms": 80}},
        {"point": {"system": "vllm", "knob": 2048}, "label": "vl",
         "metrics": {"completed": 9, "window_token_throughput": 60.0, "p99_ttft_ms": 3000,
                     "p99_tpot_ms": 90}},
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
    assert {"frontier_8k.png", "tax.png", "summary.json", "table.md", "tiers.md"} <= names
    summary = json.loads((tmp_path / "summary.json").read_text())
    # agents per node at SLO tiers, per context, with the node's row (hlserve.driver.tiers)
    assert {r["tier"] for r in summary["tiers"]["8192"]} == {
        "interactive", "production", "relaxed", "none"}
    assert any(r["config"] == "best of all" for r in summary["tiers"]["8192"])
    assert 0.0 <= summary["slos"][0]["tax"] <= 1.0
    assert "sarathi C=B=512" in (tmp_path / "table.md").read_text()
    assert StudyPoint("sglang", None, 32768, 64).label == "sglang C=inf"
    assert sim_main(["study", "--report-only", "--out", str(tmp_path)]) == 0


def _rounds(workload, index: int = 0) -> list[list[int]]:
    sess, prompts = workload.make_session(index), []
    while not sess.done:
        prompt, out = sess.next_request()
        prompts.append(prompt)
        sess.complete([7] * out)
    return prompts


def test_agent_workload_without_prefix_reuse() -> None:
    from hlserve.driver.workloads import AgentWorkload

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    kw = {"target": 32768, "sessions": 4, "seed": 3}
    reuse = _rounds(AgentWorkload.for_context(**kw))
    fresh = _rounds(AgentWorkload.for_context(**kw, prefix_reuse=False))
    system = AgentWorkload.for_context(**kw).system_prompt_len
    assert len(reuse) == len(fresh) >= 3
    assert [len(p) for p in reuse] == [len(p) for p in fresh]  # paired: the same lengths
    for a, b in itertools.pairwise(reuse):
        assert b[:len(a)] == a  # each round extends the last
    for a, b in itertools.pairwise(fresh):
        # only the shared system prompt (and a chance id) is common to consecutive rounds
        assert system <= common(a, b) < system + 4
    assert fresh[0][:system] == reuse[0][:system]
    other = _rounds(AgentWorkload.for_context(**kw, prefix_reuse=False), index=1)
    assert system <= common(fresh[0], other[0]) < system + 4


def test_stall_metrics_and_turnover() -> None:
    from hlserve.driver.closed_loop import LoopResult
    from hlserve.driver.records import RequestRecord
    from hlserve.study.core import stall_metrics, turnover_metrics, window_metrics

    def rec(times: list[float]) -> RequestRecord:
        return RequestRecord(request_id="r", start=0.0, end=times[-1], chunk_times=times,
                             output_tokens=len(times), success=True)

    recs = [rec([0.0, 0.01, 0.02, 1.02, 1.03]), rec([0.5, 0.52, 0.54]), rec([2.0])]
    m = stall_metrics(recs)
    assert m["max_longest_stall_ms"] == pytest.approx(1000.0)
    assert m["median_longest_stall_ms"] == pytest.approx(1e3 * (1.0 + 0.02) / 2)
    assert stall_metrics([])["p99_longest_stall_ms"] is None
    # the pooled gaps (ITL) are the one summary's, which a point keeps
    res = LoopResult(records=recs, duration=10.0, session_times=[])
    w = window_metrics(res)
    gaps = [0.01, 0.01, 1.0, 0.01, 0.02, 0.02]
    assert w["median_itl_ms"] == pytest.approx(1e3 * float(np.percentile(gaps, 50)))
    assert w["p99_itl_ms"] == pytest.approx(1e3 * float(np.percentile(gaps, 99)))
    assert w["failed"] == 0 and w["completed"] == 3
    res = LoopResult(records=[], duration=1800.0, session_times=[1.0] * 3)
    res.sessions_ended_in_window = 6
    t = turnover_metrics(res, sessions=8)
    assert t == {"sessions_ended_per_hour": 12.0, "turnover": 0.75, "transient": True}
    res.sessions_ended_in_window = 16
    assert turnover_metrics(res, sessions=8)["transient"] is False


def test_sessions_ended_in_window_count_long_sessions() -> None:
    """A session that starts before the window and ends inside it counts as ended there, but
    not in ``session_times`` (which needs the whole session inside the window)."""
    from hlserve.driver.workloads import AgentWorkload
    from hlserve.sim.build import build_sim_engine
    from hlserve.study.drive import run_agent_steady

    engine = build_sim_engine("Qwen2.5-7B", "H100", 1, max_model_len=8192 + 4096, mode="throughput")
    workload = AgentWorkload.for_context(8192, 8, rounds=3, vocab=(3, 4096))
    res = run_agent_steady(engine, workload, duration=40.0, warmup=20.0, ramp=10.0,
                           token_times=True)
    assert res.sessions_ended_in_window > len(res.session_times) > 0
    assert all(len(r.chunk_times) == r.output_tokens for r in res.records)
