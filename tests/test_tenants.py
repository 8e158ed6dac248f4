"""Tenants: the prefix cache never tells one namespace (cache salt, API key) what another
sent. The KV manager and the scheduler are tested here; the server's per-key salts over real
HTTP are in tests/test_server.py."""

from __future__ import annotations

from hlserve.config import EngineConfig
from hlserve.engine.factory import build_engine
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.llm_engine import Engine, VirtualClock
from hlserve.engine.policies.lpm import LongestPrefixMatch
from hlserve.engine.presets import DeviceInfo, resolve_options
from hlserve.request import Request, SamplingParams
from kv_support import release_cached, reset_prefix_cache
from support import HistoryRunner

PS = 4


def _cache(kv: KVCacheManager, tokens: list[int], rid: str, salt: str | None) -> None:
    kv.admit(rid, tokens, len(tokens) - 1, salt=salt)
    assert kv.allocate(rid, len(tokens))
    release_cached(kv, rid, tokens, num_computed=len(tokens))


def test_salted_pages_match_only_their_own_namespace() -> None:
    kv = KVCacheManager(num_pages=32, page_size=PS)
    secret = list(range(16))
    _cache(kv, secret, "alice", "salt-a")
    assert len(kv.match_prefix(secret, 15, "salt-a")) == 3
    assert kv.match_prefix(secret, 15, "salt-b") == []
    assert kv.match_prefix(secret, 15) == []  # nor the shared namespace
    # and the shared namespace's pages are not visible to a salted request either
    _cache(kv, secret, "anon", None)
    assert len(kv.match_prefix(secret, 15)) == 3
    assert kv.match_prefix(secret, 15, "salt-b") == []
    # admit reports the namespace's own hits only
    assert kv.admit("bob", secret, 15, salt="salt-b") == 0
    assert kv.allocate("bob", 16)
    release_cached(kv, "bob", secret, num_computed=16)
    kv.check_invariants()
    assert kv.num_evictable == 12  # three namespaces, four pages each: nothing shared
    assert reset_prefix_cache(kv) == 12
    kv.check_invariants()


def test_lpm_ranks_by_the_requests_own_namespace() -> None:
    kv = KVCacheManager(256, PS)
    base = list(range(32))
    _cache(kv, base, "warm", "tenant-a")
    mine = Request([*base, 900], SamplingParams(max_tokens=1), cache_salt="tenant-a")
    theirs = Request([*base, 901], SamplingParams(max_tokens=1), cache_salt="tenant-b")
    lpm = LongestPrefixMatch(kv, aging=0.0, fcfs_fallback=None)
    assert lpm.cached_tokens(mine, 1) == 32
    assert lpm.cached_tokens(theirs, 1) == 0


def _engine(**options) -> Engine:
    opts = resolve_options(options, DeviceInfo("cpu"))
    cfg = EngineConfig(model="-", check_invariants=True, **opts)
    return build_engine(cfg, HistoryRunner(256, PS, 1e-3, 1e-4, check=False), clock=VirtualClock())


def _finish(engine: Engine) -> dict[str, int]:
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    return cached


def test_engine_reports_hits_per_namespace() -> None:
    for options in ({"mode": "throughput"}, {"preset": "vllm"}, {"preset": "sglang"}):
        eng = _engine(**options)
        prompt = [i % 8 for i in range(64)]
        seen = {}
        for rid, salt in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("n1", None), ("n2", None)):
            eng.add_request(prompt, SamplingParams(max_tokens=2), request_id=rid,
                            cache_salt=salt)
            seen.update(_finish(eng))
        assert seen == {"a1": 0, "b1": 0, "a2": 60, "n1": 0, "n2": 60}, options
