"""The OpenAI-compatible HTTP server: ``hlserve serve MODEL_DIR``.

FastAPI on uvicorn, one process. The engine runs in its own thread (see
:mod:`hlserve.server.bridge`); handlers parse and validate a request, tokenize it, hand it to
the engine thread and turn the engine's cumulative outputs into OpenAI responses or SSE
chunks. Nothing here blocks the event loop: large bodies are parsed, templated and tokenized
in a worker thread.

Handlers are module-level functions over one :class:`ServerState` (``app.state.hlserve``);
:func:`add_routes` lists every endpoint: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /tokenize``, ``POST /detokenize`` (and their ``/v1/`` aliases),
``GET|HEAD /health``, ``GET|POST|HEAD /ping``, ``GET /metrics``, ``GET /version``,
``GET /openapi.json`` and ``GET /docs``. Bodies are read by the handlers themselves (a size
limit enforced while reading, strict JSON, OpenAI-shaped errors); the request models are
still what ``/openapi.json`` documents.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hlserve.config import EngineConfig
from hlserve.engine.engine import Engine
from hlserve.errors import EngineDeadError, InvalidRequestError, ServiceUnavailableError
from hlserve.request import RequestOutput, SamplingParams, TokenLogprobs
from hlserve.server.agent_checks import (
    check_constrained,
    check_response_format,
    check_tools,
    parse_tool_call_arguments,
    reasoning_kwargs,
)
from hlserve.server.args import REQUEST_CLASSES, ServerSettings
from hlserve.server.auth import ApiKey, KeyTable
from hlserve.server.bridge import (
    BridgeLimits,
    EngineBridge,
    EventSink,
    RequestFailed,
    RequestGroup,
    Submission,
)
from hlserve.server.defaults import SamplingDefaults
from hlserve.server.guided import named_constraint, request_constraint
from hlserve.server.limits import check_logprob_volume
from hlserve.server.logprobs import chat_logprobs, completion_logprobs
from hlserve.server.metrics import CONTENT_TYPE, ServerMetrics
from hlserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    clip,
    context_length_error,
    error_body,
    invalid_request,
    new_id,
    now_s,
    usage,
    validation_error,
)
from hlserve.server.reasoning import (
    ReasoningParser,
    ReasoningStream,
    apply_reasoning,
    reasoning_for,
)
from hlserve.server.tool_parsers import ToolPlan, ToolStream, apply_tool_calls, tool_plan
from hlserve.structured import StructuredOutputsParams
from hlserve.tokenizer import Tokenizer

log = logging.getLogger("hlserve.server")

KEY_SCOPE = "hlserve.api_key"  # the ApiKey the auth middleware accepted
OFFLOAD_CHARS = 16384  # larger bodies and texts are parsed/templated/tokenized in a thread
HEAD_CHARS_PER_TOKEN = 32  # prompts longer than this x the context are tokenized in part first
HEAD_MARGIN = 16  # tokens a cut can add at its end: a part over context + this is over for sure
OPEN_PATHS = frozenset({"/health", "/ping", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest,
                  TokenizeChatRequest, DetokenizeRequest)

GenerationRequest = TypeVar("GenerationRequest", CompletionRequest, ChatCompletionRequest)


def hlserve_version() -> str:
    try:
        return package_version("hlserve")
    except PackageNotFoundError:
        return "unknown"


class ServerState:
    """What every handler reads: the engine and its bridge, settings, keys, served names."""

    def __init__(self, engine: Engine, settings: ServerSettings, keys: KeyTable,
                 model_path: str) -> None:
        self.engine = engine
        self.settings = settings
        self.keys = keys
        self.model_path = model_path  # for the start-up line only: never sent to clients
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.pool_tokens = engine.kv_pool_tokens
        # reported: --served-model-name, else the directory's base name (not its path);
        # accepted besides: the model argument as given, which clients may already use
        self.model_names = settings.served_model_names or (served_name(model_path),)
        self.accepted_names = frozenset(self.model_names) | (
            frozenset() if settings.served_model_names else {model_path})
        self.model_name = self.model_names[0]
        # with API keys, no tenant may declare itself ahead of the default priority
        self.min_priority = settings.min_priority if settings.min_priority is not None \
            else (0 if keys.enabled else None)
        self.metrics = ServerMetrics(self.model_name)
        self.bridge = EngineBridge(engine, self.metrics, BridgeLimits.from_settings(settings))
        self.clock = engine.clock
        self.created = now_s()
        # generation_config.json's sampling defaults, for fields a request leaves out
        self.sampling_defaults = SamplingDefaults.load(model_path)


def served_name(model_path: str) -> str:
    return Path(model_path).name or Path(model_path).resolve().name or "model"


def state_of(request: Request) -> ServerState:
    return request.app.state.hlserve


# ---- errors and their log line ----------------------------------------------------------------


class ClientGone(Exception):
    """The client closed its connection before its request body was read."""


def engine_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ServiceUnavailableError):
        return unavailable(e)
    if isinstance(e, InvalidRequestError):
        return invalid_request(str(e))
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"The engine is not running: {e}", code="engine_dead")
    if isinstance(e, RequestFailed):
        return ApiError(500, str(e), code="engine_error")
    return ApiError(500, f"Internal error: {type(e).__name__}: {e}", code="internal_error")


def unavailable(e: ServiceUnavailableError) -> ApiError:
    headers = None if e.retry_after_s is None else {"Retry-After": str(e.retry_after_s)}
    return ApiError(503, str(e), code=e.code, headers=headers)


def output_error(out: RequestOutput, retry_after_s: int = 1) -> ApiError | None:
    """An output that ended in the engine's refusal rather than in text."""
    if out.finish_reason == "error":
        return ApiError(400, out.error or "the engine rejected this request",
                        code="request_rejected")
    if out.finish_reason == "abort" and out.error:  # aborted by the engine, not by us
        return ApiError(503, f"The engine could not serve this request now: {out.error}",
                        code="request_aborted", headers={"Retry-After": str(retry_after_s)})
    return None


def log_error(method: str, path: str, status: int, code: str | None, param: str | None,
              message: str) -> None:
    """One line per refused request, at INFO (4xx) or WARNING (5xx): a client that only shows
    "Bad Request" can be understood from the server log."""
    where = f" param={param}" if param else ""
    log.log(logging.INFO if status < 500 else logging.WARNING, "%s %s -> %d %s%s: %s", method,
            path, status, code or "-", where, clip(message, 300).replace("\n", " "))


def error_response(request: Request, e: ApiError) -> JSONResponse:
    log_error(request.method, request.url.path, e.status, e.code, e.param, e.message)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
    return error_response(request, e)


async def on_engine_exception(request: Request, e: Exception) -> JSONResponse:
    """ServiceUnavailableError, InvalidRequestError, EngineDeadError raised anywhere."""
    return error_response(request, engine_error(e))


async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return error_response(request, ApiError(
        e.status_code, f"{e.detail}: {request.method} {request.url.path}", kind,
        headers=dict(getattr(e, "headers", None) or {})))


async def on_request_validation(request: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error_response(request, ApiError(400, f"Invalid request: {first.get('msg', e)}",
                                            param=param, code="invalid_value"))


async def on_client_gone(request: Request, e: ClientGone) -> Response:
    log.info("%s %s: the client closed the connection before sending its whole body",
             request.method, request.url.path)
    return Response(status_code=499)


async def on_internal(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body(f"Internal error: {type(e).__name__}: {clip(str(e))}",
                                   "server_error", None, "internal_error"), status_code=500)


def add_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, on_api_error)
    for kind in (ServiceUnavailableError, InvalidRequestError, EngineDeadError):
        app.add_exception_handler(kind, on_engine_exception)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(Exception, on_internal)


class AuthMiddleware:
    """Bearer keys on every path but the open ones; the accepted key goes into the scope."""

    def __init__(self, app: Any, keys: KeyTable, metrics: ServerMetrics,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                text = value.decode("latin-1").strip()
                if text[:7].lower() == "bearer ":
                    token = text[7:].strip()
                break
        key = self.keys.find(token)
        if key is None:
            self.metrics.reject("unauthorized")
            message = ("You didn't provide an API key: send it as 'Authorization: Bearer KEY'"
                       if token is None else "Incorrect API key provided")
            log_error(scope["method"], scope["path"], 401, "invalid_api_key", None, message)
            response = JSONResponse(error_body(message, "invalid_request_error", None,
                                               "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope[KEY_SCOPE] = key
        await self.app(scope, receive, send)


# ---- plain endpoints ----------------------------------------------------------------------------


async def health(request: Request) -> Response:
    """200 while the engine serves; 503 with the bridge's reason (dead, draining, wedged)."""
    st = state_of(request)
    problem = st.bridge.health_problem()
    if problem is None:
        return Response(status_code=200)
    code = "engine_dead" if st.bridge.dead_reason is not None else "unavailable"
    return JSONResponse(error_body(f"The engine is not serving: {problem}", "server_error", None,
                                   code), status_code=503)


async def version(request: Request) -> dict[str, str]:
    return {"version": hlserve_version()}


async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.exposition(), media_type=CONTENT_TYPE)


def model_card(st: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": st.created, "owned_by": "hlserve",
            "root": st.model_name, "parent": None, "max_model_len": st.max_model_len}


async def list_models(request: Request) -> dict[str, Any]:
    st = state_of(request)
    return {"object": "list", "data": [model_card(st, n) for n in st.model_names]}


async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    st = state_of(request)
    check_model(st, model_id)
    return model_card(st, model_id)


def check_model(st: ServerState, name: str | None) -> None:
    if name is not None and name not in st.accepted_names:
        raise ApiError(404, f"The model `{clip(name)}` does not exist.", param="model",
                       code="model_not_found")


# ---- reading a request ------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise _too_large(total, limit, at_least=True)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> ApiError:
    what = f"at least {size}" if at_least else str(size)
    return ApiError(413, f"The request body is too large: {what} bytes; this server accepts at "
                    f"most {limit} bytes", code="request_too_large")


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the engine needs it: class, priority, prefix-cache salt."""

    request_class: str | None  # None: the engine's default
    priority: int
    cache_salt: str | None  # None: the shared namespace


@dataclass
class Inbound:
    req: Any  # CompletionRequest | ChatCompletionRequest
    caller: Caller
    arrival: float  # the engine clock's time when the request arrived
    offload: bool  # a large body: template and tokenize in a worker thread


async def read_request(request: Request, st: ServerState,
                       model: type[GenerationRequest]) -> Inbound:
    arrival = st.clock()
    body = await read_body(request, st.settings.max_request_body_bytes)
    offload = len(body) > OFFLOAD_CHARS
    try:
        req = await asyncio.to_thread(model.model_validate_json, body) if offload \
            else model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    check_model(st, req.model)
    req.check_supported()
    check_response_format(req.response_format)
    if isinstance(req, ChatCompletionRequest):
        check_tools(req.tools, req.tool_choice)
    req = st.sampling_defaults.apply(req)
    return Inbound(req, caller_of(request, st, req), arrival, offload)


def caller_of(request: Request, st: ServerState, req: Any) -> Caller:
    key: ApiKey | None = request.scope.get(KEY_SCOPE)
    return Caller(request_class(request, req.request_class, key),
                  bounded_priority(st, req.priority), cache_salt(key, req.cache_salt))


def request_class(request: Request, asked: str | None, key: ApiKey | None) -> str | None:
    """Body field, else header, else the key's class; None: the engine's default. A key
    mapped to ``agent`` cannot claim that a person is waiting (403)."""
    header = request.headers.get("x-request-class")
    if header is not None:
        header = header.strip().lower()
        if header not in REQUEST_CLASSES:
            raise ApiError(400, f"X-Request-Class must be one of {', '.join(REQUEST_CLASSES)}; "
                           f"got {clip(header)!r}", param="X-Request-Class", code="invalid_value")
    claimed = asked or header
    key_class = key.request_class if key is not None else None
    if key_class == "agent" and claimed == "interactive":
        raise ApiError(403, "This API key is for agent traffic: its requests cannot claim the "
                       "interactive class", param="request_class" if asked else "X-Request-Class",
                       code="permission_denied")
    return claimed or key_class


def bounded_priority(st: ServerState, priority: int) -> int:
    if st.min_priority is not None and priority < st.min_priority:
        raise ApiError(400, f"priority must be at least {st.min_priority} on this server (lower "
                       f"is served first), got {priority}", param="priority",
                       code="invalid_value")
    return priority


def cache_salt(key: ApiKey | None, salt: str | None) -> str | None:
    """The request's prefix-cache namespace: its key's and its own ``cache_salt``'s, hashed
    (fixed size in the tree, and no key material in it). No key and no salt: shared."""
    if key is None and salt is None:
        return None
    material = f"{key.id if key is not None else ''}\0{salt or ''}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


# ---- from a request to the engine -------------------------------------------------------------


def check_batch(st: ServerState, prompts: list[Any], per_prompt: int = 1,
                per_prompt_field: str = "n") -> None:
    """Caps that a request can never fit: a 400, not a retryable 503. Each prompt forks
    into ``per_prompt`` sequences (``per_prompt_field``: n, or best_of when it is set), each
    an engine request."""
    cap = st.settings.max_prompts_per_request
    total = len(prompts) * per_prompt
    what = f"{len(prompts)} prompts" if per_prompt == 1 else \
        f"{len(prompts)} prompts x {per_prompt} sequences"
    if total > cap:
        raise ApiError(400, f"A request may carry at most {cap} prompts (sequences); got {what}",
                       param="prompt" if per_prompt == 1 else per_prompt_field,
                       code="invalid_value")
    queue = st.settings.max_queued_requests
    if queue is not None and total > queue:
        raise ApiError(400, f"A request of {what} can never fit this server's "
                       f"queue of {queue} requests", param="prompt", code="invalid_value")


def no_tokenizer(what: str) -> ApiError:
    return ApiError(400, f"This model has no tokenizer: {what}", param="prompt",
                    code="invalid_value")


async def encode_prompts(st: ServerState, prompts: list[str | list[int]],
                         offload: bool) -> list[list[int]]:
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return prompts  # type: ignore[return-value]
    tok = st.tokenizer
    if tok is None:
        raise no_tokenizer("send the prompt as token ids")

    def run() -> list[list[int]]:
        return [p if isinstance(p, list) else encode_bounded(tok, p, st.max_model_len)
                for p in prompts]

    if offload or sum(map(len, texts)) > OFFLOAD_CHARS:
        return await asyncio.to_thread(run)
    return run()


def encode_bounded(tok: Tokenizer, text: str, max_model_len: int,
                   add_special_tokens: bool = True) -> list[int]:
    """``text``'s ids; a text far longer than the context is tokenized in part first, and
    refused if that part alone is over the context: the work a prompt costs is bounded by
    the context, not by the body size. (Tokenizing holds the GIL for long stretches, so a
    worker thread alone does not keep a multi-megabyte prompt from stalling the event loop.)
    """
    check_head(tok, text, max_model_len, add_special_tokens, "prompt", "the prompt")
    return tok.encode(text, add_special_tokens)


def check_head(tok: Tokenizer, text: str, max_model_len: int, add_special_tokens: bool,
               param: str, what: str) -> None:
    """A 400 context_length_exceeded when ``text`` is longer than HEAD_CHARS_PER_TOKEN x the
    context and its first that many characters alone are over the context (a cut can add
    HEAD_MARGIN tokens at its end). A text that passes is still tokenized whole."""
    limit = HEAD_CHARS_PER_TOKEN * max_model_len
    if len(text) <= limit:
        return
    head = tok.encode(text[:limit], add_special_tokens)
    if len(head) > max_model_len + HEAD_MARGIN:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, {what} has more than {len(head) - HEAD_MARGIN} tokens in its "
                       f"first {limit} characters alone ({len(text)} in all). Please reduce "
                       f"the length of {what}.", param=param, code="context_length_exceeded")


def text_chars(obj: Any) -> int:
    """Characters in every string of a JSON-like value (keys included): what rendering it
    into a chat template puts into the text, give or take the template's own."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(len(k) + text_chars(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(map(text_chars, obj))
    return 0


async def encode_chat(st: ServerState, req: ChatCompletionRequest, offload: bool) -> list[int]:
    tok = st.tokenizer
    if tok is None:
        raise ApiError(400, "This model has no tokenizer, so no chat template: use "
                       "/v1/completions with token ids", code="invalid_value")
    kwargs = dict(req.chat_template_kwargs or {})
    if clash := tok.template_args & kwargs.keys():
        raise ApiError(400, f"chat_template_kwargs cannot set {sorted(clash)}: the server "
                       "passes them to the template itself", param="chat_template_kwargs",
                       code="invalid_value")
    kwargs = {**reasoning_kwargs(req), **kwargs}
    if req.tools:
        kwargs["tools"] = req.tools
    messages = parse_tool_call_arguments(req.template_messages())
    run = partial(bounded_chat, tok, messages, req.add_generation_prompt, kwargs,
                  st.max_model_len)
    try:
        return await asyncio.to_thread(run) if offload else run()
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None


def bounded_chat(tok: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 kwargs: dict[str, Any], max_model_len: int) -> list[int]:
    """The chat's ids, its work bounded by the context as :func:`encode_bounded` bounds a
    prompt's: a chat whose strings are far longer than the context is rendered and only a
    head of the rendered text tokenized first (rendering is cheap; tokenizing holds the GIL).
    The head keeps special-token text as control tokens, so it counts no more tokens than
    the full encoding does (within the cut's margin)."""
    if text_chars(messages) + text_chars(kwargs) > HEAD_CHARS_PER_TOKEN * max_model_len:
        text = tok.apply_chat_template(messages, add_generation_prompt, **kwargs)
        check_head(tok, text, max_model_len, False, "messages", "the rendered chat")
    return tok.encode_chat(messages, add_generation_prompt, **kwargs)


def sampling(st: ServerState, req: Any, n_prompt: int) -> SamplingParams:
    requested = req.requested_max_tokens
    if requested is None:
        if n_prompt >= st.max_model_len:
            raise context_length_error(st.max_model_len, n_prompt, None)
        # the rest of the context, but no more than the KV pool could ever hold (nor the
        # model's max_new_tokens)
        max_tokens = st.sampling_defaults.max_tokens(
            max(1, min(st.max_model_len, st.pool_tokens) - n_prompt))
    else:
        if n_prompt + requested > st.max_model_len:
            raise context_length_error(st.max_model_len, n_prompt, requested)
        max_tokens = requested
    check_logprob_volume(req, max_tokens)
    return req.sampling_params(max_tokens)


def chat_reasoning(st: ServerState, req: Any) -> ReasoningParser | None:
    if not isinstance(req, ChatCompletionRequest):
        return None
    constrained = request_constraint(req) is not None or \
        chat_tool_plan(st, req)[0].mode in ("named", "required")
    return reasoning_for(st.settings.reasoning_parser, constrained)


def chat_tool_plan(st: ServerState, req: Any) -> tuple[ToolPlan, dict[str, Any]]:
    if not isinstance(req, ChatCompletionRequest):
        return ToolPlan(), {}
    return tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                     st.settings.tool_call_parser, st.settings.enable_auto_tool_choice)


async def constrain(st: ServerState, req: Any, params: list[SamplingParams]
                    ) -> list[SamplingParams]:
    """``params`` with the request's output constraint (response_format, structured_outputs,
    guided_*, or tool_choice required / named), compiled here so that a bad schema is a 400
    before the engine sees it (in a thread: the first compile indexes the vocabulary)."""
    named = named_constraint(req)
    param, spec = named if named else (None, None)
    plan, functions = chat_tool_plan(st, req)
    if plan.mode is not None:  # a tokenizer may mark a tool-call tag as special (vLLM's rule)
        params = [replace(p, skip_special_tokens=False) for p in params]
    check_constrained(req, spec, "an output constraint")
    if (tool_spec := plan.constraint(functions)) is not None:
        if spec is not None:
            raise ApiError(400, f"tool_choice {plan.mode} cannot be combined with another "
                           "output constraint", param="tool_choice", code="invalid_value")
        check_constrained(req, tool_spec, f"tool_choice {plan.mode}")
        spec, param = tool_spec, "tools"
    if spec is None:
        return params
    await asyncio.to_thread(compile_spec, st, spec, param)
    return [replace(p, structured_outputs=spec) for p in params]


def compile_spec(st: ServerState, spec: StructuredOutputsParams, param: str | None) -> None:
    try:
        st.engine.grammars.compile(spec)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=param or "response_format",
                       code="invalid_value") from None


async def submit(st: ServerState, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], inbound: Inbound) -> RequestGroup:
    # the bridge refuses (draining, engine dead, queue caps: ServiceUnavailableError,
    # EngineDeadError, InvalidRequestError) and coalesces what a slow reader has not read
    sink = EventSink()
    who = inbound.caller
    subs = []
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        # n / best_of: sequence j of prompt i is index i * k + j (vLLM's choice order); the
        # siblings follow the first, so they share its prompt pages
        k = p.num_sequences
        for j in range(k):
            index = i * k + j
            subs.append(Submission(f"{request_id}-{index}", ids, p.for_sibling(j) if k > 1 else p,
                                   who.request_class, who.priority, inbound.arrival, index, sink,
                                   cache_salt=who.cache_salt,
                                   follows=subs[i * k].request_id if j else None))
    group = RequestGroup(st.bridge, subs, sink)
    try:
        st.bridge.submit(subs)
        await group.wait_added()
    except BaseException as e:
        group.abort_unfinished()
        if isinstance(e, Exception):
            raise engine_error(e) from None
        raise
    return group


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, group: RequestGroup) -> list[RequestOutput] | None:
    """Every final output, in prompt order; None if the client went away first."""

    async def gather() -> list[RequestOutput]:
        latest: dict[int, RequestOutput] = {}
        async for batch in group.events():
            for index, item in batch:
                if isinstance(item, BaseException):
                    raise engine_error(item)
                if (err := output_error(item)) is not None:
                    raise err
                latest[index] = item
        return [latest[i] for i in sorted(latest)]

    task = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else None
    finally:
        watch.cancel()
        task.cancel()
        group.abort_unfinished()


# ---- responses --------------------------------------------------------------------------------


def common_choice(out: RequestOutput, return_ids: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {"stop_reason": out.stop_reason}
    if return_ids:
        extra["token_ids"] = list(out.token_ids)
        extra["prompt_token_ids"] = list(out.prompt_token_ids)
    return extra


def total_usage(outs: list[RequestOutput], per_prompt: int = 1,
                returned: list[RequestOutput] | None = None) -> dict[str, Any]:
    """Usage of sequences in index order, ``per_prompt`` of each prompt: its prompt (and
    cached) tokens count once, as vLLM counts them; completion tokens are the returned
    choices'."""
    firsts = outs[::per_prompt]
    return usage(sum(len(o.prompt_token_ids) for o in firsts),
                 sum(len(o.token_ids) for o in (outs if returned is None else returned)),
                 sum(o.num_cached_tokens for o in firsts))


def returned_choices(outs: list[RequestOutput], k: int, n: int) -> list[RequestOutput]:
    """Of each prompt's ``k`` sequences, the ``n`` returned: all, or with best_of the n of
    highest cumulative logprob (vLLM V0's best_of)."""
    if k == n:
        return outs
    chosen: list[RequestOutput] = []
    for i in range(0, len(outs), k):
        ranked = sorted(outs[i:i + k], key=lambda o: -(o.cumulative_logprob or 0.0))
        chosen += ranked[:n]
    return chosen


def completion_body(st: ServerState, rid: str, model: str, req: CompletionRequest,
                    outs: list[RequestOutput], echo: list[str] | None = None) -> dict[str, Any]:
    k = req.best_of or req.n
    chosen = returned_choices(outs, k, req.n)
    # best_of computes logprobs to rank the sequences; they are shown only when asked for
    show_lp = req.logprobs is not None
    choices = [{"index": i, "text": (echo[i // req.n] if echo else "") + o.text,
                "logprobs": None if o.logprobs is None or not show_lp else
                completion_logprobs(st.tokenizer, o.token_ids, o.logprobs),
                "finish_reason": o.finish_reason, **common_choice(o, req.return_token_ids)}
               for i, o in enumerate(chosen)]
    return {"id": rid, "object": "text_completion", "created": now_s(), "model": model,
            "choices": choices, "usage": total_usage(outs, k, chosen)}


def chat_body(st: ServerState, rid: str, model: str, req: ChatCompletionRequest,
              outs: list[RequestOutput], echo: list[str] | None = None) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": None if o.logprobs is None else
                chat_logprobs(st.tokenizer, o.token_ids, o.logprobs),
                "finish_reason": o.finish_reason, **common_choice(o, req.return_token_ids)}
               for i, o in enumerate(outs)]
    apply_reasoning(chat_reasoning(st, req), choices)  # server/reasoning.py
    apply_tool_calls(chat_tool_plan(st, req)[0], choices, outs)
    return {"id": rid, "object": "chat.completion", "created": now_s(), "model": model,
            "choices": choices, "usage": total_usage(outs, req.n)}


async def respond(request: Request, st: ServerState, group: RequestGroup, rid: str,
                  inbound: Inbound, chunks: type[_Chunks],
                  body: Callable[..., dict[str, Any]], echo: list[str] | None = None) -> Response:
    """The stream, or the whole answer once every prompt is done. ``echo``: each prompt's
    text, prepended to its choices (completions' ``echo``)."""
    req = inbound.req
    model = req.model or st.model_name
    if req.stream:
        fmt = chunks(rid, model, req.return_token_ids, st.tokenizer)
        fmt.echo = echo
        fmt.per_prompt = req.n  # streamed choices: best_of > n is refused with stream
        fmt.tool_plan = chat_tool_plan(st, req)[0]
        fmt.reasoning = chat_reasoning(st, req)
        return EngineStreamResponse(stream(group, fmt, req.stream_options),
                                    group.abort_unfinished)
    outs = await collect(request, group)
    if outs is None:
        return Response(status_code=499)
    return JSONResponse(body(st, rid, model, req, outs, echo))


# ---- generation endpoints -----------------------------------------------------------------------


async def completions(request: Request) -> Response:
    st = state_of(request)
    inbound = await read_request(request, st, CompletionRequest)
    req = inbound.req
    prompts = req.prompts()
    check_batch(st, prompts, req.best_of or req.n, "best_of" if req.best_of else "n")
    ids = await encode_prompts(st, prompts, inbound.offload)
    params = await constrain(st, req, [sampling(st, req, len(p)) for p in ids])
    if req.echo and st.tokenizer is None and any(isinstance(p, list) for p in prompts):
        raise no_tokenizer("echo needs one to show token-id prompts as text")
    rid = new_id("cmpl")
    group = await submit(st, rid, ids, params, inbound)
    # after submit: the engine has checked the token ids that echo decodes
    echo = echo_texts(st, prompts, ids) if req.echo else None
    return await respond(request, st, group, rid, inbound, _CompletionChunks, completion_body,
                         echo)


def echo_texts(st: ServerState, prompts: list[str | list[int]], ids: list[list[int]]
               ) -> list[str]:
    """Each prompt as ``echo`` shows it: the text as sent, or its token ids decoded (special
    tokens included, as vLLM shows them). Token ids only once the engine has checked them."""
    tok = st.tokenizer
    return [p if isinstance(p, str) or tok is None else tok.decode(t, skip_special_tokens=False)
            for p, t in zip(prompts, ids, strict=True)]


async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    inbound = await read_request(request, st, ChatCompletionRequest)
    check_batch(st, [None], inbound.req.n)
    ids = await encode_chat(st, inbound.req, inbound.offload)
    params = sampling(st, inbound.req, len(ids))
    params = (await constrain(st, inbound.req, [params]))[0]
    rid = new_id("chatcmpl")
    group = await submit(st, rid, [ids], [params], inbound)
    return await respond(request, st, group, rid, inbound, _ChatChunks, chat_body)


# ---- /tokenize and /detokenize -------------------------------------------------------------------


async def read_plain(request: Request, st: ServerState, model: type[Any]) -> Any:
    """A body of ``model`` (strict, size-limited), for endpoints that generate nothing."""
    body = await read_body(request, st.settings.max_request_body_bytes)
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if model is TokenizeCompletionRequest and isinstance(parsed, dict) and "messages" in parsed:
        model = TokenizeChatRequest  # vLLM's two shapes of one endpoint
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    check_model(st, req.model)
    return req


def need_tokenizer(st: ServerState) -> Tokenizer:
    if st.tokenizer is None:
        raise ApiError(400, "This model has no tokenizer", code="invalid_value")
    return st.tokenizer


async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a ``prompt`` (with ``add_special_tokens``) or chat ``messages``
    rendered as the chat endpoint renders them; ``token_strs`` on request."""
    st = state_of(request)
    req = await read_plain(request, st, TokenizeCompletionRequest)
    tok = need_tokenizer(st)
    if isinstance(req, TokenizeChatRequest):
        req.check_supported()
        ids = await encode_chat(st, req, offload=True)
    else:
        # bounded as a completion's prompt: a huge one is refused after a context's worth
        ids = await asyncio.to_thread(encode_bounded, tok, req.prompt, st.max_model_len,
                                      req.add_special_tokens)
    return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids,
            "token_strs": [tok.token_str(t) for t in ids] if req.return_token_strs else None}


async def detokenize(request: Request) -> dict[str, Any]:
    """vLLM's ``/detokenize``: ``tokens`` -> ``prompt`` (special tokens kept, as vLLM)."""
    st = state_of(request)
    req = await read_plain(request, st, DetokenizeRequest)
    tok = need_tokenizer(st)
    vocab = st.engine.runner.model_config.vocab_size
    if bad := [t for t in req.tokens if t >= vocab][:5]:
        raise ApiError(400, f"token ids not in the vocabulary [0, {vocab}): {bad}",
                       param="tokens", code="invalid_value")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


# ---- the app ----------------------------------------------------------------------------------


def json_body(model: type) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the JSON body (the handler reads it itself)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_routes(app: FastAPI) -> None:
    for path, methods in (("/health", ("GET", "HEAD")), ("/ping", ("GET", "POST", "HEAD"))):
        for method in methods:  # one route each: OpenAPI wants one operation id per method
            app.add_api_route(path, health, methods=[method], name=f"{path[1:]}_{method.lower()}",
                              include_in_schema=method != "HEAD")
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"],
                      openapi_extra=json_body(CompletionRequest))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                      openapi_extra=json_body(ChatCompletionRequest))
    for prefix in ("", "/v1"):  # vLLM serves them at the root; /v1 for clients that prefix
        app.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"],
                          name=f"tokenize{prefix.replace('/', '_')}",
                          openapi_extra=json_body(TokenizeCompletionRequest))
        app.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"],
                          name=f"detokenize{prefix.replace('/', '_')}",
                          openapi_extra=json_body(DetokenizeRequest))


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes, plus the request models the bodies refer to."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible API of hlserve (docs/server.md)")
        _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    st: ServerState = app.state.hlserve
    st.bridge.start(asyncio.get_running_loop())
    yield
    await asyncio.to_thread(st.bridge.stop)


def create_app(engine: Engine, settings: ServerSettings, keys: KeyTable | None = None,
               model_path: str | None = None) -> FastAPI:
    st = ServerState(engine, settings, keys or KeyTable({}), model_path or engine.config.model)
    app = FastAPI(title="hlserve", version=hlserve_version(), lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.hlserve = st
    app.add_middleware(AuthMiddleware, keys=st.keys, metrics=st.metrics)
    add_exception_handlers(app)
    add_routes(app)
    app.openapi = partial(openapi_schema, app)  # type: ignore[method-assign]
    return app


# ---- streaming ------------------------------------------------------------------------------


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EngineStreamResponse(StreamingResponse):
    """SSE whose end, however it comes (done, client gone, server stopping), aborts what the
    engine is still generating for it."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Chunks:
    object = ""
    echo: list[str] | None = None  # per prompt: text prepended to its choices' first chunk
    per_prompt: int = 1  # choices per prompt (n)

    def __init__(self, rid: str, model: str, return_ids: bool,
                 tokenizer: Tokenizer | None = None) -> None:
        self.rid, self.model, self.return_ids = rid, model, return_ids
        self.tokenizer = tokenizer
        self.created = now_s()

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices}

    def opening(self, index: int, out: RequestOutput | None) -> dict[str, Any] | None:
        return None

    def choice(self, index: int, text: str, out: RequestOutput, new_ids: list[int],
               first: bool) -> dict[str, Any]:
        raise NotImplementedError

    def logprobs(self, index: int, out: RequestOutput, new_ids: list[int]) -> dict[str, Any] | None:
        return None

    def _new_entries(self, out: RequestOutput, new_ids: list[int]) -> list[TokenLogprobs]:
        assert out.logprobs is not None
        return out.logprobs[len(out.token_ids) - len(new_ids) : len(out.token_ids)]

    def finish_fields(self, index: int, out: RequestOutput, new_ids: list[int],
                      first: bool) -> dict[str, Any]:
        fields: dict[str, Any] = {"logprobs": self.logprobs(index, out, new_ids),
                                  "finish_reason": out.finish_reason if out.finished else None}
        if out.finished:
            fields["stop_reason"] = out.stop_reason
        if self.return_ids:
            fields["token_ids"] = new_ids
            if first:
                fields["prompt_token_ids"] = list(out.prompt_token_ids)
        return fields


class _CompletionChunks(_Chunks):
    object = "text_completion"

    def __init__(self, rid: str, model: str, return_ids: bool,
                 tokenizer: Tokenizer | None = None) -> None:
        super().__init__(rid, model, return_ids, tokenizer)
        self._text_offset: dict[int, int] = {}  # where each choice's next token text starts

    def choice(self, index: int, text: str, out: RequestOutput, new_ids: list[int],
               first: bool) -> dict[str, Any]:
        if first and self.echo:
            text = self.echo[index // self.per_prompt] + text
        return {"index": index, "text": text, **self.finish_fields(index, out, new_ids, first)}

    def logprobs(self, index: int, out: RequestOutput, new_ids: list[int]) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        start = self._text_offset.get(index, 0)
        lp = completion_logprobs(self.tokenizer, new_ids, self._new_entries(out, new_ids), start)
        if lp["tokens"]:
            self._text_offset[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp


class _ChatChunks(_Chunks):
    object = "chat.completion.chunk"

    def opening(self, index: int, out: RequestOutput | None) -> dict[str, Any] | None:
        return self.envelope([{"index": index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}])

    tool_plan = ToolPlan()
    reasoning: ReasoningParser | None = None

    def choice(self, index: int, text: str, out: RequestOutput, new_ids: list[int],
               first: bool) -> dict[str, Any]:
        fields = self.finish_fields(index, out, new_ids, first)
        full, thought = out.text, ""
        if self.reasoning is not None:  # <think> text as reasoning_content (reasoning.py)
            rs = self.__dict__.setdefault("_reasoning", {}).setdefault(
                index, ReasoningStream(self.reasoning))
            thought, full = rs.step(out.text, out.finished)
            sent = self.__dict__.setdefault("_content_sent", {})
            text, sent[index] = full[sent.get(index, 0):], len(full)
        if self.tool_plan.mode is not None:  # tool calls as deltas (server/tool_parsers.py)
            streams = self.__dict__.setdefault("_tool_streams", {})
            ts = streams.setdefault(index, ToolStream(self.tool_plan))
            delta, reason = ts.delta(text, full, out.finished, out.finish_reason)
            if out.finished:
                fields["finish_reason"] = reason
        else:
            delta = {"content": text} if text or not (out.finished or thought) else {}
        if thought:
            delta = {"reasoning_content": thought, **delta}
        return {"index": index, "delta": delta, **fields}

    def logprobs(self, index: int, out: RequestOutput, new_ids: list[int]) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, new_ids, self._new_entries(out, new_ids))


async def stream(group: RequestGroup, fmt: _Chunks, options: Any) -> AsyncIterator[str]:
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    sent_text: dict[int, str] = {}
    sent_ids: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    for sub in group.subs:
        if (opening := fmt.opening(sub.index, None)) is not None:
            yield sse(opening)
    async for batch in group.events():
        for index, item in batch:
            err = engine_error(item) if isinstance(item, BaseException) else output_error(item)
            if err is not None:
                group.abort_unfinished()
                yield sse(err.body())
                yield SSE_DONE
                return
            out = item
            prev = sent_text.get(index, "")
            # the engine holds back text that could start a stop string, so streamed text is
            # never taken back; should it be, nothing is sent rather than a wrong delta
            delta = out.text[len(prev):] if out.text.startswith(prev) else ""
            first = index not in sent_ids
            new_ids = out.token_ids[sent_ids.get(index, 0):]
            if not delta and not new_ids and not out.finished:
                continue
            sent_text[index] = prev + delta
            sent_ids[index] = len(out.token_ids)
            chunk = fmt.envelope([fmt.choice(index, delta, out, list(new_ids), first)])
            if continuous:
                chunk["usage"] = usage(len(out.prompt_token_ids), len(out.token_ids))
            yield sse(chunk)
            if out.finished:
                finals[index] = out
    if include_usage:
        outs = [finals[i] for i in sorted(finals)]
        chunk = fmt.envelope([])
        chunk["usage"] = total_usage(outs, fmt.per_prompt)
        yield sse(chunk)
    yield SSE_DONE


# ---- entry point ----------------------------------------------------------------------------


def serve(config: EngineConfig, settings: ServerSettings) -> None:
    """Build the engine on ``config``, then serve until interrupted (``hlserve serve``)."""
    from hlserve.engine.factory import build_engine
    from hlserve.runner.torch_runner import TorchRunner
    from hlserve.server.lifecycle import run_server
    from hlserve.tokenizer import Tokenizer

    keys = KeyTable.load(settings.api_key, settings.api_keys_file)  # fail before loading
    configure_logging(settings.log_level)
    engine = build_engine(config, TorchRunner, tokenizer=Tokenizer.from_dir)
    model = settings.model_arg or config.model
    app = create_app(engine, settings, keys, model)
    st: ServerState = app.state.hlserve
    auth = f"{len(keys)} API key(s)" if keys.enabled else "off"
    print(f"hlserve {hlserve_version()} serving {', '.join(st.model_names)} ({model}) on "
          f"http://{settings.host}:{settings.port}: max_model_len {st.max_model_len}, KV pool "
          f"{st.pool_tokens} tokens; auth {auth}; default request class "
          f"{getattr(engine.config, 'default_request_class', 'agent')}; queue cap "
          f"{settings.max_queued_requests or 'none'}", file=sys.stderr, flush=True)
    if caps := getattr(engine, "caps_report", None):
        print(caps, file=sys.stderr, flush=True)
    # SIGTERM drains (exit 0); a dead engine exits 1 so that a supervisor restarts us
    if code := run_server(app, st.bridge, settings):
        sys.exit(code)


def configure_logging(level: str) -> None:
    """The server's own lines (refused requests, engine faults) at ``--uvicorn-log-level``,
    whatever the root logger's level (the CLI sets WARNING unless -v)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = {"trace": "DEBUG"}.get(level, level.upper())
    log.setLevel(getattr(logging, name, logging.INFO))
