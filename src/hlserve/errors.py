"""Errors that callers are meant to catch: each names the problem in words a user can act on."""

from __future__ import annotations

import sys
from typing import Any


class HLServeError(Exception):
    """Base of every error hlserve raises on purpose."""


class ModelLoadError(HLServeError):
    """The model directory is missing, is not a model, or holds something we cannot run."""


class InvalidRequestError(HLServeError, ValueError):
    """A request that can never be served as asked (empty prompt, too long, bad parameters).

    The server maps it to HTTP 400; the engine rejects the request and keeps serving the rest.
    """


class EngineDeadError(HLServeError):
    """The engine loop stopped on an internal error; no request can be served any more."""


class ServiceUnavailableError(HLServeError):
    """The server cannot take this request now (queue full, draining, engine gone); the server
    maps it to HTTP 503, with ``Retry-After`` when ``retry_after_s`` is set."""

    def __init__(self, message: str, code: str = "unavailable",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


# what a command line reports as "error: ..." with exit status 2, not as a traceback
CLI_ERRORS: tuple[type[Exception], ...] = (HLServeError, ValueError, TypeError, FileNotFoundError)


def run_command(args: Any) -> int:
    """Run a parsed subcommand (``args.func(args)``) as both CLIs do: 0 on success; one of
    ``CLI_ERRORS`` printed as ``hlserve: error: ...`` with exit status 2, not a traceback."""
    try:
        args.func(args)
    except CLI_ERRORS as e:
        print(f"hlserve: error: {e}", file=sys.stderr)
        return 2
    return 0
