"""benchmarks/sessions.py runs whole at tiny sizes on the tiny Llama (a smoke run, no timed
assertion): every arm and repeat interleaved A B C D D C B A, the metrics with intervals, the
ratios against lpm, identical greedy outputs across arms, and a pool under pressure.

What is asserted holds whatever the timing (tool calls are slept on the wall clock, and
throughput mode's budget follows measured step times, so which pages are evicted when is
not fixed): a pool smaller than the sessions' working set must evict (the prefix tree would
otherwise hold every full page of every session's last context at the end); with a TTL every
finished round is retained, and a session's next round finds its retained pages again
(a TTL hit), or they expired or were evicted first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import load_benchmark

ARMS = ("hold+program", "retain+program", "lpm", "fcfs")


def test_the_benchmark_runs_at_tiny_sizes(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    bench = load_benchmark("sessions")
    out = tmp_path / "sessions.json"
    sessions, rounds, pages = 3, 3, 12
    res = bench.main(["--model", str(tiny_llama), "--sessions", str(sessions), "--rounds",
                      str(rounds), "--system-prompt", "32", "--task", "16", "--tool-output",
                      "16", "32", "--max-tokens", "4", "--tool-median", "0.05", "--sigma", "0",
                      "--num-pages", str(pages), "--engine-args", "--dtype float32",
                      "--no-progress", "--out", str(out)])
    assert json.loads(out.read_text())["configs"] == json.loads(json.dumps(res["configs"]))
    assert res["bench"]["tool_time"] == "fixed:0.05"
    retain = res["bench"]["arms"]["retain+program"]  # TTL: 3 x the median tool time
    assert retain == {"session_ttl": pytest.approx(0.15), "session_ttl_policy": "fixed",
                      "order": "program", "session_hold": False}
    assert res["bench"]["arms"]["hold+program"]["session_hold"] is True
    assert not res["errors"] and set(res["configs"]) == set(ARMS)
    # A B C D, D C B A: each arm twice, repeat i of every arm on seed i
    assert [(name, i) for name, i, _ in res["order"]] == [
        *((a, 0) for a in ARMS), *((a, 1) for a in reversed(ARMS))]
    assert res["same_outputs"] is True  # greedy, lengths pinned: the arms differ in no token
    for arm in ARMS:
        s = res["configs"][arm]
        assert s["repeats"] == 2 and s["total_token_throughput_ci95"] is not None
        assert s["session_completion_p50_s"] > 0 and s["session_completion_p99_s_ci95"]
        for run in res["runs"][arm]:
            assert run["requests"] == sessions * rounds
            assert run["sessions_completed"] == sessions
            assert run["working_set_pages"] > pages  # the pool is under pressure...
            assert run["evicted_pages"] > 0  # ... so it evicted, whatever the timing
            assert 0 <= run["reprefilled_tokens"] <= run["prefilled_tokens"]
            retained = arm in ("hold+program", "retain+program")
            assert run["retained_rounds"] == (sessions * rounds if retained else 0)
            ttl = run["ttl_hits"] + run["ttl_expiries"] + run["retained_evicted"]
            assert (ttl > 0) == retained
    # the same prompts in every arm (the outputs are): the same tokens for throughput
    tokens: dict[int, set[tuple[int, int]]] = {}
    for runs in res["runs"].values():
        for r in runs:
            tokens.setdefault(r["repeat"], set()).add((r["prompt_tokens"], r["output_tokens"]))
    assert sorted(tokens) == [0, 1] and all(len(t) == 1 for t in tokens.values())
    for arm in ("hold+program", "retain+program", "fcfs"):
        ratios = res["ratios"][arm]
        assert ratios["vs"] == "lpm"
        for metric in ("total_token_throughput", "session_completion_p50_s"):
            assert ratios[metric]["n"] == 2 and ratios[metric]["ratio"] > 0
    table = capsys.readouterr().out
    assert table.count("| retain+program |") == 1 and "| tok/s vs lpm |" in table
    assert f"KV pool {pages} pages" in table and "same greedy outputs in every arm: yes" in table
