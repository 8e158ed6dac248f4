"""The API's side of "not now": a ServiceUnavailableError raised anywhere in a handler (the
bridge raises it for a full queue or a drain) is a 503 in OpenAI's format with Retry-After,
and /health and /ping answer 503 with the bridge's reason.

The app runs under uvicorn in a thread on a real socket, with a real tiny engine; the
bridge's answers are set per test (what makes it refuse is tested with the bridge).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from hlserve.errors import ServiceUnavailableError
from hlserve.llm import LLM
from hlserve.server.app import create_app
from hlserve.server.runtime.launch import free_port
from hlserve.server.runtime.settings import ServerSettings

BODY = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tiny_llama: Path):
    engine = LLM(str(tiny_llama), dtype="float32", max_model_len=64, num_pages=16).engine
    app = create_app(engine, ServerSettings(served_model_names=("m",)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield client, app.state.hlserve.bridge
    server.should_exit = True
    thread.join(10)


def test_service_unavailable_from_submit_is_a_503_with_retry_after(served, monkeypatch) -> None:
    client, bridge = served
    assert client.post("/v1/completions", json=BODY).status_code == 200

    def refuse(subs) -> None:
        raise ServiceUnavailableError("the server is draining; retry elsewhere", "draining", 7)

    monkeypatch.setattr(bridge, "submit", refuse)
    for path, body in (("/v1/completions", BODY), ("/v1/completions", {**BODY, "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 2})):
        r = client.post(path, json=body)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "7"
        assert r.json() == {"error": {"message": "the server is draining; retry elsewhere",
                                      "type": "server_error", "param": None,
                                      "code": "draining"}}
    # without retry_after_s: no header
    monkeypatch.setattr(bridge, "submit", lambda subs: (_ for _ in ()).throw(
        ServiceUnavailableError("full", "queue_full")))
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and "Retry-After" not in r.headers
    monkeypatch.undo()
    assert client.post("/v1/completions", json=BODY).status_code == 200


def test_health_and_ping_report_the_bridges_reason(served, monkeypatch) -> None:
    client, bridge = served
    for method, path in (("GET", "/health"), ("HEAD", "/health"), ("GET", "/ping"),
                         ("POST", "/ping")):
        assert client.request(method, path).status_code == 200
    monkeypatch.setattr(bridge, "health_problem", lambda: "draining")
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        r = client.request(method, path)
        assert r.status_code == 503
        err = r.json()["error"]
        assert "draining" in err["message"] and err["type"] == "server_error"
        assert err["code"] == "unavailable"
    assert client.head("/health").status_code == 503
