"""The HTTP API under arbitrary input: a schema-driven fuzz, large and broken uploads, and the
server's log of what it refused. A real ``hlserve serve`` process with its defaults (no keys,
no --served-model-name, the default body limit, INFO logging).

The fuzz draws request bodies from the server's own ``/openapi.json`` with schemathesis's
strategies: bodies that violate the schema (negative mode), and bodies of the right types
from the schema with every numeric and size bound dropped (int64 overflows, huge floats,
long lists: what a client can send). No answer may be a 5xx, and the engine must serve a
normal request after.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from hlserve.server.runtime.launch import ServerProcess

MAX_LEN = 64
FUZZ_EXAMPLES = 60  # per endpoint and mode; about 20 s in all on a 2-core machine
BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
          "maxLength", "minItems", "maxItems"}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", str(MAX_LEN), "--num-pages", "64",
            "--max-num-seqs", "8", "--cpu-threads", "1"]
    with ServerProcess(tiny_llama, args, log_path=log) as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_tail(4000)
        assert "unhandled error" not in srv.log_text(), srv.log_tail(4000)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def serves(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 3, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def loosened(schema: Any) -> Any:
    """``schema`` with every range and size bound dropped."""
    if isinstance(schema, dict):
        return {k: loosened(v) for k, v in schema.items() if k not in BOUNDS}
    if isinstance(schema, list):
        return [loosened(v) for v in schema]
    return schema


def check_answer(r: httpx.Response, body: dict[str, Any], path: str = "") -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500], json.dumps(body)[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert len(r.content) < 4000, r.text[:300]
    elif path.endswith("/tokenize"):
        assert r.json()["count"] == len(r.json()["tokens"]), r.text[:300]
    elif path.endswith("/detokenize"):
        assert isinstance(r.json()["prompt"], str), r.text[:300]
    elif body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"], r.text[:300]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
def test_schema_fuzz_never_answers_5xx(server, http, path: str, mode: GenerationMode) -> None:
    spec = http.get("/openapi.json").json()
    if mode is GenerationMode.POSITIVE:
        spec = loosened(spec)
    operation = schemathesis.openapi.from_dict(spec)[path]["POST"]

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        body = case.body
        if isinstance(body, (dict, list, str, int, float, bool)) or body is None:
            r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        else:  # a body schemathesis could not make JSON of: send its bytes as they are
            r = http.post(path, content=bytes(body))
        check_answer(r, body if isinstance(body, dict) else {}, path)

    one()
    serves(http)


def test_models_report_the_served_name_not_the_path(server, http, tiny_llama: Path) -> None:
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [tiny_llama.name]
    assert str(tiny_llama.parent) not in json.dumps(models)
    # the model argument as given is still accepted (clients and `hlserve bench` use it)
    for name in (tiny_llama.name, str(tiny_llama)):
        r = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_every_4xx_is_logged_with_its_reason(server, http) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "top_k": 2**70, "top_p": 0.9})
    assert r.status_code == 400
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        text = server.log_text()
        if "/v1/nothing-here -> 404" in text:
            break
        time.sleep(0.05)
    assert "POST /v1/completions -> 400 invalid_value param=top_k: top_k must be at most" in text
    assert "GET /v1/nothing-here -> 404" in text


def test_a_disconnect_mid_upload_is_not_an_internal_error(server, http) -> None:
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"a" * 5000)
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while "before sending its whole body" not in server.log_text():
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)
    serves(http)  # the fixture's teardown checks that no traceback was logged


HUGE_TEXT = "lorem ipsum dolor sit amet " * (8 * 1024 * 1024 // 27)  # 8 MB
HUGE_CHAT = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": HUGE_TEXT}]
HUGE_CASES = {  # path, body, the field the 400 names
    "completion": ("/v1/completions", {"prompt": HUGE_TEXT, "max_tokens": 4}, "prompt"),
    "chat": ("/v1/chat/completions", {"messages": HUGE_CHAT, "max_tokens": 4}, "messages"),
    "tokenize": ("/tokenize", {"prompt": HUGE_TEXT}, "prompt"),
    "tokenize-chat": ("/tokenize", {"messages": HUGE_CHAT}, "messages"),
}


@pytest.mark.parametrize("case", list(HUGE_CASES))
def test_a_huge_prompt_costs_what_the_context_does(server, http, case: str) -> None:
    """An 8 MB prompt took 10+ s to tokenize, and the tokenizer holds the GIL, so /health
    stalled for all of it even from a worker thread. Now only a part bounded by the context
    is tokenized before the 400, which does not quote the prompt back: for a prompt, for a
    chat (a part of the rendered chat), and for /tokenize of either."""
    path, body, param = HUGE_CASES[case]
    latencies: list[float] = []
    done = threading.Event()
    polling = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                polling.set()
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    # The poller must be polling before the request goes out: when the 400 comes back fast
    # (as it should), a poller still building its client made no poll at all and the check
    # below had nothing to check.
    assert polling.wait(10)
    t0 = time.monotonic()
    try:
        r = http.post(path, json=body)
    finally:
        took = time.monotonic() - t0
        done.set()
        poller.join()
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", err
    assert err["param"] == param and "first 2048 characters" in err["message"], err
    assert len(r.content) < 1000
    assert took < 3.0, took
    assert latencies and max(latencies) < 0.5, (took, latencies)
    serves(http)


def test_multi_megabyte_inputs_are_not_echoed(server, http) -> None:
    big = "z" * (4 * 1024 * 1024)
    for body in ({"prompt": "hi", "model": big}, {"prompt": "hi", big: 1},
                 {"prompt": "hi", "stop": big}, {"prompt": "hi", "user": 5, "session_id": big},
                 {"messages": [{"role": big, "content": "x"}]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = http.post(path, json=body)
        assert 400 <= r.status_code < 500, r.text[:300]
        assert len(r.content) < 2000, r.text[:300]
    serves(http)
