"""The engine thread survives a failing step; once the loop is dead, /health answers 503.

Faults cannot be provoked from outside a server process, so this runs the app in-process
(FastAPI's TestClient) on a real tiny engine whose runner is made to raise on cue.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hlserve.llm import LLM
from hlserve.server.app import create_app
from hlserve.server.runtime.settings import ServerSettings

POISON = 13  # a request with this max_tokens makes the runner raise


@pytest.fixture
def faulty(tiny_llama: Path):
    engine = LLM(str(tiny_llama), dtype="float32", max_model_len=128, num_pages=32,
                 check_invariants=True).engine
    execute = engine.runner.execute
    state = {"always": False}

    def flaky_execute(batch):
        if state["always"] or any(s.request.params.max_tokens == POISON for s in batch.seqs):
            raise RuntimeError("injected fault")
        return execute(batch)

    engine.runner.execute = flaky_execute
    app = create_app(engine, ServerSettings(served_model_names=("m",)))
    with TestClient(app) as client:
        yield client, engine, state


def completion(client: TestClient, max_tokens: int):
    return client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})


def test_a_failed_step_fails_its_requests_only(faulty) -> None:
    client, engine, _ = faulty
    r = completion(client, POISON)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error"
    assert "injected fault" in r.json()["error"]["message"]
    # streamed: the error arrives as an SSE event, then [DONE]
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": POISON,
                                             "stream": True})
    assert r.status_code == 200
    assert '"engine_error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    # the engine goes on serving, with its pages back
    ok = completion(client, 4)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert client.get("/health").status_code == 200
    assert engine.kv.num_used == 0
    assert 'hlserve:engine_step_errors_total{model_name="m"} 2.0' in client.get("/metrics").text


def test_a_dead_loop_answers_503(faulty) -> None:
    client, _, state = faulty
    state["always"] = True
    codes = [completion(client, 4).status_code for _ in range(3)]
    assert codes == [500, 500, 503]  # the third failure in a row kills the loop
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = completion(client, 4)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
