"""What every handler reads: :class:`ServerState`, one per app (``app.state.hlserve``).

It holds the engine and the bridge to its thread, the settings, the API keys, the names
the model is served under, the sampling defaults of its ``generation_config.json`` and the
stored responses of ``/v1/responses``;
handlers are module-level functions that find it with :func:`state_of`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

from fastapi import Request

from hlserve.engine.engine import Engine
from hlserve.server.args import ServerSettings
from hlserve.server.auth import KeyTable
from hlserve.server.bridge import BridgeLimits, EngineBridge
from hlserve.server.defaults import SamplingDefaults
from hlserve.server.metrics import ServerMetrics
from hlserve.server.offload import Offload, OffloadLimits
from hlserve.server.protocol import now_s
from hlserve.server.reasoning import END as THINK_END
from hlserve.server.reasoning import START as THINK_START
from hlserve.server.response_store import ResponseStore, StoreLimits
from hlserve.tokenizer import Tokenizer


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
        # a request's heavy work (parse, template, tokenize, compile, respond), off the loop
        self.offload = Offload(OffloadLimits(settings.prep_workers, settings.grammar_workers,
                                             settings.max_offload_per_client))
        self.clock = engine.clock
        self.created = now_s()
        # generation_config.json's sampling defaults, for fields a request leaves out
        self.sampling_defaults = SamplingDefaults.load(model_path)
        # the token ids that open and close a reasoning section (thinking_token_budget)
        self.thinking_markers = thinking_markers(self.tokenizer, settings.reasoning_parser)
        # stored responses of /v1/responses, what previous_response_id continues from
        self.responses = ResponseStore(StoreLimits(settings.responses_store_max,
                                                   settings.responses_store_max_bytes))


def thinking_markers(tokenizer: Tokenizer | None, reasoning_parser: str | None
                     ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``<think>`` and ``</think>`` as token ids, as vLLM's reasoning config derives them from
    the reasoning parser's strings; None without a parser (or a tokenizer)."""
    if reasoning_parser is None or tokenizer is None:
        return None
    start, end = (tuple(tokenizer.encode(text, add_special_tokens=False))
                  for text in (THINK_START, THINK_END))
    return (start, end) if start and end else None


def served_name(model_path: str) -> str:
    return Path(model_path).name or Path(model_path).resolve().name or "model"


def state_of(request: Request) -> ServerState:
    return request.app.state.hlserve
