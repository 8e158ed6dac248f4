"""Stored responses and ``previous_response_id`` through the official ``openai`` SDK against
real ``hlserve serve`` processes of the tiny model: a three-turn chain (a forced function
call, its output, a new question) renders and answers exactly as chat over the whole
conversation; streamed responses are stored too; ``store: false``, unknown, deleted and
evicted ids are OpenAI's 400; ``GET`` / ``DELETE`` / ``cancel``; one API key cannot see
another's responses; the store's count and byte bounds (LRU)."""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hlserve.server.openai_api.response_store import (
    ResponseStore,
    StoreLimits,
    encode,
    stored_size,
)
from support import ADD_TOOL as ADD
from support import RESPONSES_MODEL as MODEL
from support import responses_server

CHAT_ADD = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}
KEYS = {"sk-tenant-a": None, "sk-tenant-b": None}


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    with responses_server(tiny_model_dirs["qwen2"], tmp_path_factory.mktemp("responses_store")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A server with two API keys (tenants) and room for two stored responses."""
    tmp = tmp_path_factory.mktemp("responses_store_keyed")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with responses_server(tiny_model_dirs["qwen2"], tmp, "--api-keys", str(keys),
                          "--responses-store-max", "2") as srv:
        yield srv


def tenant(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat_ids(server, messages: list[dict[str, Any]]) -> list[int]:
    r = httpx.post(server.url + "/tokenize", timeout=60,
                   json={"model": MODEL, "messages": messages, "tools": [CHAT_ADD]})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def not_found(e: pytest.ExceptionInfo, rid: str) -> None:
    """OpenAI's answer to a previous_response_id it does not hold."""
    assert e.value.status_code == 400
    assert e.value.body == {"message": f"Previous response with id '{rid}' not found.",
                            "type": "invalid_request_error", "param": "previous_response_id",
                            "code": "previous_response_not_found"}, e.value.body


def test_three_turn_chain(client: openai.OpenAI, server) -> None:
    """Each turn sends only what is new; the server renders the whole conversation: turn 2's
    prompt is chat's with the forced call and its output, turn 3's adds turn 2's answer and
    the new question under turn 3's own instructions (turn 1's are not carried over), and
    turn 3's greedy answer is chat's over those messages."""
    ask = {"role": "user", "content": "What is 1 + 2?"}
    r1 = client.responses.create(model=MODEL, input=[ask], instructions="Be brief.", tools=[ADD],
                                 tool_choice={"type": "function", "name": "add"},
                                 temperature=0.0, max_output_tokens=40)
    (call,) = [o for o in r1.output if o.type == "function_call"]
    assert r1.store is True and r1.previous_response_id is None
    assert r1.id.startswith("resp_") and call.id.startswith("fc_")  # OpenAI's, vLLM's ids
    result = str(sum(json.loads(call.arguments).values()))
    r2 = client.responses.create(model=MODEL, previous_response_id=r1.id, tools=[ADD],
                                 instructions="Be brief.", tool_choice="none", input=[{
                                     "type": "function_call_output", "call_id": call.call_id,
                                     "output": result}], **GREEDY)
    assert r2.previous_response_id == r1.id and r2.output_text
    calls = [{"id": call.call_id, "type": "function",
              "function": {"name": "add", "arguments": call.arguments}}]
    history = [ask, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    assert r2.usage.input_tokens == len(chat_ids(server, [
        {"role": "system", "content": "Be brief."}, *history]))

    r3 = client.responses.create(model=MODEL, previous_response_id=r2.id, input="And 2 + 3?",
                                 instructions="Answer in French.", tools=[ADD],
                                 tool_choice="none", **GREEDY)
    messages = [{"role": "system", "content": "Answer in French."}, *history,
                {"role": "assistant", "content": r2.output_text},
                {"role": "user", "content": "And 2 + 3?"}]
    assert r3.usage.input_tokens == len(chat_ids(server, messages))
    c = client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_ADD],
                                       tool_choice="none", temperature=0.0,
                                       max_completion_tokens=12)
    assert r3.output_text == c.choices[0].message.content
    # the whole response is stored as it was answered
    assert client.responses.retrieve(r3.id).model_dump() == r3.model_dump()


def test_streamed_response_is_stored(client: openai.OpenAI, server) -> None:
    final = None
    for ev in client.responses.create(model=MODEL, input="Say hi.", stream=True, **GREEDY):
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None and final.store is True
    assert client.responses.retrieve(final.id).output_text == final.output_text
    r = client.responses.create(model=MODEL, previous_response_id=final.id, input="Again.",
                                **GREEDY)
    messages = [{"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": final.output_text},
                {"role": "user", "content": "Again."}]
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages},
                     timeout=60).json()["tokens"]
    assert r.usage.input_tokens == len(ids)


def test_store_false_is_not_stored(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hi.", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=r.id, input="More.", **GREEDY)
    not_found(e, r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_unknown_id_and_delete(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id="resp_nope", input="x",
                                **GREEDY)
    not_found(e, "resp_nope")
    with pytest.raises(openai.NotFoundError) as nf:
        client.responses.retrieve("resp_nope")
    assert nf.value.body["message"] == "Response with id 'resp_nope' not found."
    r = client.responses.create(model=MODEL, input="Hi.", **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(r.id)  # vLLM: only a background response can be cancelled
    assert "Cannot cancel a synchronous response" in e.value.body["message"]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=r.id, input="x", **GREEDY)
    not_found(e, r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_tenants_are_isolated(keyed) -> None:
    """Tenant B can neither continue, read, cancel nor delete tenant A's response: each is
    answered as for an unknown id; A's response is untouched."""
    a, b = tenant(keyed, "sk-tenant-a"), tenant(keyed, "sk-tenant-b")
    r = a.responses.create(model=MODEL, input="A's secret.", **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.create(model=MODEL, previous_response_id=r.id, input="Repeat it.", **GREEDY)
    not_found(e, r.id)
    for op in (b.responses.retrieve, b.responses.delete, b.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            op(r.id)
    assert a.responses.retrieve(r.id).output_text == r.output_text
    a.responses.create(model=MODEL, previous_response_id=r.id, input="Repeat it.", **GREEDY)


def test_eviction_by_count(keyed) -> None:
    """--responses-store-max 2: a third response evicts the least recently used one; a
    lookup counts as a use."""
    a = tenant(keyed, "sk-tenant-a")
    r1, r2 = (a.responses.create(model=MODEL, input=f"Turn {i}.", **GREEDY) for i in (1, 2))
    a.responses.retrieve(r1.id)  # r1 now more recently used than r2
    r3 = a.responses.create(model=MODEL, input="Turn 3.", **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        a.responses.create(model=MODEL, previous_response_id=r2.id, input="x", **GREEDY)
    not_found(e, r2.id)
    r4 = a.responses.create(model=MODEL, previous_response_id=r1.id, input="x", **GREEDY)
    # r4 was stored: r3 (least recently used of r1, r3) went
    assert a.responses.retrieve(r4.id).previous_response_id == r1.id
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r3.id)


def fake_response(rid: str, text: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def test_byte_bound_and_shared_history() -> None:
    """The byte bound evicts least recently used first; a response over the bound alone is
    not kept; a continuation's conversation is its predecessor's plus its turn, kept as
    one chunk per turn, the earlier ones shared."""
    msg = [{"role": "user", "content": "x" * 100}]
    one = stored_size(encode(fake_response("resp_1", "y")), (encode(msg),))
    store = ResponseStore(StoreLimits(max_count=100, max_bytes=2 * one + 10))
    assert store.put("t", fake_response("resp_1", "y"), None, msg)
    assert store.put("t", fake_response("resp_2", "y"), None, msg)
    assert len(store) == 2 and store.bytes == 2 * one
    assert store.get("t", "resp_2").response == fake_response("resp_2", "y")
    assert store.put("t", fake_response("resp_3", "y"), None, msg)
    assert store.get("t", "resp_1") is None and len(store) == 2 and store.evictions == 1
    assert not store.put("t", fake_response("resp_big", "y" * 1000), None, msg)
    assert store.get("t", "resp_big") is None and len(store) == 2

    store = ResponseStore(StoreLimits(max_count=100, max_bytes=1 << 20))
    store.put("t", fake_response("resp_a", "y"), None, msg)
    first = store.get("t", "resp_a")
    turn = [{"role": "user", "content": "more"}]
    store.put("t", fake_response("resp_b", "z"), first, turn)
    second = store.get("t", "resp_b")
    assert second.conversation == (*msg, *turn) and second.turns[0] is first.turns[0]
    assert second.size == stored_size(second.body, (encode(msg), encode(turn)))
    assert store.get("u", "resp_b") is None  # another tenant
    assert ResponseStore(StoreLimits(max_count=0)).put("t", fake_response("r", "y"), None,
                                                       msg) is False


# ---- what the store holds, measured --------------------------------------------------------

SLACK = 128 * 1024  # the allocator's and the LRU's own steps: a constant


def held_by(fill: Callable[[], ResponseStore]) -> tuple[int, ResponseStore]:
    """The bytes that ``fill``'s store still holds once it returns (``tracemalloc``)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = fill()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base, store
    finally:
        tracemalloc.stop()


def test_the_byte_bound_holds_for_what_python_keeps() -> None:
    """12 responses, each echoing 12,000 distinct floats (a tool's schema, or before the
    metadata limits a metadata object): what the store holds stays within
    --responses-store-max-bytes plus a constant. Before, it charged JSON characters (about
    9 a float) and kept Python floats (24 bytes and a list slot each): several times the
    bound."""
    limit = 512 * 1024

    def fill() -> ResponseStore:
        store = ResponseStore(StoreLimits(max_count=1000, max_bytes=limit))
        for i in range(12):
            floats = [i + k / 8 for k in range(12_000)]
            response = {**fake_response(f"resp_{i}", "y"), "tools": [
                {"type": "function", "name": "f", "parameters": {"enum": floats}}]}
            assert store.put("t", response, None, [{"role": "user", "content": "hi"}])
        return store

    used, store = held_by(fill)
    assert store.evictions > 0 and store.bytes <= limit
    assert used <= limit + SLACK, used


def test_small_entries_are_charged_their_overhead() -> None:
    """1,000 tiny responses: the per-entry charge covers what each really holds (its key,
    record and slot), so the bound holds when entries are small too."""

    def fill() -> ResponseStore:
        store = ResponseStore(StoreLimits(max_count=100_000, max_bytes=1 << 30))
        for i in range(1_000):
            store.put(f"tenant-{i % 7}", fake_response(f"resp_{i:032x}", "y"), None,
                      [{"role": "user", "content": "hi"}])
        return store

    used, store = held_by(fill)
    assert len(store) == 1_000
    assert used <= store.bytes + SLACK // 4, (used / 1_000, store.bytes / 1_000)
