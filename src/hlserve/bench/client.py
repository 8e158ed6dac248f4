"""Async HTTP client for OpenAI-compatible servers (hlserve, vLLM, SGLang, ...), built for
measurement: streamed ``/v1/completions`` with a timestamp on every chunk.

- **Prompts**: token ids where the server accepts them (hlserve, vLLM and SGLang do), so a
  prompt has exactly the length the workload asked for whatever the tokenizer; otherwise
  text decoded from the ids with the model's tokenizer (``tokenizer.json``), and the prompt
  length is then what the server's ``usage`` reports.
- **Output lengths** are pinned with ``ignore_eos`` (and ``min_tokens`` on request), which
  vLLM, SGLang and hlserve honour; ``max_tokens`` is the workload's output length.
- **Output token ids** (the next round of an agent session appends them to its context) come
  from ``return_token_ids`` where the server supports it (hlserve, vLLM); else the output
  text is re-encoded with the tokenizer; else the session appends placeholder ids of the
  same count (token counts and sharing structure are kept; the prefix cache then cannot hit
  the output's KV, and the result says so: ``output_ids_source``).
- **Usage**: ``stream_options.include_usage`` asks for a last chunk with token counts;
  without it the chunks are counted. ``prompt_tokens_details.cached_tokens`` is recorded
  where the server reports it.
- **Sessions**: a request that is a round of an agent session names it in ``session_id``
  (hlserve's field; vLLM accepts it), ``prompt_cache_key`` and ``user`` (OpenAI's), all set
  to the same per-run name (:data:`SESSION_FIELDS`), so a server that keeps a session's KV
  between rounds (``hlserve serve --session-ttl``) can.

:meth:`BenchClient.probe` finds out which of these the server supports, with one or two
one-token requests (their tokens are reported in the result as ``probe``). An optional field
that the server refuses with a 400 naming it (``return_token_ids``, a session field, as a
strict OpenAI-style server refuses an unknown argument) is dropped from every request, and a
note says so: a server that refuses a field cannot act on it, so the run measures what it
would if the server ignored it, and the result shows what was sent.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hlserve.driver.records import RequestRecord

PROBE_PROMPT = [11, 12, 13, 14]
# the fields that name a request's session, in hlserve's precedence (engine/sessions.py)
SESSION_FIELDS = ("session_id", "prompt_cache_key", "user")


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None = None
    token_prompts: bool = True  # accepts a list of token ids as the prompt
    return_token_ids: bool = True  # answers with the output's token ids
    probe_requests: int = 0
    probe_prompt_tokens: int = 0
    probe_output_tokens: int = 0
    session_fields: list[str] = field(default_factory=list)  # sent with a session's requests
    notes: list[str] = field(default_factory=list)

    @property
    def output_ids_source(self) -> str:
        return "server" if self.return_token_ids else "placeholder"


class ProbeError(RuntimeError):
    """The server cannot be benchmarked as configured (not reachable, no such model, ...)."""


def api_root(base_url: str) -> str:
    """``http://host:port`` from a URL with or without ``/v1``."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def load_tokenizer(path: str | Path | None):
    """A ``tokenizers.Tokenizer`` from a model directory, a ``tokenizer.json``, a .gguf file or
    a named model; None: none."""
    if path is None:
        return None
    from tokenizers import Tokenizer

    from hlserve.models.resolve import resolve_model

    p = Path(resolve_model(path))
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def _error_message(status: int, body: bytes | str) -> str:
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        return f"HTTP {status}: {msg}"
    except (ValueError, AttributeError):
        return f"HTTP {status}: {text[:300]}"


def refused_field(message: str, fields: Sequence[str]) -> str | None:
    """The first of ``fields`` that a 400's message names (as a whole word): the optional
    field the server refused (OpenAI: 'Unrecognized request argument supplied: NAME')."""
    for name in fields:
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", message):
            return name
    return None


class BenchClient:
    """``async with BenchClient(url, model) as c: info = await c.probe(); ...``"""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 3600.0, extra_body: dict[str, Any] | None = None,
                 request_class: str | None = None, tokenizer: Any = None,
                 ignore_eos: bool = True, min_tokens: bool = False,
                 temperature: float = 0.0, session_fields: Sequence[str] = (),
                 session_xargs: bool = False) -> None:
        self.root = api_root(base_url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if request_class:
            headers["X-Request-Class"] = request_class  # hlserve's; other servers ignore it
        self.http = httpx.AsyncClient(
            base_url=self.root, headers=headers,
            timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.extra_body = dict(extra_body or {})
        self.tokenizer = tokenizer
        self.ignore_eos = ignore_eos
        self.min_tokens = min_tokens
        self.temperature = temperature
        self.session_fields = list(session_fields)  # what the probe tries; it may drop some
        self.session_xargs = session_xargs  # also vllm_xargs.session_id (vLLM 0.32, 0.33)
        self.info: ServerInfo | None = None

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    # ---- capabilities ---------------------------------------------------------------------
    async def probe(self, token_prompts: bool | None = None,
                    return_token_ids: bool | None = None,
                    session: str = "hlserve-bench-probe") -> ServerInfo:
        """Model name and context length from ``/v1/models``; then what the server accepts,
        by one-token requests (skipped for what the caller states). They carry the session
        fields, named ``session``, when the client sends them."""
        info = self.info = await self._model_card()
        optional: dict[str, Any] = {f: session for f in self.session_fields}
        if return_token_ids is not False:
            optional["return_token_ids"] = True
        refused: dict[str, str] = {}
        if token_prompts is False:
            info.token_prompts = False
        else:
            status, obj = await self._attempt(info, PROBE_PROMPT, optional, refused)
            if status == 200:
                info.token_prompts = True
                choice = obj["choices"][0] if isinstance(obj, dict) else {}
                info.return_token_ids = "return_token_ids" in optional and "token_ids" in choice
            elif status == 400 and token_prompts is None:
                info.token_prompts = False
                info.notes.append(f"token-id prompts refused ({obj}); sending text")
            else:
                raise ProbeError(self._failed(obj, optional))
        if not info.token_prompts:
            if self.tokenizer is None:
                raise ProbeError("the server does not take token-id prompts: give the model's "
                                 "tokenizer (--tokenizer DIR) to send text")
            status, obj = await self._attempt(info, "Hello", optional, refused)
            if status != 200:
                raise ProbeError(self._failed(obj, optional))
            info.return_token_ids = ("return_token_ids" in optional
                                     and "token_ids" in obj["choices"][0])
        if return_token_ids is False:
            info.return_token_ids = False
        self._settle_sessions(info, optional, refused)
        if not info.return_token_ids:
            info.notes.append("the server does not return output token ids: "
                              + ("re-encoding output text with the tokenizer"
                                 if self.tokenizer is not None else
                                 "sessions append placeholder ids of the output's length"))
        return info

    async def _model_card(self) -> ServerInfo:
        """The model to request (``self.model``, else the first served) and its context
        length, from ``/v1/models``."""
        try:
            r = await self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise ProbeError(f"cannot reach {self.root}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ProbeError(f"GET /v1/models: {_error_message(r.status_code, r.content)}")
        cards = r.json().get("data", [])
        names = [c.get("id") for c in cards]
        if self.model is None:
            if not names:
                raise ProbeError("the server lists no model; name one with --model")
            self.model = names[0]
        elif names and self.model not in names:
            raise ProbeError(f"the server has no model {self.model!r}; it serves {names}")
        card = next((c for c in cards if c.get("id") == self.model), {})
        return ServerInfo(model=self.model, max_model_len=card.get("max_model_len"))

    async def _attempt(self, info: ServerInfo, prompt: Any, optional: dict[str, Any],
                       refused: dict[str, str]) -> tuple[int, dict[str, Any] | str]:
        """One probe request with the ``optional`` fields. An error that names one of them
        drops it from ``optional`` (its message kept in ``refused``) and tries again without
        it; any other error is returned as (status, message)."""
        while True:
            body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                    **optional}
            rr = await self.http.post("/v1/completions", json=body)
            info.probe_requests += 1
            if rr.status_code == 200:
                obj = rr.json()
                usage = obj.get("usage") or {}
                info.probe_prompt_tokens += usage.get("prompt_tokens", 0)
                info.probe_output_tokens += usage.get("completion_tokens", 0)
                return 200, obj
            msg = _error_message(rr.status_code, rr.content)
            name = refused_field(msg, list(optional))
            if name is None:
                return rr.status_code, msg
            del optional[name]
            refused[name] = msg

    def _settle_sessions(self, info: ServerInfo, optional: dict[str, Any],
                         refused: dict[str, str]) -> None:
        """Keep the session fields the server took; a note names those it refused."""
        kept = [f for f in self.session_fields if f in optional]
        dropped = [f for f in self.session_fields if f in refused]
        if dropped:
            rest = (f"sessions are named by {', '.join(kept)} only" if kept else
                    "sessions are not named on the wire (a server that keeps a session's KV "
                    "cannot tell its rounds apart)")
            info.notes.append(f"the server refused {', '.join(dropped)} "
                              f"({refused[dropped[0]]}): not sent; {rest}")
        self.session_fields = info.session_fields = kept

    def _failed(self, msg: Any, optional: dict[str, Any]) -> str:
        sent = [f for f in self.session_fields if f in optional]
        hint = (f" (it was sent {', '.join(sent)}: a server that refuses them without naming "
                "them needs --no-session-ids)" if sent else "")
        return f"probe request failed: {msg}{hint}"

    # ---- one request --------------------------------------------------------------------
    def body(self, prompt_ids: list[int], max_tokens: int, pin: bool = True,
             session: str | None = None) -> dict[str, Any]:
        """The request's JSON; ``pin`` False: the output length is the model's (a workload
        whose replies are real text, the coding one), whatever ``ignore_eos`` / ``min_tokens``
        say for the others; ``session``: the agent session it is a round of, put in every
        session field the server took (none: a request of no session)."""
        info = self.info or ServerInfo(model=self.model or "")
        prompt: Any = prompt_ids
        if not info.token_prompts:
            prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos and pin:
            body["ignore_eos"] = True
        if self.min_tokens and pin:
            body["min_tokens"] = max_tokens
        if info.return_token_ids:
            body["return_token_ids"] = True
        if session is not None:
            body.update({f: session for f in self.session_fields})
        body.update(self.extra_body)
        if session is not None and self.session_xargs:
            # vLLM before 0.34 passes no session field to its scheduler: the plugin reads
            # vllm_xargs.session_id there (docs/vllm.md)
            body["vllm_xargs"] = {**body.get("vllm_xargs", {}), "session_id": session}
        return body

    async def complete(self, prompt_ids: list[int], max_tokens: int, rec: RequestRecord,
                       t0: float, pin: bool = True, session: str | None = None,
                       ) -> list[int] | None:
        """Send one streamed completion (a round of ``session``, if given); fill ``rec``
        (times relative to ``t0``, a ``time.perf_counter`` value). Returns the output token
        ids, or None on failure."""
        body = self.body(prompt_ids, max_tokens, pin, session)
        rec.expected_output_tokens = max_tokens
        if isinstance(body["prompt"], list):
            rec.prompt_tokens = len(prompt_ids)
        ids: list[int] = []
        text_parts: list[str] = []
        chunks = 0
        usage: dict[str, Any] | None = None
        clock = time.perf_counter
        rec.start = clock() - t0
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                rec.status = r.status_code
                if r.status_code != 200:
                    rec.error = _error_message(r.status_code, await r.aread())
                    return None
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = clock() - t0
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj or obj.get("object") == "error":
                        err = obj.get("error", obj)
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        rec.error = f"error event in the stream: {msg}"
                        return None
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or ():
                        new_ids = choice.get("token_ids") or []
                        text = choice.get("text") or ""
                        if new_ids or text:
                            rec.chunk_times.append(now)
                            ids.extend(new_ids)
                            text_parts.append(text)
                            chunks += 1
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                if not done:
                    rec.error = "the stream ended without [DONE]"
                    return None
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            rec.error = f"{type(e).__name__}: {e}".rstrip(": ")
            return None
        finally:
            rec.end = clock() - t0
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
            rec.output_tokens = usage.get("completion_tokens", len(ids) or chunks)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = details["cached_tokens"]
        else:
            rec.output_tokens = len(ids) or chunks
        if not rec.chunk_times:
            rec.error = "no output chunk was received"
            return None
        rec.success = True
        if ids:
            return ids
        if self.tokenizer is not None:
            return self.tokenizer.encode("".join(text_parts), add_special_tokens=False).ids
        return [PROBE_PROMPT[0]] * rec.output_tokens
