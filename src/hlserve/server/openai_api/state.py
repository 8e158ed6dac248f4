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

from hlserve.engine.llm_engine import Engine
from hlserve.server.openai_api.auth import KeyTable
from hlserve.server.openai_api.generation_defaults import SamplingDefaults
from hlserve.server.openai_api.response_store import ResponseStore, StoreLimits
from hlserve.server.protocol import now_s
from hlserve.server.runtime.bridge import BridgeLimits, EngineBridge
from hlserve.server.runtime.metrics import ServerMetrics
from hlserve.server.runtime.offload import Offload, OffloadLimits
from hlserve.server.runtime.settings import ServerSettings
from hlserve.server.tools.reasoning import END as THINK_END
from hlserve.server.tools.reasoning import START as THINK_START
from hlserve.structured.thinking import ThinkingBudget
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
        self.thinking_markers = thinking_markers(self.tokenizer, settings)
        # stored responses of /v1/responses, what previous_response_id continues from
        self.responses = ResponseStore(StoreLimits(settings.responses_store_max,
                                                   settings.responses_store_max_bytes))


def thinking_markers(tokenizer: Tokenizer | None, settings: ServerSettings
                     ) -> ThinkingBudget | None:
    """The token ids of a reasoning section, as vLLM's reasoning config derives them: the
    reasoning parser's ``<think>`` / ``</think>``, or ``--reasoning-config``'s strings (its
    end string is what is forced; the parser's end is still how the model closes one). None
    when neither names both (thinking_token_budget is then a 400). The budget is a request's:
    0 here."""
    if tokenizer is None:
        return None
    parser = settings.reasoning_parser is not None
    start = settings.reasoning_start_str or (THINK_START if parser else None)
    end = settings.reasoning_end_str or (THINK_END if parser else None)
    if start is None or end is None:
        return None
    natural = THINK_END if parser else end

    def ids(text: str) -> tuple[int, ...]:
        out = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not out:
            raise ValueError(f"--reasoning-config: {text!r} is no tokens of this tokenizer")
        return out

    return ThinkingBudget(0, ids(start), ids(end), ids(natural))


def served_name(model_path: str) -> str:
    return Path(model_path).name or Path(model_path).resolve().name or "model"


def state_of(request: Request) -> ServerState:
    return request.app.state.hlserve
