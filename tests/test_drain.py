"""SIGTERM drains a real ``hlserve serve`` process: new requests get 503 ``draining``, what is
in flight finishes whole (or, past ``--shutdown-timeout``, ends with an error event), and
the process exits 0 within the timeout. No stream is cut without [DONE] or an error."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from hlserve.server.runtime.launch import ServerProcess
from servers import BASE_ARGS, read_stream, sse_events

LONG = 600  # tokens: a few seconds of the tiny model, so the stream spans the drain


def stream_body(max_tokens: int) -> dict:
    return {"prompt": "Tell me a story", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


def wait_draining(c: httpx.Client, limit_s: float = 10) -> dict:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        r = c.get("/health")
        if r.status_code == 503:
            return r.json()
        time.sleep(0.02)
    raise AssertionError("/health never reported the drain")


def test_sigterm_finishes_in_flight_streams_and_refuses_new_requests(tiny_llama: Path,
                                                                      tmp_path: Path) -> None:
    args = [*BASE_ARGS, "--max-model-len", "2048", "--num-pages", "512",
            "--shutdown-timeout", "30"]
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c, \
            httpx.Client(base_url=srv.url, timeout=60) as other, \
            c.stream("POST", "/v1/completions", json=stream_body(LONG)) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
        first = next(events)
        ids = list(first["choices"][0]["token_ids"])
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        health = wait_draining(other)
        assert "draining" in health["error"]["message"]
        late = other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "draining"
        assert "retry-after" in late.headers
        finish, done = None, False
        for ev in events:
            if ev == "[DONE]":
                done = True
                break
            assert "error" not in ev, ev
            for choice in ev["choices"]:
                ids += choice["token_ids"]
                finish = choice["finish_reason"] or finish
        assert done and finish == "length" and len(ids) == LONG, "the stream was cut"
        code = srv.proc.wait(30)
        elapsed = time.monotonic() - t0
    assert code == 0, srv.log_tail()
    assert elapsed < 30, elapsed
    print(f"\ndrained one {LONG}-token stream and exited 0 in {elapsed:.1f}s after SIGTERM")


def test_past_the_shutdown_timeout_streams_end_with_an_error_event(tiny_llama: Path,
                                                                   tmp_path: Path) -> None:
    args = [*BASE_ARGS, "--max-model-len", "32768", "--num-pages", "2100",
            "--shutdown-timeout", "1.5"]
    results: list[dict] = []
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv:
        started = threading.Barrier(3)

        def client() -> None:  # a client per thread: httpx's pool is not shared well
            with httpx.Client(base_url=srv.url, timeout=60) as own, \
                    own.stream("POST", "/v1/completions", json=stream_body(30000)) as r:
                lines = r.iter_lines()
                next(lines)
                started.wait()
                results.append(read_stream(r, lines))

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait(30)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(20)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(10)
    assert code == 0 and elapsed < 1.5 + 5, (code, elapsed)
    assert len(results) == 2
    for res in results:
        assert res["done"], "a stream was cut without [DONE]"
        assert res["error"] is not None and res["error"]["code"] == "server_shutdown", res
