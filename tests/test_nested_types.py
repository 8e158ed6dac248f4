"""No 500 from any field: a wrong type at every depth of every request body is a 4xx.

test_api_fuzz.py draws bodies from ``/openapi.json``, which says only "object" for the
nested shapes the handlers read themselves (messages' content parts, ``tools``,
``tool_choice``, ``response_format``, the Responses API's ``input`` items, ``text.format``,
``reasoning``...). Here each endpoint has valid base bodies that fill every field, nested
ones included, and the value at every path of them (every key and list index at every depth)
is replaced in turn by each value of another JSON type, deterministically. Every answer must
be below 500, an error must be in OpenAI's format, and the engine must serve a normal
request afterwards. The app runs in-process (FastAPI's TestClient) on the tiny Qwen2 model
with the hermes tool parser and a reasoning parser; the bodies cap ``max_tokens`` at 1.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from hlserve.llm import LLM
from hlserve.server.app import create_app
from hlserve.server.runtime.settings import ServerSettings

MODEL = "tiny"
CONCURRENCY = 8  # requests in flight at once
# one of each JSON type, plus the edges of numbers: an int past int64, a float past float32
WRONG = ("x", 7, 2**70, 1e308, True, None, [], [1, "a"], {}, {"k": 1})

ADD_PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b",
                                              "parameters": ADD_PARAMS, "strict": False}}
HISTORY = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "add 1 and 2"}], "name": "u"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    {"role": "user", "content": "thanks"},
]
SAMPLING = {"model": MODEL, "max_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "min_p": 0.1, "seed": 1, "n": 1, "presence_penalty": 0.1, "frequency_penalty": 0.1,
            "repetition_penalty": 1.1, "logit_bias": {"5": 1.0},
            "stop_token_ids": [3], "include_stop_str_in_output": False, "min_tokens": 0,
            "user": "u", "session_id": "s", "prompt_cache_key": "k", "cache_salt": "salt",
            "priority": 0, "request_class": "interactive", "safety_identifier": "id",
            "return_token_ids": False, "skip_special_tokens": True, "ignore_eos": False}
CHAT = {**SAMPLING, "messages": HISTORY, "logprobs": True, "top_logprobs": 1,
        "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
        "prediction": {"type": "content", "content": "x"}, "modalities": ["text"],
        "reasoning_effort": "low", "add_generation_prompt": True,
        "chat_template_kwargs": {"enable_thinking": False}, "parallel_tool_calls": True,
        "thinking_token_budget": 8}
COMPLETION = {**SAMPLING, "prompt": "hello", "stop": ["zz"], "best_of": 1, "echo": False, "logprobs": 1,
              "suffix": None}
BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {**CHAT, "tools": [CHAT_TOOL], "tool_choice": "auto", "stop": ["zz"]},
        {**CHAT, "tools": [CHAT_TOOL], "tool_choice": {"type": "function",
                                                        "function": {"name": "add"}}},
        {**CHAT, "max_tokens": None, "max_completion_tokens": 1, "stream": True, "stream_options": {"include_usage": True,
                                                    "continuous_usage_stats": False}},
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "description": "d", "schema": ADD_PARAMS, "strict": True}}},
        {**CHAT, "response_format": {"type": "json_object"}},
        {**CHAT, "structured_outputs": {"choice": ["a", "b"]}},
        {**CHAT, "guided_json": ADD_PARAMS},
        {**CHAT, "guided_regex": "[ab]"},
        {**CHAT, "guided_choice": ["a", "b"]},
        {**CHAT, "guided_grammar": "root ::= \"a\""},
    ],
    "/v1/completions": [
        COMPLETION,
        {**COMPLETION, "prompt": [[5, 6], [7]], "stream": True,
         "stream_options": {"include_usage": True}},
        {**COMPLETION, "prompt": ["a", "b"], "thinking_token_budget": 4},
        {**COMPLETION, "stop": None, "response_format": {"type": "json_object"}},
        {**COMPLETION, "stop": None, "structured_outputs": {"regex": "[ab]"}},
        {**COMPLETION, "stop": None, "guided_json": ADD_PARAMS},
        {**COMPLETION, "stop": None, "guided_regex": "[ab]"},
        {**COMPLETION, "stop": None, "guided_choice": ["a", "b"]},
        {**COMPLETION, "stop": None, "guided_grammar": "root ::= \"a\""},
    ],
    "/tokenize": [
        {"model": MODEL, "prompt": "hi", "add_special_tokens": True, "return_token_strs": True},
        {"model": MODEL, "messages": HISTORY, "add_generation_prompt": True,
         "continue_final_message": False, "add_special_tokens": False,
         "chat_template_kwargs": {"enable_thinking": False}, "tools": [CHAT_TOOL],
         "return_token_strs": False},
    ],
    "/detokenize": [{"model": MODEL, "tokens": [5, 6]}],
    "/v1/responses": [
        {"model": MODEL, "instructions": "be brief", "input": [
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "add 1 and 2"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "add",
             "arguments": "{\"a\": 1, \"b\": 2}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "3"},
            {"role": "assistant", "content": "3"},
            {"type": "message", "role": "user", "content": "thanks"}],
         "tools": [{"type": "function", "name": "add", "description": "a + b",
                    "parameters": ADD_PARAMS, "strict": False}],
         "tool_choice": {"type": "function", "name": "add"}, "parallel_tool_calls": True,
         "max_output_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 1,
         "reasoning": {"effort": "low"}, "store": False, "metadata": {"a": "b"},
         "user": "u", "service_tier": "auto", "prompt_cache_key": "k",
         "safety_identifier": "id", "priority": 0, "request_class": "interactive",
         "cache_salt": "salt", "truncation": "disabled", "background": False, "include": [],
         "previous_response_id": None},
        {"model": MODEL, "input": "hi", "max_output_tokens": 1, "stream": True, "store": False,
         "text": {"format": {"type": "json_schema", "name": "n", "description": "d",
                             "schema": ADD_PARAMS, "strict": True}}},
        {"model": MODEL, "input": "hi", "max_output_tokens": 1, "store": False,
         "text": {"format": {"type": "json_object"}}, "tool_choice": "none"},
    ],
}


def paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key and list index of ``obj``, at every depth."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) \
        else ()
    for key, value in items:
        yield (*prefix, key)
        yield from paths(value, (*prefix, key))


def replaced(body: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def cases() -> Iterator[tuple[str, tuple, dict[str, Any]]]:
    """(endpoint, path, body) for every path of every base body and every wrong value of
    another type than the one there (the huge numbers go everywhere). A field that a later base of an endpoint shares with
    its first is varied in the first only."""
    for endpoint, bodies in BODIES.items():
        for base in bodies:
            for path in paths(base):
                if base is not bodies[0] and bodies[0].get(path[0]) == base[path[0]]:
                    continue
                old = _value_at(base, path)
                for value in WRONG:
                    huge = isinstance(value, (int, float)) and abs(value) > 2**64
                    if type(value) is not type(old) or huge:
                        yield endpoint, path, replaced(base, path, value)


def _value_at(body: dict[str, Any], path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


@dataclass
class Run:
    """What the app answered: the base bodies' statuses, the mutations' problems, and the
    normal request sent after them all."""

    spec: dict[str, Any]
    base_status: list[tuple[str, int, str]]
    seen: int
    failed: list[str]
    after: httpx.Response
    accepted: list[tuple[str, str, Any]]  # (endpoint, dotted path, value) answered 200


async def exercise(app: Any) -> Run:
    """Every base body, then every mutation, CONCURRENCY at a time (the engine batches the
    accepted ones), then a normal request; in-process over ASGI, the app's lifespan run."""
    failed: list[str] = []
    accepted: list[tuple[str, str, Any]] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    # a handler's exception is answered 500 by the app: recorded below, not raised here
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=60) as c:

        async def one(endpoint: str, path: tuple, body: dict[str, Any]) -> None:
            async with gate:
                r = await c.post(endpoint, json=body)
            if (why := problem(r, body)) is not None:
                value = json.dumps(_value_at(body, path))
                failed.append(f"{endpoint} {'.'.join(map(str, path))} = {value} -> {why}")
            elif r.status_code == 200:
                accepted.append((endpoint, ".".join(map(str, path)), _value_at(body, path)))

        spec = (await c.get("/openapi.json")).json()
        base_status = []
        for endpoint, bodies in BODIES.items():
            for body in bodies:
                r = await c.post(endpoint, json=body)
                base_status.append((endpoint, r.status_code, r.text[:300]))
        todo = list(cases())
        await asyncio.gather(*(one(*case) for case in todo))
        after = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "ignore_eos": True})
    return Run(spec, base_status, len(todo), failed, after, accepted)


@pytest.fixture(scope="module")
def run(tiny_model_dirs: dict[str, Path]) -> Run:
    engine = LLM(str(tiny_model_dirs["qwen2"]), dtype="float32", max_model_len=512,
                 num_pages=128, max_num_seqs=CONCURRENCY).engine
    settings = ServerSettings(served_model_names=(MODEL,), tool_call_parser="hermes",
                              enable_auto_tool_choice=True, reasoning_parser="qwen3")
    return asyncio.run(exercise(create_app(engine, settings)))


def problem(r: Any, body: dict[str, Any]) -> str | None:
    """What is wrong with the answer ``r`` to ``body``, if anything."""
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json().get("error")
        if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"} \
                or err["type"] != "invalid_request_error":
            return f"{r.status_code} not in OpenAI's format: {r.text[:300]}"
    elif body.get("stream"):
        # chat's and completions' streams end with [DONE], a response's with its final event
        ends = ("data: [DONE]", '"type":"response.completed"', '"type":"response.incomplete"')
        last = r.text.rstrip().rsplit("\n", 1)[-1]
        if not any(end in last for end in ends) or '"server_error"' in r.text:
            return f"a stream that did not end well: {r.text[-300:]}"
    return None


def test_the_base_bodies_are_valid_and_cover_every_documented_field(run: Run) -> None:
    """Each base body is answered 200 (so a 4xx below is the mutation's), and together
    they fill every top-level field ``/openapi.json`` documents for their endpoint."""
    for endpoint, status, text in run.base_status:
        assert status == 200, (endpoint, text)
    for endpoint, bodies in BODIES.items():
        body_schema = run.spec["paths"][endpoint]["post"]["requestBody"]["content"]
        documented = set()
        for ref in body_schema["application/json"]["schema"].get("anyOf", [
                body_schema["application/json"]["schema"]]):
            name = ref["$ref"].rsplit("/", 1)[1]
            documented |= set(run.spec["components"]["schemas"][name]["properties"])
        sent = {k for body in bodies for k in body}
        assert documented <= sent, (endpoint, sorted(documented - sent))


def test_a_wrong_type_at_any_depth_is_a_4xx(run: Run) -> None:
    assert not run.failed, "\n".join([f"{len(run.failed)} of {run.seen}", *run.failed[:40]])
    assert run.seen > 2000, run.seen  # every path of every base, each with every wrong value
    # the engine still serves
    assert run.after.status_code == 200, run.after.text
    assert run.after.json()["usage"]["completion_tokens"] == 3



# Fields whose type OpenAI (and vLLM's pydantic models) fix, nested where the body models say
# only "object": every other type is a 400, null too unless the field is optional ("null ok").
TYPED = {
    "/v1/chat/completions": (
        (r"tools\.\d+\.(type|function|function\.name)", False),
        (r"tools\.\d+\.function\.(description|strict|parameters)", True),
        (r"messages\.\d+\.tool_calls\.\d+\.type", False),
        (r"messages\.\d+\.tool_calls\.\d+\.(id|function\.name)", True),
        (r"response_format\.json_schema\.(name|description|strict)", True),
        (r"prediction\.(type|content)", False)),
    "/v1/responses": (
        (r"tools\.\d+\.strict", True),
        (r"text\.format\.(name|description|strict)", True),
        (r"input\.\d+\.id", True),
        (r"input\.\d+\.summary", False)),
}
TYPED["/tokenize"] = TYPED["/v1/chat/completions"][:4]  # tools and the history


def test_typed_nested_fields_refuse_every_other_type(run: Run) -> None:
    """Beyond no 5xx: a nested field with a fixed type is a 4xx for any other, not a 200
    that carries the wrong value into a template or a grammar."""
    wrong = [f"{ep} {path} = {json.dumps(value)}" for ep, path, value in run.accepted
             if any(re.fullmatch(pattern, path) and (value is not None or not null_ok)
                    for pattern, null_ok in TYPED.get(ep, ()))
             and not (path == "prediction.content" and value == [])]  # no parts: a list of them
    assert not wrong, "\n".join([f"{len(wrong)} accepted with 200:", *wrong[:40]])
    varied = {(ep, ".".join(map(str, path))) for ep, path, _ in cases()}
    for ep, typed in TYPED.items():  # each pattern names fields the bodies really vary
        for pattern, _ in typed:
            assert any(e == ep and re.fullmatch(pattern, p) for e, p in varied), (ep, pattern)
