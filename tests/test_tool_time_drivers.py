"""Tool time between an agent session's rounds, in every driver (issue 25): the simulator's and
the real engine's closed loop wait it out on their own clock while the engine serves the other
sessions, a zero tool time leaves every draw and record as it was, seeded distributions
reproduce, and session completion time (tool calls included) is reported as p50/p90/p99.
The HTTP bench's side is in tests/test_bench.py (it shares that file's server)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from hlserve.driver.closed_loop import run_agent_sessions, run_closed_loop
from hlserve.driver.coding_workload import CodingWorkload
from hlserve.driver.records import RequestRecord, headline, summarize
from hlserve.driver.tool_time import parse_tool_time
from hlserve.driver.workloads import AgentWorkload
from hlserve.llm import LLM
from hlserve.sim.build import build_sim_engine

SMALL = AgentWorkload(sessions=5, rounds=3, system_prompt_len=2048, task_len=128,
                      tool_output_len=(500, 2000), output_len=(10, 30), vocab=(3, 150000),
                      seed=3)


def sim_run(tool_time: str, workload: AgentWorkload = SMALL, check: bool = False):
    """The workload's sessions to their end on the simulated H20 x8 (virtual clock), with
    each request's prompt ids kept; ``check``: the KV accounting after every step."""
    engine = build_sim_engine("Qwen2.5-32B", "H20", 8, mode="throughput",
                              check_invariants=check)
    w = dataclasses.replace(workload, tool_time=parse_tool_time(tool_time))
    prompts: dict[tuple[int, int], list[int]] = {}

    def keep(rec: RequestRecord, prompt: list[int], _out: list[int] | None) -> None:
        prompts[(rec.session_id, rec.round)] = prompt

    res = run_closed_loop(engine, w.make_session, w.sessions, on_record=keep)
    return engine, res, prompts


def rounds_of(records: list[RequestRecord]) -> dict[int, list[RequestRecord]]:
    by: dict[int, list[RequestRecord]] = {}
    for r in sorted(records, key=lambda r: (r.session_id, r.round)):
        by.setdefault(r.session_id, []).append(r)
    return by


def as_json(records: list[RequestRecord]) -> str:
    return json.dumps(sorted((r.to_json() for r in records), key=lambda d: d["request_id"]))


def test_fixed_tool_time_in_the_simulator() -> None:
    rounds = SMALL.rounds
    _, base, _ = sim_run("0")
    engine, res, _ = sim_run("fixed:2", check=True)
    assert len(res.records) == SMALL.sessions * rounds and all(r.success for r in res.records)
    assert len(res.session_times) == SMALL.sessions
    for recs in rounds_of(res.records).values():
        # each next round is sent exactly 2 simulated seconds after the last one finished
        for prev, cur in itertools.pairwise(recs):
            assert cur.start == pytest.approx(prev.end + 2.0)
        # completion = the rounds' own latencies + the tool calls between them
        served = sum(r.e2el for r in recs)
        assert recs[-1].end - recs[0].start == pytest.approx(served + 2.0 * (rounds - 1))
    assert min(res.session_times) >= 2.0 * (rounds - 1)
    # longer than with no tool time by at least the tool calls of the slowest session less
    # what less contention saves (each session's serving time is compared below)
    assert max(res.session_times) >= max(base.session_times) + 2.0 * (rounds - 1) - 0.5
    s = summarize(res.records, res.duration, session_times=res.session_times)
    z = summarize(base.records, base.duration, session_times=base.session_times)
    assert s["session_completion_p50_s"] >= 2.0 * (rounds - 1)
    assert s["session_completion_p50_s"] > z["session_completion_p50_s"] + 2.0
    # the engine was idle part of the time (the clock jumped while every session was in a
    # tool call) and served other sessions while some were in theirs
    assert engine.clock() > engine.stats.busy_time + 1.0
    gaps = [(p.end, c.start, sid) for sid, recs in rounds_of(res.records).items()
            for p, c in itertools.pairwise(recs)]
    overlapping = sum(1 for a, b, sid in gaps
                      if any(r.session_id != sid and r.start < b and r.end > a
                             for r in res.records))
    assert overlapping > 0


def test_zero_tool_time_changes_nothing_and_tool_time_changes_no_prompt() -> None:
    # zero draws nothing: the same records, bit for bit, as the workload built without one
    engine0 = build_sim_engine("Qwen2.5-32B", "H20", 8, mode="throughput")
    plain = run_agent_sessions(engine0, SMALL)
    _, zero, zero_prompts = sim_run("0")
    _, fixed0, _ = sim_run("fixed:0")
    assert as_json(zero.records) == as_json(plain.records) == as_json(fixed0.records)
    assert zero.session_times == plain.session_times
    # a tool time moves every round in time, never its prompt or its length: tool times
    # come from a generator of their own
    _, timed, timed_prompts = sim_run("exp:3")
    assert timed_prompts == zero_prompts
    key = lambda r: (r.session_id, r.round, r.prompt_tokens, r.output_tokens)  # noqa: E731
    assert sorted(map(key, timed.records)) == sorted(map(key, zero.records))
    assert max(timed.session_times) > max(zero.session_times)


@pytest.mark.parametrize("spec", ["exp:1.5", "lognormal:1:0.8"])
def test_seeded_tool_times_reproduce(spec: str) -> None:
    _, a, _ = sim_run(spec)
    _, b, _ = sim_run(spec)
    assert as_json(a.records) == as_json(b.records) and a.session_times == b.session_times
    gaps = [c.start - p.end for recs in rounds_of(a.records).values()
            for p, c in itertools.pairwise(recs)]
    assert len(set(gaps)) == len(gaps) and min(gaps) > 0  # drawn per round, all different
    _, other, _ = sim_run(spec, dataclasses.replace(SMALL, seed=4))
    other_gaps = [c.start - p.end for recs in rounds_of(other.records).values()
                  for p, c in itertools.pairwise(recs)]
    assert other_gaps != gaps


class _Chat:
    """A stand-in chat codec: the coding workload's tasks are rendered, never a model's."""

    def encode_chat(self, messages, **_: object) -> list[int]:
        return [len(m["content"]) % 97 for m in messages]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_coding_sessions_draw_tool_time_apart_from_their_tasks() -> None:
    """The coding workload takes the agent workload's tool time: drawn per session from its
    own generator (reproducible, different per session), never moving a task."""
    timed = CodingWorkload(sessions=3, rounds=3, seed=2, tool_time=parse_tool_time("exp:2"))
    plain = CodingWorkload(sessions=3, rounds=3, seed=2)
    draws = [[s.tool_pause() for _ in range(3)] for s in timed.sessions_list(_Chat())]
    again = [[s.tool_pause() for _ in range(3)] for s in timed.sessions_list(_Chat())]
    assert draws == again and len({d for row in draws for d in row}) == 9 and min(map(min, draws)) > 0
    assert all(s.tool_pause() == 0.0 for s in plain.sessions_list(_Chat()))
    assert [timed.task(i, r).prompt for i in range(3) for r in range(3)] == \
        [plain.task(i, r).prompt for i in range(3) for r in range(3)]


def test_session_completion_percentiles_on_a_known_set() -> None:
    times = [float(x) for x in range(10, 0, -1)]  # 1..10 s, in any order
    s = summarize([], 10.0, session_times=times)
    # numpy's linear interpolation: rank q/100 * (n - 1)
    assert s["session_completion_p50_s"] == pytest.approx(5.5)
    assert s["session_completion_p90_s"] == pytest.approx(9.1)
    assert s["session_completion_p99_s"] == pytest.approx(9.91)
    assert s["session_completion_p50_s"] == s["median_session_time_s"]
    assert s["sessions_completed"] == 10
    line = headline(s)
    assert line.startswith("Session completion p50/p90/p99: 5.50/9.10/9.91 s")
    assert "3600.0 sessions/h" in line
    none = summarize([], 1.0)
    assert none["session_completion_p99_s"] is None and "n/a" in headline(none)


def test_real_engine_waits_out_fixed_tool_time(tiny_llama: Path) -> None:
    engine = LLM(str(tiny_llama), dtype="float32", max_model_len=512, num_pages=128).engine
    w = AgentWorkload(sessions=2, rounds=3, system_prompt_len=32, task_len=8,
                      tool_output_len=(8, 16), output_len=(2, 4), seed=1,
                      tool_time=parse_tool_time("fixed:0.2"))
    res = run_agent_sessions(engine, w)
    assert len(res.records) == 6 and all(r.success for r in res.records)
    for recs in rounds_of(res.records).values():
        for prev, cur in itertools.pairwise(recs):
            # on the wall clock: sent when due (0.2 s after the round's end was seen, which
            # is at or after the engine finished it)
            assert cur.start - prev.end >= 0.2
    s = summarize(res.records, res.duration, session_times=res.session_times)
    for q in (50, 90, 99):
        assert s[f"session_completion_p{q}_s"] >= (w.rounds - 1) * 0.2
    assert s["sessions_completed"] == 2


def test_study_points_take_a_tool_time(tmp_path: Path) -> None:
    """``hlserve study --tool-time``: the spec is checked and written one way (zero as the
    stored points' ``0``), it is part of a point's fingerprint, and a steady-state point
    reports session completion with the tool calls in it."""
    from hlserve.cli.commands import build_parser
    from hlserve.study.core import StudyPoint, StudySpec, run_point
    from hlserve.study.runs import _done

    def study(*flags: str):
        return build_parser().parse_args(["study", *flags]).tool_time

    assert study() == "0" and study("--tool-time", "fixed:0") == "0"
    assert study("--tool-time", "lognormal:5:1.0") == "lognormal:5:1"
    with pytest.raises(SystemExit):
        study("--tool-time", "exp:-1")
    base = StudySpec(hardware="H100", tp=1, model="Qwen2.5-7B", contexts=(8192,),
                     sessions=(8,), systems=("hlserve",), duration=60.0, warmup=20.0, rounds=3)
    timed = dataclasses.replace(base, tool_time="fixed:5")
    point = StudyPoint("hlserve", None, 8192, 8)
    zero, tool = run_point(base, point), run_point(timed, point)
    assert zero["spec"]["tool_time"] == "0" and tool["spec"]["tool_time"] == "fixed:5"
    z, t = zero["metrics"], tool["metrics"]
    assert t["session_completion_p50_s"] >= 2 * 5.0
    # longer by the tool calls, less what the lighter load saves the rounds themselves
    assert t["session_completion_p50_s"] > z["session_completion_p50_s"] + 5.0
    # a stored zero-gap point (no tool_time in its spec) is reused only by a zero-gap run
    path = tmp_path / "p.json"
    rec = json.loads(json.dumps(zero))
    del rec["spec"]["tool_time"]
    path.write_text(json.dumps(rec))
    assert _done(path, base) and not _done(path, timed)
