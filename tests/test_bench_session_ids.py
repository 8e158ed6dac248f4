"""``hlserve bench`` names each agent session on the wire (session_id, prompt_cache_key, user),
so ``hlserve serve --session-ttl`` keeps a session's KV through its tool calls, and the result
shows the cached tokens that this buys.

The real test runs one agent workload twice against one ``hlserve serve --session-ttl`` whose
KV pool is small, while single-turn traffic (no session: it names none) floods the pool
during the sessions' tool calls: with ``--no-session-ids`` a session's pages are plain cached
pages, evicted in LRU order by that traffic, and its next round recomputes its context; with
the names they are retained (evicted only after every plain page), and every next round
finds its whole context cached: exactly the full pages of the round before's prompt and
output. The probe's handling of a server that refuses a session field is checked against an
OpenAI-shaped responder that refuses ``session_id`` as OpenAI's API does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from hlserve.bench.client import SESSION_FIELDS, BenchClient, refused_field
from hlserve.bench.serve_bench import BenchSpec, chain_sessions, format_result, run_bench
from hlserve.driver.tool_time import parse_tool_time
from hlserve.driver.workloads import MooncakeTrace, ScaledTrace, trace_requests
from hlserve.server.runtime.launch import ServerProcess
from servers import BASE_ARGS, metric

PS = 16  # the server's page size (the default)
MODEL = "tiny"
FLOOD_PROMPT = 320  # tokens of a flood request: 20 pages, all new


def flood(url: str, stop: threading.Event, done: list[int | str]) -> None:
    """Single-turn requests of fresh random prompts, one after another, until ``stop``: the
    other traffic that fills the pool between a session's rounds (it names no session).
    ``done`` gets each one's status (200, or the error)."""
    rng = random.Random(1)
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            prompt = [rng.randrange(3, 4096) for _ in range(FLOOD_PROMPT)]
            try:
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                       "max_tokens": 1})
                done.append(r.status_code if r.status_code == 200 else r.text)
            except httpx.HTTPError as e:
                done.append(repr(e))


def rows_of(res: dict) -> list[dict]:
    return [json.loads(x) for x in Path(res["request_file"]).read_text().splitlines() if x]


def explained(rows: list[dict]) -> tuple[int, int, int]:
    """(cached tokens of every round after a session's first, what a kept context explains,
    its tail): the round before computed the KV of its prompt and output less the last output
    token; the full pages of that are what can be kept, the rest (a part page) is computed
    again (the server counts it in its re-prefilled tokens)."""
    got = want = tail = 0
    by_session: dict[int, list[dict]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    for rounds in by_session.values():
        rounds.sort(key=lambda x: x["round"])
        for prev, cur in itertools.pairwise(rounds):
            computed = prev["prompt_tokens"] + prev["output_tokens"] - 1
            got += cur["cached_tokens"]
            want += PS * (computed // PS)
            tail += computed % PS
    return got, want, tail


def test_named_sessions_keep_their_kv_through_tool_calls(tiny_llama: Path,
                                                         tmp_path: Path) -> None:
    # 64 pages: two sessions' contexts (6 pages each at most) + a running round + a flood
    # request (21) fit; the flood's 20 new pages a request churn the pool in a tool call
    args = [*BASE_ARGS, "--served-model-name", MODEL, "--max-model-len", "512",
            "--num-pages", "64", "--session-ttl", "30"]
    spec = BenchSpec(base_url="", model=MODEL, workload="agent", sessions=2, rounds=3,
                     system_prompt_len=32, task_len=16, tool_output_len=(16, 16),
                     output_len=(4, 4), tool_time=parse_tool_time("fixed:0.5"),
                     progress=False, timeout=60)
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv:
        stop, flooded = threading.Event(), []
        flooder = threading.Thread(target=flood, args=(srv.url, stop, flooded), daemon=True)
        flooder.start()
        runs, hits = {}, {}
        try:
            # without names first: what it leaves cached is plain, so the named run starts
            # on an equal pool; other seeds, so neither run finds the other's prompts
            for name, seed, ids in (("plain", 1, False), ("named", 2, True)):
                before = metric(httpx.get(srv.url + "/metrics").text, "hlserve:session_ttl_hits")
                runs[name] = run_bench(replace(spec, base_url=srv.url, seed=seed,
                                               session_ids=ids,
                                               result_file=str(tmp_path / f"{name}.json")))
                text = httpx.get(srv.url + "/metrics").text
                hits[name] = metric(text, "hlserve:session_ttl_hits") - before
        finally:
            stop.set()
            flooder.join(60)
        reprefilled = metric(text, "hlserve:session_reprefilled_tokens")
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]
    plain, named = runs["plain"], runs["named"]
    assert len(flooded) >= 20 and set(flooded) == {200}  # the flood ran through both runs
    for res in (plain, named):
        assert res["failed"] == 0 and res["sessions_completed"] == 2
    assert named["session_fields"] == list(SESSION_FIELDS)
    assert named["session_prefix"].startswith("hlserve-bench-")
    assert plain["session_fields"] == [] and plain["session_prefix"] is None
    named_got, named_want, tail = explained(rows_of(named))
    plain_got, plain_want, _ = explained(rows_of(plain))
    assert named_want == plain_want > 0  # lengths are fixed: the same contexts to keep
    # named: every later round found its whole previous context, as retention explains
    assert named_got == named_want
    # and the server agrees: it found retained pages, and recomputed only the part pages
    assert hits["named"] > 0 and reprefilled == tail
    # plain: the flood evicted most of it between rounds (LRU), and nothing was retained
    assert plain_got <= named_want // 2
    assert hits["plain"] == 0
    assert named["total_cached_tokens"] > plain["total_cached_tokens"]
    assert named["cached_token_ratio"] == pytest.approx(
        named["total_cached_tokens"] / named["total_input_tokens"])
    assert f"{named['total_cached_tokens']} ({named['cached_token_ratio']:.1%})" in \
        format_result(named)


# ---- the probe, against a server that refuses session fields ------------------------------

STRICT = {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options",
          "ignore_eos", "return_token_ids", "prompt_cache_key", "user", "session_id"}


def strict_server(refuses: set[str]) -> httpx.MockTransport:
    """An OpenAI-shaped responder that refuses the fields ``refuses`` with OpenAI's 400."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL, "max_model_len": 512}]})
        body = json.loads(request.content)
        unknown = sorted(k for k in body if k not in STRICT or k in refuses)
        if unknown:
            return httpx.Response(400, json={"error": {
                "message": f"Unrecognized request argument supplied: {unknown[0]}",
                "type": "invalid_request_error", "param": unknown[0], "code": None}})
        return httpx.Response(200, json={
            "choices": [{"text": "x", "token_ids": [5], "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}})

    return httpx.MockTransport(handle)


async def probed(refuses: set[str]) -> tuple[BenchClient, object]:
    client = BenchClient("http://server", MODEL, session_fields=SESSION_FIELDS)
    await client.http.aclose()
    client.http = httpx.AsyncClient(base_url=client.root, transport=strict_server(refuses))
    async with client:
        return client, await client.probe(session="run-probe")


def test_a_refused_session_field_is_dropped_with_a_note() -> None:
    client, info = asyncio.run(probed({"session_id"}))
    assert info.session_fields == ["prompt_cache_key", "user"]
    assert info.token_prompts and info.return_token_ids  # nothing else was given up
    (note,) = info.notes
    assert "refused session_id" in note and "prompt_cache_key, user only" in note
    body = client.body([1, 2, 3], 4, session="run-s0")
    assert body["prompt_cache_key"] == body["user"] == "run-s0" and "session_id" not in body
    assert not set(SESSION_FIELDS) & set(client.body([1, 2, 3], 4))  # a request of no session
    client, info = asyncio.run(probed(set(SESSION_FIELDS)))
    assert info.session_fields == [] and "not named on the wire" in info.notes[0]
    assert not set(SESSION_FIELDS) & set(client.body([1], 4, session="run-s0"))


def test_refused_field_reads_whole_words_only() -> None:
    assert refused_field("HTTP 400: Unrecognized request argument supplied: user",
                         SESSION_FIELDS) == "user"
    assert refused_field("HTTP 400: 'session_id': extra fields not permitted",
                         SESSION_FIELDS) == "session_id"
    assert refused_field("HTTP 400: user_id is required", SESSION_FIELDS) is None
    assert refused_field("HTTP 400: max_tokens too large", SESSION_FIELDS) is None


def test_a_trace_replay_names_its_chains(tmp_path: Path) -> None:
    """Replayed requests of one Mooncake chain share a session name; one alone has none."""
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
            {"timestamp": 10, "input_length": 600, "output_length": 20, "hash_ids": [7, 8]},
            {"timestamp": 20, "input_length": 1800, "output_length": 20,
             "hash_ids": [0, 1, 3, 4]},
            {"timestamp": 30, "input_length": 2100, "output_length": 20,
             "hash_ids": [0, 1, 3, 5, 6]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    requests, _ = trace_requests(ScaledTrace(MooncakeTrace.load(path), 0.02))
    chain_sessions(requests, MooncakeTrace.load(path), "run")
    assert [q.session for q in requests] == ["run-c0", None, "run-c0", "run-c0"]


def test_no_session_ids_flag() -> None:
    from hlserve.cli.commands import build_parser
    from hlserve.cli.measure import bench_spec

    assert bench_spec(build_parser().parse_args(["bench"])).session_ids is True
    assert bench_spec(build_parser().parse_args(["bench", "--no-session-ids"])).session_ids \
        is False
