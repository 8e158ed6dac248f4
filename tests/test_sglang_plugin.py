"""hlserve's SGLang plugin on SGLang 0.5.23's own scheduler, driven on the CPU.

One subprocess in SGLang's environment (``.ci/sglang-env``; ``HLSERVE_SGLANG_PYTHON`` names
its python, default ``~/.cache/hlserve/venv-sglang-0.5.23``): it runs a request stream through
stock SGLang (``hlserve.integrations.sglang.harness``: SGLang's ``Scheduler`` methods over its
real pools, the forward a stand-in), then loads plugins through SGLang's own discovery
(``SGLANG_PLUGINS=hlserve``, ``load_plugins()``) and runs the same stream again, plus the
checks that need one hook each. It prints one JSON line; each test checks one property.
Where the environment is missing the module is skipped, and the rest of the suite runs.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

SGLANG_PY = Path(os.environ.get("HLSERVE_SGLANG_PYTHON")
                 or Path.home() / ".cache" / "hlserve" / "venv-sglang-0.5.23" / "bin" / "python")

SCRIPT = r'''
import json, logging, os, sys, tempfile
logging.basicConfig(level=logging.INFO)  # SGLang's plugin loader and the caps block log at INFO
from hlserve.integrations.sglang import harness as H
TMP = tempfile.mkdtemp()

def stream():
    shared = tuple(range(100, 356))  # a 256-token system prompt the agents share
    reqs = [H.Request(f"a{i}", shared + tuple(range(1000 + 100 * i, 1070 + 130 * i)), 24)
            for i in range(6)]
    return reqs + [H.Request("long", tuple(range(5000, 6500)), 16)]

def pressure():
    # four long requests fill the pool to its end; small ones queue behind them
    return ([H.Request(f"l{i}", tuple(range(20000 + 500 * i, 20384 + 500 * i)), 96)
             for i in range(4)]
            + [H.Request(f"s{i}", tuple(range(40000 + 100 * i, 40032 + 100 * i)), 8)
               for i in range(40)])

def retract():
    # three long requests and a short one; "c" joins when the short one ends (SGLang counts
    # the long ones' output at its new-token ratio), and the pool runs out near their end
    return ([H.Request(f"a{i}", tuple(range(80000 + 200 * i, 80128 + 200 * i)), 330,
                       ignore_eos=False) for i in range(3)]
            + [H.Request("b", tuple(range(81000, 81128)), 16, ignore_eos=False),
               H.Request("c", tuple(range(82000, 82400)), 400, ignore_eos=False)])

def backfill():
    # the second does not fit beside the first; the small ones behind it do
    return ([H.Request("r0", tuple(range(60000, 62000)), 32),
             H.Request("big", tuple(range(62000, 64500)), 32)]
            + [H.Request(f"s{i}", tuple(range(65000 + 100 * i, 65100 + 100 * i)), 8)
               for i in range(4)])

def many():
    return [H.Request(f"m{i}", tuple(range(70000 + 100 * i, 70064 + 100 * i)), 2 + i % 5)
            for i in range(24)]

def spiky():
    # every step alike but the 4th to 6th that hold prefill, each 5x slower
    n = [0]
    def cost(batch):
        if not batch.forward_mode.is_extend():
            return 0.01
        n[0] += 1
        return 0.05 if 4 <= n[0] <= 6 else 0.01
    return cost

CFG = H.HarnessConfig(num_tokens=4096, chunked_prefill_size=256, max_prefill_tokens=2048)
PCFG = H.HarnessConfig(num_tokens=2048, max_running_requests=16, chunked_prefill_size=2048,
                       max_prefill_tokens=2048, schedule_policy="fcfs")
BCFG = H.HarnessConfig(num_tokens=4096, chunked_prefill_size=4096, max_prefill_tokens=4096,
                       schedule_policy="fcfs")
ECFG = H.HarnessConfig(num_tokens=4096, max_running_requests=4, schedule_policy="fcfs")

def go(cfg, reqs, cost=None):
    trace = os.path.join(TMP, f"trace-{len(os.listdir(TMP))}.jsonl")
    os.environ["HLSERVE_SGLANG_TRACE"] = trace  # read by the plugin, when loaded
    s = H.build_scheduler(cfg)
    runner = H.StandInRunner(s, cost)
    if getattr(s, "hlserve", None) is not None:
        s.hlserve.clock = lambda: runner.clock
    res = H.run(s, reqs, runner)
    plug = getattr(s, "hlserve", None)
    return {"finished": res.finished, "aborted": sorted(res.aborted), "kv": H.kv_balanced(s),
            "steps": [st.as_dict() for st in res.steps], "chunk": s.chunked_prefill_size,
            "mixed": s.is_mixed_chunk, "delayer": s.prefill_delayer is not None,
            "max_prefill_tokens": s.max_prefill_tokens,
            "trace": [json.loads(line) for line in open(trace)] if os.path.exists(trace) else [],
            "backfilled": plug.backfilled if plug else None,
            "retract_cached": plug.retract_cached if plug else None}

def lpm_order():
    """SGLang's SchedulePolicy over 200 waiting requests: the last one's prefix is cached."""
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    s = H.build_scheduler(CFG)
    H.run(s, [H.Request("warm", tuple(range(100, 420)), 1)])  # its prompt stays in the cache
    for i in range(200):
        H.add_request(s, H.Request(f"w{i}", tuple(range(9000 + i * 50, 9000 + i * 50 + 40)), 4))
    hot = H.add_request(s, H.Request("hot", tuple(range(100, 420)) + (7, 8), 4))
    s.policy.calc_priority(s.waiting_queue, s.running_batch)
    return [r.rid for r in s.waiting_queue[:3]], s.waiting_queue.index(hot)

queued = H.HarnessConfig(num_tokens=4096, chunked_prefill_size=256, max_queued_requests=2)
def queued_stream():
    return [H.Request(f"q{i}", tuple(range(i * 100, i * 100 + 64)), 8) for i in range(5)]

out = {"stock": go(CFG, stream()), "stock_lpm": lpm_order(),
       "stock_queued": go(queued, queued_stream()), "stock_pressure": go(PCFG, pressure()),
       "stock_backfill": go(BCFG, backfill()), "stock_retract": go(PCFG, retract())}
os.environ.update(SGLANG_PLUGINS="hlserve", HLSERVE_SGLANG_BUDGET_WARMUP="2")
from sglang.srt.plugins import load_plugins
load_plugins()  # SGLang's discovery: entry point group sglang.srt.plugins, allow-list
out["plugin"] = go(CFG, stream())
out["plugin_lpm"] = lpm_order()
out["plugin_queued"] = go(queued, queued_stream())
out["plugin_pressure"] = go(PCFG, pressure())
out["plugin_backfill"] = go(BCFG, backfill())
out["plugin_retract"] = go(PCFG, retract())
out["plugin_ema"] = go(ECFG, many(), spiky())
from hlserve.integrations.sglang.hooks import UnsupportedSGLangError, check_sglang_version
try:
    check_sglang_version("0.5.22")
    out["refused"] = None
except UnsupportedSGLangError as e:
    out["refused"] = str(e)
print("RESULT " + json.dumps(out))
'''


def _run() -> tuple[dict[str, Any] | None, str]:
    if not SGLANG_PY.exists():
        return None, (f"SGLang 0.5.23's environment is missing ({SGLANG_PY}; run .ci/sglang-env "
                      "or set HLSERVE_SGLANG_PYTHON)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "HLSERVE_SGLANG_"))}
    # this checkout's hlserve, whatever checkout the environment was built from
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    r = subprocess.run([str(SGLANG_PY), "-c", SCRIPT], capture_output=True, text=True,
                       timeout=600, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), r.stderr
    raise AssertionError(f"the SGLang run failed (rc {r.returncode}): {r.stderr[-3000:]}")


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], str]:
    out, log = _run()
    if out is None:
        pytest.skip(log)
    return out, log


def _prefill_steps(run: dict[str, Any], rid: str) -> list[int]:
    return [n for st in run["steps"] for (r, _, n, kind) in st["sched"]
            if r == rid and kind == "prefill"]


def test_plugin_loads_through_sglang_discovery_and_logs_its_caps(runs):
    out, log = runs
    assert "Loaded plugin hlserve from group sglang.srt.plugins" in log
    assert "hlserve throughput mode on SGLang 0.5.23: caps in force" in log
    for cap in ("chunk_size", "token_budget", "max_running_requests", "kv_pool"):
        assert cap in log
    stock, plugin = out["stock"], out["plugin"]
    assert (stock["chunk"], stock["mixed"]) == (256, False)
    assert (plugin["chunk"], plugin["mixed"], plugin["delayer"]) == (None, True, False)


def test_same_stream_completes_with_balanced_kv_on_both(runs):
    out, _ = runs
    stock, plugin = out["stock"], out["plugin"]
    assert stock["finished"] == plugin["finished"]  # same requests, same (made-up) tokens
    assert len(stock["finished"]) == 7 and not stock["aborted"] and not plugin["aborted"]
    for run in (stock, plugin):
        kv = run["kv"]
        assert kv["free"] + kv["evictable"] == kv["total"] and kv["protected"] == 0
        assert kv["slots_free"] == kv["slots"]


def test_greedy_prefill_replaces_the_chunk_cap(runs):
    out, _ = runs
    stock, plugin = out["stock"], out["plugin"]
    assert max(st["prefill_tokens"] for st in stock["steps"]) <= 256  # SGLang's chunk cap
    assert sum(_prefill_steps(stock, "long")) == 1500 and len(_prefill_steps(stock, "long")) > 5
    assert _prefill_steps(plugin, "long") == [1500]  # one step
    assert len(plugin["steps"]) < len(stock["steps"])


def test_ema_budget_is_sglangs_prefill_budget_each_step(runs):
    out, _ = runs
    trace = out["plugin"]["trace"]
    assert trace and [r["step"] for r in trace] == list(range(1, len(trace) + 1))
    assert all(r["stage"] == "mix" for r in trace)  # the pool never filled: no decode-only
    assert trace[0]["budget"] == 4096  # the ceiling: the pool, not --max-prefill-tokens 2048
    assert out["plugin"]["max_prefill_tokens"] == 2048  # restored after each pass
    prefill = [r for r in trace if r["mode"] in ("prefill", "mixed")]
    assert prefill and all(r["extend_tokens"] <= r["budget"] for r in prefill)


def test_lpm_keeps_ranking_past_128_waiting(runs):
    out, _ = runs
    stock_head, stock_hot = out["stock_lpm"]
    plugin_head, plugin_hot = out["plugin_lpm"]
    assert stock_head[0] == "w0" and stock_hot == 200  # SGLang: FCFS past 128 waiting
    assert plugin_head[0] == "hot" and plugin_hot == 0  # the cached prefix first


def test_backpressure_instead_of_the_queue_limit_abort(runs):
    out, _ = runs
    stock, plugin = out["stock_queued"], out["plugin_queued"]
    assert stock["aborted"] == ["q2", "q3", "q4"]  # --max-queued-requests 2: aborted
    assert plugin["aborted"] == [] and sorted(plugin["finished"]) == [f"q{i}" for i in range(5)]
    assert plugin["kv"]["free"] + plugin["kv"]["evictable"] == plugin["kv"]["total"]


def _balanced(run: dict[str, Any]) -> bool:
    kv = run["kv"]
    return (kv["free"] + kv["evictable"] == kv["total"] and kv["protected"] == 0
            and kv["slots_free"] == kv["slots"])


HIGH, LOW = 0.90, 0.70  # two_stage_high, two_stage_low (the defaults)


def test_two_stage_goes_decode_only_under_pool_pressure(runs):
    out, _ = runs
    stock, plugin = out["stock_pressure"], out["plugin_pressure"]
    for run in (stock, plugin):
        assert len(run["finished"]) == 44 and not run["aborted"] and _balanced(run)
    steps = plugin["steps"]
    stages = [st["stage"] for st in steps]
    enter = [i for i in range(1, len(steps)) if stages[i - 1] == "mix" and stages[i] == "decode_only"]
    leave = [i for i in range(1, len(steps)) if stages[i - 1] == "decode_only" and stages[i] == "mix"]
    assert enter and leave and leave[0] - enter[0] > 10
    assert all(steps[i]["kv_usage"] > HIGH for i in enter)  # entered above two_stage_high
    assert all(steps[i]["kv_usage"] < LOW for i in leave)  # left below two_stage_low
    # in the decode-only stage no prefill batch forms, while small requests wait
    only = [st for st in steps if st["stage"] == "decode_only"]
    assert all(st["mode"] == "decode" and not st["prefill_tokens"] and st["waiting"] for st in only)
    # stock SGLang on the same stream: no such stage; it goes on prefilling small requests
    # with the pool above two_stage_high, between the long requests' decodes
    assert {st["stage"] for st in stock["steps"]} == {None}
    assert len([st for st in stock["steps"] if st["prefill_tokens"] and st["kv_usage"] > HIGH]) >= 2


def test_ema_budget_cut_by_slow_prefill_steps_and_grown_back(runs):
    out, _ = runs
    trace = out["plugin_ema"]["trace"]
    start = trace[0]["budget"]
    budgets = [r["budget"] for r in trace]
    low = min(budgets)
    cut = budgets.index(low)
    assert low < start  # the slow prefill steps cut it
    assert budgets[-1] == start and budgets[cut:] == sorted(budgets[cut:])  # then it grew back
    # each step's pass gets the budget the last step left
    assert all(abs(a["budget_after"] - b["budget"]) < 1 for a, b in itertools.pairwise(trace))
    slow = [r for r in trace if r["elapsed"] > 0.04]
    assert len(slow) == 3 and all(r["mode"] in ("prefill", "mixed") for r in slow)
    assert all(r["budget_after"] < r["budget"] for r in slow)


def test_retracted_requests_keep_their_pages_in_the_radix_cache(runs):
    out, _ = runs
    stock, plugin = out["stock_retract"], out["plugin_retract"]
    for run in (stock, plugin):
        assert len(run["finished"]) == 5 and not run["aborted"] and _balanced(run)

    def readmissions(run: dict[str, Any]) -> list[tuple[str, int, int, int]]:
        """(rid, tokens computed when retracted, prefix found and tokens computed again when
        prefilled again)."""
        found = []
        for i, st in enumerate(run["steps"]):
            for rid, computed in st["retracted"]:
                prefix, n = next((p, n) for later in run["steps"][i + 1:]
                                 for (r, p, n, kind) in later["sched"]
                                 if r == rid and kind == "prefill")
                found.append((rid, computed, prefix, n))
        return found

    (s_rid, s_computed, s_prefix, s_again), = readmissions(stock)
    (p_rid, p_computed, p_prefix, p_again), = readmissions(plugin)
    assert s_rid == p_rid == "c" and s_computed == p_computed > 400 + 256
    # SGLang: its decoded tokens' pages were freed; only its prompt (inserted into the radix
    # cache when its prefill ended) is found again
    assert s_prefix == 400
    # the plugin: its decoded tokens' pages are found too, less the tail that SGLang's
    # eviction took for the decodes that ran until it was admitted again
    assert 400 + 128 <= p_prefix <= p_computed and p_again < s_again / 2
    assert plugin["retract_cached"] >= p_prefix - 400


def test_admission_backfills_past_a_request_that_does_not_fit(runs):
    out, _ = runs
    stock, plugin = out["stock_backfill"], out["plugin_backfill"]
    for run in (stock, plugin):
        assert len(run["finished"]) == 6 and not run["aborted"] and _balanced(run)

    def first_prefill(run: dict[str, Any]) -> dict[str, int]:
        first: dict[str, int] = {}
        for st in run["steps"]:
            for rid, _, _, kind in st["sched"]:
                if kind == "prefill":
                    first.setdefault(rid, st["index"])
        return first

    s, p = first_prefill(stock), first_prefill(plugin)
    # SGLang's PrefillAdder stops at "big": the small ones wait until r0 ends and big goes
    assert s["r0"] == 0 and all(s[f"s{i}"] >= s["big"] > 0 for i in range(4))
    # hlserve's pass passes over "big" and admits those behind it that fit
    assert all(p[f"s{i}"] == 0 for i in range(4)) and p["big"] > 0
    assert plugin["backfilled"] == 4


def test_other_sglang_versions_are_refused_by_name(runs):
    out, _ = runs
    assert "supports SGLang 0.5.23" in out["refused"] and "'0.5.22'" in out["refused"]
