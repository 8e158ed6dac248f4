"""API keys: which keys are accepted, and the request class each one implies.

``--api-key KEY`` accepts one key with no class. ``--api-keys FILE`` adds keys, each
optionally mapped to a request class. FILE is either a JSON object::

    {"sk-agents": "agent", "sk-chat-ui": "interactive", "sk-ops": null}

or text, one key per line, an optional class after whitespace, ``#`` starting a comment::

    sk-agents   agent
    sk-chat-ui  interactive
    sk-ops

Keys are compared in constant time: the presented key's SHA-256 is compared with every
accepted key's with :func:`hmac.compare_digest`, without stopping at a match, so neither the
content of a key nor its position in the table shows in the response time.

A key's identity (:attr:`ApiKey.id`, a prefix of its SHA-256, never the key) names its
tenant: the server salts the prefix cache with it, so one key's prompts are never a cache
hit for another.

:class:`AuthMiddleware` checks the bearer key of every request but those to the open paths
(health, the API's schema and docs) and puts the accepted key into the ASGI scope.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from hlserve.request import REQUEST_CLASSES
from hlserve.server.openai_api.error_replies import log_error
from hlserve.server.protocol import error_body
from hlserve.server.runtime.metrics import ServerMetrics

KEY_SCOPE = "hlserve.api_key"  # the ApiKey the auth middleware accepted
OPEN_PATHS = frozenset({"/health", "/ping", "/openapi.json", "/docs", "/docs/oauth2-redirect"})


@dataclass(frozen=True)
class ApiKey:
    """An accepted key as the server sees it: who (a digest, not the key) and its class."""

    id: str
    request_class: str | None


class KeyTable:
    def __init__(self, keys: dict[str, str | None]) -> None:
        for key, cls in keys.items():
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"an API key must be non-empty and without spaces: {key!r}")
            if cls is not None and cls not in REQUEST_CLASSES:
                raise ValueError(f"API key class must be one of {REQUEST_CLASSES} or none, "
                                 f"got {cls!r}")
        self._entries = [(_digest(k), cls) for k, cls in keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, presented: str | None) -> ApiKey | None:
        """The accepted key ``presented`` is, or None."""
        digest = _digest(presented or "")
        found, found_cls = False, None
        for d, cls in self._entries:  # no early exit: constant time in the table too
            match = hmac.compare_digest(d, digest)
            found |= match
            if match:
                found_cls = cls
        if not found or presented is None:
            return None
        return ApiKey(digest.hex()[:32], found_cls)

    @classmethod
    def load(cls, api_key: str | None, path: Path | None) -> KeyTable:
        keys: dict[str, str | None] = {}
        if path is not None:
            keys.update(read_key_file(path))
        if api_key is not None:
            keys.setdefault(api_key, None)
        return cls(keys)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: Path) -> dict[str, str | None]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from None
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in obj.items()
        ):
            raise ValueError(f'{path}: expected a JSON object {{"KEY": "agent" | "interactive" '
                             "| null}")
        return dict(obj)
    keys: dict[str, str | None] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2 or (len(parts) == 2 and parts[1] not in REQUEST_CLASSES):
            raise ValueError(f"{path}:{lineno}: expected 'KEY [interactive|agent]', got {raw!r}")
        keys[parts[0]] = parts[1] if len(parts) == 2 else None
    if not keys:
        raise ValueError(f"{path} holds no API keys")
    return keys


class AuthMiddleware:
    """Bearer keys on every path but the open ones; the accepted key goes into the scope."""

    def __init__(self, app: Any, keys: KeyTable, metrics: ServerMetrics,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
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
        key = self.keys.find(token)
        if key is None:
            self.metrics.reject("unauthorized")
            message = ("You didn't provide an API key: send it as 'Authorization: Bearer KEY'"
                       if token is None else "Incorrect API key provided")
            log_error(scope["method"], scope["path"], 401, "invalid_api_key", None, message)
            response = JSONResponse(error_body(message, "invalid_request_error", None,
                                               "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope[KEY_SCOPE] = key
        await self.app(scope, receive, send)
