"""``POST /v1/responses``: OpenAI's Responses API, as vLLM serves it, on the chat path.

A Responses request is translated into the chat request it means (``instructions`` the
system message; ``input`` items into messages, ``function_call`` items into an assistant
turn's ``tool_calls`` and ``function_call_output`` items into tool messages; ``tools`` from
the flat Responses shape to chat's nested one; ``text.format`` into ``response_format``;
``reasoning.effort`` into ``reasoning_effort``) and run through the very checks, template,
tool parsers and reasoning parser that chat completions use. The chat body that comes back
is reshaped into a ``response`` object: a ``reasoning`` item, a ``message`` item with its
``output_text`` and one ``function_call`` item per parsed call.

Responses are stored (``store``, true by default as OpenAI's) in the bounded, per-tenant
store of server/openai_api/response_store.py; ``previous_response_id`` puts the stored conversation
between this request's instructions and its input. ``GET /v1/responses/{id}`` answers a
stored response, ``DELETE`` forgets it, and ``POST /v1/responses/{id}/cancel`` is vLLM's
400 (no response here runs in the background).

Refused with a 400 rather than dropped: built-in tools (web search, file search, computer
use, code interpreter, MCP...: nothing here can run them), ``background``, ``include``,
``truncation: "auto"``, non-text input parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from hlserve.server.openai_api.completion_bodies import chat_body
from hlserve.server.openai_api.generation import (
    chat_reasoning,
    chat_tool_plan,
    collect,
    constrain,
    sampling,
    submit,
)
from hlserve.server.openai_api.intake import (
    OFFLOAD_CHARS,
    Inbound,
    caller_of,
    check_model,
    client_of,
    parse,
    parse_body,
    read_body,
)
from hlserve.server.openai_api.prompts import encode_chat
from hlserve.server.openai_api.response_store import (
    StoredResponse,
    output_messages,
    previous_not_found,
    response_not_found,
    tenant_of,
)
from hlserve.server.openai_api.state import ServerState, state_of
from hlserve.server.openai_api.streaming import ChatChunks, EngineStreamResponse
from hlserve.server.protocol import (
    INT32_MAX,
    MAX_IDENTIFIER_CHARS,
    ApiError,
    ChatCompletionRequest,
    Identifier,
    Metadata,
    _Strict,
    new_id,
    now_s,
    validation_error,
)
from hlserve.server.responses.output_items import (
    ResponseEvents,
    final_status,
    function_call_item,
    item_id,
    message_item,
    reasoning_item,
    response_stream,
    response_usage,
)
from hlserve.server.tools.agent_checks import check_response_format, check_tools

# the Responses API's hosted tools: a model served here cannot call any of them
BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                 "code_interpreter", "image_generation", "mcp", "local_shell")


def _refuse(message: str, param: str, code: str = "unsupported_parameter") -> ApiError:
    return ApiError(400, message, param=param, code=code)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    # ids here are 37 characters; OpenAI's do not reach 64
    previous_response_id: Identifier | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # accepted and ignored: they do not change what is generated here
    metadata: Metadata | None = None
    user: Identifier | None = None
    service_tier: str | None = None
    prompt_cache_key: Identifier | None = None
    safety_identifier: Identifier | None = None
    # vLLM's extras on this endpoint
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    priority: int = 0
    request_class: Literal["interactive", "agent"] | None = None
    cache_salt: str | None = None

    def check_supported(self) -> None:
        if self.background:
            raise _refuse("background responses are not supported", "background")
        if self.include:
            raise _refuse(f"include {self.include!r} is not supported", "include")
        if self.truncation == "auto":
            raise _refuse("truncation 'auto' is not supported: a conversation longer than the "
                          "context is refused", "truncation")


# ---- input items -> chat messages -------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where}.content must be a string or a list of parts", "input",
                      "invalid_value")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise _refuse(f"{where}.content[{i}] has type {kind!r}; this model accepts only "
                          "text parts", "input")
        texts.append(part["text"])
    return "".join(texts)


def _item_message(item: dict[str, Any], where: str, messages: list[dict[str, Any]]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise _refuse(f"{where}.role must be user, assistant, system or developer; got "
                          f"{role!r}", "input", "invalid_value")
        messages.append({"role": role, "content": _text_of(item.get("content"), where)})
    elif kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
            raise _refuse(f"{where}: a function_call needs a name and string arguments", "input",
                          "invalid_value")
        for key in ("call_id", "id", "name"):
            _identifier(item, key, where)
        call = {"id": item.get("call_id") or item.get("id") or new_id("call"), "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
            raise _refuse(f"{where}: a function_call_output needs a call_id and an output",
                          "input", "invalid_value")
        _identifier(item, "call_id", where)
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text_of(output, where)})
    elif kind == "reasoning":  # earlier reasoning is not shown to the model again (as chat
        _identifier(item, "id", where)  # drops it), but typed as OpenAI types it
        if not isinstance(item.get("summary", []), list):
            raise _refuse(f"{where}.summary must be a list", f"{where}.summary", "invalid_type")
    else:
        raise _refuse(f"{where} has type {kind!r}; this server takes message, function_call, "
                      "function_call_output and reasoning items", "input")


def _identifier(item: dict[str, Any], key: str, where: str) -> None:
    """An item's id, call id or function name: absent, or a string of at most OpenAI's 64
    characters (OpenAI and vLLM take only strings; an integer or object is a 400, not a call
    id the template renders as whatever it is)."""
    value = item.get(key)
    if value is None:
        return
    if not isinstance(value, str):
        raise _refuse(f"{where}.{key} must be a string, got {type(value).__name__}",
                      f"{where}.{key}", "invalid_type")
    if len(value) > MAX_IDENTIFIER_CHARS:
        raise _refuse(f"{where}.{key} may be at most {MAX_IDENTIFIER_CHARS} characters long "
                      f"(it has {len(value)})", f"{where}.{key}", "invalid_value")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` items as chat messages (a list of their own: a call that
    follows a stored turn's calls never joins that stored message)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        _item_message(item, f"input[{i}]", messages)
    return messages


def chat_messages(req: ResponsesRequest, history: tuple[dict[str, Any], ...] = (),
                  new: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The chat the request means: its instructions, the stored conversation it continues
    (``history``), then its input (``new``: :func:`input_messages`, if already built)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += history
    messages += input_messages(req) if new is None else new
    if not messages:
        raise _refuse("input must not be empty", "input", "invalid_value")
    return messages


# ---- tools, text.format, reasoning -----------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            why = "a hosted tool that this server cannot run" if kind in BUILTIN_TOOLS or \
                str(kind).startswith("web_search") else "not a tool type this server knows"
            raise _refuse(f"tools[{i}] has type {kind!r}: {why}; only function tools are "
                          "supported", "tools")
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise _refuse(f"tools[{i}] has keys this server does not read: {sorted(extra)}",
                          "tools", "invalid_value")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise _refuse(f"tools[{i}].strict must be a boolean, got "
                          f"{type(tool['strict']).__name__}", f"tools.{i}.strict",
                          "invalid_type")
        if tool.get("strict"):
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or set(choice) - {"type", "name"}:
        raise _refuse(f"tool_choice {json.dumps(choice)[:200]} is not supported: a string or "
                      "{'type': 'function', 'name': ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice.get("name")}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    if set(text) - {"format"}:  # verbosity: nothing here could honour it
        raise _refuse(f"text has keys this server does not read: {sorted(set(text))}", "text",
                      "invalid_value")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):  # read as an object below: a string or list is the client's
        raise _refuse(f"text.format must be an object with a type, got {type(fmt).__name__}",
                      "text", "invalid_type")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise _refuse(f"text.format type {fmt.get('type')!r} is not supported", "text",
                  "invalid_value")


def reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    if reasoning is None:
        return None
    if set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise _refuse(f"reasoning has keys this server does not read: {sorted(reasoning)}",
                      "reasoning", "invalid_value")
    if reasoning.get("summary") or reasoning.get("generate_summary"):
        raise _refuse("reasoning summaries are not supported: the reasoning text itself is "
                      "returned when a reasoning parser is set", "reasoning")
    return reasoning.get("effort")


def to_chat(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request means, over ``messages`` (:func:`chat_messages`);
    built through chat's own model so that every field is checked as chat checks it."""
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream,
        "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
        "response_format": chat_response_format(req.text),
        "reasoning_effort": reasoning_effort(req.reasoning), "priority": req.priority,
        "request_class": req.request_class, "cache_salt": req.cache_salt,
        # an agent session's name, as chat's (engine/sessions.py's precedence)
        "prompt_cache_key": req.prompt_cache_key, "user": req.user}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None or k in ("model",)})
    except ValidationError as e:
        raise validation_error(e) from None


# ---- the handler ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """What a response adds to its chain once it is done: the stored response it continues
    (``previous``), its own input as chat messages, and where it is kept (``tenant``;
    ``store``: whether it is)."""

    tenant: str | None
    previous: StoredResponse | None
    new_messages: list[dict[str, Any]]
    store: bool

    def keep(self, st: ServerState, response: dict[str, Any]) -> None:
        if self.store:
            st.responses.put(self.tenant, response, self.previous,
                             [*self.new_messages, *output_messages(response["output"])])


def continued_turn(request: Request, st: ServerState, req: ResponsesRequest) -> Turn:
    """The stored conversation ``previous_response_id`` names (400 if this tenant holds no
    such response) and whether this response is to be stored."""
    tenant = tenant_of(request)
    previous = None
    if req.previous_response_id is not None:
        previous = st.responses.get(tenant, req.previous_response_id)
        if previous is None:
            raise previous_not_found(req.previous_response_id)
    # store off (--responses-store-max 0): store=true is quietly false, as vLLM's default
    store = req.store is not False and st.responses.enabled
    return Turn(tenant, previous, input_messages(req), store)


async def read_responses_request(request: Request
                                 ) -> tuple[ResponsesRequest, Inbound, Turn]:
    st = state_of(request)
    arrival = st.clock()
    body = await read_body(request, st.settings.max_request_body_bytes)
    offload, client = len(body) > OFFLOAD_CHARS, client_of(request)
    # a large body counted and parsed off the event loop, as chat's (intake.read_request)
    req = await parse_body(st, body, ResponsesRequest, client) if offload \
        else parse(body, ResponsesRequest)
    check_model(st, req.model)
    req.check_supported()
    turn = continued_turn(request, st, req)
    history = turn.previous.conversation if turn.previous is not None else ()
    chat = to_chat(req, chat_messages(req, history, turn.new_messages))
    chat.check_supported()
    check_response_format(chat.response_format)
    check_tools(chat.tools, chat.tool_choice)
    chat = st.sampling_defaults.apply(chat)
    return req, Inbound(chat, caller_of(request, st, chat), arrival, offload, client), turn


async def create_response(request: Request) -> Response:
    st = state_of(request)
    req, inbound, turn = await read_responses_request(request)
    chat = inbound.req
    ids = await encode_chat(st, chat, inbound.offload, inbound.client)
    params = (await constrain(st, chat, [sampling(st, chat, len(ids))], inbound.client))[0]
    rid = item_id("resp")
    group = await submit(st, rid, [ids], [params], inbound)
    model = chat.model or st.model_name
    shell = response_shell(rid, model, req, turn.store)
    if req.stream:
        fmt = ChatChunks(rid, model, False, st.tokenizer)
        fmt.tool_plan = chat_tool_plan(st, chat)[0]
        fmt.reasoning = chat_reasoning(st, chat)
        events = ResponseEvents(shell, on_final=partial(turn.keep, st))
        return EngineStreamResponse(response_stream(group, fmt, chat.stream_options, events),
                                    group.abort_unfinished)
    outs = await collect(request, group)
    if outs is None:
        return Response(status_code=499)
    response = finish_response(shell, chat_body(st, rid, model, chat, outs))
    turn.keep(st, response)
    return JSONResponse(response)


def response_shell(rid: str, model: str, req: ResponsesRequest, store: bool) -> dict[str, Any]:
    """The ``response`` object before any output: what ``response.created`` carries."""
    return {"id": rid, "object": "response", "created_at": now_s(), "status": "in_progress",
            "model": model, "output": [], "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "previous_response_id": req.previous_response_id, "store": store,
            "truncation": "disabled", "metadata": req.metadata, "error": None,
            "incomplete_details": None, "usage": None, "user": req.user}


# ---- stored responses: GET, DELETE, cancel ----------------------------------------------------


async def get_response(request: Request, response_id: str) -> Response:
    """A stored response as it was answered (vLLM's 404 for one this tenant does not hold).
    ``stream`` / ``starting_after`` replay a background response's events: none here."""
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise _refuse("stream=true replays a background response's events; this server runs "
                      "no background responses", "stream")
    entry = state_of(request).responses.get(tenant_of(request), response_id)
    if entry is None:
        raise response_not_found(response_id)
    return Response(entry.body, media_type="application/json")  # as it was answered


async def delete_response(request: Request, response_id: str) -> JSONResponse:
    """OpenAI's ``DELETE /v1/responses/{id}``: the response is forgotten; a continuation of
    it is then a 400."""
    if not state_of(request).responses.delete(tenant_of(request), response_id):
        raise response_not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request, response_id: str) -> JSONResponse:
    """vLLM cancels only a background response; every response here is synchronous."""
    if state_of(request).responses.get(tenant_of(request), response_id) is None:
        raise response_not_found(response_id)
    raise _refuse("Cannot cancel a synchronous response.", "response_id", "invalid_value")


def finish_response(shell: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """``shell`` completed from a whole chat body: its output items, status and usage."""
    choice = body["choices"][0]
    msg = choice["message"]
    items: list[dict[str, Any]] = []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    if msg.get("reasoning_content"):
        items.append(reasoning_item(item_id("rs"), msg["reasoning_content"]))
    if msg.get("content"):
        items.append(message_item(item_id("msg"), msg["content"], status))
    for call in msg.get("tool_calls") or ():
        items.append(function_call_item(item_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], status))
    return {**shell, **final_status(choice["finish_reason"]), "output": items,
            "usage": response_usage(body["usage"])}
