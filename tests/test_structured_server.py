"""Structured outputs and tool calling on a real ``hlserve serve`` process, through the
official ``openai`` client, on the random-weight tiny model: every greedy and sampled
output of every schema validates (``jsonschema``), tool calls come back as ``tool_calls``
(whole and streamed), and bad specs are 400s that leave the engine serving."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from hlserve.server.runtime.launch import ServerProcess
from hlserve.tokenizer import Tokenizer
from structured_schemas import SCHEMAS, TOOLS

MODEL = "tiny"
MAX_TOKENS = 96
ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "4096",
        "--max-num-seqs", "16", "--uvicorn-log-level", "warning"]
OBJECT_SCHEMAS = {k: v for k, v in SCHEMAS.items() if v.get("type") == "object"}
# one tool per object schema: named and required tool choice over 20+ schemas
SCHEMA_TOOLS = [{"type": "function", "function": {"name": f"f_{k.replace('-', '_')}",
                                                  "parameters": v}}
                for k, v in OBJECT_SCHEMAS.items()]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in SCHEMA_TOOLS + TOOLS}
HERMES_ADD = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("structured")
    args = [*ARGS, "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    with ServerProcess(tiny_model_dirs["qwen2"], args, log_path=tmp / "server.log") as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def sampling(i: int) -> dict[str, Any]:
    """Even cases greedy, odd ones sampled with a seed."""
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}


def chat(client: openai.OpenAI, content: str, **kw: Any):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}],
        max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def parallel(fn, items: list) -> list:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, items))


# ---- response_format ---------------------------------------------------------------------------


def test_json_schema_every_schema_greedy_and_sampled(client: openai.OpenAI) -> None:
    cases = [(name, i) for name in SCHEMAS for i in (0, 1)]

    def one(case: tuple[str, int]) -> tuple[str, Any]:
        name, i = case
        rf = {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"),
                                                     "schema": SCHEMAS[name], "strict": True}}
        return name, chat(client, f"Give me {name} as JSON", response_format=rf, **sampling(i))

    for name, r in parallel(one, cases):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_schema_streamed_and_completions(client: openai.OpenAI) -> None:
    schema = SCHEMAS["mixed"]
    rf = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}
    text, reason = "", None
    for chunk in chat(client, "stream it", response_format=rf, stream=True, temperature=1.0,
                      seed=5):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    for body in ({"response_format": rf}, {"structured_outputs": {"json": schema}},
                 {"guided_json": schema}):
        r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=body)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_json_object_parses(client: openai.OpenAI, tiny_model_dirs: dict[str, Path]) -> None:
    """Any JSON object. Its strings are unbounded, and the random model never closes one by
    itself (a reply cut by max_tokens, "length", is an incomplete object, as in vLLM); a
    logit_bias towards '"' (and a little '}') makes it want to finish, and then every reply parses."""
    tok = Tokenizer.from_dir(tiny_model_dirs["qwen2"])
    assert tok is not None
    bias = {str(tok.encode(t, add_special_tokens=False)[0]): b for t, b in (('"', 6), ("}", 2))}
    for i in range(6):
        r = chat(client, "an object", response_format={"type": "json_object"}, max_tokens=64,
                 logit_bias=bias, **sampling(i))
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        assert isinstance(json.loads(c.message.content), dict)
    r = chat(client, "an object", response_format={"type": "json_object"}, max_tokens=16)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content[0] == "{"


def test_regex_choice_grammar_extras(client: openai.OpenAI) -> None:
    pattern = r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"
    choices = ["alpha", "beta gamma", "delta"]
    bodies = [
        ({"structured_outputs": {"regex": pattern}}, lambda t: re.fullmatch(pattern, t)),
        ({"guided_regex": pattern}, lambda t: re.fullmatch(pattern, t)),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"structured_outputs": {"grammar": 'start: "x" ("," "y"){0,3}'}},
         lambda t: re.fullmatch(r"x(,y){0,3}", t)),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]
    for body, ok in bodies:
        for i in (0, 1):
            r = chat(client, "pick", extra_body=body, max_tokens=40, **sampling(i))
            assert r.choices[0].finish_reason == "stop", body
            assert ok(r.choices[0].message.content), (body, r.choices[0].message.content)


# ---- tool calling ------------------------------------------------------------------------------


def check_calls(calls: list, allowed: dict[str, Any]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_named_tool_choice_every_schema(client: openai.OpenAI) -> None:
    assert len(SCHEMA_TOOLS) >= 20
    cases = [(tool, i) for tool in SCHEMA_TOOLS for i in (0, 1)]

    def one(case: tuple[dict, int]) -> tuple[str, Any]:
        tool, i = case
        name = tool["function"]["name"]
        return name, chat(client, "call it", tools=[tool, *TOOLS], **sampling(i),
                          tool_choice={"type": "function", "function": {"name": name}})

    for name, r in parallel(one, cases):
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"  # vLLM keeps "stop" for a named function
        assert [c.function.name for c in msg.tool_calls] == [name]
        check_calls(msg.tool_calls, {name: TOOL_SCHEMAS[name]})


def test_required_tool_choice(client: openai.OpenAI) -> None:
    """One call (parallel_tool_calls false: at most one) over 20+ schemas validates, greedy
    and sampled. Parallel calls are an unbounded array that the random model keeps
    extending: a reply cut by max_tokens ("length") is an incomplete array, as in vLLM, and
    one that ends validates call by call."""
    cases = [(tools, par, i) for tools in (TOOLS, SCHEMA_TOOLS[:10], SCHEMA_TOOLS[10:])
             for par in (False, True) for i in (0, 1)]

    def one(case: tuple[list, bool, int]) -> tuple[list, bool, Any]:
        tools, par, i = case
        return tools, par, chat(client, "use a tool", tools=tools, tool_choice="required",
                                parallel_tool_calls=par, max_tokens=200, **sampling(i))

    for tools, par, r in parallel(one, cases):
        c = r.choices[0]
        allowed = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        if par and c.finish_reason == "length":
            assert c.message.content.startswith('[{"name":"') and not c.message.tool_calls
            continue
        assert c.finish_reason == "tool_calls", c.message
        check_calls(c.message.tool_calls, allowed)
        if not par:
            assert len(c.message.tool_calls) == 1
    for tool in SCHEMA_TOOLS[1:]:  # every schema, one call each
        r = chat(client, "use it", tools=[SCHEMA_TOOLS[0], tool], tool_choice="required",
                 parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=len(tool))
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls, TOOL_SCHEMAS)


# an object of one declared key and no word on additionalProperties: vLLM's default backend
# allows no other key, and so does this server. A logit_bias towards ',' and '"' makes the
# random model reach for another key at once wherever the grammar lets it
ONE_KEY = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}}, "required": ["a"]}


def test_omitted_additional_properties_means_none_in_every_path(
        client: openai.OpenAI, tiny_model_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(tiny_model_dirs["qwen2"])
    assert tok is not None
    bias = {str(tok.encode(t, add_special_tokens=False)[0]): b for t, b in ((",", 8), ('"', 6))}
    one = [{"type": "function", "function": {"name": "one", "parameters": ONE_KEY}}]
    paths = {
        "response_format": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "one", "schema": ONE_KEY}}},
        "guided_json": {"extra_body": {"guided_json": ONE_KEY}},
        "structured_outputs": {"extra_body": {"structured_outputs": {"json": ONE_KEY}}},
        "named tool": {"tools": one, "tool_choice": {"type": "function",
                                                     "function": {"name": "one"}}},
        "required tool": {"tools": one, "tool_choice": "required",
                          "parallel_tool_calls": False},
    }
    for path, kw in paths.items():
        for i in (0, 1):
            r = chat(client, "one key", max_tokens=40, logit_bias=bias, **kw, **sampling(i))
            c = r.choices[0]
            text = c.message.tool_calls[0].function.arguments if c.message.tool_calls \
                else c.message.content
            assert c.finish_reason in ("stop", "tool_calls"), (path, i, text)
            assert set(json.loads(text)) == {"a"}, (path, i, text)


def test_forced_call_outranks_response_format(client: openai.OpenAI) -> None:
    """As vLLM: tool_choice required (or named) with a response_format answers the call (the
    tools' grammar); the format is for a text answer, which a forced call has not. The
    OpenAI Agents SDK sends both on every turn of an agent with an output_type."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}}}
    for choice in ("required", {"type": "function", "function": {"name": TOOLS[0]["function"][
            "name"]}}):
        r = chat(client, "use a tool", tools=TOOLS, tool_choice=choice, response_format=fmt,
                 parallel_tool_calls=False, max_tokens=200, temperature=0.0)
        assert r.choices[0].message.tool_calls, r.choices[0]
        check_calls(r.choices[0].message.tool_calls, TOOL_SCHEMAS)


def stream_tool_calls(client: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, dict], str]:
    """A streamed reply accumulated as OpenAI clients do: content, calls by index, reason."""
    content, calls, reason = "", {}, None
    for chunk in chat(client, "stream a call", stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"id": None, "name": "", "arguments": "",
                                                 "deltas": 0})
                acc["id"] = d.id or acc["id"]
                if d.function is not None:
                    acc["name"] += d.function.name or ""
                    acc["arguments"] += d.function.arguments or ""
                    acc["deltas"] += bool(d.function.arguments)
            reason = c.finish_reason or reason
    return content, calls, reason


def test_streamed_tool_calls(client: openai.OpenAI) -> None:
    name = "get_weather"
    _, calls, reason = stream_tool_calls(
        client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
        temperature=1.0, seed=2)
    assert reason == "stop" and list(calls) == [0] and calls[0]["name"] == name
    assert calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOL_SCHEMAS[name])
    _, calls, reason = stream_tool_calls(client, tools=TOOLS, tool_choice="required",
                                         max_tokens=200, temperature=0,
                                         parallel_tool_calls=False)
    assert reason == "tool_calls" and calls
    for acc in calls.values():
        jsonschema.validate(json.loads(acc["arguments"]), TOOL_SCHEMAS[acc["name"]])


def test_auto_tool_choice_parses_hermes_calls(client: openai.OpenAI) -> None:
    """The model writes Qwen's <tool_call> format (a regex makes the random model do so),
    and the hermes parser turns it into tool_calls, whole and streamed."""
    body = {"structured_outputs": {"regex": HERMES_ADD}}
    r = chat(client, "add 1 2", tools=TOOLS, tool_choice="auto", extra_body=body, max_tokens=80,
             temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["add"]
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments),
                        TOOL_SCHEMAS["add"])
    content, calls, reason = stream_tool_calls(client, tools=TOOLS, extra_body=body,
                                               max_tokens=80, temperature=0)
    assert reason == "tool_calls" and content == "" and calls[0]["name"] == "add"
    # streamed as generated (name first, then argument deltas), the same text in the end
    assert calls[0]["arguments"] == c.message.tool_calls[0].function.arguments
    assert calls[0]["deltas"] > 2
    # without a call in the text the reply is plain content
    r = chat(client, "hello", tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason != "tool_calls" and not r.choices[0].message.tool_calls


def test_tool_history_renders(client: openai.OpenAI) -> None:
    """Assistant turns with tool_calls and tool results go through the template: the
    prompt grows by what they render to."""
    base = [{"role": "user", "content": "add 1 and 2"}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [*base, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    short = client.chat.completions.create(model=MODEL, messages=base, tools=TOOLS,
                                           max_tokens=2, tool_choice="none")
    long = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                          max_tokens=2, tool_choice="none")
    no_tools = client.chat.completions.create(model=MODEL, messages=base, max_tokens=2)
    assert short.usage.prompt_tokens > no_tools.usage.prompt_tokens + 50  # the tools block
    assert long.usage.prompt_tokens > short.usage.prompt_tokens + 20


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, "invalid json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format type"),
    ({"extra_body": {"structured_outputs": {"regex": "(["}}}, "invalid regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: ???"}}}, "invalid grammar"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "only one"),
    ({"extra_body": {"structured_outputs": {"bogus": 1}}}, "Unrecognized"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tool_choice": "required"}, "requires tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
])
def test_bad_specs_are_400(client: openai.OpenAI, kw: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "x", max_tokens=4, **kw)
    assert words in e.value.message
    assert chat(client, "still serving", max_tokens=2).choices[0].finish_reason == "length"


def test_auto_needs_the_flags(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """As vLLM: tools with tool_choice auto (the default with tools) need
    --enable-auto-tool-choice and --tool-call-parser; required and named do not."""
    with ServerProcess(tiny_model_dirs["qwen2"], ARGS, log_path=tmp_path / "s.log") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for choice in ("auto", None):
            kw = {} if choice is None else {"tool_choice": choice}
            with pytest.raises(openai.BadRequestError) as e:
                chat(c, "x", tools=TOOLS, max_tokens=4, **kw)
            assert "--enable-auto-tool-choice" in e.value.message
        r = chat(c, "x", tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
                 parallel_tool_calls=False)
        check_calls(r.choices[0].message.tool_calls, TOOL_SCHEMAS)


# grammars that compile but cannot be matched (llguidance reports these only once matching
# starts): each a 400 naming the field the client sent, found before the engine sees it
SELF_REF = {"$ref": "#"}
REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
             "$ref": "#/$defs/a"}


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": SELF_REF}}},
     "response_format"),
    ({"extra_body": {"guided_json": REF_CYCLE}}, "guided_json"),
    ({"extra_body": {"guided_choice": [f"c{i}" for i in range(2001)]}}, "guided_choice"),
    ({"extra_body": {"guided_regex": "[^\\x00-\\x{10FFFF}]"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "start: /a{1000000}/"}}, "guided_grammar"),
    ({"extra_body": {"structured_outputs": {"grammar": 'root ::= root "a"'}}},
     "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": SELF_REF}}],
      "tool_choice": "required"}, "tools"),
])
def test_unmatchable_grammars_are_400(client: openai.OpenAI, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "x", max_tokens=4, **kw)
    body = e.value.body or {}
    assert body.get("param") == param, body
    assert "structured output" in e.value.message and len(e.value.message) < 400
    assert chat(client, "still serving", max_tokens=2).choices[0].finish_reason == "length"
