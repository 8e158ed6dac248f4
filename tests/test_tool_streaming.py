"""Streamed tool calls (auto and required) as vLLM streams them: the name first, then the
arguments as they are generated; concatenated by index, the deltas equal the unstreamed
calls, for every parser, however the text is cut into steps. The texts are of the shapes
these models write (the shapes vLLM's parser tests use)."""

from __future__ import annotations

import json
import random

import pytest

from hlserve.server.tools.parsers import PARSERS, ToolPlan, ToolStream

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"}, "state": {"type": "string"}, "days": {"type": "integer"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "hourly": {"type": "boolean"}, "zip": {"type": "string"}}}
FUNCTIONS = {"get_current_weather": WEATHER_PARAMS, "get_time": {
    "type": "object", "properties": {"tz": {"type": "string"}, "offsets": {"type": "array"}}}}

HERMES = ('Let me check both.\n<tool_call>\n{"name": "get_current_weather", "arguments": '
          '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "America/Chicago", '
          '"offsets": [-5, -6], "dst": true}}\n</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "get_current_weather", "parameters": {"city": "San '
          'Francisco", "metric": "celsius"}}; {"name": "lookup", "parameters": {"n": 12, '
          '"ok": false, "x": null, "f": 1.5e3, "nested": [1, 2, {"k": "v\\"q]}"}]}}')
REQUIRED = ('[{"name": "add", "parameters": {"a": 1, "b": 22}}, {"name": "echo", '
            '"parameters": {"s": "h\\u00e9llo ]}\\" done", "t": "\\u4f60\\u597d"}}]')
# Qwen3-Coder's XML: values are text, typed by the tool's schema ("12345" stays a string
# for a string parameter, 3 becomes an integer)
QWEN3_CODER = ("I'll check the weather.\n<tool_call>\n<function=get_current_weather>\n"
               "<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n"
               "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n"
               "</parameter>\n<parameter=zip>\n75201\n</parameter>\n</function>\n"
               "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\n"
               "America/Chicago\n</parameter>\n<parameter=offsets>\n[-5, -6]\n</parameter>\n"
               "</function>\n</tool_call>")
MISTRAL_V11 = ('[TOOL_CALLS]get_current_weather[ARGS]{"city": "Dallas", "state": "TX", '
               '"unit": "fahrenheit"}[TOOL_CALLS]get_time[ARGS]{"tz": "America/Chicago"}')
MISTRAL_JSON = ('[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"city": "Dallas", '
                '"state": "TX", "unit": "fahrenheit"}}, {"name": "get_time", "arguments": '
                '{"tz": "America/Chicago"}}]')
PYTHONIC = ('[get_current_weather(city="San Francisco", state="CA", unit="fahrenheit", '
            'days=3), get_time(tz=\'America/Los_Angeles\', offsets=[-8, -7])]')


def auto(name: str) -> ToolPlan:
    return ToolPlan("auto", PARSERS[name](FUNCTIONS) if name in ("qwen3_coder", "mistral",
                                                                  "pythonic")
                    else PARSERS[name]())


CASES = {"qwen3_coder": (auto("qwen3_coder"), QWEN3_CODER),
         "mistral_v11": (auto("mistral"), MISTRAL_V11),
         "mistral_json": (auto("mistral"), MISTRAL_JSON),
         "pythonic": (auto("pythonic"), PYTHONIC),
         "hermes": (ToolPlan("auto", PARSERS["hermes"]()), HERMES),
         "llama3_json": (ToolPlan("auto", PARSERS["llama3_json"]()), LLAMA3),
         "required": (ToolPlan("required"), REQUIRED)}


def cuts(text: str, seed: int) -> list[int]:
    """Where steps end: every character (seed 0) or random 1-6 character steps."""
    if seed == 0:
        return list(range(1, len(text) + 1))
    rng, ends, at = random.Random(seed), [], 0
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 6))
        ends.append(at)
    return ends


def run_stream(plan: ToolPlan, text: str, seed: int):
    ts, deltas, reason = ToolStream(plan), [], None
    prev = 0
    ends = cuts(text, seed)
    for i, end in enumerate(ends):
        finished = i == len(ends) - 1
        delta, r = ts.delta(text[prev:end], text[:end], finished, "stop" if finished else None)
        prev = end
        deltas.append(delta)
        reason = r if finished else reason
    return deltas, reason


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("parser", list(CASES))
def test_concatenated_deltas_equal_the_unstreamed_calls(parser: str, seed: int) -> None:
    plan, text = CASES[parser]
    content, calls, final_reason = plan.final(text, "stop")
    assert len(calls) == 2
    deltas, reason = run_stream(plan, text, seed)
    assert reason == final_reason == "tool_calls"
    streamed: dict[int, dict] = {}
    streamed_content = ""
    for step, d in enumerate(deltas):
        streamed_content += d.get("content") or ""
        for tc in d.get("tool_calls") or ():
            entry = streamed.setdefault(tc["index"], {"name": None, "arguments": "",
                                                      "first_step": step})
            fn = tc["function"]
            if "name" in fn:
                assert entry["name"] is None and "id" in tc and tc["type"] == "function"
                entry["name"] = fn["name"]
            assert entry["name"] is not None  # the name comes first
            entry["arguments"] += fn.get("arguments", "")
    assert (streamed_content or None) == (content or None)
    assert [(streamed[i]["name"], streamed[i]["arguments"]) for i in sorted(streamed)] == \
        [(c.name, c.arguments) for c in calls]
    for c in calls:
        json.loads(c.arguments)
    if parser == "pythonic":
        return  # a prefix of Python is not parsed: its calls come whole, at the end
    # streamed as generated: the first call is announced long before the last step
    assert streamed[0]["first_step"] < len(deltas) - 1
    args_steps = [s for s, d in enumerate(deltas) for tc in d.get("tool_calls") or ()
                  if tc["index"] == 0 and tc["function"].get("arguments")]
    assert len(args_steps) > 3


def test_not_a_call_after_all_stays_content() -> None:
    plan = ToolPlan("auto", PARSERS["hermes"]())
    text = "a <tool_call> is how I call tools"
    deltas, reason = run_stream(plan, text, 0)
    assert "".join(d.get("content", "") for d in deltas) == text
    assert reason == "stop"
    assert not any(d.get("tool_calls") for d in deltas)


def test_new_parsers_extract_typed_arguments() -> None:
    content, calls = auto("qwen3_coder").parser.extract(QWEN3_CODER)
    assert content == "I'll check the weather."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_current_weather", {"city": "Dallas", "state": "TX", "days": 3, "hourly": True,
                                 "zip": "75201"}),
        ("get_time", {"tz": "America/Chicago", "offsets": [-5, -6]})]
    for text in (MISTRAL_V11, MISTRAL_JSON):
        content, calls = auto("mistral").parser.extract(text)
        assert content is None
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
            ("get_time", {"tz": "America/Chicago"})]
    content, calls = auto("pythonic").parser.extract(f"<|python_start|>{PYTHONIC}<|python_end|>")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "fahrenheit",
                                 "days": 3}),
        ("get_time", {"tz": "America/Los_Angeles", "offsets": [-8, -7]})]


@pytest.mark.parametrize("name, text", [
    ("qwen3_coder", "Use <function=x> maybe"), ("mistral", "[TOOL_CALLS] not json"),
    ("pythonic", "[1, 2, 3]"), ("pythonic", "[f(x)"), ("pythonic", "plain text")])
def test_new_parsers_leave_non_calls_as_content(name: str, text: str) -> None:
    assert auto(name).parser.extract(text) == (text, [])
