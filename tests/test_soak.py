"""Soak: 40 seconds of mixed traffic on one real server, then nothing left behind.

Streaming and non-streaming clients, chat and completions, batch prompts, clients that hang
up mid-stream or before the answer, and bad requests, all at once and for ``SOAK_S``
seconds. Afterwards: every answer was a 200 or the 4xx it should be (never a 5xx), the KV
pool is back to idle, the engine holds no request (the SIGTERM drain finds none in flight),
and the server's RSS is flat between the middle and the end of the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from hlserve.server.runtime.launch import ServerProcess
from servers import BASE_ARGS, metric, rss_mib

SOAK_S = 40.0
WORKERS = 12
RSS_FLAT_MIB = 40  # growth allowed from the middle of the run to its end

BAD = [  # (body, expected status): malformed or out-of-range requests
    (b'{"prompt": "hi", "max_tokens": ', 400),
    (json.dumps({"prompt": "hi", "top_k": 1180591620717411303424, "max_tokens": 2}).encode(), 400),
    (json.dumps({"prompt": "hi", "max_tokens": 2, "tempreature": 0}).encode(), 400),
    (json.dumps({"prompt": [1, 2, 3] * 400, "max_tokens": 4}).encode(), 400),  # over the context
    (json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), 400),
    (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404),
]


async def one(c: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    kind = rng.choice(["stream", "stream", "plain", "chat", "batch", "drop", "drop_plain", "bad"])
    n = rng.randint(4, 40)
    prompt = f"request {rng.randint(0, 10**6)}: " + "word " * rng.randint(1, 60)
    if kind == "bad":
        body, want = rng.choice(BAD)
        r = await c.post("/v1/completions", content=body,
                         headers={"content-type": "application/json"})
        assert r.status_code == want, (r.status_code, r.text[:300])
    elif kind in ("stream", "drop", "chat"):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        body = {"max_tokens": n, "temperature": rng.choice([0, 0.8]), "ignore_eos": True,
                "stream": True}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            chunks = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    break
                if line.startswith("data: "):
                    # an error event has an "error" key (generated text may say "error")
                    assert "error" not in json.loads(line[len("data: "):]), line
                    chunks += 1
                    if kind == "drop" and chunks >= 2:
                        break  # hang up mid-stream
            else:
                raise AssertionError("a stream ended without [DONE]")
    elif kind == "drop_plain":  # hang up before the answer
        with pytest.raises(httpx.TimeoutException):
            await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 200,
                                                  "ignore_eos": True}, timeout=0.05)
    else:
        prompts = [prompt, prompt + "!"] if kind == "batch" else prompt
        r = await c.post("/v1/completions", json={"prompt": prompts, "max_tokens": n,
                                                  "ignore_eos": True})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == n * (2 if kind == "batch" else 1)
    tally[kind] = tally.get(kind, 0) + 1


@pytest.mark.slow
def test_soak_mixed_traffic_leaves_nothing_behind(tiny_llama: Path, tmp_path: Path) -> None:
    args = [*BASE_ARGS, "--max-model-len", "512", "--num-pages", "512", "--max-num-seqs", "32",
            "--uvicorn-log-level", "info"]
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv:
        pid = srv.proc.pid
        tally: dict[str, int] = {}
        rss: list[float] = []

        async def worker(i: int, c: httpx.AsyncClient, end: float) -> None:
            rng = random.Random(i)
            while time.monotonic() < end:
                await one(c, rng, tally)

        async def sample_rss(end: float) -> None:
            while time.monotonic() < end:
                rss.append(rss_mib(pid))
                await asyncio.sleep(1.0)

        async def main() -> None:
            end = time.monotonic() + SOAK_S
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                await asyncio.gather(sample_rss(end), *(worker(i, c, end) for i in range(WORKERS)))

        t0 = time.monotonic()
        asyncio.run(main())
        elapsed = time.monotonic() - t0
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            end = time.monotonic() + 10
            while True:
                text = c.get("/metrics").text
                idle = all(metric(text, name) == 0 for name in (
                    "hlserve:kv_cache_usage_perc", "hlserve:num_requests_running",
                    "hlserve:num_requests_waiting"))
                if idle or time.monotonic() > end:
                    break
                time.sleep(0.1)
            assert idle, "the engine did not return to idle"
            assert c.get("/health").status_code == 200
            finished = metric(text, "hlserve:request_success_total")
        final_rss = rss_mib(pid)
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(30)
        log = srv.log_text()
    mid = rss[len(rss) // 2]
    print(f"\nsoak {elapsed:.0f}s: {sum(tally.values())} requests {tally}; {finished:.0f} "
          f"engine requests finished; RSS {rss[0]:.0f} -> {mid:.0f} (middle) -> "
          f"{final_rss:.0f} MiB")
    assert code == 0
    assert "draining 0 requests in flight" in log, "requests were still live after the soak"
    assert "Traceback" not in log, log[-3000:]
    assert final_rss - mid < RSS_FLAT_MIB, (mid, final_rss)
    assert all(tally.get(k, 0) > 0 for k in ("stream", "plain", "chat", "batch", "drop", "bad"))
