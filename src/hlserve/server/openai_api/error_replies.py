"""Errors as the client sees them, and the server's log line for each.

:func:`engine_error` and :func:`output_error` turn what the engine raises or ends a request
with into an :class:`~hlserve.server.protocol.ApiError` (status, OpenAI error body,
headers); the exception handlers that :func:`add_exception_handlers` installs answer every
error in that shape, FastAPI's and Starlette's own included (a client that left before its
body was read gets a bare 499), and log one line per refused request (:func:`log_error`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hlserve.errors import EngineDeadError, InvalidRequestError, ServiceUnavailableError
from hlserve.request import RequestOutput
from hlserve.server.protocol import ApiError, clip, error_body, invalid_request
from hlserve.server.runtime.bridge import RequestFailed

log = logging.getLogger("hlserve.server")


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
