"""Benchmark arithmetic without a server: metrics formulas, SLO/goodput, the tax table,
sweep points, and agent sessions along a Mooncake-format trace's chains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlserve.bench import report
from hlserve.bench.sweep import SweepPoint, make_points, parse_sizes, server_command
from hlserve.driver.records import SLO, RequestRecord, summarize
from hlserve.driver.workloads import (
    MooncakeTrace,
    ScaledTrace,
    chains,
    trace_requests,
    trace_sessions,
)


def rec(start: float, chunks: list[float], n_out: int, n_in: int = 100, ok: bool = True,
        **kw) -> RequestRecord:
    return RequestRecord(request_id="x", start=start, end=chunks[-1] if chunks else start,
                         chunk_times=chunks, prompt_tokens=n_in, output_tokens=n_out,
                         success=ok, error=None if ok else "HTTP 500: boom", **kw)


def test_latency_formulas() -> None:
    r = rec(1.0, [1.5, 1.6, 1.8, 2.0], 4)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.5) / 3)  # (E2E - TTFT) / (n - 1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.2])
    assert rec(0.0, [0.3], 1).tpot is None  # one token: no TPOT


def test_summary_keys_throughput_and_failures() -> None:
    recs = [rec(0.0, [0.5, 1.0], 2, 100), rec(0.0, [1.0, 2.0, 4.0], 3, 50),
            rec(0.0, [], 0, 0, ok=False, status=500)]
    s = summarize(recs, duration=4.0, session_times=[4.0], sessions_failed=1)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 150 and s["total_output_tokens"] == 5
    assert s["total_token_throughput"] == pytest.approx(155 / 4)
    assert s["output_throughput"] == pytest.approx(5 / 4)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["mean_ttft_ms"] == pytest.approx(750.0)
    assert s["median_itl_ms"] == pytest.approx(1000.0)  # gaps 0.5, 1.0, 2.0
    assert s["p99_tpot_ms"] == pytest.approx(1000 * (0.5 + (0.99 * (1.5 - 0.5))))
    assert s["sessions_per_hour"] == pytest.approx(900.0)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["sessions_failed"] == 1
    json.dumps(s)  # no NaN: JSON-clean


def test_slo_attainment_and_goodput() -> None:
    fast = rec(0.0, [0.1, 0.2, 0.3], 3)  # ttft 100 ms, tpot 100 ms
    slow = rec(0.0, [0.9, 1.0], 2)  # ttft 900 ms
    s = summarize([fast, slow], 2.0, SLO(ttft_ms=500, tpot_ms=150))
    assert s["slo_attainment"] == 0.5
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["token_goodput"] == pytest.approx(103 / 2)
    assert SLO(tpot_ms=50).met(rec(0.0, [0.1], 1))  # no TPOT: the target holds
    assert not SLO(tpot_ms=50).met(fast)


def point(label: str, thr: float, ttft: float, tpot: float, failed: int = 0) -> dict:
    return {"label": label, "knobs": {}, "metrics": {
        "completed": 10, "failed": failed, "total_token_throughput": thr,
        "p99_ttft_ms": ttft, "p99_tpot_ms": tpot}}


def test_tax_table() -> None:
    pts = [point("C=64", 500, 100, 10), point("C=256", 800, 300, 20),
           point("none", 1000, 900, 50), point("broken", 5000, 1, 1, failed=1)]
    rows = report.tax_rows(pts)
    by_target = {(r["slo_p99_ttft_ms"], r["slo_p99_tpot_ms"]): r for r in rows}
    assert by_target[(100, 10)]["best_config"] == "C=64"
    assert by_target[(100, 10)]["human_tax"] == pytest.approx(0.5)
    assert by_target[(300, 20)]["human_tax"] == pytest.approx(0.2)
    assert by_target[(None, None)]["best_config"] == "none"  # a point with failures never wins
    assert by_target[(None, None)]["human_tax"] == 0
    none_meets = report.tax_rows(pts, [(50.0, None)])[0]
    assert none_meets["best_config"] is None and none_meets["human_tax"] == 1.0
    assert "| 100 | 10 | C=64 | 500 | 50% |" in report.tax_table(rows)


def test_points_and_server_command() -> None:
    assert parse_sizes("64, 256,none") == [64, 256, None]
    pts = make_points([64, None], "same", ["tp=--mode throughput"])
    assert [(p.label, p.chunk_size, p.token_budget) for p in pts] == [
        ("C=64", 64, 64), ("C=none", None, None), ("tp", None, None)]
    assert pts[2].args == ["--mode", "throughput"]
    grid = make_points([64], "128,none")
    assert [(p.chunk_size, p.token_budget) for p in grid] == [(64, 128), (64, None)]
    t = "vllm serve {model} --port {port} --max-num-batched-tokens {token_budget} {args}"
    # no cap is the word hlserve serve reads; a grid point's number is passed as it is
    cmd = server_command(t, SweepPoint("C=none"), "/m", "127.0.0.1", 9)
    assert cmd == ["vllm", "serve", "/m", "--port", "9", "--max-num-batched-tokens", "none"]
    cmd = server_command(t, SweepPoint("C=4096", 4096, 4096), "/m", "127.0.0.1", 9)
    assert cmd == ["vllm", "serve", "/m", "--port", "9", "--max-num-batched-tokens", "4096"]


def write_trace(path: Path) -> Path:
    rows = [  # timestamps in ms; a 3-round conversation (ids 1..), an unrelated request, a branch of round 1
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 5000, "input_length": 700, "output_length": 20, "hash_ids": [0, 9]},
        {"timestamp": 10000, "input_length": 1600, "output_length": 30, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 20000, "input_length": 2100, "output_length": 40,
         "hash_ids": [0, 1, 3, 5, 6]},
        {"timestamp": 30000, "input_length": 1600, "output_length": 5, "hash_ids": [0, 1, 7, 8]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_chains_and_sessions(tmp_path: Path) -> None:
    trace = MooncakeTrace.load(write_trace(tmp_path / "t.jsonl"))
    assert chains(trace) == [[0, 2, 3], [1], [4]]  # the branch starts its own session
    st = ScaledTrace(trace, length_scale=0.1)
    p0, p2 = st.prompt(trace.requests[0]), st.prompt(trace.requests[2])
    assert len(p0) == 110 and len(p2) == 160
    assert p0[:102] == p2[:102]  # two shared 51-token blocks (512 x 0.1)
    assert p0[102:] != p2[102:110]
    sessions = trace_sessions(st, sessions=5, min_rounds=2)
    assert len(sessions) == 1 and sessions[0].rounds_spec == [(110, 1), (160, 3), (210, 4)]
    s = sessions[0]
    prompt, n = s.next_request()
    assert prompt == p0 and n == 1
    s.complete([7])
    prompt2, _ = s.next_request()
    assert prompt2[:111] == [*p0, 7] and len(prompt2) == 160
    reqs, skipped = trace_requests(st, time_scale=10.0, max_len=200)
    assert skipped == 1 and [r.send_at for r in reqs] == [0.0, 0.5, 1.0, 3.0]
