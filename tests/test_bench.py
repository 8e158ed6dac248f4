"""``hlserve bench`` against a real ``hlserve serve`` process on loopback.

The benchmark's token counts must agree with the server's own Prometheus counters, the
agent sessions must have the closed-loop structure (round r's prompt extends round r−1's
prompt and output), and failures (a parameter the server refuses, a server that dies in the
middle) must be counted and reported, never dropped or hung on.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hlserve.bench.serve_bench import BenchSpec, run_bench
from hlserve.server.runtime.launch import ServerProcess
from hlserve.sim.fitting import find_data_dir

MODEL = "tiny"
MAX_LEN = 2048
SERVER_ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len",
               str(MAX_LEN), "--num-pages", "512", "--uvicorn-log-level", "warning"]


def small_agent(url: str, tmp: Path, **kw) -> BenchSpec:
    base = BenchSpec(base_url=url, model=MODEL, workload="agent", sessions=4, rounds=3,
                     system_prompt_len=128, task_len=16, tool_output_len=(16, 48),
                     output_len=(4, 12), progress=False, result_file=str(tmp / "res.json"),
                     timeout=120)
    return replace(base, **kw)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("bench-server")
    with ServerProcess(tiny_llama, SERVER_ARGS, log_path=tmp / "server.log") as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


def counters(url: str) -> dict[str, float]:
    """Totals over every label of the server's counters."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_agent_numbers_agree_with_server_metrics(server, tmp_path: Path) -> None:
    before = counters(server.url)
    res = run_bench(small_agent(server.url, tmp_path))
    after = counters(server.url)
    assert res["failed"] == 0 and res["completed"] == 12
    assert res["sessions_completed"] == 4 and res["sessions_failed"] == 0
    probe = res["probe"]
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["hlserve:prompt_tokens_total"] == res["total_input_tokens"] + probe["prompt_tokens"]
    assert d["hlserve:generation_tokens_total"] == (res["total_output_tokens"]
                                                    + probe["output_tokens"])
    assert d["hlserve:request_success_total"] == res["completed"] + probe["requests"]
    # output lengths are pinned: every request got what the workload asked for
    rows = read_jsonl(res["request_file"])
    assert len(rows) == 12
    assert all(r["output_tokens"] == r["expected_output_tokens"] for r in rows)
    assert res["short_outputs"] == 0
    # the result file has vLLM's keys and the session keys, with the formulas
    saved = json.loads(Path(tmp_path / "res.json").read_text())
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p90_tpot_ms", "mean_itl_ms", "p99_e2el_ms",
                "sessions_per_hour", "median_session_time_s", "formulas"):
        assert key in saved, key
    assert saved["output_throughput"] == pytest.approx(
        saved["total_output_tokens"] / saved["duration"])
    # TPOT = (E2E - TTFT) / (n - 1), from the client's own timestamps
    r = rows[0]
    assert r["tpot"] == pytest.approx((r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1))
    assert r["ttft"] == pytest.approx(r["chunk_times"][0] - r["start"])


def test_session_structure(server, tmp_path: Path) -> None:
    res = run_bench(small_agent(server.url, tmp_path, record_ids=True, sessions=3, rounds=4,
                                seed=7))
    assert res["output_ids_source"] == "server" and res["prompt_format"] == "token_ids"
    rows = read_jsonl(res["request_file"])
    by_session: dict[int, list[dict]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    assert sorted(by_session) == [0, 1, 2]
    systems = set()
    for rounds in by_session.values():
        rounds.sort(key=lambda x: x["round"])
        assert [x["round"] for x in rounds] == [0, 1, 2, 3]
        systems.add(tuple(rounds[0]["prompt_ids"][:128]))
        for prev, cur in itertools.pairwise(rounds):
            head = prev["prompt_ids"] + prev["output_ids"]
            assert cur["prompt_ids"][: len(head)] == head  # extends prompt + output
            assert len(cur["prompt_ids"]) >= len(head) + 16  # plus a new tool result
            assert cur["start"] >= prev["end"]  # closed loop: sent after the last finished
            assert cur["prompt_tokens"] == len(cur["prompt_ids"])  # the server's count
            assert cur["cached_tokens"] >= 16 * (len(head) // 16) - 16  # prefix cache hit
        for x in rounds:
            assert len(x["output_ids"]) == x["output_tokens"]
    assert len(systems) == 1  # one system prompt shared by every session
    assert res["sessions_completed"] == 3 and len(rows) == 12


def test_tool_time_between_rounds(server, tmp_path: Path, capsys) -> None:
    """``hlserve bench --tool-time fixed:0.3``: each session's next round is sent 0.3 s after
    its last one ended, the session completion percentiles count the tool calls, and the
    headline line leads the printed result."""
    from hlserve.cli import main

    rc = main(["bench", "--base-url", server.url, "--model", MODEL, "--sessions", "2",
               "--rounds", "3", "--system-prompt-len", "64", "--task-len", "8",
               "--tool-output-len", "8:16", "--output-len", "2:4", "--tool-time", "fixed:0.3",
               "--result-file", str(tmp_path / "res.json"), "--no-progress",
               "--report", str(tmp_path / "res.html")])
    assert rc == 0
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["tool_time"] == "fixed:0.3" and res["sessions_completed"] == 2
    # the result names the client's machine; --report draws the run from its requests
    assert res["machine"]["logical_cpus"] >= 1 and res["machine"]["cpu_model"]
    page = (tmp_path / "res.html").read_text()
    assert page.count('class="dist-row tip"') == 4  # TTFT, TPOT, ITL, E2E: one row each
    assert "TTFT (ms), from requests, 6 values" in page
    rows = read_jsonl(res["request_file"])
    for sid in (0, 1):
        rounds = sorted((r for r in rows if r["session_id"] == sid), key=lambda r: r["round"])
        assert len(rounds) == 3
        for prev, cur in itertools.pairwise(rounds):
            assert cur["start"] - prev["end"] >= 0.3
    for q in (50, 90, 99):
        assert res[f"session_completion_p{q}_s"] >= 2 * 0.3
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("Session completion p50/p90/p99: ")
    assert f"{res['total_token_throughput']:.0f} tok/s" in out[1]


def test_trace_chains_over_http_wait_out_their_recorded_gaps(server, tmp_path: Path) -> None:
    """``hlserve bench --trace FILE --tool-time recorded``: a chain's next round is sent its
    recorded gap (over ``--time-scale``) after the round before was sent, so the pause after
    a round is the gap less what serving the round took."""
    from hlserve.driver.tool_time import ToolTime

    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 200, "hash_ids": [0, 1, 2]},
            {"timestamp": 1000, "input_length": 1800, "output_length": 300,
             "hash_ids": [0, 1, 3, 4]},
            {"timestamp": 1600, "input_length": 2100, "output_length": 150,
             "hash_ids": [0, 1, 3, 5, 6]}]
    trace = tmp_path / "chain.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = run_bench(small_agent(server.url, tmp_path, sessions=1, rounds=3, trace=str(trace),
                                length_scale=0.02, time_scale=2.0,
                                tool_time=ToolTime("recorded")))
    assert res["tool_time"] == "recorded" and res["sessions_completed"] == 1
    rounds = sorted(read_jsonl(res["request_file"]), key=lambda r: r["round"])
    assert [r["output_tokens"] for r in rounds] == [4, 6, 3]  # the trace's lengths x 0.02
    for (prev, cur), gap in zip(itertools.pairwise(rounds), (0.5, 0.3), strict=True):
        # Holds however long serving the round took (a loaded machine can take longer than
        # the gap; then the next round goes at once): never sent early, and the pause after
        # the round is the gap less its serving, not the whole gap again.
        assert cur["start"] - prev["start"] >= gap - 0.02
        assert cur["start"] - prev["end"] < gap


def test_outside_formats_replay_over_http(server, tmp_path: Path) -> None:
    """AIPerf's documented multi-turn trace runs as closed-loop sessions (its turns the
    sessions' rounds, their lengths), inference-perf's OTel example replays open loop, each
    request naming its session."""
    data = Path(__file__).parent / "data" / "traces"
    res = run_bench(small_agent(server.url, tmp_path, sessions=1, rounds=2,
                                trace=str(data / "aiperf_mooncake_sessions.jsonl")))
    assert res["sessions_completed"] == 1 and res["failed"] == 0
    rounds = sorted(read_jsonl(res["request_file"]), key=lambda r: r["round"])
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in rounds] == [(300, 40),
                                                                         (490, 20)]
    rep = run_bench(BenchSpec(base_url=server.url, workload="trace", progress=False,
                              trace=str(data / "inference_perf_simple_chain.json"),
                              trace_format="inference-perf", time_scale=10.0, timeout=120))
    assert rep["completed"] == 3 and rep["failed"] == 0
    assert rep["session_fields"] == ["session_id", "prompt_cache_key", "user"]


def test_think_time_is_fixed_tool_time() -> None:
    from hlserve.cli.commands import build_parser
    from hlserve.cli.measure import bench_spec
    from hlserve.driver.tool_time import ToolTime, parse_tool_time

    def spec(*flags: str):
        return bench_spec(build_parser().parse_args(["bench", *flags]))

    assert spec().tool_time == ToolTime()
    assert spec("--think-time", "0.5").tool_time == parse_tool_time("fixed:0.5")
    assert spec("--tool-time", "lognormal:5:1").tool_time == ToolTime("lognormal", 5.0, 1.0)
    with pytest.raises(ValueError, match="give one of them"):
        spec("--think-time", "1", "--tool-time", "exp:2")
    with pytest.raises(SystemExit):  # argparse: a bad spec is refused with the reason
        build_parser().parse_args(["bench", "--tool-time", "gamma:2"])
    sweep = build_parser().parse_args(["sweep", "--model", "m", "--tool-time", "exp:2"])
    assert bench_spec(sweep).tool_time == ToolTime("exp", 2.0)


def test_chat_and_trace_workloads(server, tmp_path: Path) -> None:
    before = counters(server.url)
    chat = run_bench(BenchSpec(base_url=server.url, workload="chat", num_prompts=8,
                               request_rate=40.0, input_len=(32, 96), output_len=(4, 8),
                               system_prompt_len=32, progress=False, timeout=120,
                               slo=_slo(ttft_ms=1e6)))
    assert chat["completed"] == 8 and chat["failed"] == 0
    assert chat["session_fields"] == [] and chat["session_prefix"] is None  # single-turn
    assert chat["slo_attainment"] == 1.0
    assert chat["request_goodput"] == pytest.approx(chat["request_throughput"])
    trace = find_data_dir() / "mooncake_conversation_trace.jsonl"
    rep = run_bench(BenchSpec(base_url=server.url, workload="trace", trace=str(trace),
                              trace_limit=10, length_scale=0.02, output_scale=0.02,
                              time_scale=100.0, progress=False, timeout=120))
    assert rep["completed"] + rep["trace_skipped_too_long"] == 10 and rep["failed"] == 0
    assert rep["session_fields"] == ["session_id", "prompt_cache_key", "user"]  # its chains
    after = counters(server.url)
    sent_in = chat["total_input_tokens"] + rep["total_input_tokens"]
    probes = chat["probe"]["prompt_tokens"] + rep["probe"]["prompt_tokens"]
    assert after["hlserve:prompt_tokens_total"] - before["hlserve:prompt_tokens_total"] == \
        sent_in + probes


def _slo(**kw):
    from hlserve.driver.records import SLO

    return SLO(**kw)


def test_a_refused_parameter_fails_every_request_and_exits_nonzero(server,
                                                                    tmp_path: Path) -> None:
    res = run_bench(small_agent(server.url, tmp_path, extra_body={"bogus_knob": 1}))
    assert res["completed"] == 0 and res["failed"] == 4  # each session's first round
    assert res["sessions_failed"] == 4 and res["sessions_completed"] == 0
    (msg, n), = res["errors"].items()
    assert n == 4 and "HTTP 400" in msg and "bogus_knob" in msg
    # the command line says so too, and exits 1
    cmd = [sys.executable, "-m", "hlserve.cli", "bench", "--base-url", server.url, "--sessions",
           "2", "--rounds", "1", "--system-prompt-len", "32", "--output-len", "2:2",
           "--extra-body", '{"bogus_knob": 1}', "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "Failed requests:" in p.stdout and "bogus_knob" in p.stdout
    assert "2 request(s) failed" in p.stderr


def test_a_server_that_dies_is_reported(tiny_llama: Path, tmp_path: Path) -> None:
    with ServerProcess(tiny_llama, SERVER_ARGS, log_path=tmp_path / "server.log") as srv:
        spec = small_agent(srv.url, tmp_path, sessions=4, rounds=50, output_len=(8, 16),
                           tool_output_len=(8, 16), timeout=30)
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(res=run_bench(spec)), daemon=True)
        t.start()
        jsonl = tmp_path / "res.requests.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if jsonl.exists() and len(jsonl.read_text().splitlines()) >= 6:
                break
            time.sleep(0.05)
        srv.proc.kill()  # the server dies mid-run
        srv.proc.wait()
        t.join(90)
    assert not t.is_alive(), "the bench hung on a dead server"
    res = box["res"]
    assert res["completed"] >= 6 and res["failed"] >= 1
    # every session ended: done, or abandoned at exactly one failed round; nothing dropped
    assert res["sessions_failed"] == 4 - res["sessions_completed"] >= 1
    rows = read_jsonl(res["request_file"])
    assert len(rows) == res["completed"] + res["failed"]
    assert sum(1 for r in rows if not r["success"]) == res["sessions_failed"]
    assert all(r["error"] for r in rows if not r["success"])
    assert any(("Error" in m or "Connect" in m) for m in res["errors"])
