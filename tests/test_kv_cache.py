"""KV page accounting: unit cases and a hypothesis state machine over the manager alone."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hlserve.engine.kv_cache import KVCacheManager
from kv_support import num_seq_pages, release_cached

PS = 4


def test_prefix_hit_after_release_and_lru_eviction_order() -> None:
    kv = KVCacheManager(num_pages=8, page_size=PS)
    a = list(range(12))  # three full pages
    kv.admit("a", a, len(a) - 1)
    assert kv.allocate("a", 12)
    release_cached(kv, "a", a, num_computed=12)
    assert kv.num_evictable == 3 and kv.num_free == 5
    # same first two pages, different third: hits 8 tokens
    b = [*range(8), 99, 98, 97, 96, 95]
    assert kv.admit("b", b, len(b) - 1) == 8
    assert kv.num_evictable == 1  # only a's third page is unreferenced now
    assert kv.allocate("b", 13)
    kv.check_invariants()
    # eviction takes the unreferenced leaf, never a page b holds
    assert kv.evict(10) == 1
    release_cached(kv, "b", b, num_computed=12)
    kv.check_invariants()
    assert kv.num_used == 0


def test_full_hit_keeps_last_token_to_compute() -> None:
    kv = KVCacheManager(num_pages=8, page_size=PS)
    a = list(range(8))
    kv.admit("a", a, 7)
    kv.allocate("a", 8)
    release_cached(kv, "a", a, 8)
    # the whole prompt is cached, but its last token must run to give logits
    assert kv.admit("b", a, len(a) - 1) == 4


def test_concurrent_duplicate_pages_are_shared_on_commit() -> None:
    kv = KVCacheManager(num_pages=8, page_size=PS)
    toks = list(range(8))
    for rid in ("a", "b"):
        kv.admit(rid, toks, 7)
        kv.allocate(rid, 8)
    kv.commit("a", toks, 8)
    kv.commit("b", toks, 8)  # b computed the same pages: it adopts a's, frees its own
    assert kv.page_table("a") == kv.page_table("b")
    assert kv.num_free == 6
    kv.check_invariants()
    release_cached(kv, "a", toks, 8)
    release_cached(kv, "b", toks, 8)
    kv.check_invariants()
    assert kv.num_used == 0 and kv.num_evictable == 2


def test_commit_from_an_offset_equals_a_full_commit() -> None:
    """The scheduler passes only the tokens after the committed pages (``offset``): the tree
    must come out as if it had passed the whole context."""
    toks = list(range(6 * PS))
    full, tail = KVCacheManager(num_pages=8, page_size=PS), KVCacheManager(num_pages=8, page_size=PS)
    for kv in (full, tail):
        kv.admit("a", toks, len(toks) - 1)
        kv.allocate("a", len(toks))
    full.commit("a", toks, 2 * PS)
    tail.commit("a", toks[: 2 * PS], 2 * PS)
    assert tail.committed_tokens("a") == 2 * PS
    full.commit("a", toks, 5 * PS + 1)
    tail.commit("a", toks[2 * PS : 5 * PS + 1], 5 * PS + 1, offset=2 * PS)
    assert full.page_table("a") == tail.page_table("a") and tail.committed_tokens("a") == 5 * PS
    # a later request sees the same cached prefix in both
    assert full.match_prefix(toks) and [n.key for n in full.match_prefix(toks)] == \
        [n.key for n in tail.match_prefix(toks)]
    # tokens that start after the committed pages cannot be placed: refused, nothing changed
    with pytest.raises(ValueError):
        tail.commit("a", toks[5 * PS + PS :], 6 * PS, offset=6 * PS)
    release_cached(tail, "a", toks[5 * PS :], 6 * PS, offset=5 * PS)
    release_cached(full, "a", toks, 6 * PS)
    for kv in (full, tail):
        kv.check_invariants()
        assert kv.num_evictable == 6 and kv.num_used == 0


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_pages=2, page_size=PS)
    kv.admit("a", [1], 0)
    assert not kv.allocate("a", 3 * PS)
    assert num_seq_pages(kv, "a") == 0 and kv.num_free == 2


def test_no_prefix_caching_frees_everything() -> None:
    kv = KVCacheManager(num_pages=4, page_size=PS, enable_prefix_caching=False)
    t = list(range(8))
    kv.admit("a", t, 7)
    kv.allocate("a", 8)
    release_cached(kv, "a", t, 8)
    assert kv.num_free == 4 and kv.admit("b", t, 7) == 0


class KVMachine(RuleBasedStateMachine):
    """Random admits / growth / commits / releases / evictions over a small vocabulary (so
    prefixes collide): after every rule, every page is accounted for exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_pages=24, page_size=PS)
        self.live: dict[str, tuple[list[int], int]] = {}  # rid -> (tokens, computed)
        self.n = 0
        self.content: dict[int, tuple[int, ...]] = {}  # what "KV" each computed page holds

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40))
    def admit(self, tokens: list[int]) -> None:
        rid = f"r{self.n}"
        self.n += 1
        cached = self.kv.admit(rid, tokens, len(tokens) - 1)
        assert cached % PS == 0 and cached < len(tokens)
        # a hit must hand out pages that hold exactly this prefix
        for i, page in enumerate(self.kv.page_table(rid)[: cached // PS]):
            assert self.content[page] == tuple(tokens[i * PS : (i + 1) * PS])
        if self.kv.allocate(rid, len(tokens)):
            self.live[rid] = (tokens, cached)
        else:
            self.kv.release(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, _ = self.live[rid]
        self.kv.commit(rid, tokens, len(tokens))
        for i, page in enumerate(self.kv.page_table(rid)[: len(tokens) // PS]):
            chunk = tuple(tokens[i * PS : (i + 1) * PS])
            self.content[page] = chunk
        self.live[rid] = (tokens, len(tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, computed = self.live[rid]
        if self.kv.allocate(rid, len(tokens) + len(extra)):
            self.live[rid] = (tokens + extra, computed)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.booleans())
    def release(self, data: st.DataObject, keep: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, computed = self.live.pop(rid)
        if keep:
            release_cached(self.kv, rid, tokens, computed)
        else:
            self.kv.release(rid)

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        before = self.kv.num_evictable
        got = self.kv.evict(n)
        assert got == min(n, before)

    @invariant()
    def balanced(self) -> None:
        self.kv.check_invariants()
        kv = self.kv
        assert kv.num_used + kv.num_free + kv.num_evictable == kv.num_pages
        held = sum(num_seq_pages(kv, r) for r in self.live)
        assert kv.num_used <= held  # shared pages count once

    def teardown(self) -> None:
        for rid, (tokens, computed) in list(self.live.items()):
            release_cached(self.kv, rid, tokens, computed)
        self.kv.check_invariants()
        assert self.kv.num_used == 0, "a page is still referenced after every request ended"


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_content_matches(page_size: int) -> None:
    kv = KVCacheManager(num_pages=64, page_size=page_size)
    a = list(range(50))
    kv.admit("a", a, 49)
    kv.allocate("a", 50)
    release_cached(kv, "a", a, 50)
    b = [*a[:37], 7, 7, 7]
    cached = kv.admit("b", b, len(b) - 1)
    assert cached == (37 // page_size) * page_size
