"""Stored responses of ``POST /v1/responses``: what ``previous_response_id`` continues from.

A response created with ``store`` (true unless the request says false, as OpenAI's) is kept
with the conversation it ends: the chat messages of every earlier turn of its chain, its own
input items as messages and its output as the assistant turn (its ``message`` text and its
``function_call`` items; reasoning is not shown to the model again, as chat drops it). The
request's ``instructions`` are not part of it: OpenAI does not carry them over to a
continuation, which sends its own.

The store is bounded in count (``--responses-store-max``) and in bytes
(``--responses-store-max-bytes``); past either bound the least recently used response is
evicted (a lookup or a continuation uses it). A response whose own size is over the byte
bound is not kept. What is kept is bytes, not Python objects: the response as the JSON it
was answered with, and its conversation as one JSON chunk per turn, shared with the response
it continues. So the charge is the real footprint: each chunk's length plus
``CHUNK_OVERHEAD`` (a ``bytes`` object's header and the allocator's rounding) and each
entry's ``ENTRY_OVERHEAD`` (its key, record and slot; measured, tests/test_responses_store.py).
A shared chunk is charged to every response that holds it, so the charge is an upper bound.
Before, the store kept the parsed objects and charged their JSON characters: a float in a
list costs about 32 bytes in Python for its 4 characters, and 23 requests of 10 MB of such
``metadata`` held 1.4 GiB under a 128 MiB bound. Entries are scoped
by tenant (the API key's id; one shared tenant without keys): another tenant's id is
answered as unknown, so one tenant can neither read nor continue nor tell apart another's
responses. The store lives in the server's memory only: a restart forgets it.

vLLM keeps its responses only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, unbounded; without
it ``store`` is silently false and every ``previous_response_id`` is a 404.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from hlserve.server.openai_api.auth import KEY_SCOPE, ApiKey
from hlserve.server.protocol import ApiError
from hlserve.server.runtime.settings import (
    DEFAULT_RESPONSES_STORE_MAX,
    DEFAULT_RESPONSES_STORE_MAX_BYTES,
)


@dataclass(frozen=True)
class StoreLimits:
    max_count: int = DEFAULT_RESPONSES_STORE_MAX  # 0: nothing is stored
    max_bytes: int = DEFAULT_RESPONSES_STORE_MAX_BYTES


CHUNK_OVERHEAD = 64  # a bytes object's 33-byte header, its tuple slot, allocator rounding
ENTRY_OVERHEAD = 512  # key tuple, response id, record, dict slot and LRU links (measured)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: the object as answered, and the conversation through it, as
    JSON bytes (what the byte bound charges is what is held)."""

    body: bytes  # the response object, JSON as answered
    turns: tuple[bytes, ...]  # the conversation: each turn's chat messages, a JSON list
    size: int  # what the byte bound charges: ``stored_size``

    @property
    def response(self) -> dict[str, Any]:
        return decode(self.body)

    @property
    def conversation(self) -> tuple[dict[str, Any], ...]:
        """The chat messages, without the instructions (new objects on every call)."""
        return tuple(m for turn in self.turns for m in decode(turn))


def encode(value: Any) -> bytes:
    """``value`` as compact JSON, as a JSON response renders it; lone surrogates, which a
    JSON body can carry, pass through rather than fail."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass")


def decode(data: bytes) -> Any:
    return json.loads(data.decode("utf-8", "surrogatepass"))


def stored_size(body: bytes, turns: tuple[bytes, ...]) -> int:
    """The memory an entry holds, at most: its chunks and their headers, and its record."""
    return (ENTRY_OVERHEAD + len(body) + CHUNK_OVERHEAD
            + sum(len(t) + CHUNK_OVERHEAD for t in turns))


class ResponseStore:
    """An LRU of stored responses keyed by (tenant, response id), bounded in count and bytes.

    Handlers call it from the event loop; the lock only keeps it whole should anything else
    ever do. A conversation shares its earlier turns' chunks with the response it continues
    (bytes never change), so the byte bound over-counts a chain's memory: it is an upper
    bound, not an estimate.
    """

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.limits.max_count > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None if unknown to this tenant."""
        with self._lock:
            entry = self._entries.get((tenant, response_id))
            if entry is not None:
                self._entries.move_to_end((tenant, response_id))
            return entry

    def put(self, tenant: str | None, response: dict[str, Any],
            history: StoredResponse | None, new_messages: list[dict[str, Any]]) -> bool:
        """Keep ``response``, whose conversation is ``history``'s and then ``new_messages``;
        then evict down to the bounds. False when it is not kept (store off, or too big)."""
        if not self.enabled:
            return False
        body = encode(response)
        turns = (*(history.turns if history is not None else ()), encode(new_messages))
        entry = StoredResponse(body, turns, stored_size(body, turns))
        if entry.size > self.limits.max_bytes:
            return False
        key = (tenant, response["id"])
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[key] = entry
            self._bytes += entry.size
            self._evict()
        return True

    def delete(self, tenant: str | None, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop((tenant, response_id), None)
            if entry is None:
                return False
            self._bytes -= entry.size
            return True

    def _evict(self) -> None:
        while len(self._entries) > self.limits.max_count or self._bytes > self.limits.max_bytes:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.size
            self.evictions += 1


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant turn chat would have: its text and its
    tool calls in one message (reasoning items are dropped, as chat drops reasoning)."""
    text = "".join(part.get("text", "") for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def tenant_of(request: Request) -> str | None:
    """Whose responses a request may see: its API key's id; None (one tenant) without keys."""
    key: ApiKey | None = request.scope.get(KEY_SCOPE)
    return key.id if key is not None else None


def previous_not_found(response_id: str) -> ApiError:
    """OpenAI's answer to a ``previous_response_id`` it does not hold (unknown, evicted,
    deleted, another tenant's, or from a request with ``store: false``)."""
    return ApiError(400, f"Previous response with id '{response_id}' not found.",
                    param="previous_response_id", code="previous_response_not_found")


def response_not_found(response_id: str) -> ApiError:
    """vLLM's answer to ``GET /v1/responses/{id}`` of an id it does not hold."""
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
