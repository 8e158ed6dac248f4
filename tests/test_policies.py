"""Throughput mode, presets and request classes: each test fails without its feature.

The scheduler runs for real; a stand-in runner (tests/support.py) gives deterministic step
times on a virtual clock, so time-driven policies are tested without timing flakiness.
"""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from hlserve import LLM
from hlserve.config import EngineConfig
from hlserve.engine.factory import build_engine
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.llm_engine import Engine, VirtualClock
from hlserve.engine.policies.budget import EMABudget, RatchetBudget, StepTimeCap
from hlserve.engine.policies.lpm import LongestPrefixMatch
from hlserve.engine.policies.mixing import MixState, TwoStage
from hlserve.engine.policies.retraction import LIFO, FewestGenerated, PriorityVictim
from hlserve.engine.presets import DeviceInfo, preset_options, resolve_options
from hlserve.errors import InvalidRequestError
from hlserve.request import Request, RequestClass, SamplingParams
from kv_support import plain_radix_walk_order, release_cached
from support import HistoryRunner

CPU = DeviceInfo("cpu")


def engine_for(num_pages: int = 1024, page_size: int = 16, overhead: float = 2e-3,
               per_token: float = 1e-4, **options) -> Engine:
    opts = resolve_options(options, CPU)
    cfg = EngineConfig(model="-", check_invariants=True, **opts)
    runner = HistoryRunner(num_pages, page_size, overhead, per_token, check=False)
    return build_engine(cfg, runner, clock=VirtualClock())


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8) for _ in range(n)]


def run(engine: Engine, max_steps: int = 100_000) -> dict[str, object]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request ended twice"
                finished[out.request_id] = out
    assert not engine.has_unfinished()
    return finished


def prefill_steps(engine: Engine, request_id: str) -> int:
    runner = engine.runner
    assert isinstance(runner, HistoryRunner)
    return sum(1 for b in runner.batches for s in b.seqs
               if s.request.request_id == request_id and not s.is_decode)


# ---- 1. greedy prefill ------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "iterations"), [
    ({"mode": "throughput"}, 1),
    ({"preset": "sglang"}, math.ceil(8192 / 2048)),  # CPU tier: C = 2048
    ({"preset": "sarathi"}, math.ceil(8192 / 512)),
    ({"preset": "vllm"}, math.ceil(8192 / 2048)),  # budget 2048 on CPU bounds each chunk
])
def test_greedy_prefill_takes_one_pass(options, iterations: int) -> None:
    e = engine_for(num_pages=2048, **options)
    req = e.add_request(prompt(8192, 0), params(4))
    run(e)
    assert prefill_steps(e, req.request_id) == iterations


def test_greedy_prefill_on_the_real_model(tiny_llama: Path) -> None:
    """An 8K prompt through the real runner: one forward in throughput mode, ceil(n/C)
    under a chunked preset, and the same greedy tokens either way."""
    ids = prompt(8192, 1)
    ids = [3 + t for t in ids]
    outs = {}
    for name, opts in {"throughput": {"mode": "throughput"},
                       "sglang": {"preset": "sglang"}}.items():
        llm = LLM(str(tiny_llama), dtype="float32", **opts)
        out = llm.generate([ids], params(3), use_tqdm=False)[0]
        outs[name] = (out.token_ids, llm.engine.stats.steps)
    assert outs["throughput"][0] == outs["sglang"][0]
    # steps = prefill iterations + one decode step per token after the first
    assert outs["throughput"][1] == 1 + 2
    assert outs["sglang"][1] == 4 + 2


# ---- 2. two-stage mixing ----------------------------------------------------------------------


def test_two_stage_switches_to_decode_drains_and_returns() -> None:
    e = engine_for(num_pages=48, page_size=16, mode="throughput")
    for i in range(14):
        e.add_request(prompt(96, i), params(150))
    mixing = e.scheduler.mixing
    assert isinstance(mixing, TwoStage)
    stages: list[bool] = []
    usage_at_entry: list[float] = []
    while e.has_unfinished():
        before = mixing.decode_only
        e.step()
        if mixing.decode_only and not before:
            usage_at_entry.append(e.kv.usage)
        stages.append(mixing.decode_only)
    assert any(stages), "pressure never triggered the decode-only stage"
    assert mixing.switches >= 2 and not stages[-1], "it must return to mixing"
    # decode-only iterations hold no prefill
    runner = e.runner
    assert isinstance(runner, HistoryRunner)
    for batch, decode_only in zip(runner.batches, stages, strict=False):
        if decode_only:
            assert batch.num_prefill_tokens == 0
    # hysteresis: every decode-only stretch lasts several iterations, no flapping
    runs, n = [], 0
    for s in stages:
        if s:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert min(runs) >= 3, f"decode-only stretches {runs} flap"


def test_two_stage_policy_hysteresis_unit() -> None:

    ts = TwoStage(high=0.9, low=0.7)
    assert ts.plan(MixState(0.95, pending_prefill_pages=10, evictable_pages=50, num_decoding=4)) \
        == (True, True), "evictable pages can absorb the prefill: keep mixing"
    assert ts.plan(MixState(0.95, 10, 2, 4)) == (False, True)
    assert ts.plan(MixState(0.80, 10, 2, 4)) == (False, True), "between watermarks: stay"
    assert ts.plan(MixState(0.60, 10, 2, 4)) == (True, True)
    assert ts.switches == 2


# ---- 3. budget controllers --------------------------------------------------------------------


def test_ratchet_unit_falls_to_zero_and_never_rises() -> None:
    r = RatchetBudget(initial=2048, warmup=10)
    for _ in range(10):
        r.observe(0.01, True)  # near-empty calibration batches
    for _ in range(300):
        r.observe(0.05, True)  # real load: every iteration "too slow"
    assert r.budget == 0
    for _ in range(50):
        r.observe(0.001, True)
    assert r.budget == 0, "the ratchet never raises the budget"


def test_ema_unit_bounds_growth_warmup_and_decode_only() -> None:
    e = EMABudget(initial=1024, alpha=0.1, warmup=10, floor=256, ceiling=16384)
    for _ in range(10):
        e.observe(5.0, True)  # warm-up: ignored however slow
    assert e.budget == 1024 and e.tau is None
    e.observe(0.05, True)
    for _ in range(30):
        e.observe(10.0, False)  # decode-only: ignored
    assert e.budget == 1024 and e.tau == 0.05
    for _ in range(100):
        e.observe(0.05, True)
    assert e.budget > 1024, "can grow above its initial value"
    assert e.budget <= 16384
    for t in [0.05 * 4**k for k in range(1, 30)]:  # ever slower spikes
        e.observe(t, True)
    assert e.budget >= 256, "bounded away from zero"


def _sustained_load(controller: str) -> Engine:
    """A few near-empty iterations (the calibration window), then a crowd of requests."""
    e = engine_for(num_pages=4096, overhead=2e-3, per_token=2e-5, budget_controller=controller,
                   token_budget=1024, budget_warmup=10)
    e.add_request(prompt(8, 99), params(12))
    for _ in range(12):
        e.step()
    for i in range(400):
        e.add_request(prompt(300, i), params(40))
    for _ in range(400):
        e.step()
    return e


def test_ratchet_budget_collapses_and_prefill_stops_under_load() -> None:
    e = _sustained_load("ratchet")
    assert e.scheduler.budget_controller.budget == 0
    runner = e.runner
    assert isinstance(runner, HistoryRunner)
    assert e.scheduler.waiting, "requests are still waiting"
    # what decoded finished; what was mid-prefill is stuck there, holding its pages
    assert all(r.in_prefill for r in e.scheduler.running)
    n = len(runner.batches)
    for _ in range(20):
        e.step()
    assert len(runner.batches) == n, "prefill stopped for good: the engine idles with work queued"


def test_ema_budget_keeps_prefill_going_under_the_same_load() -> None:
    e = _sustained_load("ema")
    ctl = e.scheduler.budget_controller
    assert ctl.budget >= e.config.budget_min
    runner = e.runner
    assert isinstance(runner, HistoryRunner)
    assert sum(b.num_prefill_tokens for b in runner.batches[-50:]) > 0
    assert max(b.num_tokens for b in runner.batches) > 1024, "grew above its initial value"
    run(e)


# ---- 4. longest prefix match ------------------------------------------------------------------


def _cache(kv: KVCacheManager, tokens: list[int], rid: str) -> None:
    kv.admit(rid, tokens, len(tokens) - 1)
    kv.allocate(rid, len(tokens))
    release_cached(kv, rid, tokens, len(tokens))


def _req(tokens: list[int], t: float) -> Request:
    return Request(prompt_token_ids=tokens, params=params(4), arrival_time=t)


def test_lpm_orders_by_cached_prefix() -> None:
    kv = KVCacheManager(256, 4)
    base = list(range(64))
    _cache(kv, base, "warm")
    long_hit = _req([*base, 900, 901], 3.0)
    short_hit = _req([*base[:16], 7, 7, 7, 7, 7], 2.0)
    cold = _req([500 + i for i in range(30)], 1.0)
    lpm = LongestPrefixMatch(kv, aging=0.0, fcfs_fallback=None)
    assert list(lpm.order([cold, short_hit, long_hit], 1)) == [long_hit, short_hit, cold]


def test_lpm_aging_bounds_how_long_a_cold_request_waits() -> None:
    kv = KVCacheManager(512, 16)
    hot_prefix = list(range(256))
    _cache(kv, hot_prefix, "hot")
    cold = _req([1000 + i for i in range(40)], 0.0)

    def first_turn(aging: float, horizon: int = 200) -> int | None:
        lpm = LongestPrefixMatch(kv, aging=aging, fcfs_fallback=None)
        for step in range(horizon):
            hot = _req([*hot_prefix, step % 7 + 2000, 1], float(step + 1))  # a fresh hot one
            if next(lpm.order([cold, hot], step)) is cold:
                return step
            lpm.forget(hot)
        return None

    assert first_turn(aging=0.0) is None, "without aging the cold request starves"
    served = first_turn(aging=4.0)
    assert served is not None and served <= 256 / 4 + 1  # 256 cached tokens / 4 per iteration


def test_lpm_pass_is_incremental_at_thousands_waiting() -> None:
    """4096 waiting requests over shared prefixes: after the first pass, a pass makes about
    one tree lookup per request, where the plain walk makes one per cached page."""
    kv = KVCacheManager(20000, 16)
    rng = random.Random(0)
    systems = [[rng.randrange(50) for _ in range(1024)] for _ in range(8)]
    for i, s in enumerate(systems):
        _cache(kv, s, f"sys{i}")
    waiting = [_req([*systems[i % 8], *[rng.randrange(50) for _ in range(64)]], float(i))
               for i in range(4096)]
    lpm = LongestPrefixMatch(kv, aging=1.0, fcfs_fallback=None)
    list(lpm.order(waiting, 0))
    first = lpm.lookups
    lpm.lookups = 0
    ordered = list(lpm.order(waiting, 1))
    assert lpm.lookups <= 2 * len(waiting), f"{lpm.lookups} lookups in a repeated pass"
    assert first >= 64 * len(waiting)  # the first pass did walk every prefix
    assert [r.request_id for r in ordered[:8]] == [r.request_id for r in waiting[:8]]
    assert plain_radix_walk_order(kv, waiting[:100])[0] is waiting[0]


def test_lpm_with_1024_running_and_4096_waiting_schedules() -> None:
    e = engine_for(num_pages=1024 * 8 + 4096 * 8, mode="throughput", max_num_seqs=1024)
    shared = prompt(64, 0)
    e.add_request([*shared, *prompt(40, 0)], params(8))
    e.step()  # the shared prefix gets cached
    for i in range(1024 + 4096 - 1):
        e.add_request([*shared, *prompt(40, i + 1)], params(8))
    e.step()
    assert len(e.scheduler.running) == 1024 and len(e.scheduler.waiting) == 4096
    e.step()  # a pass over 4096 waiting with 1024 running completes


# ---- 5. backpressure --------------------------------------------------------------------------


def _pressure(admission: str) -> tuple[Engine, Request, Request]:
    e = engine_for(num_pages=32, page_size=16, mode="throughput", admission=admission,
                   mixing="always")
    a = e.add_request(prompt(300, 1), params(100))  # holds 19 pages, projected 25
    e.step()
    b = e.add_request(prompt(150, 2), params(150))  # projected 19 pages > headroom 13
    return e, a, b


def test_backpressure_waits_then_admits() -> None:
    e, a, b = _pressure("backpressure")
    e.step()
    assert b in e.scheduler.waiting, "b must wait while it does not fit"
    done = run(e)
    assert done[a.request_id].finish_reason == "length"
    assert done[b.request_id].finish_reason == "length"
    assert len(done[b.request_id].token_ids) == 150
    assert e.scheduler.num_retractions == 0, "nothing was aborted or retracted in flight"


def test_abort_guard_rejects_what_backpressure_holds() -> None:
    e, a, b = _pressure("abort_guard")
    done = run(e)
    assert done[b.request_id].finish_reason == "abort"
    assert "headroom" in (done[b.request_id].error or "")
    assert done[a.request_id].finish_reason == "length"


def test_a_request_that_can_never_fit_errors_at_once() -> None:
    e = engine_for(num_pages=32, page_size=16, mode="throughput")
    with pytest.raises(InvalidRequestError, match="pool holds 512"):
        e.add_request(prompt(400, 1), params(200))
    assert not e.has_unfinished()


# ---- 6. retraction ----------------------------------------------------------------------------


def _r(prompt_len: int, outputs: int, priority: int = 0) -> Request:
    r = Request(prompt_token_ids=[1] * prompt_len, params=params(100), priority=priority)
    r.output_token_ids = [2] * outputs
    return r


def test_victim_policies_pick_what_they_should() -> None:
    a, b, c = _r(10, 5), _r(50, 1), _r(20, 1)
    assert FewestGenerated().victim([a, b, c]) is b  # fewest outputs, tie -> longest prompt
    assert LIFO().victim([a, b, c]) is c  # newest
    lo, hi1, hi2 = _r(10, 1, priority=5), _r(10, 1, priority=0), _r(10, 1, priority=0)
    assert PriorityVictim().victim([hi1, lo, hi2]) is lo
    assert PriorityVictim().victim([hi1, hi2]) is hi2  # same priority: the latest


@pytest.mark.parametrize("retraction", ["fewest_generated", "lifo", "priority"])
def test_retracted_pages_stay_cached_and_are_hit_on_readmission(retraction: str) -> None:
    e = engine_for(num_pages=40, page_size=16, mode="throughput", admission="chunk",
                   retraction=retraction)
    reqs = [e.add_request(prompt(160, i), params(200), priority=i % 3) for i in range(5)]
    hits_before = e.kv.prefix_hits
    done = run(e)
    assert e.scheduler.num_retractions > 0
    # prompts share nothing, so every prefix hit is a retracted request finding its pages
    assert e.kv.prefix_hits > hits_before
    for r in reqs:
        assert done[r.request_id].finish_reason == "length"
        assert len(done[r.request_id].token_ids) == 200
    assert e.kv.num_used == 0


def test_retraction_storm_never_crashes() -> None:
    e = engine_for(num_pages=24, page_size=4, mode="throughput", admission="chunk")
    for i in range(60):
        e.add_request(prompt(random.Random(i).randint(5, 60), i), params(30))
    done = run(e)
    assert len(done) == 60 and e.scheduler.num_retractions > 20
    assert all(o.finish_reason == "length" for o in done.values())


# ---- 7. request classes -----------------------------------------------------------------------


def _classes_run(with_interactive: bool, interactive_class: str = "interactive"):
    """Closed-loop agents (each finished request is followed by a new 2K-token prompt, so
    big prefills keep coming) and, optionally, a short interactive request every 15 steps."""
    e = engine_for(num_pages=8192, overhead=5e-3, per_token=1e-4, mode="throughput",
                   interactive_chunk_size=256, interactive_token_budget=256)
    agents = [e.add_request(prompt(2000, i), params(64)) for i in range(8)]
    interactive: list[Request] = []
    steps = 0
    while e.has_unfinished():
        if with_interactive and steps % 40 == 0 and steps < 600:
            interactive.append(e.add_request(prompt(200, 1000 + steps), params(16),
                                             request_class=interactive_class))
        for out in e.step():
            if out.finished and len(agents) < 48 and any(
                    a.request_id == out.request_id for a in agents):
                agents.append(e.add_request(prompt(2000, len(agents)), params(64)))
        steps += 1
    return e, agents, interactive


def _tpot(r: Request) -> float:
    assert r.first_token_time is not None and r.finish_time is not None
    return (r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)


def test_interactive_caps_apply_only_where_felt() -> None:
    e, _agents, inter = _classes_run(with_interactive=True)
    runner = e.runner
    assert isinstance(runner, HistoryRunner)
    inter_ids = {r.request_id for r in inter}
    capped = uncapped = 0
    for b in runner.batches:
        decoding = any(s.request.request_id in inter_ids and s.is_decode for s in b.seqs)
        if decoding:
            capped += 1
            assert b.num_tokens <= max(256, b.num_decodes), "TPOT cap broken"
        elif b.num_tokens > 256:
            uncapped += 1
    assert capped > 0 and uncapped > 0, "caps must bind only where an interactive request is"


def test_interactive_latency_protected_and_agent_throughput_kept() -> None:
    _mixed, agents, inter = _classes_run(with_interactive=True)
    _as_agent, _, inter_as_agent = _classes_run(with_interactive=True, interactive_class="agent")
    _pure, pure_agents, _ = _classes_run(with_interactive=False)

    def agent_rate(agents_: list[Request]) -> float:
        end = max(r.finish_time or 0 for r in agents_)
        return sum(len(r.output_token_ids) + r.num_prompt_tokens for r in agents_) / end

    def worst_gap(r: Request) -> float:
        return max(b - a for a, b in itertools.pairwise(r.token_times))

    # every gap between an interactive request's tokens is one capped iteration at most...
    iteration_cap = 5e-3 + 1e-4 * 256  # overhead + the interactive budget
    assert max(worst_gap(r) for r in inter) <= iteration_cap * 1.01
    # ...while as plain agent traffic it sits in iterations with whole 2K-token prefills
    assert max(worst_gap(r) for r in inter_as_agent) > 5 * iteration_cap
    assert _p90([_tpot(r) for r in inter]) < _p90([_tpot(r) for r in inter_as_agent])
    # and the agents barely notice
    assert agent_rate(agents) >= 0.8 * agent_rate(pure_agents)


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * len(xs))]


def test_default_request_class_is_configurable() -> None:
    e = engine_for(default_request_class="interactive")
    assert e.add_request([1, 2, 3], params(2)).request_class is RequestClass.INTERACTIVE


# ---- presets, mode, caps log ------------------------------------------------------------------


def test_presets_follow_the_reference_defaults() -> None:
    h100 = DeviceInfo("cuda", 80.0, hopper_class=True)
    a100 = DeviceInfo("cuda", 80.0, hopper_class=False)
    assert preset_options("sglang", h100)["chunk_size"] == 8192
    assert preset_options("sglang", DeviceInfo("cuda", 40.0))["chunk_size"] == 4096
    assert preset_options("sglang", CPU)["chunk_size"] == 2048
    assert preset_options("sglang", h100)["lpm_fcfs_fallback"] == 128
    assert preset_options("sglang", h100)["max_prefill_tokens"] == 16384
    assert preset_options("vllm", h100)["token_budget"] == 8192
    assert preset_options("vllm", a100)["token_budget"] == 2048
    assert preset_options("vllm", CPU)["retraction"] == "lifo"
    assert preset_options("sarathi", CPU)["chunk_size"] == 512
    assert preset_options("sarathi-relaxed", CPU)["token_budget"] == 2048
    tp = resolve_options({"mode": "throughput", "max_num_seqs": 64}, CPU)
    assert tp["chunk_size"] is None and tp["mixing"] == "two_stage" and tp["max_num_seqs"] == 64
    assert resolve_options({"preset": "sglang", "chunk_size": 100}, CPU)["chunk_size"] == 100
    with pytest.raises(ValueError, match="unknown mode"):
        resolve_options({"mode": "fast"}, CPU)


def test_startup_log_lists_every_cap() -> None:
    e = engine_for(preset="sglang")
    text = e.caps_report
    for cap in ("chunk_size", "token_budget", "prefill_delay", "max_num_seqs", "max_model_len",
                "kv_pool", "max_prefill_tokens"):
        assert cap in text
    assert "latency chunk_size" in " ".join(text.split()) and "2048" in text
    assert "safety max_num_seqs" in " ".join(text.split())


def test_prefill_delay_holds_new_prefill() -> None:
    e = engine_for(prefill_delay=4, token_budget=4096)
    e.add_request(prompt(32, 0), params(40))
    e.step()
    for i in range(10):
        e.add_request(prompt(32, i + 1), params(5))
    admits = []
    for _ in range(20):
        n_running = len(e.scheduler.running)
        e.step()
        admits.append(len(e.scheduler.running) > n_running)
    gaps = [i for i, a in enumerate(admits) if a]
    assert all(b - a >= 4 for a, b in itertools.pairwise(gaps))


@pytest.mark.parametrize("defer", [True, False])
def test_requests_arriving_together_share_their_prefix_prefill(defer: bool) -> None:
    """Greedy admission would prefill a shared system prompt once per request of a burst;
    holding the followers one iteration lets them hit the cache instead."""
    e = engine_for(mode="throughput", defer_shared_prefill=defer)
    system = prompt(1024, 0)
    for i in range(8):
        e.add_request([*system, *prompt(64, i + 1)], params(2))
    run(e)
    prefill = e.stats.computed_tokens - 8  # minus one decode step per request
    if defer:
        assert prefill <= 1024 + 8 * 64 + 8 * 16  # the system prompt once (plus page slack)
    else:
        assert prefill >= 8 * 1024


# ---- the step-time safety cap -------------------------------------------------------------


def test_step_time_cap_unit_measures_time_per_token() -> None:
    off = StepTimeCap(None)
    off.observe(10.0, 100_000)
    assert off.limit == math.inf and off.per_token is None  # off: nothing measured
    cap = StepTimeCap(1.0, initial=2048, floor=256)
    assert cap.limit == 2048  # before a measurement
    cap.observe(5.0, StepTimeCap.MIN_SAMPLE - 1)  # a small step measures fixed cost: ignored
    assert cap.limit == 2048
    cap.observe(0.5, 2000)  # 0.25 ms a token -> 4000 tokens a second
    assert cap.limit == pytest.approx(4000)
    cap.observe(0.5, 1000)  # EMA (alpha 0.5) of 0.25 and 0.5 ms
    assert cap.limit == pytest.approx(1.0 / 0.000375)
    cap.observe(30.0, 3000)  # a step that overran by far resets the estimate at once
    assert cap.limit == 256  # 10 ms a token would give 100: the floor holds


@pytest.mark.parametrize("mode", ["throughput", "default"])
def test_step_time_cap_splits_one_huge_prefill_into_bounded_steps(mode: str) -> None:
    """40K prompt tokens at 0.1 ms a token: one 4 s step without the cap; with a 0.5 s cap
    every step after the first measurement takes about 0.5 s, and the tokens are the same."""
    options = {"mode": mode} if mode != "default" else {}
    prompts = [prompt(2000, 100 + i) for i in range(20)]
    results = {}
    for seconds in (None, 0.5):
        e = engine_for(num_pages=4096, max_step_seconds=seconds, **options)
        ids = [e.add_request(p, params(2)).request_id for p in prompts]
        outs = run(e)
        runner = e.runner
        assert isinstance(runner, HistoryRunner)
        times = [2e-3 + 1e-4 * b.num_tokens for b in runner.batches]
        results[seconds] = ([outs[i].token_ids for i in ids], times)
    uncapped, capped = results[None], results[0.5]
    assert capped[0] == uncapped[0]  # chunking never changes a token
    assert max(uncapped[1]) > 3.9  # all of it in one forward
    assert max(capped[1][1:]) < 0.5 * 1.05  # bounded once measured
    assert capped[1][0] <= 2e-3 + 1e-4 * 2048  # the first step: the initial cap


def test_step_time_cap_keeps_greedy_tokens_on_the_real_model(tiny_llama: Path) -> None:
    ids = [3 + t for t in prompt(3000, 7)]
    outs = {}
    for seconds in (None, 0.02):
        llm = LLM(str(tiny_llama), dtype="float32", mode="throughput", max_step_seconds=seconds)
        out = llm.generate([ids], params(4), use_tqdm=False)[0]
        outs[seconds] = (out.token_ids, llm.engine.stats.steps)
    assert outs[0.02][0] == outs[None][0]
    assert outs[None][1] == 1 + 3  # one prefill step, three decodes
    assert outs[0.02][1] > outs[None][1]  # the prefill split by the cap
