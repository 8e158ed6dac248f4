"""The OpenAI-compatible HTTP server: ``hlserve serve MODEL_DIR``.

FastAPI on uvicorn, one process. The engine runs in its own thread
(:mod:`hlserve.server.runtime.bridge`); handlers parse and validate a request
(:mod:`~hlserve.server.openai_api.intake`), tokenize it
(:mod:`~hlserve.server.openai_api.prompts`), hand it to the engine thread
(:mod:`~hlserve.server.openai_api.generation`) and turn the engine's cumulative outputs into
OpenAI bodies (:mod:`~hlserve.server.openai_api.completion_bodies`) or SSE chunks
(:mod:`~hlserve.server.openai_api.streaming`); errors are answered in one shape
(:mod:`~hlserve.server.openai_api.error_replies`). Nothing blocks the event loop: large
bodies are parsed, templated and tokenized in a worker thread.

This module assembles the app (:func:`create_app`: state, auth, error handlers, the routes
of :mod:`~hlserve.server.routes`, the OpenAPI schema, the engine thread's lifespan) and
runs it (:func:`serve`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from hlserve.config import EngineConfig
from hlserve.cpu_runtime import release_openmp_workers
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import Engine
from hlserve.runner.torch_runner import TorchRunner
from hlserve.server.openai_api.auth import AuthMiddleware, KeyTable
from hlserve.server.openai_api.error_replies import add_exception_handlers
from hlserve.server.openai_api.state import ServerState, hlserve_version
from hlserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from hlserve.server.responses.endpoint import ResponsesRequest
from hlserve.server.routes import add_routes
from hlserve.server.runtime.lifecycle import run_server
from hlserve.server.runtime.settings import ServerSettings
from hlserve.tokenizer import Tokenizer

log = logging.getLogger("hlserve.server")

REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest,
                  TokenizeChatRequest, DetokenizeRequest, ResponsesRequest)


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
    st.offload.shutdown()


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


def serve(config: EngineConfig, settings: ServerSettings) -> None:
    """Build the engine on ``config`` (the one factory, on the real runner), then serve until
    interrupted (``hlserve serve``)."""
    keys = KeyTable.load(settings.api_key, settings.api_keys_file)  # fail before loading
    configure_logging(settings.log_level)
    engine = build_engine(config, TorchRunner, tokenizer=Tokenizer.from_dir)
    # the engine steps on its own thread: this one's OpenMP workers (from loading the
    # weights) are given back, so that the engine thread's are the only ones and spin between
    # a step's parallel regions instead of sleeping (decode steps ran 1.15-1.18x slower
    # without; cpu_runtime.release_openmp_workers)
    release_openmp_workers()
    model = settings.model_arg or config.model
    app = create_app(engine, settings, keys, model)
    st: ServerState = app.state.hlserve
    freeze_startup_heap()
    auth = f"{len(keys)} API key(s)" if keys.enabled else "off"
    print(f"hlserve {hlserve_version()} serving {', '.join(st.model_names)} ({model}) on "
          f"http://{settings.host}:{settings.port}: max_model_len {st.max_model_len}, KV pool "
          f"{st.pool_tokens} tokens; auth {auth}; default request class "
          f"{engine.config.default_request_class}; queue cap "
          f"{settings.max_queued_requests or 'none'}", file=sys.stderr, flush=True)
    print(engine.caps_report, file=sys.stderr, flush=True)
    # SIGTERM drains (exit 0); a dead engine exits 1 so that a supervisor restarts us
    if code := run_server(app, st.bridge, settings):
        sys.exit(code)


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (modules, tokenizer, imported code: ~336K on
    the tiny test model) to the permanent generation, as vLLM does. A full collection walks
    every tracked object while holding the GIL, and the event loop waits for it; frozen,
    that heap is never walked again (with a large body being built, gen-2 passes of up to
    0.32 s became 0.12-0.23 s; the body itself is left out by responses.render_large)."""
    gc.collect()
    gc.freeze()


def configure_logging(level: str) -> None:
    """The server's own lines (refused requests, engine faults) at ``--uvicorn-log-level``,
    whatever the root logger's level (the CLI sets WARNING unless -v)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = {"trace": "DEBUG"}.get(level, level.upper())
    log.setLevel(getattr(logging, name, logging.INFO))
