"""Workloads shared by real and simulated runs: agent sessions, Mooncake trace replay (open
loop by timestamps, closed loop along chains), Poisson chat, and their drivers."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from hlserve.driver.closed_loop import run_closed_loop
from hlserve.driver.tool_time import ToolTime, parse_tool_time
from hlserve.driver.workloads import (
    BLOCK,
    AgentWorkload,
    Dist,
    MooncakeTrace,
    PoissonChat,
    ScaledTrace,
    trace_arrivals,
    trace_sessions,
)
from hlserve.sim.build import build_sim_engine
from hlserve.sim.fitting import find_data_dir
from hlserve.study.drive import run_open_loop


def _write_trace(path, rows) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


ROWS = [  # a chain 0 -> 2 -> 3, a separate request 1 sharing only the system block, a branch 4
    {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [0, 9]},
    {"timestamp": 1000, "input_length": 1800, "output_length": 30, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 1500, "input_length": 2100, "output_length": 15, "hash_ids": [0, 1, 3, 5, 6]},
    {"timestamp": 1600, "input_length": 1500, "output_length": 12, "hash_ids": [0, 1, 7]},
]


def test_mooncake_prefixes_and_chains(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    _write_trace(path, ROWS)
    tr = MooncakeTrace.load(path)
    assert [r.parent for r in tr.requests] == [None, None, 0, 2, 0]
    p = [tr.prompt(r) for r in tr.requests]
    assert [len(x) for x in p] == [r["input_length"] for r in ROWS]
    # equal hash ids at position k <=> the first k*512 tokens are equal
    assert p[0][: 2 * BLOCK] == p[2][: 2 * BLOCK] and p[0][2 * BLOCK] != p[2][2 * BLOCK]
    assert p[1][:BLOCK] == p[0][:BLOCK] and p[1][BLOCK:BLOCK + 16] != p[0][BLOCK:BLOCK + 16]
    assert p[3][: 3 * BLOCK] == p[2][: 3 * BLOCK]
    assert tr.stats()["continuations"] == 3


def test_real_trace_chains() -> None:
    """README: about 3,500 of 12,031 conversation requests continue an earlier one."""
    tr = MooncakeTrace.load(find_data_dir() / "mooncake_conversation_trace.jsonl")
    s = tr.stats()
    assert s["requests"] == 12031
    assert 3000 < s["continuations"] < 4200
    # the Mooncake paper's trace table (FAST'25, arXiv 2407.00079): conversation, mean input 12,035
    assert s["mean_input"] == pytest.approx(12035, rel=0.01)


def test_open_and_closed_trace_replay(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    _write_trace(path, ROWS)
    tr = MooncakeTrace.load(path, vocab=(3, 150000))
    # open loop: each request arrives at its timestamp on the virtual clock
    e = build_sim_engine("Qwen2.5-7B", "H100", 1, mode="throughput", check_invariants=True)
    res = run_open_loop(e, trace_arrivals(tr))
    arrivals = sorted(r.start for r in res.records)
    assert arrivals == pytest.approx([r["timestamp"] / 1000 for r in ROWS])
    assert [r.output_tokens for r in sorted(res.records, key=lambda r: r.session_id)] == \
        [r["output_length"] for r in ROWS]
    # closed loop along the chains, as sessions on the one closed-loop driver: a continuation
    # is sent the moment its parent finishes, and finds the prefix its parent left cached
    sessions = trace_sessions(ScaledTrace(tr, 1.0), sessions=5)
    assert [len(s.rounds_spec) for s in sessions] == [3]  # the chain 0 -> 2 -> 3
    e = build_sim_engine("Qwen2.5-7B", "H100", 1, mode="throughput", check_invariants=True)
    res = run_closed_loop(e, sessions.__getitem__, len(sessions))
    by = {r.round: r for r in res.records}
    assert len(by) == 3 and all(r.success for r in res.records)
    assert by[1].start == pytest.approx(by[0].end)
    assert by[2].start == pytest.approx(by[1].end)
    assert [r.output_tokens for r in (by[0], by[1], by[2])] == [20, 30, 15]
    assert len(res.session_times) == 1
    assert by[2].cached_tokens >= 3 * BLOCK - 16


def test_poisson_chat() -> None:
    chat = PoissonChat(rate=4.0, num_requests=400, seed=1, vocab=(3, 120000))
    arr = list(chat.arrivals())
    gaps = [b.time - a.time for a, b in itertools.pairwise(arr)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.15)
    assert all(a.prompt[:256] == arr[0].prompt[:256] for a in arr)  # shared system prompt
    e = build_sim_engine("Llama-3.1-8B", "H100", 1, preset="vllm")
    res = run_open_loop(e, arr[:60])
    assert res.summary()["completed"] == 60


def test_agent_workload_distributions() -> None:
    rng = random.Random(0)
    d = Dist.lognormal(1000, 0.6, 16, 8000)
    xs = [d.sample(rng) for _ in range(4000)]
    assert sum(xs) / len(xs) == pytest.approx(1000, rel=0.08) and min(xs) >= 16
    assert Dist.constant(7).sample(rng) == 7
    w = AgentWorkload.for_context(32768, sessions=3)
    s = w.make_session(5)
    assert s.context[:2048] == w.system_ids() and w.make_session(5).context == s.context
    rounds = 0
    while not s.done:
        prompt, out = s.next_request()
        assert len(prompt) + out <= 32768
        s.complete([1] * out)
        rounds += 1
    assert 3 <= rounds <= 8 and len(s.context) > 16384
    # the original API: tuple ranges, fixed rounds
    legacy = AgentWorkload(sessions=2, rounds=3).sessions_list()
    assert len(legacy) == 2 and legacy[0].context[:512] == legacy[1].context[:512]


@pytest.mark.parametrize("time_scale", [1.0, 50.0])
def test_closed_trace_replay_waits_out_the_recorded_gaps(tmp_path, time_scale: float) -> None:
    """``--tool-time recorded``: a chain's next round is sent its recorded gap (over the time
    scale) after the previous round was sent, or at once when serving took longer, on the
    one closed-loop driver (the simulator's here, the HTTP bench's too)."""
    path = tmp_path / "t.jsonl"
    _write_trace(path, ROWS)
    tr = MooncakeTrace.load(path, vocab=(3, 150000))
    sessions = trace_sessions(ScaledTrace(tr, 1.0), sessions=5, tool_time=ToolTime("recorded"),
                              time_scale=time_scale)
    assert sessions[0].gaps == pytest.approx([1.0 / time_scale, 0.5 / time_scale])
    e = build_sim_engine("Qwen2.5-7B", "H100", 1, mode="throughput", check_invariants=True)
    res = run_closed_loop(e, sessions.__getitem__, len(sessions))
    by = {r.round: r for r in res.records}
    for r, gap in ((1, 1.0), (2, 0.5)):
        prev = by[r - 1]
        assert by[r].start == pytest.approx(max(prev.end, prev.start + gap / time_scale))
    waited = [by[r].start > by[r - 1].end + 1e-9 for r in (1, 2)]
    assert waited == ([True, True] if time_scale == 1.0 else [False, False])


def test_recorded_tool_time_needs_a_trace() -> None:
    with pytest.raises(ValueError, match="needs a trace"):
        AgentWorkload(sessions=2, tool_time=parse_tool_time("recorded"))
    assert parse_tool_time("recorded").spec == "recorded"
