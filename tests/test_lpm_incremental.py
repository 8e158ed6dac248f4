"""The incremental LPM ranking gives, pass by pass, the order of the full pass it replaced
(``FullPassLPM``: every waiting request scored afresh), over seeded random sequences of
what a scheduler does to the queue and the tree: arrivals, admissions, prefill commits,
finishes, retractions, evictions, forgotten and reordered requests, several passes per
step or steps skipped, with and without aging and the FCFS fallback."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.policies import lpm
from hlserve.engine.policies.lpm import LongestPrefixMatch, _keys_exact
from hlserve.engine.policies.order import AgedPrefixOrder
from hlserve.request import Request, SamplingParams
from kv_support import FullPassLPM, plain_radix_walk_order, release_cached

PS = 4
VOCAB = 3  # few distinct tokens: requests share pages by chance, not only by family


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@dataclass
class World:
    """A queue, a running set and a tree that both orders see, changed at random."""

    rng: random.Random
    aging: float
    fcfs_fallback: int | None
    kv: KVCacheManager = field(init=False)
    new: LongestPrefixMatch = field(init=False)
    ref: FullPassLPM = field(init=False)
    families: list[list[int]] = field(init=False)
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    step: int = 0
    passes: int = 0
    incremental_passes: int = 0

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(num_pages=96, page_size=PS)
        self.new = LongestPrefixMatch(self.kv, self.aging, self.fcfs_fallback)
        self.ref = FullPassLPM(self.kv, self.aging, self.fcfs_fallback)
        self.families = [_tokens(self.rng, 24) for _ in range(4)]

    # ---- the queue ----------------------------------------------------------------------
    def arrive(self) -> None:
        rng = self.rng
        family = rng.choice(self.families)
        tokens = family[: rng.randrange(len(family) + 1)] + _tokens(rng, rng.randint(1, 14))
        # few distinct arrival times: ties on score and arrival go by queue position
        arrival = float(rng.choice([self.step, rng.randrange(self.step + 1)]))
        salt = "tenant" if rng.random() < 0.15 else None
        self.waiting.append(Request(prompt_token_ids=tokens, params=SamplingParams(max_tokens=8),
                                    arrival_time=arrival, cache_salt=salt))

    def _forget(self, req: Request) -> None:
        self.new.forget(req)
        self.ref.forget(req)

    def admit(self) -> None:
        """The queue's head (or anyone) leaves the queue and prefills part of its prompt:
        pages enter the tree where waiting requests' walks stopped."""
        if not self.waiting:
            return
        req = self.waiting[0] if self.rng.random() < 0.3 else self.rng.choice(self.waiting)
        self.waiting.remove(req)
        self._forget(req)
        tokens = req.all_token_ids
        cached = self.kv.admit(req.request_id, tokens, len(tokens) - 1, salt=req.cache_salt)
        if not self.kv.allocate(req.request_id, len(tokens)):
            self.kv.release(req.request_id)
            self.waiting.append(req)  # no room: back at the tail, as a retraction would be
            return
        req.num_computed = self.rng.randint(cached, len(tokens))
        self.kv.commit(req.request_id, tokens, req.num_computed)
        self.running.append(req)

    def progress(self) -> None:
        """A running request computes the rest of its tokens."""
        if self.running:
            req = self.rng.choice(self.running)
            req.num_computed = req.num_tokens
            self.kv.commit(req.request_id, req.all_token_ids, req.num_computed)

    def finish(self) -> None:
        if self.running:
            req = self.running.pop(self.rng.randrange(len(self.running)))
            release_cached(self.kv, req.request_id, req.all_token_ids, req.num_computed)

    def retract(self) -> None:
        """A running request decoded a few tokens, gives its pages up and waits again with
        more tokens than it had (its computed pages stay cached)."""
        if not self.running:
            return
        req = self.running.pop(self.rng.randrange(len(self.running)))
        req.output_token_ids.extend(_tokens(self.rng, self.rng.randint(1, 6)))
        if self.kv.allocate(req.request_id, req.num_tokens):
            req.num_computed = req.num_tokens - 1
        release_cached(self.kv, req.request_id, req.all_token_ids, req.num_computed)
        req.num_computed = 0
        self.waiting.append(req)

    def grow_in_place(self) -> None:
        """A waiting request's tokens change while it waits (not the scheduler's way, but
        the full pass matches it anew, so the incremental one must too)."""
        if self.waiting:
            self.rng.choice(self.waiting).output_token_ids.extend(_tokens(self.rng, PS))

    def forget_waiting(self) -> None:
        """Forgotten but still queued: its wait counts from the next pass again."""
        if self.waiting:
            self._forget(self.rng.choice(self.waiting))

    def shuffle(self) -> None:
        self.rng.shuffle(self.waiting)

    # ---- the tree -----------------------------------------------------------------------
    def evict(self) -> None:
        self.kv.evict(self.rng.randint(1, 12))

    def cache_family(self) -> None:
        """Someone else's request caches a family's prefix (insertions near the root)."""
        tokens = [*self.rng.choice(self.families)[: self.rng.randrange(PS, 25)], 7]
        rid = f"other{self.rng.random()}"
        self.kv.admit(rid, tokens, len(tokens) - 1)
        if self.kv.allocate(rid, len(tokens)):
            release_cached(self.kv, rid, tokens, len(tokens))
        else:
            self.kv.release(rid)

    # ---- a pass -------------------------------------------------------------------------
    def order_pass(self) -> None:
        rng = self.rng
        self.step += rng.choice([0, 1, 1, 1, 1, 5])
        queue = self.waiting
        if rng.random() < 0.1:  # the interactive requests set aside: a subsequence
            queue = [r for r in queue if r.seq % 3]
        elif rng.random() < 0.03 and queue:  # a request queued twice
            queue = [*queue, queue[0]]
        got = [r.request_id for r in self.new.order(queue, self.step)]
        want = [r.request_id for r in self.ref.order(queue, self.step)]
        assert got == want, f"pass {self.passes} (step {self.step}) orders differently"
        if self.aging == 0 and self.fcfs_fallback is None and len(queue) > 1:
            assert want == [r.request_id for r in plain_radix_walk_order(self.kv, queue)]
        self.passes += 1
        self.incremental_passes += bool(self.new._ranking.entries)


OPS: list[tuple[Callable[[World], None], int]] = [
    (World.arrive, 12), (World.admit, 6), (World.progress, 4), (World.finish, 4),
    (World.retract, 3), (World.grow_in_place, 1), (World.forget_waiting, 1),
    (World.shuffle, 1), (World.evict, 4), (World.cache_family, 2), (World.order_pass, 14),
]


def _run(seed: int, aging: float, fcfs_fallback: int | None, num_ops: int = 400) -> World:
    rng = random.Random(seed)
    world = World(rng, aging, fcfs_fallback)
    ops, weights = zip(*OPS, strict=True)
    for _ in range(num_ops):
        rng.choices(ops, weights)[0](world)
        if rng.random() < 0.05:
            world.kv.check_invariants()
    world.order_pass()
    return world


@pytest.mark.parametrize("aging", [0.0, 4.0, 0.5, 3, 0.1])
@pytest.mark.parametrize("seed", range(12))
def test_incremental_order_equals_the_full_pass(seed: int, aging: float) -> None:
    world = _run(seed, aging, fcfs_fallback=12 if seed % 4 == 3 else None)
    assert world.passes > 40
    if aging != 0.1:  # 0.1 keeps the full pass (its rounding moves with the step)
        assert world.incremental_passes > 0


@pytest.mark.parametrize("seed", range(4))
def test_many_changes_at_once_take_the_sort_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past a few key changes a pass filters and merges the whole ranking instead of moving
    keys one by one; at these queue sizes only a lowered threshold gets there (here every
    change, a forget's included, takes that path)."""
    monkeypatch.setattr(lpm, "_BISECT_MAX", -(10**9))
    _run(seed, 4.0, fcfs_fallback=None)


def test_a_pass_where_nothing_changed_walks_nothing() -> None:
    kv = KVCacheManager(4096, PS)
    rng = random.Random(1)
    base = _tokens(rng, 64)
    rid = "warm"
    kv.admit(rid, base, len(base) - 1)
    kv.allocate(rid, len(base))
    release_cached(kv, rid, base, len(base))
    waiting = [Request(prompt_token_ids=base[: rng.randrange(70)] + _tokens(rng, 9),
                       params=SamplingParams(max_tokens=4), arrival_time=float(i))
               for i in range(300)]
    lpm = LongestPrefixMatch(kv, aging=4.0, fcfs_fallback=None)
    ref = FullPassLPM(kv, aging=4.0, fcfs_fallback=None)
    assert list(lpm.order(waiting, 1)) == list(ref.order(waiting, 1))
    lpm.lookups = 0
    assert list(lpm.order(waiting, 2)) == list(ref.order(waiting, 2))
    assert lpm.lookups == 0, "an unchanged tree and queue: no request is walked again"
    # one page added where one request's walk stopped: that request alone is walked again
    top = next(lpm.order(waiting, 3))
    rid = "one-more"
    tokens = top.all_token_ids
    kv.admit(rid, tokens, len(tokens) - 1)
    kv.allocate(rid, len(tokens))
    release_cached(kv, rid, tokens, len(tokens))
    lpm.lookups = 0
    assert list(lpm.order(waiting, 4)) == list(ref.order(waiting, 4))
    assert 0 < lpm.lookups <= len(tokens) // PS


def test_keys_are_exact_only_for_short_binary_agings() -> None:
    assert _keys_exact(0.0, 10**12, 10**9)
    assert _keys_exact(4.0, 10**9, 10**9) and _keys_exact(0.5, 10**9, 10**9)
    assert not _keys_exact(0.1, 2, 10**6), "0.1 x step rounds differently at each step"
    assert not _keys_exact(float("inf"), 1, 1)


class _TableOrder(AgedPrefixOrder):
    """An ``AgedPrefixOrder`` whose cached counts change with no notice (as vLLM's block
    pool's do, hlserve.integrations.vllm): it keeps the full pass."""

    def __init__(self, table: dict[str, int]) -> None:
        super().__init__(aging=2.0, fcfs_fallback=None)
        self.table = table

    def cached_tokens(self, req: Request, step: int) -> int:
        return self.table[req.request_id]


def test_other_aged_prefix_orders_keep_the_full_pass() -> None:
    reqs = [Request(prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=1),
                    arrival_time=float(i)) for i in range(3)]
    table = {r.request_id: 0 for r in reqs}
    order = _TableOrder(table)
    assert list(order.order(reqs, 0)) == reqs
    table[reqs[2].request_id] = 16  # changed behind the policy's back
    assert next(order.order(reqs, 1)) is reqs[2]
    order.forget(reqs[2])
    assert list(order.order(reqs[:2], 4)) == reqs[:2]
