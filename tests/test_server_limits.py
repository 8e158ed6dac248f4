"""Per-request limits of ``hlserve serve`` on a real server process without API keys:
``--request-timeout`` (the bridge's deadlines) and ``--min-priority`` (the priority floor,
which applies without keys too).

One server for the module: ``--request-timeout 1`` and ``--min-priority -3``. The tiny model
cannot produce thousands of tokens in a second, so a long request is past its deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from hlserve.server.runtime.launch import ServerProcess
from servers import metric, read_stream

TIMEOUT_S = 1
MIN_PRIORITY = -3
MAX_LEN = 4096
LONG = {"prompt": "Write a long story", "max_tokens": MAX_LEN - 64, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}
SHORT = {"prompt": "ok", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", str(MAX_LEN), "--num-pages", "512",
            "--cpu-threads", "1", "--uvicorn-log-level", "warning",
            "--request-timeout", str(TIMEOUT_S), "--min-priority", str(MIN_PRIORITY)]
    with ServerProcess(tiny_llama, args, log_path=log) as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_tail(4000)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=SHORT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def wait_idle(http: httpx.Client, limit_s: float = 10) -> str:
    """The metrics once nothing runs or waits and no KV page is held (or after limit_s)."""
    deadline = time.monotonic() + limit_s
    while True:
        text = http.get("/metrics").text
        idle = (metric(text, "hlserve:kv_cache_usage_perc") == 0
                and metric(text, "hlserve:num_requests_running") == 0
                and metric(text, "hlserve:num_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def aborts(text: str) -> float:
    return metric(text, "hlserve:request_success_total", finished_reason="abort")


def test_a_request_past_its_deadline_ends_with_request_timeout(server, http) -> None:
    before = aborts(http.get("/metrics").text)
    t0 = time.monotonic()
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        out = read_stream(r)
    took = time.monotonic() - t0
    assert out["error"] is not None, "the stream ran to its end: not past its deadline"
    assert out["error"]["code"] == "request_timeout", out["error"]
    assert "--request-timeout" in out["error"]["message"]
    assert out["done"], "no [DONE] after the error event"
    assert 0 < len(out["ids"]) < LONG["max_tokens"]
    assert took < TIMEOUT_S + 10, took

    t0 = time.monotonic()
    r = http.post("/v1/completions", json=LONG)
    took = time.monotonic() - t0
    assert r.status_code == 503, r.text[:300]
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_timeout" and err["type"] == "server_error", err
    assert took < TIMEOUT_S + 10, took

    after = wait_idle(http)
    assert metric(after, "hlserve:kv_cache_usage_perc") == 0, after
    assert metric(after, "hlserve:num_requests_running") == 0
    assert metric(after, "hlserve:num_requests_waiting") == 0
    assert aborts(after) - before == 2  # both counted as aborts
    assert http.get("/health").status_code == 200
    serves(http)  # a request within the deadline is unaffected


def test_min_priority_bounds_priority_without_api_keys(server, http) -> None:
    r = http.post("/v1/completions", json={**SHORT, "priority": MIN_PRIORITY - 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and err["code"] == "invalid_value", err
    assert f"priority must be at least {MIN_PRIORITY}" in err["message"], err
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "priority": MIN_PRIORITY - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    for priority in (MIN_PRIORITY, 0, 7):  # at the floor, the default, and behind it
        r = http.post("/v1/completions", json={**SHORT, "priority": priority})
        assert r.status_code == 200, r.text


def test_a_logprob_volume_over_the_limit_is_refused_up_front(server, http) -> None:
    """n=128 x max_tokens=1000 x top_logprobs 20 (a 200-byte body) would be a ~200 MB
    response built in one piece: a 400 before any token is generated, naming the field."""
    body = {"prompt": "hi", "n": 128, "max_tokens": 1000, "logprobs": 20, "temperature": 1}
    started = time.monotonic()
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "logprobs" and "logprob entries" in err["message"]
    assert time.monotonic() - started < 5
    small = http.post("/v1/completions", json={**SHORT, "logprobs": 20})
    assert small.status_code == 200, small.text[:300]
    assert len(small.json()["choices"][0]["logprobs"]["top_logprobs"]) == 3
    serves(http)
