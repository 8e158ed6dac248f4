"""``POST /v1/responses`` through the official ``openai`` SDK's ``client.responses`` against
a real ``hlserve serve`` of the tiny model: plain and streamed answers (the streamed events
add up to the unstreamed response), a two-turn function-calling loop fed back with
``function_call_output`` items and rendered as the equivalent chat, structured
``text.format``, and 400s for what is not served (hosted tools, background responses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support import ADD_TOOL as ADD
from support import RESPONSES_MODEL as MODEL
from support import responses_server

GREEDY = {"temperature": 0.0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    with responses_server(tiny_model_dirs["qwen2"], tmp_path_factory.mktemp("responses_api")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat_ids(server, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
             ) -> list[int]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if tools:
        body["tools"] = tools
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_plain_and_streamed(client: openai.OpenAI, server) -> None:
    """A string input with instructions: the same text as chat's greedy answer to the same
    messages, usage counting the rendered prompt; the stream's deltas add up to it."""
    r = client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.",
                                **GREEDY)
    assert r.object == "response" and r.status == "incomplete"  # 12 tokens: cut by length
    assert r.incomplete_details.reason == "max_output_tokens"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    c = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0,
                                       max_completion_tokens=12)
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == len(chat_ids(server, messages))
    assert r.usage.output_tokens == 12 == r.usage.total_tokens - r.usage.input_tokens

    kinds, text, final = [], "", None
    for ev in client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.",
                                      stream=True, **GREEDY):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert text == r.output_text == final.output_text
    assert final.usage.output_tokens == 12


def test_function_call_loop(client: openai.OpenAI, server) -> None:
    """Turn 1: a named tool_choice gives a function_call item (streamed, its argument deltas
    add up to the unstreamed call). Turn 2: the call and its function_call_output fed back
    render exactly as the chat history with tool_calls and a tool message."""
    ask = [{"role": "user", "content": "What is 1 + 2?"}]
    choice = {"type": "function", "name": "add"}
    r = client.responses.create(model=MODEL, input=ask, tools=[ADD], tool_choice=choice,
                                temperature=0.0, max_output_tokens=40)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    call = calls[0]
    args = json.loads(call.arguments)
    assert call.name == "add" and set(args) == {"a", "b"}

    streamed, names, done_args = "", [], None
    for ev in client.responses.create(model=MODEL, input=ask, tools=[ADD], tool_choice=choice,
                                      temperature=0.0, max_output_tokens=40, stream=True):
        if ev.type == "response.output_item.added":
            names.append(ev.item.name)
        if ev.type == "response.function_call_arguments.delta":
            streamed += ev.delta
        if ev.type == "response.function_call_arguments.done":
            done_args = ev.arguments
    assert names == ["add"] and streamed == done_args == call.arguments

    result = str(args["a"] + args["b"])
    history = [*ask, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    r2 = client.responses.create(model=MODEL, input=history, tools=[ADD], tool_choice="none",
                                 **GREEDY)
    assert not [o for o in r2.output if o.type == "function_call"] and r2.output_text
    chat_history = [*ask, {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.call_id, "type": "function",
        "function": {"name": "add", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    assert r2.usage.input_tokens == len(chat_ids(server, chat_history, [chat_tool(ADD)]))


def test_structured_text_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name a city.", temperature=0.0,
                                max_output_tokens=60, text={"format": {
                                    "type": "json_schema", "name": "c", "schema": schema}})
    assert r.status == "completed"
    assert set(json.loads(r.output_text)) == {"city"}
    r = client.responses.create(model=MODEL, input="JSON please.", temperature=0.0,
                                max_output_tokens=60, text={"format": {"type": "json_object"}})
    # the random tiny model may not close the object within the budget: the grammar still
    # made it start as one
    assert r.output_text.lstrip().startswith("{")


def test_omitted_additional_properties_means_none(client: openai.OpenAI) -> None:
    """text.format json_schema and a forced function's parameters, both leaving
    additionalProperties out: the output has the declared key and no other, as vLLM's
    default backend gives (sampled: a permissive grammar lets the random model add keys)."""
    one = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}}, "required": ["a"]}
    tool = {"type": "function", "name": "one", "parameters": one}
    for seed in range(6):
        kw: dict[str, Any] = {"model": MODEL, "input": "one key", "temperature": 1.0,
                              "max_output_tokens": 40, "extra_body": {"seed": seed}}
        r = client.responses.create(**kw, text={"format": {"type": "json_schema",
                                                           "name": "one", "schema": one}})
        assert r.status == "completed" and set(json.loads(r.output_text)) == {"a"}, r.output_text
        r = client.responses.create(**kw, tools=[tool],
                                    tool_choice={"type": "function", "name": "one"})
        call = r.output[-1]
        assert call.type == "function_call" and set(json.loads(call.arguments)) == {"a"}, call


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools", "hosted tool"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools",
     "hosted tool"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning", "summaries"),
    ({"input": [{"type": "message", "role": "user",
                 "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input", "only text"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"background": True}, "background", "not supported"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning_effort", "must be one of"),
    ({"text": {"format": "json_object"}}, "text", "must be an object"),
    ({"text": {"format": ["json_object"]}}, "text", "must be an object"),
    ({"text": {"format": 5}}, "text", "must be an object"),
    # OpenAI's metadata: at most 16 string pairs, keys of 64 characters, values of 512
    ({"metadata": {"k": [0.5] * 1000}}, "metadata.k", "valid string"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 items"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "at most 64 characters"),
    # identifiers: OpenAI's 64 characters
    ({"user": "u" * 65}, "user", "at most 64 characters"),
    ({"prompt_cache_key": "p" * 65}, "prompt_cache_key", "at most 64 characters"),
    ({"safety_identifier": "s" * 65}, "safety_identifier", "at most 64 characters"),
    ({"previous_response_id": "r" * 65}, "previous_response_id", "at most 64 characters"),
    ({"input": [{"type": "function_call", "call_id": 7, "name": "add", "arguments": "{}"}]},
     "input[0].call_id", "must be a string"),
    ({"input": [{"type": "function_call", "call_id": {"a": 1}, "name": "add",
                 "arguments": "{}"}]}, "input[0].call_id", "must be a string"),
    ({"input": [{"type": "function_call", "call_id": "c" * 65, "name": "add",
                 "arguments": "{}"}]}, "input[0].call_id", "at most 64 characters"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "n" * 65,
                 "arguments": "{}"}]}, "input[0].name", "at most 64 characters"),
    ({"input": [{"type": "function_call_output", "call_id": "c" * 65, "output": "3"}]},
     "input[0].call_id", "at most 64 characters"),
    ({"tools": [{**ADD, "name": "f" * 65}]}, "tools.0.function.name", "at most 64 characters"),
    ({"tools": [ADD, {**ADD, "description": "another"}]}, "tools", "names must be unique"),
])
def test_refused(client: openai.OpenAI, fields: dict[str, Any], param: str, words: str) -> None:
    fields.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=4, **fields)
    body = e.value.body
    assert body["param"] == param and words in body["message"], body


def test_reasoning_effort_reaches_template(client: openai.OpenAI) -> None:
    """``reasoning.effort`` is chat's ``reasoning_effort``: accepted values are honoured as
    chat honours them (the same greedy answer as chat with the same effort)."""
    r = client.responses.create(model=MODEL, input="Hi.", reasoning={"effort": "none"},
                                **GREEDY)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}],
                                       reasoning_effort="none", temperature=0.0,
                                       max_completion_tokens=12)
    assert r.output_text == c.choices[0].message.content
