"""Stress on loopback: 200 concurrent streaming clients, a fifth of them hanging up mid-stream.

Every other request completes with exactly the tokens it asked for, the aborted ones are
counted as aborts, KV usage returns to idle, and /health answers 200 throughout. Bounded:
short prompts, small ``max_tokens``, one server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hlserve.server.runtime.launch import ServerProcess

CLIENTS = 200
DROP_EVERY = 5  # clients 0, 5, 10, ... disconnect after their second chunk
KEEP_TOKENS = 12
# Long enough that a dropped request cannot finish before its client's hang-up reaches the
# engine: with 64, a loaded 2-core CI machine once let 10 of 40 finish (the one client process
# drives 200 streams and read its second chunk late), which is a "length", not a lost abort.
DROP_TOKENS = 448
TIME_LIMIT_S = 60


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("stress")
    args = ["--dtype", "float32", "--max-model-len", "512", "--num-pages", "2048",
            "--uvicorn-log-level", "warning"]
    with ServerProcess(tiny_llama, args, log_path=tmp / "server.log") as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


def metric_totals(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())
                                   if k == "finished_reason")
            out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.mark.slow
def test_many_streams_with_disconnects(server) -> None:
    async def client(c: httpx.AsyncClient, i: int) -> tuple[str, int, int | None]:
        drop = i % DROP_EVERY == 0
        body = {"prompt": f"Request {i}: list the files in /tmp", "temperature": 0,
                "max_tokens": DROP_TOKENS if drop else KEEP_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        n_ids, n_chunks, usage, done = 0, 0, None, False
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    n_ids += len(choice["token_ids"])
                    n_chunks += 1
                if drop and n_chunks >= 2:
                    return "dropped", n_ids, None  # leaving the block closes the connection
        assert done
        return "done", n_ids, usage

    async def watch_health(c: httpx.AsyncClient, stop: asyncio.Event, seen: list) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            r = await c.get("/health")
            seen.append((r.status_code, time.monotonic() - t0))
            await asyncio.sleep(0.1)

    async def main() -> dict:
        limits = httpx.Limits(max_connections=CLIENTS + 20, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=TIME_LIMIT_S) as c:
            before = metric_totals((await c.get("/metrics")).text)
            stop, health = asyncio.Event(), []
            watcher = asyncio.create_task(watch_health(c, stop, health))
            t0 = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(client(c, i) for i in range(CLIENTS))), TIME_LIMIT_S)
            elapsed = time.monotonic() - t0
            # idle again: nothing running or waiting, no KV held
            t1 = time.monotonic()
            while True:
                after = metric_totals((await c.get("/metrics")).text)
                idle = (after["hlserve:kv_cache_usage_perc"] == 0
                        and after["hlserve:num_requests_running"] == 0
                        and after["hlserve:num_requests_waiting"] == 0)
                if idle or time.monotonic() - t1 > 10:
                    break
                await asyncio.sleep(0.05)
            settle = time.monotonic() - t1
            stop.set()
            await watcher
            return {"results": results, "elapsed": elapsed, "settle": settle, "idle": idle,
                    "before": before, "after": after, "health": health}

    out = asyncio.run(main())
    results = out["results"]
    kept = [r for r in results if r[0] == "done"]
    dropped = [r for r in results if r[0] == "dropped"]
    n_drop = len(range(0, CLIENTS, DROP_EVERY))
    assert len(dropped) == n_drop and len(kept) == CLIENTS - n_drop
    assert all(n == KEEP_TOKENS and usage == KEEP_TOKENS for _, n, usage in kept), kept[:5]
    assert out["idle"], out["after"]
    before, after = out["before"], out["after"]

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert delta("hlserve:request_success_total|finished_reason=length") == len(kept)
    assert delta("hlserve:request_success_total|finished_reason=abort") == n_drop
    assert delta("hlserve:generation_tokens_total") >= len(kept) * KEEP_TOKENS
    health = out["health"]
    assert health and all(code == 200 for code, _ in health)
    print(f"\n{CLIENTS} streams ({n_drop} dropped) in {out['elapsed']:.2f}s; idle "
          f"{out['settle']:.2f}s after; /health max {max(t for _, t in health) * 1000:.0f} ms "
          f"over {len(health)} probes")
    assert out["elapsed"] < TIME_LIMIT_S


# ---- slow readers, queue caps, slow clients ----------------------------------------------------

SLOW_STREAMS, SLOW_TOKENS = 2, 2000
SLOW_RSS_BOUND_MIB = 48  # growth allowed while the streams sit unread (measured: well under 10)


def _stalled_stream(url: str, body: dict) -> socket.socket:
    """A stream request on a socket that is never read (a tiny receive buffer, so the
    server's writes stall at once)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect((host, int(port)))
    payload = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return s


@pytest.mark.slow
def test_a_stream_that_is_never_read_keeps_memory_bounded(tiny_llama: Path, tmp_path: Path) -> None:
    """Outputs a reader has not taken are coalesced: a stalled stream holds one output, not
    a copy per step (which grows with the square of the length)."""
    from servers import metric, rss_mib

    args = ["--dtype", "float32", "--max-model-len", "4096", "--num-pages", "1024",
            "--uvicorn-log-level", "warning", "--cpu-threads", "1"]
    body = {"prompt": "Write a long story", "max_tokens": SLOW_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 5, "return_token_ids": True}
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:  # warm-up, read in full
            for _ in r.iter_lines():
                pass
        base = rss_mib(srv.proc.pid)
        gen0 = metric(c.get("/metrics").text, "hlserve:generation_tokens_total")
        socks = [_stalled_stream(srv.url, body) for _ in range(SLOW_STREAMS)]
        try:
            end = time.monotonic() + 120
            while time.monotonic() < end:
                gen = metric(c.get("/metrics").text, "hlserve:generation_tokens_total")
                if gen - gen0 >= SLOW_STREAMS * SLOW_TOKENS:
                    break
                time.sleep(0.2)
            assert gen - gen0 >= SLOW_STREAMS * SLOW_TOKENS, "the streams did not finish"
            grown = rss_mib(srv.proc.pid) - base
        finally:
            for s in socks:
                s.close()
        print(f"\n{SLOW_STREAMS} unread streams of {SLOW_TOKENS} tokens: RSS +{grown:.1f} MiB "
              f"(bound {SLOW_RSS_BOUND_MIB})")
        assert grown < SLOW_RSS_BOUND_MIB
        assert c.get("/health").status_code == 200


def test_queue_caps_answer_503_and_a_request_that_could_never_fit_400(
        tiny_llama: Path, tmp_path: Path) -> None:
    args = ["--dtype", "float32", "--max-model-len", "256", "--num-pages", "64",
            "--uvicorn-log-level", "warning", "--max-num-seqs", "1",
            "--max-queued-requests", "2", "--max-queued-tokens", "300"]
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        never = c.post("/v1/completions", json={"prompt": [[1, 2]] * 3, "max_tokens": 1})
        assert never.status_code == 400, never.text
        big = c.post("/v1/completions", json={"prompt": [[5] * 200] * 2, "max_tokens": 1})
        assert big.status_code == 400 and "max-queued-tokens" in big.text, big.text

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ac:
                body = {"prompt": [7] * 100, "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(ac.post("/v1/completions", json=body)
                                              for _ in range(8)))

        answers = asyncio.run(burst())
        codes = [r.status_code for r in answers]
        full = [r for r in answers if r.status_code == 503]
        assert 200 in codes and 503 in codes, codes
        assert full and full[0].json()["error"]["code"] == "queue_full"
        assert full[0].headers["retry-after"] == "1"


def test_a_slowloris_connection_is_closed(tiny_llama: Path, tmp_path: Path) -> None:
    args = ["--dtype", "float32", "--max-model-len", "256", "--num-pages", "64",
            "--uvicorn-log-level", "warning", "--request-read-timeout", "1"]
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv:
        host, port = srv.host, srv.port
        trickle = socket.create_connection((host, port))
        silent = socket.create_connection((host, port))
        trickle.settimeout(10)
        silent.settimeout(10)
        t0 = time.monotonic()
        closed = False
        for byte in b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n":  # headers, one a time
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
        assert closed or trickle.recv(1024) == b"", "a trickling client kept its connection"
        assert silent.recv(1024) == b"", "a silent connection was kept open"
        assert time.monotonic() - t0 < 8
        trickle.close()
        silent.close()
        with httpx.Client(base_url=srv.url) as c:  # normal clients are unaffected
            assert c.get("/health").status_code == 200
