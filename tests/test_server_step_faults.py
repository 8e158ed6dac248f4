"""Engine faults on a real ``hlserve serve`` process (faults injected by
``tests/faulty_server.py``): a step that raises outside the runner gives every request it
touched its final event and leaks nothing; a dead engine ends the process with exit 1; a
wedged one turns ``/health`` 503."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from servers import faulty_server, metric, read_stream

POISON = 13  # faulty_server.POISON


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


@pytest.mark.parametrize("fault", ["update", "schedule"])
def test_a_step_that_raises_outside_the_runner_ends_each_request_it_touched(
        fault: str, tiny_llama: Path, tmp_path: Path) -> None:
    args = ["--max-model-len", "1024", "--num-pages", "256"]
    streams: list[dict] = []
    with faulty_server(fault, tiny_llama, args, tmp_path / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        started = threading.Barrier(4)

        def stream_client() -> None:  # a client per thread: httpx's pool is not shared well
            with httpx.Client(base_url=srv.url, timeout=60) as own, \
                    own.stream("POST", "/v1/completions", json=body(300, stream=True)) as r:
                lines = r.iter_lines()
                next(lines)
                started.wait()
                streams.append(read_stream(r, lines))

        threads = [threading.Thread(target=stream_client) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait(30)  # three streams decoding: the poisoned request joins their batch
        bad = c.post("/v1/completions", json=body(POISON))
        for t in threads:
            t.join(60)
        assert bad.status_code == 500, bad.text
        assert f"injected fault in {fault}" in bad.json()["error"]["message"]
        assert len(streams) == 3
        for s in streams:
            assert s["done"], "a stream was cut without [DONE]"
            assert s["error"] is not None or (s["finish_reason"] == "length"
                                              and len(s["ids"]) == 300), s
        # the server goes on serving, with every page back
        ok = c.post("/v1/completions", json=body(5))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert c.get("/health").status_code == 200
        text = c.get("/metrics").text
        assert metric(text, "hlserve:kv_cache_usage_perc") == 0
        assert metric(text, "hlserve:num_requests_running") == 0
        assert metric(text, "hlserve:engine_step_errors_total") >= 1


def test_a_dead_engine_ends_the_process_with_exit_1(tiny_llama: Path, tmp_path: Path) -> None:
    with faulty_server("dead", tiny_llama, ["--max-model-len", "256", "--num-pages", "64"],
                       tmp_path / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        codes = [c.post("/v1/completions", json=body(4)).status_code for _ in range(2)]
        assert codes == [500, 500]
        with c.stream("POST", "/v1/completions", json=body(4, stream=True)) as r:
            last = read_stream(r)  # the third failure kills the loop, in this stream
        assert last["done"] and last["error"]["code"] == "engine_dead", last
        t0 = time.monotonic()
        code = srv.proc.wait(30)
    assert code == 1, srv.log_tail()
    assert time.monotonic() - t0 < 10


def test_a_wedged_engine_turns_health_503(tiny_llama: Path, tmp_path: Path) -> None:
    args = ["--max-model-len", "256", "--num-pages", "64", "--engine-iteration-timeout", "1"]
    with faulty_server("hang", tiny_llama, args, tmp_path / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        def poisoned() -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as own:
                own.post("/v1/completions", json=body(POISON))

        t = threading.Thread(target=poisoned)
        t.start()
        seen = None
        end = time.monotonic() + 5
        while time.monotonic() < end and seen is None:
            r = c.get("/health")
            if r.status_code == 503:
                seen = r.json()["error"]["message"]
            time.sleep(0.1)
        t.join(30)
        assert seen is not None and "engine wedged" in seen, seen
        assert c.get("/health").status_code == 200  # the step came back: healthy again
