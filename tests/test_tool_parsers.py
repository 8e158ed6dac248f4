"""The tool-call parsers on the text formats of the model families (Qwen's hermes format,
Llama 3 JSON), and the streamed form of their calls."""

from __future__ import annotations

import json

from hlserve.server.tools.parsers import HermesParser, Llama3JsonParser, ToolPlan, ToolStream


def test_hermes_calls_after_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    content, calls = HermesParser().extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert HermesParser().extract("no calls here") == ("no calls here", [])
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert HermesParser().extract(bad) == (bad, [])  # stays content, as vLLM


def test_llama3_json_calls() -> None:
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    content, calls = Llama3JsonParser().extract(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert Llama3JsonParser().extract("Hello {x}") == ("Hello {x}", [])


def test_auto_stream_holds_back_the_tag_and_streams_the_call() -> None:
    plan = ToolPlan("auto", HermesParser())
    ts = ToolStream(plan)
    text = 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    deltas, full = [], ""
    for ch in text:  # one character per chunk: the marker itself arrives in pieces
        full += ch
        deltas.append(ts.delta(ch, full, False, None)[0])
    last, reason = ts.delta("", full, True, "stop")
    content = "".join(d.get("content", "") for d in [*deltas, last])
    assert content == "Hi" and reason == "tool_calls"  # as unstreamed: stripped before a call
    calls = [tc for d in [*deltas, last] for tc in d.get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == "add"  # first, alone, with the id
    assert "id" in calls[0] and "name" not in calls[1]["function"]
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"a": 1}'
    assert calls[-1]["function"]["arguments"] == "}"  # the rest only at the end


def test_parallel_false_keeps_one_auto_call() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    _, calls, _ = ToolPlan("auto", HermesParser(), parallel=False).final(text, "stop")
    assert [c.name for c in calls] == ["a"]
