"""Streamed answers: the engine's cumulative outputs as server-sent events.

:func:`stream` turns each prompt's newest output into the text and token ids not yet sent;
a :class:`Chunks` subclass shapes them as ``text_completion`` or ``chat.completion.chunk``
events (a chat's reasoning and tool calls as their own deltas). An error ends the stream
with an error event and ``[DONE]``; :class:`EngineStreamResponse` aborts whatever the
engine is still generating when the stream ends, however it ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from hlserve.request import RequestOutput, TokenLogprobs
from hlserve.server.openai_api.completion_bodies import total_usage
from hlserve.server.openai_api.error_replies import engine_error, output_error
from hlserve.server.openai_api.logprobs import chat_logprobs, completion_logprobs
from hlserve.server.protocol import now_s, usage
from hlserve.server.runtime.events import RequestGroup
from hlserve.server.tools.parsers import ToolPlan, ToolStream
from hlserve.server.tools.reasoning import ReasoningParser, ReasoningStream
from hlserve.tokenizer import Tokenizer

SSE_DONE = "data: [DONE]\n\n"


# Characters that Python's str.splitlines (and so httpx's iter_lines and many agents' SSE
# readers) takes for line breaks, though SSE and JSON do not. Raw in an event, they cut it in
# two for such a reader (the soak test saw a sampled one do so). JSON text can hold them
# only inside strings, where the \u escape decodes to the same string. (Those under U+0020
# are escaped by json.dumps already.)
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict[str, Any]) -> str:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


class EngineStreamResponse(StreamingResponse):
    """SSE whose end, however it comes (done, client gone, server stopping), aborts what the
    engine is still generating for it."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Chunks:
    """How one endpoint shapes its stream's events: the envelope, an optional opening event
    per choice, and each choice's new text with its finish fields (subclasses per endpoint)."""

    object = ""
    echo: list[str] | None = None  # per prompt: text prepended to its choices' first chunk
    per_prompt: int = 1  # choices per prompt (n)

    def __init__(self, rid: str, model: str, return_ids: bool,
                 tokenizer: Tokenizer | None = None) -> None:
        self.rid, self.model, self.return_ids = rid, model, return_ids
        self.tokenizer = tokenizer
        self.created = now_s()

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices}

    def opening(self, index: int, out: RequestOutput | None) -> dict[str, Any] | None:
        return None

    def choice(self, index: int, text: str, out: RequestOutput, new_ids: list[int],
               first: bool) -> dict[str, Any]:
        raise NotImplementedError

    def logprobs(self, index: int, out: RequestOutput, new_ids: list[int]) -> dict[str, Any] | None:
        return None

    def _new_entries(self, out: RequestOutput, new_ids: list[int]) -> list[TokenLogprobs]:
        assert out.logprobs is not None
        return out.logprobs[len(out.token_ids) - len(new_ids) : len(out.token_ids)]

    def finish_fields(self, index: int, out: RequestOutput, new_ids: list[int],
                      first: bool) -> dict[str, Any]:
        fields: dict[str, Any] = {"logprobs": self.logprobs(index, out, new_ids),
                                  "finish_reason": out.finish_reason if out.finished else None}
        if out.finished:
            fields["stop_reason"] = out.stop_reason
        if self.return_ids:
            fields["token_ids"] = new_ids
            if first:
                fields["prompt_token_ids"] = list(out.prompt_token_ids)
        return fields


class CompletionChunks(Chunks):
    object = "text_completion"

    def __init__(self, rid: str, model: str, return_ids: bool,
                 tokenizer: Tokenizer | None = None) -> None:
        super().__init__(rid, model, return_ids, tokenizer)
        self._text_offset: dict[int, int] = {}  # where each choice's next token text starts

    def choice(self, index: int, text: str, out: RequestOutput, new_ids: list[int],
               first: bool) -> dict[str, Any]:
        if first and self.echo:
            text = self.echo[index // self.per_prompt] + text
        return {"index": index, "text": text, **self.finish_fields(index, out, new_ids, first)}

    def logprobs(self, index: int, out: RequestOutput, new_ids: list[int]) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        start = self._text_offset.get(index, 0)
        lp = completion_logprobs(self.tokenizer, new_ids, self._new_entries(out, new_ids), start)
        if lp["tokens"]:
            self._text_offset[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp


class ChatChunks(Chunks):
    object = "chat.completion.chunk"

    def opening(self, index: int, out: RequestOutput | None) -> dict[str, Any] | None:
        return self.envelope([{"index": index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}])

    tool_plan = ToolPlan()
    reasoning: ReasoningParser | None = None

    def choice(self, index: int, text: str, out: RequestOutput, new_ids: list[int],
               first: bool) -> dict[str, Any]:
        fields = self.finish_fields(index, out, new_ids, first)
        full, thought = out.text, ""
        if self.reasoning is not None:  # <think> text as reasoning_content (reasoning.py)
            rs = self.__dict__.setdefault("_reasoning", {}).setdefault(
                index, ReasoningStream(self.reasoning))
            thought, full = rs.step(out.text, out.finished)
            sent = self.__dict__.setdefault("_content_sent", {})
            text, sent[index] = full[sent.get(index, 0):], len(full)
        if self.tool_plan.mode is not None:  # tool calls as deltas (server/tools/parsers.py)
            streams = self.__dict__.setdefault("_tool_streams", {})
            ts = streams.setdefault(index, ToolStream(self.tool_plan))
            delta, reason = ts.delta(text, full, out.finished, out.finish_reason)
            if out.finished:
                fields["finish_reason"] = reason
        else:
            delta = {"content": text} if text or not (out.finished or thought) else {}
        if thought:
            delta = {"reasoning_content": thought, **delta}
        return {"index": index, "delta": delta, **fields}

    def logprobs(self, index: int, out: RequestOutput, new_ids: list[int]) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, new_ids, self._new_entries(out, new_ids))


async def stream(group: RequestGroup, fmt: Chunks, options: Any) -> AsyncIterator[str]:
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    sent_text: dict[int, str] = {}
    sent_ids: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    for sub in group.subs:
        if (opening := fmt.opening(sub.index, None)) is not None:
            yield sse(opening)
    async for batch in group.events():
        for index, item in batch:
            err = engine_error(item) if isinstance(item, BaseException) else output_error(item)
            if err is not None:
                group.abort_unfinished()
                yield sse(err.body())
                yield SSE_DONE
                return
            out = item
            prev = sent_text.get(index, "")
            # the engine holds back text that could start a stop string, so streamed text is
            # never taken back; should it be, nothing is sent rather than a wrong delta
            delta = out.text[len(prev):] if out.text.startswith(prev) else ""
            first = index not in sent_ids
            new_ids = out.token_ids[sent_ids.get(index, 0):]
            if not delta and not new_ids and not out.finished:
                continue
            sent_text[index] = prev + delta
            sent_ids[index] = len(out.token_ids)
            chunk = fmt.envelope([fmt.choice(index, delta, out, list(new_ids), first)])
            if continuous:
                chunk["usage"] = usage(len(out.prompt_token_ids), len(out.token_ids))
            yield sse(chunk)
            if out.finished:
                finals[index] = out
    if include_usage:
        outs = [finals[i] for i in sorted(finals)]
        chunk = fmt.envelope([])
        chunk["usage"] = total_usage(outs, fmt.per_prompt)
        yield sse(chunk)
    yield SSE_DONE
