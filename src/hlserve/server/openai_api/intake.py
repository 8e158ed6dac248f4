"""Request intake: reading a body and checking it before any work is done for it.

A body is read under a size limit (413), parsed strictly into its request model (400 with
the field at fault), checked against what this server supports and serves (model name,
features, tools, response format, batch caps), completed with the model's sampling defaults
for the fields it leaves out, and given its caller: the request class, priority and
prefix-cache salt that the request, its headers and its API key imply. Large bodies
(``OFFLOAD_CHARS``) are counted (``limits.check_body_nodes``) and parsed in the server's
``prep`` pool under the client's limit (:mod:`hlserve.server.runtime.offload`), never on the event
loop. What comes out is an :class:`Inbound`, ready to be tokenized
(:mod:`hlserve.server.openai_api.prompts`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from hlserve.engine.sessions import session_key
from hlserve.request import REQUEST_CLASSES
from hlserve.server.openai_api.auth import KEY_SCOPE, ApiKey
from hlserve.server.openai_api.error_replies import ClientGone
from hlserve.server.openai_api.limits import check_body_nodes
from hlserve.server.openai_api.state import ServerState
from hlserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    clip,
    validation_error,
)
from hlserve.server.tools.agent_checks import (
    check_prediction,
    check_response_format,
    check_tools,
)

OFFLOAD_CHARS = 16384  # larger bodies and texts are parsed/templated/tokenized in a thread
GenerationRequest = TypeVar("GenerationRequest", CompletionRequest, ChatCompletionRequest)
T = TypeVar("T")


def check_model(st: ServerState, name: str | None) -> None:
    if name is not None and name not in st.accepted_names:
        raise ApiError(404, f"The model `{clip(name)}` does not exist.", param="model",
                       code="model_not_found")


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
    # the agent session it is a round of: session_id, else prompt_cache_key, else user
    # (engine/sessions.py; the engine scopes it by the cache salt, so per tenant)
    session: str | None = None


@dataclass
class Inbound:
    req: Any  # CompletionRequest | ChatCompletionRequest
    caller: Caller
    arrival: float  # the engine clock's time when the request arrived
    offload: bool  # a large body: template and tokenize in a worker thread
    client: str  # whom its offloaded work counts against (offload.client_of)


async def read_request(request: Request, st: ServerState,
                       model: type[GenerationRequest]) -> Inbound:
    arrival = st.clock()
    body = await read_body(request, st.settings.max_request_body_bytes)
    offload, client = len(body) > OFFLOAD_CHARS, client_of(request)
    req = await parse_body(st, body, model, client) if offload else parse(body, model)
    check_model(st, req.model)
    req.check_supported()
    check_response_format(req.response_format)
    if isinstance(req, ChatCompletionRequest):
        check_tools(req.tools, req.tool_choice)
        check_prediction(req.prediction)
    req = st.sampling_defaults.apply(req)
    return Inbound(req, caller_of(request, st, req), arrival, offload, client)


def parse(body: bytes, model: type[T]) -> T:
    """``body`` validated strictly into ``model`` (400 naming the field at fault)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


async def parse_body(st: ServerState, body: bytes, model: type[T], client: str) -> T:
    """A large body counted, then parsed, in the ``prep`` pool (validation holds the GIL
    for as long as the body's nodes take, so they are bounded first)."""

    def run() -> T:
        check_body_nodes(body)
        return parse(body, model)

    return await st.offload.run("prep", client, run)


async def read_plain(request: Request, st: ServerState, model: type[Any]) -> Any:
    """A body of ``model`` (strict, size-limited), for endpoints that generate nothing; a
    large one counted and parsed in the ``prep`` pool, as a generation request's."""
    body = await read_body(request, st.settings.max_request_body_bytes)

    def run() -> Any:
        if len(body) > OFFLOAD_CHARS:
            check_body_nodes(body)
        return parse(body, plain_model(body, model))

    req = await st.offload.run("prep", client_of(request), run) \
        if len(body) > OFFLOAD_CHARS else run()
    check_model(st, req.model)
    return req


def plain_model(body: bytes, model: type[Any]) -> type[Any]:
    """``/tokenize`` takes a prompt or chat messages: vLLM's two shapes of one endpoint."""
    if model is not TokenizeCompletionRequest:
        return model
    try:
        parsed = json.loads(body)
    except ValueError:
        return model
    return TokenizeChatRequest if isinstance(parsed, dict) and "messages" in parsed else model


def client_of(request: Request) -> str:
    """Whom a request's offloaded work counts against: its API key, else its address."""
    key: ApiKey | None = request.scope.get(KEY_SCOPE)
    if key is not None:
        return f"key:{key.id}"
    peer = request.client
    return f"addr:{peer.host}" if peer is not None else "addr:?"


def caller_of(request: Request, st: ServerState, req: Any) -> Caller:
    key: ApiKey | None = request.scope.get(KEY_SCOPE)
    return Caller(request_class(request, req.request_class, key),
                  bounded_priority(st, req.priority), cache_salt(key, req.cache_salt),
                  session_key(getattr(req, "session_id", None),
                              getattr(req, "prompt_cache_key", None), getattr(req, "user", None)))


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
