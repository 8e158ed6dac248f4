"""The Responses API's output items and its streamed events.

A streamed response is chat's stream (:func:`hlserve.server.openai_api.streaming.stream`, with its
reasoning and tool-call deltas) re-said as Responses events: ``response.created`` and
``response.in_progress``; per output item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``, ``response.content_part.added`` then
``response.output_text.delta``, ``response.function_call_arguments.delta``), their
``.done`` events and ``response.output_item.done``; then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it) with every item and the usage.
An engine error becomes an ``error`` event and ``response.failed``. Every event carries
its ``sequence_number``; there is no ``[DONE]`` (OpenAI sends none on this endpoint).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from hlserve.server.openai_api.streaming import SSE_DONE, ChatChunks, sse, stream
from hlserve.server.protocol import new_id
from hlserve.server.runtime.events import RequestGroup

# ---- output items -----------------------------------------------------------------------------


def item_id(prefix: str) -> str:
    """An id of the Responses API: ``resp_``, ``msg_``, ``fc_``, ``rs_`` and hex, OpenAI's
    and vLLM's shape (chat's ids are ``chatcmpl-...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str
                       ) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def final_status(finish_reason: str | None) -> dict[str, Any]:
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed"}


def response_usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if u is None:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}


# ---- streamed events --------------------------------------------------------------------------


@dataclass
class ResponseEvents:
    """One streamed response's state: the items so far and the one still open."""

    shell: dict[str, Any]  # the response object before any output
    items: list[dict[str, Any]] = field(default_factory=list)
    open_key: str | None = None  # "reasoning", "message" or "call:<index>"
    seq: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    # called with the finished response (completed or incomplete): where it is stored
    on_final: Callable[[dict[str, Any]], None] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body)

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.shell),
                self.event("response.in_progress", response=self.shell)]

    def _open(self, key: str, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open_key = key
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.items) - 1, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
            item["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        return out

    def close(self, status: str = "completed") -> list[str]:
        """The open item's ``.done`` events; ``status``: the item's, "incomplete" when the
        output was cut."""
        if self.open_key is None:
            return []
        self.open_key = None
        item, index = self.items[-1], len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"]))
        if "status" in item:
            item["status"] = status
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def reasoning(self, text: str) -> list[str]:
        out = [] if self.open_key == "reasoning" else \
            self._open("reasoning", reasoning_item(item_id("rs"), ""))
        item = self.items[-1]
        item["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=text))
        return out

    def text(self, text: str) -> list[str]:
        out = [] if self.open_key == "message" else \
            self._open("message", message_item(item_id("msg"), None, "in_progress"))
        item = self.items[-1]
        item["content"][0]["text"] += text
        out.append(self.event("response.output_text.delta", item_id=item["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=text,
                              logprobs=[]))
        return out

    def call(self, tc: dict[str, Any]) -> list[str]:
        key = f"call:{tc.get('index', 0)}"
        fn = tc.get("function") or {}
        out = []
        if self.open_key != key:
            out = self._open(key, function_call_item(item_id("fc"), tc.get("id") or new_id("call"),
                                                     fn.get("name") or "", "", "in_progress"))
        item = self.items[-1]
        if args := fn.get("arguments"):
            item["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=len(self.items) - 1, delta=args))
        return out

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for c in chunk.get("choices") or ():
            delta = c.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.reasoning(delta["reasoning_content"])
            if delta.get("content"):
                out += self.text(delta["content"])
            for tc in delta.get("tool_calls") or ():
                out += self.call(tc)
            self.finish_reason = c.get("finish_reason") or self.finish_reason
        return out

    def finish(self) -> list[str]:
        out = self.close(final_status(self.finish_reason)["status"])
        final = {**self.shell, **final_status(self.finish_reason), "output": self.items,
                 "usage": response_usage(self.usage)}
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        if self.on_final is not None:
            self.on_final(final)
        return [*out, self.event(kind, response=final)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        out = [self.event("error", code=error.get("code"), message=error.get("message"),
                          param=error.get("param"))]
        final = {**self.shell, "status": "failed", "output": self.items,
                 "error": {"code": error.get("code") or "server_error",
                           "message": error.get("message")}}
        return [*out, self.event("response.failed", response=final)]


async def response_stream(group: RequestGroup, fmt: ChatChunks, options: Any,
                          events: ResponseEvents) -> AsyncIterator[str]:
    """Chat's stream of ``group`` re-said as Responses events. Chat's chunks are read back
    from their SSE text: the one shaping of reasoning and tool-call deltas stays in chat's
    stream, at the cost of one JSON parse per chunk."""
    for ev in events.start():
        yield ev
    async for raw in stream(group, fmt, options):
        if raw == SSE_DONE:
            break
        chunk = json.loads(raw[len("data: "):])
        if "error" in chunk:
            for ev in events.failed(chunk["error"]):
                yield ev
            return
        for ev in events.chunk(chunk):
            yield ev
    for ev in events.finish():
        yield ev
