"""Traces in the ecosystem's formats (hlserve.driver.trace_formats): hlserve's own workload
written as a Mooncake, AIPerf or inference-perf trace reads back as the same requests
(lengths, sessions, order, delays), each outside format's documented example
(tests/data/traces/README.md) replays as hlserve requests, and one replays over HTTP."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from hlserve.driver.tool_time import ToolTime, parse_tool_time
from hlserve.driver.trace_formats import detect_format, load_trace, workload_turns, write_trace
from hlserve.driver.workloads import AgentWorkload, ScaledTrace, chains, trace_sessions

DATA = Path(__file__).parent / "data" / "traces"


def workload(**kw) -> AgentWorkload:
    return AgentWorkload(**{"sessions": 3, "rounds": 4, "system_prompt_len": 700,
                            "task_len": 400, "tool_output_len": (64, 300),
                            "output_len": (8, 40), "seed": 3,
                            "tool_time": parse_tool_time("exp:1.5"), **kw})


def expected(w: AgentWorkload) -> list[list[tuple[int, int, float]]]:
    """Per session, its rounds' (prompt length, output length, delay before it)."""
    out: dict[int, list[tuple[int, int, float]]] = {}
    for sid, _, prompt, n_out, delay in workload_turns(w.sessions_list()):
        out.setdefault(sid, []).append((len(prompt), n_out, delay))
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize("fmt", ["mooncake", "aiperf", "inference-perf"])
def test_round_trip(tmp_path: Path, fmt: str) -> None:
    w = workload()
    want = expected(w)
    path = write_trace(w.sessions_list(), tmp_path / "t", fmt)
    assert detect_format(path) == fmt
    trace = load_trace(path)
    # the same requests: per session (a chain), in order, the lengths
    got = [[(trace.requests[i].input_length, trace.requests[i].output_length) for i in c]
           for c in chains(trace)]
    assert sorted(got) == sorted([[(n, o) for n, o, _ in s] for s in want])
    # the delays, to the millisecond the formats keep: AIPerf and inference-perf record
    # them; Mooncake's timestamps put each round its delay after the one before
    sessions = trace_sessions(ScaledTrace(trace), len(want), tool_time=ToolTime("recorded"))
    by_first = {tuple(s.rounds_spec): s for s in sessions}
    for s in want:
        ts = by_first[tuple((n, o) for n, o, _ in s)]
        assert ts.gaps == pytest.approx([d for _, _, d in s[1:]], abs=1e-3)
        assert ts.gaps_are_delays == (fmt != "mooncake")
    # sessions sharing the system prompt share its first block's hash id (where the format
    # has hash ids: OTel spans have none), and a round's prompt continues the round before
    # block for block
    firsts = [trace.requests[c[0]] for c in chains(trace)]
    assert len({r.hash_ids[0] for r in firsts}) == (3 if fmt == "inference-perf" else 1)
    for c in chains(trace):
        for a, b in itertools.pairwise(c):
            ra, rb = trace.requests[a], trace.requests[b]
            assert rb.hash_ids[: ra.input_length // 512] == ra.hash_ids[: ra.input_length // 512]


def test_a_closed_loop_replay_of_a_written_trace_sends_the_same_prompts(tmp_path: Path) -> None:
    """The trace's sessions (what ``--workload agent --trace`` runs) send prompts of the
    lengths the workload's own sessions send, round by round."""
    w = workload(tool_time=ToolTime())
    path = write_trace(w.sessions_list(), tmp_path / "t.jsonl", "aiperf")
    replay = trace_sessions(ScaledTrace(load_trace(path)), 3)
    for s, want in zip(replay, expected(w), strict=True):
        lengths = []
        while not s.done:
            prompt, n_out = s.next_request()
            lengths.append((len(prompt), n_out))
            s.complete([7] * n_out)
        assert lengths == [(n, o) for n, o, _ in want]


def test_aiperf_documented_examples() -> None:
    t = load_trace(DATA / "aiperf_mooncake_sessions.jsonl")
    assert detect_format(DATA / "aiperf_mooncake_sessions.jsonl") == "aiperf"
    # the second turn's 150 tokens are new input after the first turn and its reply
    assert [(r.input_length, r.output_length, r.parent) for r in t.requests] == [
        (300, 40, None), (300 + 40 + 150, 20, 0)]
    assert t.requests[1].delay == pytest.approx(0.002)
    m = load_trace(DATA / "aiperf_multi_turn.jsonl")
    assert [len(c) for c in chains(m)] == [2, 3, 2]
    first = m.requests[chains(m)[0][0]]
    assert first.input_length == len("What is machine learning?") // 4
    assert first.output_length == 256  # none given: vLLM bench serve's default
    delayed = m.requests[chains(m)[2][1]]
    assert delayed.delay == pytest.approx(1.0) and delayed.timestamp == pytest.approx(1.0)
    plain = DATA / "aiperf_mooncake_trace.jsonl"  # no sessions: plain Mooncake rows
    assert detect_format(plain) == "mooncake"
    assert [r.input_length for r in load_trace(plain).requests] == [1200, 1800, 1300]


def test_inference_perf_documented_example() -> None:
    path = DATA / "inference_perf_simple_chain.json"
    assert detect_format(path) == "inference-perf"
    t = load_trace(path)
    assert chains(t) == [[0, 1, 2]]  # one trace: one session of three calls
    spans = json.loads(path.read_text())["spans"]
    for r, s in zip(t.requests, spans, strict=True):
        msgs = json.loads(s["attributes"]["gen_ai.input.messages"])
        assert r.input_length == sum(len(m["content"]) for m in msgs) // 4
        assert r.output_length == len(s["attributes"]["gen_ai.output.text"]) // 4
    # the tool time: from a call's end (10:00:02.5) to the next call's start (10:00:03)
    assert [r.delay for r in t.requests] == [None, pytest.approx(0.5), pytest.approx(1.0)]
    assert [r.timestamp for r in t.requests] == pytest.approx([0.0, 0.5, 1.5])


def test_bad_traces_are_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty trace"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "none.json").write_text(json.dumps({"spans": [{"name": "tool"}]}))
    with pytest.raises(ValueError, match="no chat spans"):
        load_trace(tmp_path / "none.json")
    with pytest.raises(ValueError, match="unknown trace format"):
        write_trace([], tmp_path / "x", "sharegpt")


def test_write_trace_flag(tmp_path: Path, capsys) -> None:
    """``hlserve bench --write-trace FILE --trace-format aiperf`` writes the bench's agent
    workload without a server."""
    from hlserve.cli.commands import build_parser

    out = tmp_path / "w.jsonl"
    args = build_parser().parse_args([
        "bench", "--sessions", "2", "--rounds", "3", "--tool-time", "fixed:0.25",
        "--write-trace", str(out), "--trace-format", "aiperf"])
    args.func(args)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["session_id"] for r in rows] == ["s0"] * 3 + ["s1"] * 3
    assert [r.get("delay") for r in rows] == [None, 250, 250] * 2
    assert "wrote" in capsys.readouterr().out
