"""The simulated runner under the real Engine, Scheduler and KV cache manager."""

from __future__ import annotations

import pytest

from hlserve.config import EngineConfig
from hlserve.driver.closed_loop import run_agent_sessions
from hlserve.driver.workloads import AgentWorkload
from hlserve.engine.factory import build_engine
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.llm_engine import VirtualClock
from hlserve.engine.scheduler import Scheduler
from hlserve.request import SamplingParams
from hlserve.sim.build import SimOptions, build_sim_engine
from hlserve.sim.sim_runner import SimRunner
from hlserve.study.drive import run_agent_steady

SMALL = dict(sessions=6, rounds=3, system_prompt_len=2048, task_len=128,
             tool_output_len=(500, 2000), output_len=(20, 60), vocab=(3, 150000), seed=3)


def test_same_scheduler_and_virtual_time() -> None:
    engine = build_sim_engine("Qwen2.5-32B", "H20", 8, mode="throughput", check_invariants=True)
    assert type(engine.scheduler) is Scheduler and type(engine.kv) is KVCacheManager
    assert isinstance(engine.clock, VirtualClock) and isinstance(engine.runner, SimRunner)
    res = run_agent_sessions(engine, AgentWorkload(**SMALL), progress=False)
    s = res.summary()
    assert s["completed"] == 18
    # output lengths as asked (never an EOS), virtual time == the sum of predicted steps
    assert all(r.output_tokens >= 20 for r in res.records)
    assert engine.clock() == pytest.approx(engine.runner.busy_time)
    assert res.duration == pytest.approx(engine.clock())
    # prefix caching works through the simulated runner: later rounds hit the cache
    assert s["cached_tokens"] > 0.5 * s["total_input_tokens"]
    # H20 TP8 serving a 32B model: tens of ms per decode step, seconds of simulated time
    assert 0.01 < s["median_tpot_ms"] / 1e3 < 0.2


def test_step_requests_are_the_requests_step_reports() -> None:
    """Drivers that read only finished requests use ``step_requests``; ``step`` is the same
    iteration with a snapshot of each touched request."""
    a, b = (build_sim_engine("Qwen2.5-32B", "H20", 8, mode="throughput") for _ in range(2))
    index: dict[str, int] = {}  # request id -> submission order, the same in both engines
    for e in (a, b):
        for i, n in enumerate((3000, 5000)):
            req = e.add_request(list(range(10, 10 + n)), SamplingParams(max_tokens=4, ignore_eos=True))
            index[req.request_id] = i
    steps = 0
    while a.has_unfinished() or b.has_unfinished():
        reqs = a.step_requests()
        outs = b.step()
        steps += 1
        assert [(index[r.request_id], list(r.output_token_ids), r.finished) for r in reqs] == \
            [(index[o.request_id], o.token_ids, o.finished) for o in outs]
    assert steps >= 4
    assert a.clock() == b.clock() > 0


def test_deterministic() -> None:
    def run() -> dict:
        e = build_sim_engine("Qwen2.5-32B", "H20", 8, preset="sglang")
        return run_agent_sessions(e, AgentWorkload(**SMALL), progress=False).summary()

    assert run() == run()


def test_tokens_avoid_eos_unless_asked() -> None:
    cfg = EngineConfig(model="Qwen2.5-0.5B")
    runner = SimRunner(cfg, "H100", 1)
    eos = set(runner.model_config.eos_token_ids)
    toks = {runner.token_at(last, pos) for last in range(50) for pos in range(200)}
    assert not toks & eos and len(toks) > 9000
    engine = build_sim_engine("Qwen2.5-0.5B", "H100", 1, sim=SimOptions(eos_rate=0.2))
    req = engine.add_request(list(range(100, 400)), SamplingParams(max_tokens=500, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason.value == "stop" and len(req.output_token_ids) < 100


def test_pool_from_memory_and_pressure() -> None:
    """The pool follows GPU memory (8xH20 vs 2xH20); a pool too small for the sessions makes
    the real scheduler retract or hold requests back, and every request still finishes."""
    big = build_sim_engine("Qwen2.5-32B", "H20", 8, preset="vllm")
    small = build_sim_engine("Qwen2.5-32B", "H20", 2, preset="vllm")
    assert big.kv.num_pages > 4 * small.kv.num_pages
    with pytest.raises(ValueError, match="fewer than one"):
        build_sim_engine("Qwen2.5-72B", "L40S", 4, preset="vllm")
    for preset in ("vllm", "sglang", "hlserve"):
        e = build_sim_engine("Qwen2.5-32B", "H20", 8, preset=preset, num_pages=1200,
                             max_model_len=16384, check_invariants=True)
        w = AgentWorkload(**{**SMALL, "sessions": 8, "tool_output_len": (1000, 2500)})
        res = run_agent_sessions(e, w, progress=False)
        assert res.summary()["completed"] == 24, preset
        assert e.scheduler.num_retractions > 0 or preset != "vllm"


def test_steady_state_driver() -> None:
    engine = build_sim_engine("Qwen2.5-7B", "H100", 1, mode="throughput", num_pages=5000)
    w = AgentWorkload.for_context(8192, sessions=8, rounds=3, vocab=(3, 150000))
    res = run_agent_steady(engine, w, duration=40.0, warmup=10.0)
    assert res.duration == pytest.approx(40.0)
    assert res.sessions_started > 8  # ended sessions were replaced
    assert all(r.start >= 10.0 and r.end <= 50.0 for r in res.records)
    assert res.summary()["total_token_throughput"] > 0
    # contexts grow up to the target and no further
    assert max(r.prompt_tokens + r.output_tokens for r in res.records) <= 8192


def test_window_counts_computed_tokens_apart_from_cached_ones() -> None:
    """``window_computed_token_throughput`` counts the window's prompt tokens the engine
    computed, not those the prefix cache served: far below the served count when rounds reuse
    their session's prefix, nearer it without reuse (the system prompt is still shared)."""
    out = {}
    for reuse in (True, False):
        engine = build_sim_engine("Qwen2.5-7B", "H100", 1, mode="throughput", num_pages=5000)
        w = AgentWorkload.for_context(8192, sessions=8, rounds=3, vocab=(3, 150000),
                                      prefix_reuse=reuse)
        res = run_agent_steady(engine, w, duration=40.0, warmup=10.0)
        served, computed = (res.extra["window_token_throughput"],
                            res.extra["window_computed_token_throughput"])
        assert 0 < computed <= served
        assert res.extra["window_output_throughput"] < computed
        out[reuse] = computed / served
    # with reuse each round's prompt is mostly its last round's, cached (a third computed);
    # without it only the shared system prompt is (two thirds computed)
    assert out[True] < 0.4 and out[False] > 0.55


def test_engine_built_by_hand() -> None:
    """SimRunner is a plain Runner: any Engine takes it."""
    cfg = EngineConfig(model="Llama-3.1-8B", chunk_size=256, token_budget=512)
    engine = build_engine(cfg, SimRunner(cfg, "A100", 1), clock=VirtualClock())
    req = engine.add_request(list(range(3, 1003)), SamplingParams(max_tokens=4, temperature=0))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps == 4 + 3  # 1000 prompt tokens in chunks of 256, then 3 more decodes
    assert len(req.output_token_ids) == 4 and engine.clock() > 0


def test_steady_state_ramp_and_stall() -> None:
    engine = build_sim_engine("Qwen2.5-7B", "H100", 1, mode="throughput", num_pages=5000)
    w = AgentWorkload.for_context(8192, sessions=4, rounds=2, vocab=(3, 150000))
    res = run_agent_steady(engine, w, duration=20.0, warmup=10.0, ramp=8.0)
    firsts = sorted(r.start for r in res.records)
    assert not res.stalled and firsts and firsts[0] >= 10.0
    # a budget of zero schedules nothing: the engine is stalled and the window passes empty
    engine = build_sim_engine("Qwen2.5-7B", "H100", 1, mode="throughput", num_pages=5000)
    engine.scheduler.budget_controller.budget = 0
    res = run_agent_steady(engine, w, duration=20.0, warmup=5.0)
    assert res.stalled and res.stalled_at == 0.0 and not res.records
    assert engine.clock() == pytest.approx(25.0) and res.duration == pytest.approx(20.0)


def test_steady_state_progress_bar_survives_overshooting_the_window() -> None:
    """The last iteration ends past the window (a multi-second prefill): the progress bar
    must clamp at its total instead of failing when it formats."""
    engine = build_sim_engine("Qwen2.5-32B", "H20", 8, mode="throughput")
    wl = AgentWorkload(sessions=1, rounds=1, system_prompt_len=60000, task_len=16,
                       tool_output_len=(16, 32), output_len=(8, 16), vocab=(3, 150000))
    res = run_agent_steady(engine, wl, duration=1.0, progress=True)
    assert engine.clock() > 1.5  # one greedy 60K prefill: far past the window
    assert res.duration == pytest.approx(1.0)


def test_simulated_runs_restore_the_gc_thresholds() -> None:
    """The drivers relax the collector only while they simulate, and put it back even when
    the run raises."""
    import gc

    before = gc.get_threshold()
    engine = build_sim_engine("Qwen2.5-32B", "H20", 8, mode="throughput")
    seen: list[tuple[int, ...]] = []
    real_step = engine.step_requests

    def step():
        seen.append(gc.get_threshold())
        if len(seen) == 3:
            raise RuntimeError("boom")
        return real_step()

    engine.step_requests = step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        run_agent_steady(engine, AgentWorkload(**SMALL), duration=60.0)
    assert seen and all(t[0] > before[0] for t in seen)
    assert gc.get_threshold() == before
