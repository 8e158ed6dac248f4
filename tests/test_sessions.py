"""Agent sessions: a finished round's KV retained with a TTL (engine/sessions.py and the
retained list of engine/kv_cache.py): evicted after plain cached pages, plain again at the
deadline, taken anyway when an admission needs them, accounting balanced throughout, tenants
kept apart."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hlserve.config import EngineConfig
from hlserve.engine.args import parse_engine_args
from hlserve.engine.factory import build_engine
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.llm_engine import Engine, VirtualClock
from hlserve.engine.sessions import Sessions, session_key
from hlserve.request import SamplingParams
from kv_support import release_cached
from support import HistoryRunner

PS = 4


def engine_for(num_pages: int = 64, **options) -> Engine:
    cfg = EngineConfig(model="-", check_invariants=True, page_size=PS, **options)
    runner = HistoryRunner(num_pages, PS, 2e-3, 1e-4, check=False)
    # prompts spell distinct pages with ids past the runner's tiny output vocabulary
    runner.model_config = dataclasses.replace(runner.model_config, vocab_size=5000)
    return build_engine(cfg, runner, clock=VirtualClock())


def run(engine: Engine, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# ---- the KV manager ------------------------------------------------------------------------
def _cached(kv: KVCacheManager, rid: str, tokens: list[int], until: float | None) -> None:
    kv.admit(rid, tokens, len(tokens) - 1)
    assert kv.allocate(rid, len(tokens))
    kv.commit(rid, tokens, len(tokens))
    kv.release(rid, until)


def test_plain_cached_pages_are_evicted_before_retained_ones() -> None:
    kv = KVCacheManager(8, PS)
    _cached(kv, "s", list(range(100, 108)), until=10.0)  # 2 pages retained
    _cached(kv, "p", list(range(200, 208)), until=None)  # 2 plain pages, more recent
    kv.check_invariants()
    assert kv.num_retained == 2 and kv.num_evictable == 4
    assert kv.evict(2) == 2
    kv.check_invariants()
    assert len(kv.match_prefix(list(range(100, 108)))) == 2  # the session's survived
    assert kv.match_prefix(list(range(200, 208))) == []
    assert kv.evict(1) == 1 and kv.retained_evicted == 1  # then retained ones, leaf first
    assert len(kv.match_prefix(list(range(100, 108)))) == 1
    kv.check_invariants()


def test_retained_pages_become_plain_at_their_deadline() -> None:
    kv = KVCacheManager(8, PS)
    _cached(kv, "s", list(range(100, 108)), until=5.0)
    assert kv.expire(4.9) == 0 and kv.num_retained == 2
    assert kv.expire(5.0) == 2 and kv.num_retained == 0 and kv.retained_expired == 2
    _cached(kv, "p", list(range(200, 208)), until=None)  # newer plain pages
    kv.evict(2)  # LRU again: the expired (older) ones go first
    assert kv.match_prefix(list(range(100, 108))) == []
    kv.check_invariants()


def test_a_hit_on_retained_pages_is_counted_and_locks_them() -> None:
    kv = KVCacheManager(8, PS)
    toks = list(range(100, 108))
    _cached(kv, "s", toks, until=5.0)
    assert kv.admit("s2", [*toks, 1], len(toks)) == 8
    assert kv.retained_hits == 2 and kv.num_retained == 0
    kv.check_invariants()
    release_cached(kv, "s2", [*toks, 1], 8)
    kv.check_invariants()


def test_a_plain_parent_of_retained_children_waits_behind_them() -> None:
    kv = KVCacheManager(8, PS)
    prefix = list(range(100, 104))
    _cached(kv, "s", [*prefix, 5, 6, 7, 8], until=9.0)  # prefix page + child, both retained
    kv.admit("o", [*prefix, 1, 1, 1, 1], 7)  # locks the shared prefix page
    assert kv.allocate("o", 8)
    release_cached(kv, "o", [*prefix, 1, 1, 1, 1], 8)  # prefix page now plain, child retained
    kv.check_invariants()
    assert kv.evict(8) == 3  # everything goes, always a leaf at a time, nothing lost
    kv.check_invariants()
    assert kv.num_free == 8


def test_retention_never_blocks_an_allocation_that_fits_without_it() -> None:
    kv = KVCacheManager(4, PS)
    _cached(kv, "s", list(range(100, 116)), until=1e9)  # the whole pool retained
    assert kv.num_free == 0 and kv.num_retained == 4
    kv.admit("n", list(range(300, 316)), 15)
    assert kv.allocate("n", 16)  # takes retained pages rather than wait
    kv.check_invariants()


# ---- the engine ----------------------------------------------------------------------------
def test_session_key_precedence_and_tenant_scope() -> None:
    assert session_key("a", "b", "c") == session_key("a") != session_key("b")
    assert session_key(None, "b", "c") == session_key("b")
    assert session_key("", None, "c") == session_key("c")
    assert session_key() is None
    assert session_key("a", salt="t1") != session_key("a", salt="t2")
    assert session_key("a", salt="t1") != session_key("a")
    assert len(session_key("x" * 100_000)) == 32  # a digest, whatever the name's length
    assert session_key("\ud800") != session_key("\ud801")  # JSON's lone surrogates hash too


def test_flags_reach_the_config() -> None:
    opts = parse_engine_args(["--session-ttl", "2.5", "--session-ttl-policy", "learned"])
    assert opts == {"session_ttl": 2.5, "session_ttl_policy": "learned"}
    assert parse_engine_args(["--session-ttl", "none"]) == {"session_ttl": None}


def _round_two_hit(ttl: float | None, salt2: str | None = None) -> int:
    """A session's round, then pressure from sessionless traffic, then its next round: the
    prompt tokens the second round found cached."""
    eng = engine_for(num_pages=24, session_ttl=ttl)
    ctx = [7] * 3 + list(range(1000, 1061))  # 64 tokens, 16 pages
    eng.add_request(ctx, greedy(1), session_id="agent", cache_salt="t1")
    run(eng)
    for i in range(3):  # 3 x 8 pages of other prompts: the pool must evict
        eng.add_request(list(range(2000 + 100 * i, 2032 + 100 * i)), greedy(1))
        run(eng)
    r2 = eng.add_request([*ctx, 5, 5, 5, 5], greedy(1), session_id="agent",
                         cache_salt=salt2 or "t1")
    run(eng)
    return r2.num_cached_prompt


def test_retention_keeps_a_session_context_through_pressure() -> None:
    assert _round_two_hit(None) == 0  # plain LRU: the older session context went first
    assert _round_two_hit(30.0) == 64  # retained: found whole


def test_retention_expires_with_the_ttl() -> None:
    eng = engine_for(session_ttl=1.0)
    eng.add_request(list(range(100, 140)), greedy(2), session_id="s")
    run(eng)
    assert eng.kv.num_retained == 10
    eng.clock.advance(1.5)
    eng.step()
    assert eng.kv.num_retained == 0 and eng.kv.retained_expired == 10


def _hold_case(hold: bool) -> tuple[int, bool]:
    """Session A's context retained (16 of 24 pages), a sessionless request decoding, then
    a new session C whose prompt fits only by evicting A's pages, then A's next round: the
    tokens A found cached, and whether C was admitted while the other request still ran."""
    eng = engine_for(num_pages=24, session_ttl=30.0, session_hold=hold)
    ctx = [7] * 3 + list(range(1000, 1061))  # 64 tokens, 16 pages
    eng.add_request(ctx, greedy(1), session_id="A")
    run(eng)
    assert eng.kv.num_pinned == 16
    other = eng.add_request(list(range(3000, 3008)), greedy(16))  # grows to 6 pages
    eng.step()
    c = eng.add_request(list(range(2000, 2032)), greedy(1), session_id="C")  # 8 pages
    eng.step()
    c_ran_early = c.num_computed > 0 and not other.finished
    a2 = eng.add_request([*ctx, 5, 5, 5, 5], greedy(1), session_id="A")
    run(eng)  # no deadlock: C is admitted once nothing else runs
    assert c.finished and a2.finished and eng.kv.num_used == 0
    eng.kv.check_invariants()
    return a2.num_cached_prompt, c_ran_early


def test_hold_keeps_retained_pages_from_new_sessions_until_the_engine_frees() -> None:
    """Retention alone yields to the new session (A's context is evicted and recomputed);
    with ``session_hold`` the new session waits while another request runs, A's next round
    finds its whole context, and the new session still runs to its end."""
    cached, early = _hold_case(hold=False)
    assert cached < 64 and early
    cached, early = _hold_case(hold=True)
    assert cached == 64 and not early
    assert parse_engine_args(["--session-hold", "on"]) == {"session_hold": True}


def test_retention_isolates_tenants() -> None:
    assert _round_two_hit(30.0, salt2="t2") == 0  # same session name, another tenant


@pytest.mark.parametrize("hold", [False, True])
def test_accounting_balances_under_random_sessions_with_aborts(hold: bool) -> None:
    rng = random.Random(0)
    eng = engine_for(num_pages=40, session_ttl=0.05, session_ttl_policy="learned",
                     session_hold=hold)
    contexts = {f"s{i}": [i] * 5 for i in range(6)}
    live: list[str] = []
    for _step in range(600):
        if rng.random() < 0.3:
            sid = rng.choice(list(contexts))
            ctx = contexts[sid] = (contexts[sid] + [rng.randrange(50)
                                   for _ in range(rng.randrange(1, 12))])[-100:]
            live.append(eng.add_request(ctx, greedy(rng.randrange(1, 6)), session_id=sid,
                                        cache_salt=rng.choice([None, "k"])).request_id)
        if live and rng.random() < 0.05:
            eng.abort(live.pop(rng.randrange(len(live))))
        eng.step()  # check_invariants=True: the accounting is checked after every step
        eng.kv.check_invariants()
        eng.clock.advance(rng.random() * 0.02)
    run(eng)
    eng.kv.check_invariants()
    assert eng.kv.retained_hits > 0


def test_learned_ttl_follows_the_session_gaps() -> None:
    s = Sessions(10.0, "learned")
    assert s.retain_until("a", 1.0, 100, 7, 100) == 11.0  # no gaps yet: the fixed TTL
    for t in (2.0, 4.0, 6.0):
        s.on_admit("a", t, 100)
        s.retain_until("a", t + 1.0, 100, 7, 100)
    until = s.retain_until("a", 8.0, 100, 7, 100)
    assert until is not None and abs(until - 8.0 - 1.25) < 1e-9  # 1.25 x its 1 s gaps
    s.per_token = 1e-6  # reloading is nearly free: holding the pages is not worth it
    assert s.retain_until("a", 9.0, 100, 70, 100) is None
    assert Sessions(None).retain_until("a", 0.0, 100, 7, 100) is None


def test_metrics_publish_the_session_counters() -> None:
    from hlserve.server.runtime.metrics import ServerMetrics

    eng = engine_for(session_ttl=1.0)
    eng.add_request(list(range(100, 140)), greedy(2), prompt_cache_key="s")
    run(eng)
    m = ServerMetrics("m")
    m.publish_sessions(eng.stats)
    text = m.exposition().decode()
    assert 'session_retained_pages{model_name="m"} 10.0' in text
    eng.clock.advance(2.0)
    eng.step()
    m.publish_sessions(eng.stats)
    text = m.exposition().decode()
    assert 'session_ttl_expiries{model_name="m"} 10.0' in text


def test_tool_time_sampling(tmp_path) -> None:
    import statistics

    import pytest

    from hlserve.driver.tool_time import parse_tool_time

    rng = random.Random(0)
    assert parse_tool_time("0").is_zero and parse_tool_time(0).sample(rng) == 0.0
    assert parse_tool_time("fixed:2.5").sample(rng) == 2.5
    exp = [parse_tool_time("exp:5").sample(rng) for _ in range(4000)]
    assert 4.5 < statistics.mean(exp) < 5.5
    logn = [parse_tool_time("lognormal:3:0.5").sample(rng) for _ in range(4000)]
    assert 2.7 < statistics.median(logn) < 3.3
    f = tmp_path / "gaps.txt"
    f.write_text("0.5\n30\n")
    assert {parse_tool_time(f"empirical:{f}").sample(rng) for _ in range(50)} == {0.5, 30.0}
    for bad in ("exp:0", "fixed:-1", "weird:3", "lognormal:x"):
        with pytest.raises(ValueError):
            parse_tool_time(bad)
    a = [parse_tool_time("exp:1").sample(random.Random(7)) for _ in range(2)]
    assert a[0] == a[1]  # the workload seed fixes the samples
