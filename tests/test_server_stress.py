"""Stress on loopback: 200 concurrent streaming clients, a fifth of them hanging up mid-stream.

Every other request completes with exactly the tokens it asked for, the aborted ones are
counted as aborts, KV usage returns to idle, and /health answers 200 throughout. Bounded:
short prompts, small ``max_tokens``, one server.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hlserve.server.launch import ServerProcess

CLIENTS = 200
DROP_EVERY = 5  # clients 0, 5, 10, ... disconnect after their second chunk
KEEP_TOKENS = 12
DROP_TOKENS = 64  # long enough that a dropped request cannot finish before it is aborted
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
