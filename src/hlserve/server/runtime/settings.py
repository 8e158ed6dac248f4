"""Flags of ``hlserve serve`` that are the server's own (the engine's are in ``engine/args.py``).

Kept free of heavy imports: the CLI builds its parser from this module even when the
``server`` extra (fastapi, uvicorn, prometheus-client) is not installed. The class of a
request that names none is the engine's ``--default-request-class``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from hlserve.engine.args import cap_flag

# vLLM's names (server/tools/parsers.py)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names (server/tools/reasoning.py)
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_PROMPTS = 256
# limits of hlserve serve (docs/server.md, "Limits")
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_QUEUED_TOKENS = 1 << 22  # prompt tokens waiting: ~150 MB of token lists at most
DEFAULT_ENGINE_ITERATION_TIMEOUT_S = 60.0  # vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S
# the engine's step-time safety cap in a server (--max-step-seconds): a few seconds, so that
# /health and every other request are answered within that while one request's work runs
DEFAULT_MAX_STEP_SECONDS = 1.0
# prompt tokens of one request's prompts waiting for their prefill in the engine at once
# (--request-prefill-window): the rest are handed over as those prefill, so a request of 256
# long prompts does not queue ahead of every request that comes after it
DEFAULT_REQUEST_PREFILL_WINDOW = 8192
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's and vLLM's
# stored responses of /v1/responses (server/openai_api/response_store.py): count and JSON bytes
DEFAULT_RESPONSES_STORE_MAX = 1000
DEFAULT_RESPONSES_STORE_MAX_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # the first one is reported; all are accepted. None given: the model directory's base
    # name is reported, and the model argument as given is accepted too
    served_model_names: tuple[str, ...] = ()
    # the model argument as given (``smollm2-135m``, a .gguf file, a directory): the name
    # reported and accepted when served_model_names is empty; None: the engine's directory
    model_arg: str | None = None
    api_key: str | None = None
    api_keys_file: Path | None = None
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS
    max_queued_tokens: int | None = DEFAULT_MAX_QUEUED_TOKENS
    request_timeout_s: float | None = None  # arrival to finish; None: no deadline
    engine_iteration_timeout_s: float = DEFAULT_ENGINE_ITERATION_TIMEOUT_S
    request_prefill_window: int | None = DEFAULT_REQUEST_PREFILL_WINDOW
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    request_read_timeout_s: float | None = DEFAULT_REQUEST_READ_TIMEOUT_S
    timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS
    # the pools a request's heavy work runs in, and what one client may have in each
    prep_workers: int = 4
    grammar_workers: int = 4
    max_offload_per_client: int = 2
    # the lowest (most urgent) priority a request may declare; None: any int32, or 0 once
    # API keys are configured (a tenant cannot put itself ahead of the others)
    min_priority: int | None = None
    retry_after_s: int = 1
    log_level: str = "info"
    access_log: bool = False
    # tool calling, vLLM's flags: the format the model writes tool calls in, and whether
    # tool_choice "auto" (the default when tools are sent) is allowed at all
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # vLLM's --reasoning-config: the strings that open a reasoning section and that are
    # forced to end it under thinking_token_budget; None: the reasoning parser's
    reasoning_start_str: str | None = None
    reasoning_end_str: str | None = None
    enable_auto_tool_choice: bool = False
    # the bounds of the stored responses (previous_response_id); 0 responses: none stored
    responses_store_max: int = DEFAULT_RESPONSES_STORE_MAX
    responses_store_max_bytes: int = DEFAULT_RESPONSES_STORE_MAX_BYTES


REASONING_CONFIG_KEYS = ("reasoning_start_str", "reasoning_end_str")


def _reasoning_config(text: str) -> dict[str, str]:
    """vLLM's ``--reasoning-config`` JSON, of the keys hlserve reads."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict) or set(obj) - set(REASONING_CONFIG_KEYS) or not all(
            isinstance(v, str) and v for v in obj.values()):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object with non-empty strings for {' / '.join(REASONING_CONFIG_KEYS)}"
            f", got {text!r}")
    return obj


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API answers to; the first is reported "
                        "(default: the model directory's base name)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    g.add_argument("--api-keys", dest="api_keys_file", type=Path, default=None, metavar="FILE",
                   help="more accepted keys, each optionally mapped to a request class: a JSON "
                        'object {"KEY": "agent" | "interactive" | null} or lines "KEY [CLASS]" '
                        "(see docs/server.md)")
    g.add_argument("--max-queued-requests", type=_positive(int),
                   default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="answer 503 with Retry-After once this many requests wait for the "
                        f"engine (default: {DEFAULT_MAX_QUEUED_REQUESTS})")
    g.add_argument("--max-queued-tokens", type=_positive(int), default=DEFAULT_MAX_QUEUED_TOKENS,
                   help="answer 503 with Retry-After once the waiting requests' prompts hold "
                        f"this many tokens (default: {DEFAULT_MAX_QUEUED_TOKENS})")
    g.add_argument("--request-timeout", dest="request_timeout_s", type=_positive(float),
                   default=None, help="end a request that has not finished this many seconds "
                                      "after it arrived (default: no deadline)")
    g.add_argument("--engine-iteration-timeout", dest="engine_iteration_timeout_s",
                   type=_positive(float), default=DEFAULT_ENGINE_ITERATION_TIMEOUT_S,
                   help="/health reports the engine wedged when no step completes in this many "
                        f"seconds while requests are in flight (default: "
                        f"{DEFAULT_ENGINE_ITERATION_TIMEOUT_S:g}); a step whose forward "
                        "still progresses (layer by layer) is not wedged")
    g.add_argument("--request-prefill-window", dest="request_prefill_window",
                   type=cap_flag, default=DEFAULT_REQUEST_PREFILL_WINDOW,
                   help="a request of several prompts is handed to the engine prompt by "
                        "prompt: at most this many of its prompt tokens wait for prefill at "
                        "once, so it cannot queue ahead of the requests after it; 'none': all "
                        f"at once (default: {DEFAULT_REQUEST_PREFILL_WINDOW})")
    g.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float,
                   default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, let requests in flight finish for up to this many seconds, "
                        f"then end them (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    g.add_argument("--request-read-timeout", dest="request_read_timeout_s",
                   type=_positive(float), default=DEFAULT_REQUEST_READ_TIMEOUT_S,
                   help="close a connection that has not sent a whole request (headers and "
                        f"body) within this many seconds (default: "
                        f"{DEFAULT_REQUEST_READ_TIMEOUT_S:g})")
    g.add_argument("--timeout-keep-alive", dest="timeout_keep_alive_s", type=_positive(float),
                   default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                   help="close an idle keep-alive connection after this many seconds "
                        f"(default: {DEFAULT_TIMEOUT_KEEP_ALIVE_S:g})")
    g.add_argument("--max-request-body-bytes", type=_positive(int), default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--max-prompts-per-request", type=_positive(int), default=DEFAULT_MAX_PROMPTS,
                   help="a completions request with more prompts gets 400 "
                        f"(default: {DEFAULT_MAX_PROMPTS})")
    g.add_argument("--prep-workers", type=_positive(int), default=4,
                   help="threads that parse large bodies, render chats, tokenize and build "
                        "large responses, off the event loop (default: 4)")
    g.add_argument("--grammar-workers", type=_positive(int), default=4,
                   help="threads that compile structured-output grammars (default: 4)")
    g.add_argument("--max-offload-per-client", type=_positive(int), default=2,
                   help="tasks one client (API key, else address) may have running or queued "
                        "in each of those pools; more wait their turn (default: 2)")
    g.add_argument("--min-priority", type=int, default=None,
                   help="the lowest (most urgent) 'priority' a request may declare; lower gets "
                        "400 (default: any, or 0 when API keys are configured)")
    g.add_argument("--uvicorn-log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (default: info)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_agent_args(g)


def add_agent_args(g: argparse._ArgumentGroup) -> None:
    """What agents use: tool calls, reasoning, stored responses."""
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how the model writes tool calls: hermes (Qwen2.5/Qwen3 "
                        "<tool_call>{json}</tool_call>), llama3_json (Llama 3 JSON), "
                        "qwen3_coder (XML), mistral ([TOOL_CALLS]) or pythonic (a Python "
                        "list of calls); parsed into tool_calls under tool_choice auto")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="put the model's <think>...</think> text into reasoning_content: "
                        "qwen3 or deepseek_r1 (vLLM's names)")
    g.add_argument("--reasoning-config", type=_reasoning_config, default={},
                   metavar="JSON", help="vLLM's: {\"reasoning_start_str\": ..., "
                   "\"reasoning_end_str\": ...}, the strings of a reasoning section for "
                   "thinking_token_budget (the end string is what is forced, e.g. a closing "
                   "phrase and </think>); default: the reasoning parser's <think> / </think>")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (needs --tool-call-parser), as vLLM")
    g.add_argument("--responses-store-max", type=_non_negative,
                   default=DEFAULT_RESPONSES_STORE_MAX,
                   help="keep at most this many /v1/responses responses for "
                        "previous_response_id, least recently used evicted first; 0: store "
                        f"none (default: {DEFAULT_RESPONSES_STORE_MAX})")
    g.add_argument("--responses-store-max-bytes", type=_positive(int),
                   default=DEFAULT_RESPONSES_STORE_MAX_BYTES,
                   help="and at most this many bytes of them (their JSON, conversations "
                        f"included) (default: {DEFAULT_RESPONSES_STORE_MAX_BYTES})")


def server_settings(args: argparse.Namespace, model: str) -> ServerSettings:
    names = tuple(args.served_model_name or ())
    return ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=names,
        model_arg=model,
        api_key=args.api_key,
        api_keys_file=args.api_keys_file,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout_s=args.request_timeout_s,
        engine_iteration_timeout_s=args.engine_iteration_timeout_s,
        request_prefill_window=args.request_prefill_window,
        shutdown_timeout_s=args.shutdown_timeout_s,
        request_read_timeout_s=args.request_read_timeout_s,
        timeout_keep_alive_s=args.timeout_keep_alive_s,
        max_request_body_bytes=args.max_request_body_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        prep_workers=args.prep_workers,
        grammar_workers=args.grammar_workers,
        max_offload_per_client=args.max_offload_per_client,
        min_priority=args.min_priority,
        log_level=args.log_level,
        access_log=args.access_log,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        reasoning_start_str=args.reasoning_config.get("reasoning_start_str"),
        reasoning_end_str=args.reasoning_config.get("reasoning_end_str"),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        responses_store_max=args.responses_store_max,
        responses_store_max_bytes=args.responses_store_max_bytes,
    )
