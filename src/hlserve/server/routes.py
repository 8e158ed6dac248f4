"""The endpoints: one handler per route, and :func:`add_routes`, which lists them all.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` with
``GET|DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
(server/responses/endpoint.py), ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize`` (and their ``/v1/``
aliases), ``GET|HEAD /health``, ``GET|POST|HEAD /ping``, ``GET /metrics`` and
``GET /version``. A generation handler is intake, tokenizing, constraining and submitting
in that order, then :func:`respond`: the stream, or the whole body once every prompt is done.
Handlers read their bodies themselves (a size limit while reading, strict JSON, OpenAI-shaped
errors); :func:`json_body` still declares each body's model for ``/openapi.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hlserve.server.openai_api.completion_bodies import chat_body, completion_body, render_large
from hlserve.server.openai_api.generation import (
    chat_reasoning,
    chat_tool_plan,
    collect,
    constrain,
    sampling,
    submit,
)
from hlserve.server.openai_api.intake import (
    Inbound,
    check_batch,
    check_model,
    client_of,
    read_plain,
    read_request,
)
from hlserve.server.openai_api.prompts import (
    encode_bounded,
    encode_chat,
    encode_prompts,
    need_tokenizer,
    no_tokenizer,
)
from hlserve.server.openai_api.state import ServerState, hlserve_version, state_of
from hlserve.server.openai_api.streaming import (
    ChatChunks,
    Chunks,
    CompletionChunks,
    EngineStreamResponse,
    stream,
)
from hlserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    new_id,
)
from hlserve.server.responses.endpoint import (
    ResponsesRequest,
    cancel_response,
    create_response,
    delete_response,
    get_response,
)
from hlserve.server.runtime.events import RequestGroup
from hlserve.server.runtime.metrics import CONTENT_TYPE
from hlserve.server.tools.agent_checks import check_tools

# ---- plain endpoints -------------------------------------------------------------------------


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


# ---- generation endpoints --------------------------------------------------------------------

INLINE_RESPONSE_WEIGHT = 4096  # token entries of a body built on the loop; more: prep pool


async def respond(request: Request, st: ServerState, group: RequestGroup, rid: str,
                  inbound: Inbound, chunks: type[Chunks],
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
    if response_weight(outs, req) <= INLINE_RESPONSE_WEIGHT:
        return JSONResponse(body(st, rid, model, req, outs, echo))
    # a large body (long outputs, logprobs: one decode per entry) is built and serialised in
    # the prep pool: a 20 MB logprobs response took seconds on the event loop
    build = partial(body, st, rid, model, req, outs, echo)
    content = await st.offload.run("prep", inbound.client, render_large, build)
    return Response(content, media_type="application/json")


def response_weight(outs: list[Any], req: Any) -> int:
    """What building a response costs, in token entries: each output token, times the
    logprobs it carries (the chosen token and top_logprobs alternatives)."""
    per_token = 1 if req.requested_logprobs is None else req.requested_logprobs + 2
    return per_token * sum(len(o.token_ids) for o in outs)


async def completions(request: Request) -> Response:
    st = state_of(request)
    inbound = await read_request(request, st, CompletionRequest)
    req = inbound.req
    prompts = req.prompts()
    check_batch(st, prompts, req.best_of or req.n, "best_of" if req.best_of else "n")
    ids = await encode_prompts(st, prompts, inbound.offload, inbound.client)
    params = await constrain(st, req, [sampling(st, req, len(p)) for p in ids], inbound.client)
    if req.echo and st.tokenizer is None and any(isinstance(p, list) for p in prompts):
        raise no_tokenizer("echo needs one to show token-id prompts as text")
    rid = new_id("cmpl")
    group = await submit(st, rid, ids, params, inbound)
    # after submit: the engine has checked the token ids that echo decodes
    echo = echo_texts(st, prompts, ids) if req.echo else None
    return await respond(request, st, group, rid, inbound, CompletionChunks, completion_body,
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
    ids = await encode_chat(st, inbound.req, inbound.offload, inbound.client)
    params = sampling(st, inbound.req, len(ids))
    params = (await constrain(st, inbound.req, [params], inbound.client))[0]
    rid = new_id("chatcmpl")
    group = await submit(st, rid, [ids], [params], inbound)
    return await respond(request, st, group, rid, inbound, ChatChunks, chat_body)


# ---- /tokenize and /detokenize ---------------------------------------------------------------


async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a ``prompt`` (with ``add_special_tokens``) or chat ``messages``
    rendered as the chat endpoint renders them; ``token_strs`` on request."""
    st = state_of(request)
    req = await read_plain(request, st, TokenizeCompletionRequest)
    tok = need_tokenizer(st)
    if isinstance(req, TokenizeChatRequest):
        req.check_supported()
        check_tools(req.tools, None)  # typed as chat's (the template renders them)
        ids = await encode_chat(st, req, True, client_of(request))
    else:
        # bounded as a completion's prompt: a huge one is refused after a context's worth
        ids = await st.offload.run("prep", client_of(request), encode_bounded, tok, req.prompt,
                                   st.max_model_len, req.add_special_tokens)
    return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids,
            "token_strs": [tok.token_str(t) for t in ids] if req.return_token_strs else None}


async def detokenize(request: Request) -> dict[str, Any]:
    """vLLM's ``/detokenize``: ``tokens`` -> ``prompt`` (special tokens kept, as vLLM)."""
    st = state_of(request)
    req = await read_plain(request, st, DetokenizeRequest)
    tok = need_tokenizer(st)
    vocab = st.engine.model_config.vocab_size
    if bad := [t for t in req.tokens if t >= vocab][:5]:
        raise ApiError(400, f"token ids not in the vocabulary [0, {vocab}): {bad}",
                       param="tokens", code="invalid_value")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


# ---- the table of routes ---------------------------------------------------------------------


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
    app.add_api_route("/v1/responses", create_response, methods=["POST"],
                      openapi_extra=json_body(ResponsesRequest))
    app.add_api_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"])
    for prefix in ("", "/v1"):  # vLLM serves them at the root; /v1 for clients that prefix
        app.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"],
                          name=f"tokenize{prefix.replace('/', '_')}",
                          openapi_extra=json_body(TokenizeCompletionRequest))
        app.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"],
                          name=f"detokenize{prefix.replace('/', '_')}",
                          openapi_extra=json_body(DetokenizeRequest))
