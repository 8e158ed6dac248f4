"""``hlserve demo --agent`` end to end on the real model: two real ``hlserve serve`` processes,
the openai SDK, tool calls that parse and tools that run, the transcript and the table."""

from __future__ import annotations

import pytest

from hlserve.bench.agent_demo import CORPUS, TASKS, AgentSpec, calculate, run_agent_demo
from hlserve.errors import ModelLoadError
from hlserve.models.resolve import NAMED_MODELS


def test_calculator_is_arithmetic_only() -> None:
    assert calculate("17 * 23 + 4") == "395"
    assert calculate("128 / 4 - 7") == "25"
    assert calculate("__import__('os')").startswith("error")
    assert calculate("1/0").startswith("error")


def test_expected_answers_come_from_the_tools() -> None:
    for t in TASKS:
        assert t.plan and all(step in ("calculator", "read_file", "word_count") for step in t.plan)
    assert str(len(CORPUS["rivers.txt"].split())) in [t.expected for t in TASKS]


def test_agent_demo_end_to_end() -> None:
    try:
        NAMED_MODELS["smollm2-135m"].locate()
    except ModelLoadError as e:
        pytest.skip(str(e))
    lines: list[str] = []
    res = run_agent_demo(AgentSpec(sessions=2, repeats=1), log=lines.append)
    out = "\n".join(lines)
    assert not res["errors"], res["errors"]
    # warm-up + one run a mode, two sessions each, at least one tool call a session
    assert res["tool_calls_executed"] >= 6
    assert "assistant -> " in out and "tool     : " in out  # the transcript's call and result
    for mode in ("slo", "throughput"):
        s = res["configs"][mode]
        assert s["sessions_per_min"] > 0 and 0 <= s["task_completion"] <= 1
    assert "[3/3]" in out  # progress, run by run
