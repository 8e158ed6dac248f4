"""The OpenAI-compatible HTTP server: ``hlserve serve MODEL_DIR``.

FastAPI on uvicorn, one process. The engine runs in its own thread (see
:mod:`hlserve.server.bridge`); handlers parse and validate a request, tokenize it, hand it to
the engine thread and turn the engine's cumulative outputs into OpenAI responses or SSE
chunks. Nothing here blocks the event loop: large prompts are tokenized in a worker thread.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, ``GET /version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hlserve.engine.engine import Engine
from hlserve.errors import EngineDeadError, InvalidRequestError
from hlserve.request import RequestOutput, SamplingParams, TokenLogprobs
from hlserve.server.args import REQUEST_CLASSES, ServerSettings
from hlserve.server.auth import KeyTable
from hlserve.server.bridge import EngineBridge, RequestFailed, RequestGroup, Submission
from hlserve.server.logprobs import chat_logprobs, completion_logprobs
from hlserve.server.metrics import CONTENT_TYPE, ServerMetrics
from hlserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    context_length_error,
    error_body,
    invalid_request,
    new_id,
    now_s,
    usage,
    validation_error,
)
from hlserve.tokenizer import Tokenizer

log = logging.getLogger("hlserve.server")

KEY_CLASS_SCOPE = "hlserve.key_class"
OFFLOAD_CHARS = 16384  # longer texts are templated/tokenized in a worker thread
RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "bos_token", "eos_token"}


def hlserve_version() -> str:
    try:
        return package_version("hlserve")
    except PackageNotFoundError:
        return "unknown"


class ServerState:
    def __init__(self, engine: Engine, settings: ServerSettings, keys: KeyTable,
                 model_path: str) -> None:
        self.engine = engine
        self.settings = settings
        self.keys = keys
        self.model_path = model_path
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.pool_tokens = engine.kv.num_pages * engine.kv.page_size
        self.model_names = settings.served_model_names or (model_path,)
        self.model_name = self.model_names[0]
        self.metrics = ServerMetrics(self.model_name)
        self.bridge = EngineBridge(engine, self.metrics)
        self.clock = engine.clock
        self.created = now_s()


# ---- helpers ------------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _too_large(total, limit, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> ApiError:
    what = f"at least {size}" if at_least else str(size)
    return ApiError(413, f"The request body is too large: {what} bytes; this server accepts at "
                    f"most {limit} bytes", code="request_too_large")


def engine_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return invalid_request(str(e))
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"The engine is not running: {e}", code="engine_dead")
    if isinstance(e, RequestFailed):
        return ApiError(500, str(e), code="engine_error")
    return ApiError(500, f"Internal error: {type(e).__name__}: {e}", code="internal_error")


def output_error(out: RequestOutput, retry_after_s: int = 1) -> ApiError | None:
    """An output that ended in the engine's refusal rather than in text."""
    if out.finish_reason == "error":
        return ApiError(400, out.error or "the engine rejected this request",
                        code="request_rejected")
    if out.finish_reason == "abort" and out.error:  # aborted by the engine, not by us
        return ApiError(503, f"The engine could not serve this request now: {out.error}",
                        code="request_aborted", headers={"Retry-After": str(retry_after_s)})
    return None


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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


class AuthMiddleware:
    """Bearer keys on every path but the open ones; the key's class goes into the scope."""

    def __init__(self, app: Any, keys: KeyTable, metrics: ServerMetrics,
                 open_paths: frozenset[str] = frozenset({"/health"})) -> None:
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
        ok, cls = self.keys.lookup(token)
        if not ok:
            self.metrics.reject("unauthorized")
            message = ("You didn't provide an API key: send it as 'Authorization: Bearer KEY'"
                       if token is None else "Incorrect API key provided")
            response = JSONResponse(error_body(message, "invalid_request_error", None,
                                               "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope[KEY_CLASS_SCOPE] = cls
        await self.app(scope, receive, send)


# ---- the app ------------------------------------------------------------------------------


def create_app(engine: Engine, settings: ServerSettings, keys: KeyTable | None = None,
               model_path: str | None = None) -> FastAPI:
    st = ServerState(engine, settings, keys or KeyTable({}), model_path or engine.config.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st.bridge.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(st.bridge.stop)

    app = FastAPI(title="hlserve", version=hlserve_version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hlserve = st
    app.add_middleware(AuthMiddleware, keys=st.keys, metrics=st.metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{e.detail}: {request.method} {request.url.path}"
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"Internal error: {type(e).__name__}: {e}",
                                       "server_error", None, "internal_error"), status_code=500)

    # ---- plain endpoints ---------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if st.bridge.alive:
            return Response(status_code=200)
        return JSONResponse(error_body(f"The engine is not running: {st.bridge.dead_reason}",
                                       "server_error", None, "engine_dead"), status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hlserve_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.exposition(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": st.created, "owned_by": "hlserve",
                "root": st.model_path, "parent": None, "max_model_len": st.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in st.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card(model_id)

    # ---- generation ------------------------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name not in st.model_names:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        body = await read_body(request, st.settings.max_request_body_bytes)
        try:
            req = model.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None
        check_model(req.model)
        req.check_supported()
        return req

    def request_class(request: Request, asked: str | None) -> str | None:
        """Body field, else header, else the key's class; None: the engine's default. A key
        mapped to ``agent`` caps the class at ``agent``."""
        header = request.headers.get("x-request-class")
        if header is not None:
            header = header.strip().lower()
            if header not in REQUEST_CLASSES:
                raise ApiError(400, f"X-Request-Class must be one of {', '.join(REQUEST_CLASSES)}; "
                               f"got {header!r}", param="X-Request-Class", code="invalid_value")
        key_class = request.scope.get(KEY_CLASS_SCOPE)
        if key_class == "agent":  # an agent key cannot claim a person is waiting
            return "agent"
        return asked or header or key_class

    async def encode(text: str, add_special_tokens: bool) -> list[int]:
        if st.tokenizer is None:
            raise ApiError(400, "This model has no tokenizer: send the prompt as token ids",
                           param="prompt", code="invalid_value")
        if len(text) > OFFLOAD_CHARS:
            return await asyncio.to_thread(st.tokenizer.encode, text, add_special_tokens)
        return st.tokenizer.encode(text, add_special_tokens)

    def sampling(req: CompletionRequest | ChatCompletionRequest, n_prompt: int) -> SamplingParams:
        requested = req.requested_max_tokens
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else \
            "max_tokens"
        if requested is not None and requested < 1:
            raise ApiError(400, f"{name} must be at least 1, got {requested}", param=name,
                           code="invalid_value")
        if requested is None:
            if n_prompt >= st.max_model_len:
                raise context_length_error(st.max_model_len, n_prompt, None)
            # the rest of the context, but no more than the KV pool could ever hold
            max_tokens = max(1, min(st.max_model_len, st.pool_tokens) - n_prompt)
        else:
            if n_prompt + requested > st.max_model_len:
                raise context_length_error(st.max_model_len, n_prompt, requested)
            max_tokens = requested
        return req.sampling_params(max_tokens)

    async def submit(request_id: str, prompts: list[list[int]], params: list[SamplingParams],
                     rclass: str | None, priority: int, arrival: float) -> RequestGroup:
        if not st.bridge.alive:
            raise ApiError(503, f"The engine is not running: {st.bridge.dead_reason}",
                           code="engine_dead")
        cap = st.settings.max_queued_requests
        if cap is not None and (queued := st.bridge.num_queued()) + len(prompts) > cap:
            st.metrics.reject("queue_full")
            raise ApiError(503, f"The server is overloaded: {queued} requests are waiting "
                           f"(limit {cap}); retry later", code="queue_full",
                           headers={"Retry-After": str(st.settings.retry_after_s)})
        sink: asyncio.Queue = asyncio.Queue()
        subs = [Submission(f"{request_id}-{i}", ids, p, rclass, priority, arrival, i, sink)
                for i, (ids, p) in enumerate(zip(prompts, params, strict=True))]
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

    def common_choice(out: RequestOutput, return_ids: bool) -> dict[str, Any]:
        extra: dict[str, Any] = {"stop_reason": out.stop_reason}
        if return_ids:
            extra["token_ids"] = list(out.token_ids)
            extra["prompt_token_ids"] = list(out.prompt_token_ids)
        return extra

    def total_usage(outs: list[RequestOutput]) -> dict[str, Any]:
        return usage(sum(len(o.prompt_token_ids) for o in outs),
                     sum(len(o.token_ids) for o in outs),
                     sum(o.num_cached_tokens for o in outs))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = st.clock()
        req: CompletionRequest = await parse(request, CompletionRequest)
        rclass = request_class(request, req.request_class)
        prompts = [p if isinstance(p, list) else await encode(p, True) for p in req.prompts()]
        params = [sampling(req, len(ids)) for ids in prompts]
        rid = new_id("cmpl")
        group = await submit(rid, prompts, params, rclass, req.priority, arrival)
        model = req.model or st.model_name
        if req.stream:
            fmt = _CompletionChunks(rid, model, req.return_token_ids, st.tokenizer)
            return EngineStreamResponse(
                stream(group, fmt, req.stream_options), group.abort_unfinished)
        outs = await collect(request, group)
        if outs is None:
            return Response(status_code=499)
        choices = [{"index": i, "text": o.text,
                    "logprobs": None if o.logprobs is None else
                    completion_logprobs(st.tokenizer, o.token_ids, o.logprobs),
                    "finish_reason": o.finish_reason, **common_choice(o, req.return_token_ids)}
                   for i, o in enumerate(outs)]
        return JSONResponse({"id": rid, "object": "text_completion", "created": now_s(),
                             "model": model, "choices": choices, "usage": total_usage(outs)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = st.clock()
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        rclass = request_class(request, req.request_class)
        if st.tokenizer is None:
            raise ApiError(400, "This model has no tokenizer, so no chat template: use "
                           "/v1/completions with token ids", code="invalid_value")
        kwargs = dict(req.chat_template_kwargs or {})
        if clash := RESERVED_TEMPLATE_KWARGS & kwargs.keys():
            raise ApiError(400, f"chat_template_kwargs cannot set {sorted(clash)}",
                           param="chat_template_kwargs", code="invalid_value")
        if req.tools:
            kwargs["tools"] = req.tools
        messages = req.template_messages()
        render = st.tokenizer.apply_chat_template
        try:
            if sum(len(m.get("content") or "") for m in messages) > OFFLOAD_CHARS:
                text = await asyncio.to_thread(render, messages, req.add_generation_prompt,
                                               **kwargs)
            else:
                text = render(messages, req.add_generation_prompt, **kwargs)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        ids = await encode(text, False)  # the template wrote the special tokens
        params = sampling(req, len(ids))
        rid = new_id("chatcmpl")
        group = await submit(rid, [ids], [params], rclass, req.priority, arrival)
        model = req.model or st.model_name
        if req.stream:
            fmt = _ChatChunks(rid, model, req.return_token_ids, st.tokenizer)
            return EngineStreamResponse(
                stream(group, fmt, req.stream_options), group.abort_unfinished)
        outs = await collect(request, group)
        if outs is None:
            return Response(status_code=499)
        o = outs[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": o.text},
                  "logprobs": None if o.logprobs is None else
                  chat_logprobs(st.tokenizer, o.token_ids, o.logprobs),
                  "finish_reason": o.finish_reason,
                  **common_choice(o, req.return_token_ids)}
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now_s(),
                             "model": model, "choices": [choice], "usage": total_usage(outs)})

    return app


# ---- streaming ------------------------------------------------------------------------------


class _Chunks:
    object = ""

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

    def choice(self, index: int, text: str, out: RequestOutput, new_ids: list[int],
               first: bool) -> dict[str, Any]:
        delta = {"content": text} if text or not out.finished else {}
        return {"index": index, "delta": delta, **self.finish_fields(index, out, new_ids, first)}

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
        outs = list(finals.values())
        chunk = fmt.envelope([])
        chunk["usage"] = usage(sum(len(o.prompt_token_ids) for o in outs),
                               sum(len(o.token_ids) for o in outs),
                               sum(o.num_cached_tokens for o in outs))
        yield sse(chunk)
    yield SSE_DONE


# ---- entry point ----------------------------------------------------------------------------


def serve(model: str, engine_options: dict[str, Any], settings: ServerSettings) -> None:
    """Build the engine, then serve until interrupted (``hlserve serve``)."""
    import uvicorn

    from hlserve.llm import build_engine

    keys = KeyTable.load(settings.api_key, settings.api_keys_file)  # fail before loading
    engine = build_engine(model, **engine_options)
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
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=settings.access_log,
                            timeout_graceful_shutdown=5, backlog=4096)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()
