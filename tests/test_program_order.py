"""Program-level ordering (``--order program``, policies/order.py:ProgramOrder): the next round
of a started agent session goes ahead of sessions that have not started, each class in LPM's
order, and the aging limit keeps a request of either class from waiting forever."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlserve import LLM
from hlserve.config import EngineConfig
from hlserve.engine.args import parse_engine_args
from hlserve.engine.factory import build_engine
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.llm_engine import Engine, VirtualClock
from hlserve.engine.policies.lpm import LongestPrefixMatch
from hlserve.engine.policies.order import ProgramOrder
from hlserve.engine.scheduler import Scheduler
from hlserve.engine.sessions import session_key
from hlserve.request import Request, SamplingParams
from support import HistoryRunner

PS = 4


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _req(tokens: list[int], t: float, session: str | None = None) -> Request:
    return Request(prompt_token_ids=tokens, params=params(4), arrival_time=t, session=session)


def _cache(kv: KVCacheManager, tokens: list[int], rid: str) -> None:
    kv.admit(rid, tokens, len(tokens) - 1)
    assert kv.allocate(rid, len(tokens))
    kv.commit(rid, tokens, len(tokens))
    kv.release(rid)


def _program(kv: KVCacheManager, aging_steps: int = 1000) -> ProgramOrder:
    return ProgramOrder(LongestPrefixMatch(kv, aging=0.0, fcfs_fallback=None), aging_steps)


# ---- the policy ----------------------------------------------------------------------------
def test_next_rounds_go_ahead_of_new_sessions_each_class_by_cached_prefix() -> None:
    kv = KVCacheManager(256, PS)
    hot = list(range(64))
    _cache(kv, hot, "warm")
    order = _program(kv)
    order.admitted(_req([1, 2, 3], 0.0, session="a"))  # sessions a and b have had a round
    order.admitted(_req([1, 2, 3], 0.0, session="b"))
    new_hot = _req([*hot, 900], 1.0, session="n1")  # the longest cached prefix of all
    new_cold = _req([500 + i for i in range(20)], 2.0, session="n2")
    plain = _req([*hot[:32], 7, 7], 3.0)  # no session: with the new ones
    next_cold = _req([600 + i for i in range(20)], 4.0, session="a")
    next_warm = _req([*hot[:16], 8, 8], 5.0, session="b")
    waiting = [new_hot, new_cold, plain, next_cold, next_warm]
    got = list(order.order(waiting, 1))
    assert got == [next_warm, next_cold, new_hot, plain, new_cold]
    # plain LPM over the same queue: by cached prefix only
    lpm = LongestPrefixMatch(kv, aging=0.0, fcfs_fallback=None)
    assert list(lpm.order(waiting, 1)) == [new_hot, plain, next_warm, new_cold, next_cold]


def test_a_session_is_started_by_its_first_admitted_round_only() -> None:
    kv = KVCacheManager(64, PS)
    order = _program(kv)
    first = _req([10, 11, 12], 1.0, session="s")
    other = _req([20, 21, 22], 0.0, session="t")
    assert list(order.order([other, first], 1)) == [other, first]  # neither started: by arrival
    order.forget(first)  # ended (say, aborted) without admission: not started
    second = _req([10, 11, 12, 13], 2.0, session="s")
    assert list(order.order([other, second], 2)) == [other, second]
    order.admitted(second)
    order.forget(second)
    third = _req([10, 11, 12, 13, 14], 3.0, session="s")
    assert list(order.order([other, third], 3)) == [third, other]


def test_aging_limit_puts_a_starved_new_session_first() -> None:
    """A stream of next rounds would keep a new session waiting forever; at the aging limit it
    goes first, and not an iteration before."""
    kv = KVCacheManager(256, PS)
    limit = 20

    def first_turn(order: ProgramOrder, horizon: int = 200) -> int | None:
        new = _req([1000 + i for i in range(12)], 0.0, session="new")
        for step in range(horizon):
            nxt = _req([2000 + step, 1, 2], float(step + 1), session=f"s{step % 3}")
            order.admitted(_req([0], 0.0, session=f"s{step % 3}"))
            if next(order.order([new, nxt], step)) is new:
                return step
            order.forget(nxt)
        return None

    assert first_turn(_program(kv, aging_steps=limit)) == limit
    assert first_turn(_program(kv, aging_steps=10**9)) is None, "without aging it starves"


def test_aged_requests_join_the_next_rounds_in_lpm_order() -> None:
    """Past the aging limit a new session's round joins the started sessions' class, and that
    class stays in LPM's order: an aged round ahead of a cached one (by arrival, or as a
    class of its own) would be FCFS-like in overload, where most of the queue is aged
    (docs/study.md, section 9)."""
    kv = KVCacheManager(64, PS)
    hot = list(range(32))
    _cache(kv, hot, "warm")
    order = _program(kv, aging_steps=5)
    order.admitted(_req([0], 0.0, session="a"))
    order.admitted(_req([0], 0.0, session="b"))
    old_cold = _req([40, 41], 1.0)  # no session, nothing cached, the earliest
    old_warm = _req([*hot[:8], 30, 31], 2.0, session="n")  # a new session, 8 tokens cached
    nxt_hot = _req([*hot, 50, 51], 3.0, session="a")  # a next round, 32 cached
    nxt_cold = _req([60, 61], 4.0, session="b")  # a next round, nothing cached
    waiting = [old_cold, old_warm, nxt_hot, nxt_cold]
    for _ in order.order(waiting, 0):
        pass
    assert list(order.order(waiting, 4)) == [nxt_hot, nxt_cold, old_warm, old_cold]
    # aged, the two no-session or new-session rounds join; ties by arrival
    assert list(order.order(waiting, 5)) == [nxt_hot, old_warm, old_cold, nxt_cold]


def test_order_program_is_a_flag_and_builds_program_order_over_lpm() -> None:
    opts = parse_engine_args(["--order", "program", "--program-aging-steps", "8"])
    assert opts == {"order": "program", "program_aging_steps": 8}
    cfg = EngineConfig(model="-", **opts)
    order = Scheduler(cfg, KVCacheManager(16, PS)).order  # order.make_order, the tree's LPM
    assert isinstance(order, ProgramOrder) and order.aging_steps == 8
    assert isinstance(order.inner, LongestPrefixMatch)
    with pytest.raises(ValueError, match="program_aging_steps"):
        EngineConfig(model="-", order="program", program_aging_steps=0)


# ---- in the engine -------------------------------------------------------------------------
def _admitted_first(engine: Engine, *requests: Request) -> Request:
    """Step until one of ``requests`` runs; the engine admits one request at a time."""
    for _ in range(100):
        engine.step()
        running = [r for r in requests if r in engine.running]
        if running:
            return running[0]
    raise AssertionError("none was admitted")


def _drain(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def _next_round_vs_new_session(engine: Engine, base: int) -> tuple[Request, Request]:
    """Session a's first round runs; a sessionless request caches a long prompt. Then a new
    session b (that long prompt and more: the longer cached prefix) and a's next round (its
    history and more) wait together, b first. Returns (a's next round, b)."""
    a1 = engine.add_request([base + i for i in range(8)], params(2), session_id="a")
    warm = [base + 100 + i for i in range(40)]
    engine.add_request(warm, params(1))
    _drain(engine)
    hist = [*a1.prompt_token_ids, *a1.output_token_ids]
    b = engine.add_request([*warm, 7, 8], params(2), session_id="b")
    a2 = engine.add_request([*hist, 9, 10], params(2), session_id="a")
    return a2, b


@pytest.mark.parametrize(("order", "first"), [("program", "next round"), ("lpm", "new session")])
def test_engine_admits_the_next_round_before_a_new_session_on_the_real_model(
        tiny_llama: Path, order: str, first: str) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", order=order, max_num_seqs=1, page_size=PS,
              check_invariants=True)
    a2, b = _next_round_vs_new_session(llm.engine, base=3)
    got = _admitted_first(llm.engine, a2, b)
    assert got is (a2 if first == "next round" else b)
    _drain(llm.engine)
    assert a2.output_token_ids and b.output_token_ids


def test_engine_aging_limit_admits_a_new_session_under_a_stream_of_next_rounds() -> None:
    """One running slot, and a next round of a started session always waiting (a page of it
    cached): a new session is admitted once it has waited the aging limit (not before), never
    without it. Past the limit it is ranked with the next rounds by LPM, so LPM's own aging
    (throughput mode's 4 tokens an iteration) is what then lifts it over their cached page:
    with none, a cold request can wait forever, as under plain LPM."""

    def wait_of_new(limit: int, horizon: int = 120, lpm_aging: float = 1.0) -> int | None:
        cfg = EngineConfig(model="-", check_invariants=True, page_size=PS, order="program",
                           max_num_seqs=1, program_aging_steps=limit, lpm_aging=lpm_aging)
        engine = build_engine(cfg, HistoryRunner(256, PS, 2e-3, 1e-4, check=False), clock=VirtualClock())
        engine.add_request([1, 2, 3, 4, 5], params(1), session_id="s")
        _drain(engine)
        new = engine.add_request([6, 7, 1, 2], params(1), session_id="new")
        k = 0
        for step in range(horizon):
            if sum(1 for r in engine.scheduler.waiting if r.session is not None
                   and r.session == session_key("s")) < 2:
                k += 1
                engine.add_request([1, 2, 3, 4, 5, k % 7, 3], params(3), session_id="s")
            engine.step()
            if new in engine.running or new.finished:
                return step
        return None

    waited = wait_of_new(10)
    assert waited is not None and 10 <= waited <= 14
    assert wait_of_new(10**6) is None
    assert wait_of_new(10, lpm_aging=0.0) is None
