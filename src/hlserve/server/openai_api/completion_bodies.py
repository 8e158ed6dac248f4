"""The bodies of answers that are not streamed: ``text_completion`` and ``chat.completion``.

Choices in vLLM's order (sequence ``j`` of prompt ``i`` at ``i * k + j``), best_of's ``n``
best by cumulative logprob, logprobs in each endpoint's shape, a chat's reasoning and tool
calls taken out of its text, and usage that counts each prompt once.
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Callable
from typing import Any

from hlserve.request import RequestOutput
from hlserve.server.openai_api.generation import chat_reasoning, chat_tool_plan
from hlserve.server.openai_api.logprobs import chat_logprobs, completion_logprobs
from hlserve.server.openai_api.state import ServerState
from hlserve.server.protocol import ChatCompletionRequest, CompletionRequest, now_s, usage
from hlserve.server.tools.parsers import apply_tool_calls
from hlserve.server.tools.reasoning import apply_reasoning


def common_choice(out: RequestOutput, return_ids: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {"stop_reason": out.stop_reason}
    if return_ids:
        extra["token_ids"] = list(out.token_ids)
        extra["prompt_token_ids"] = list(out.prompt_token_ids)
    return extra


def total_usage(outs: list[RequestOutput], per_prompt: int = 1,
                returned: list[RequestOutput] | None = None) -> dict[str, Any]:
    """Usage of sequences in index order, ``per_prompt`` of each prompt: its prompt (and
    cached) tokens count once, as vLLM counts them; completion tokens are the returned
    choices'."""
    firsts = outs[::per_prompt]
    return usage(sum(len(o.prompt_token_ids) for o in firsts),
                 sum(len(o.token_ids) for o in (outs if returned is None else returned)),
                 sum(o.num_cached_tokens for o in firsts))


def returned_choices(outs: list[RequestOutput], k: int, n: int) -> list[RequestOutput]:
    """Of each prompt's ``k`` sequences, the ``n`` returned: all, or with best_of the n of
    highest cumulative logprob (vLLM V0's best_of)."""
    if k == n:
        return outs
    chosen: list[RequestOutput] = []
    for i in range(0, len(outs), k):
        ranked = sorted(outs[i:i + k], key=lambda o: -(o.cumulative_logprob or 0.0))
        chosen += ranked[:n]
    return chosen


def completion_body(st: ServerState, rid: str, model: str, req: CompletionRequest,
                    outs: list[RequestOutput], echo: list[str] | None = None) -> dict[str, Any]:
    k = req.best_of or req.n
    chosen = returned_choices(outs, k, req.n)
    # best_of computes logprobs to rank the sequences; they are shown only when asked for
    show_lp = req.logprobs is not None
    choices = [{"index": i, "text": (echo[i // req.n] if echo else "") + o.text,
                "logprobs": None if o.logprobs is None or not show_lp else
                completion_logprobs(st.tokenizer, o.token_ids, o.logprobs),
                "finish_reason": o.finish_reason, **common_choice(o, req.return_token_ids)}
               for i, o in enumerate(chosen)]
    return {"id": rid, "object": "text_completion", "created": now_s(), "model": model,
            "choices": choices, "usage": total_usage(outs, k, chosen)}


def chat_body(st: ServerState, rid: str, model: str, req: ChatCompletionRequest,
              outs: list[RequestOutput], echo: list[str] | None = None) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": None if o.logprobs is None else
                chat_logprobs(st.tokenizer, o.token_ids, o.logprobs),
                "finish_reason": o.finish_reason, **common_choice(o, req.return_token_ids)}
               for i, o in enumerate(outs)]
    apply_reasoning(chat_reasoning(st, req), choices)  # server/tools/reasoning.py
    apply_tool_calls(chat_tool_plan(st, req)[0], choices, outs)
    return {"id": rid, "object": "chat.completion", "created": now_s(), "model": model,
            "choices": choices, "usage": total_usage(outs, req.n)}


JSON_SLICE = 64  # items of a long list serialised per json.dumps call (see render_json)


def render_json(obj: Any) -> bytes:
    """``obj`` as Starlette's ``JSONResponse`` renders it (compact, UTF-8, no NaN), byte for
    byte, but in pieces: one ``json.dumps`` holds the GIL throughout, ~1 s for the 40 MB of a
    large logprobs response, and the event loop with it even from a worker thread. Dicts and
    lists are walked, and long lists dumped JSON_SLICE items at a time, so the GIL changes
    hands between pieces."""
    parts: list[str] = []
    _render(obj, parts)
    return "".join(parts).encode("utf-8")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _render(obj: Any, parts: list[str]) -> None:
    if isinstance(obj, dict) and obj:
        sep = "{"
        for key, value in obj.items():
            parts.append(f"{sep}{_dumps(str(key))}:")
            _render(value, parts)
            sep = ","
        parts.append("}")
    elif isinstance(obj, list) and len(obj) > JSON_SLICE:
        sep = "["
        for i in range(0, len(obj), JSON_SLICE):
            parts.append(sep + _dumps(obj[i:i + JSON_SLICE])[1:-1])
            sep = ","
        parts.append("]")
    elif isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        sep = "["
        for value in obj:
            parts.append(sep)
            _render(value, parts)
            sep = ","
        parts.append("]")
    else:
        parts.append(_dumps(obj))


class _CollectorPause:
    """Python's cyclic collector off while any thread builds a large body. A large logprobs
    answer is half a million small dicts and lists, alive until serialised; each full
    collection the build set off walked all of them holding the GIL, 0.1-0.3 s in which the
    event loop answered nothing (the start-up heap is frozen: server/app.py). The bodies hold
    no cycles, and are freed, by reference count, before the collector is back on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._builders = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._builders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._builders += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._builders -= 1
            if self._builders == 0 and self._was_enabled:
                gc.enable()


_COLLECTOR_PAUSE = _CollectorPause()


def render_large(build: Callable[[], dict[str, Any]]) -> bytes:
    """``render_json(build())`` with the collector paused: the body is built, serialised and
    dropped before it resumes, so no collection ever walks it."""
    with _COLLECTOR_PAUSE:
        return render_json(build())
