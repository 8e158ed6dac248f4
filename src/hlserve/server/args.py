"""Flags of ``hlserve serve`` that are the server's own (the engine's come from the CLI).

Kept free of heavy imports: the CLI builds its parser from this module even when the
``server`` extra (fastapi, uvicorn, prometheus-client) is not installed. The class of a
request that names none is the engine's ``--default-request-class``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

REQUEST_CLASSES = ("interactive", "agent")
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # the first one is reported; all are accepted
    api_key: str | None = None
    api_keys_file: Path | None = None
    max_queued_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1
    log_level: str = "info"
    access_log: bool = False


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
                        "(default: the model argument as given)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    g.add_argument("--api-keys", dest="api_keys_file", type=Path, default=None, metavar="FILE",
                   help="more accepted keys, each optionally mapped to a request class: a JSON "
                        'object {"KEY": "agent" | "interactive" | null} or lines "KEY [CLASS]" '
                        "(see docs/server.md)")
    g.add_argument("--max-queued-requests", type=_positive(int), default=None,
                   help="answer 503 with Retry-After once this many requests wait for the "
                        "engine (default: unlimited)")
    g.add_argument("--max-request-body-bytes", type=_positive(int), default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--uvicorn-log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (default: info)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")


def server_settings(args: argparse.Namespace, model: str) -> ServerSettings:
    names = tuple(args.served_model_name or (model,))
    return ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=names,
        api_key=args.api_key,
        api_keys_file=args.api_keys_file,
        max_queued_requests=args.max_queued_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        log_level=args.log_level,
        access_log=args.access_log,
    )
