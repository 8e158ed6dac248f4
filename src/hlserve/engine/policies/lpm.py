"""LPM with aging over hlserve's radix tree, matched and ranked incrementally.

``LongestPrefixMatch`` gives the very order of ``AgedPrefixOrder._rank`` (order.py) while a
pass touches only the requests whose match may have changed.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, filterfalse
from operator import attrgetter, itemgetter

from hlserve.engine.kv_cache import KVCacheManager, Node, TreeWatch
from hlserve.engine.policies.order import AgedPrefixOrder
from hlserve.request import Request


@dataclass(slots=True)
class _Match:
    num_tokens: int  # request length when the match began (grows after a retraction)
    node: Node  # deepest tree node matched so far
    depth: int  # pages matched
    version: int = -1  # node.version when its next page was last looked up and not found
    missing: tuple | None = None  # that page's key (None: the walk ended at ``node``)



# a rank key: (aging x since - cached, arrival time, queue sequence, request); ascending is
# first, and the sequence is unique, so a comparison never reaches the request
_Key = tuple[float, float, int, Request]
_OUTPUT = attrgetter("output_token_ids")
_KEY_REQUEST = itemgetter(3)
_FLOAT_BITS = 53  # significand of a binary64
# key changes in a pass are placed one by one (a binary search and a move of the list's
# tail, ~2 us each) up to this many plus a quarter of the ranking; past that, one filter and
# one merge of the whole list (~0.6 us per key) are cheaper
_BISECT_MAX = 64


@dataclass(slots=True)
class _Ranked:
    """A waiting request's place in the incremental LPM ranking."""

    req: Request
    num_output: int  # output tokens when last scored (more, on a retracted request)
    key: _Key
    # where its walk stopped, and the key of the page it missed there (None: the walk ended
    # at ``node``): only a change at that spot of the tree can change its match
    node: Node
    missing: tuple | None


@dataclass(slots=True)
class _Ranking:
    """The LPM ranking kept from one pass to the next, so a pass touches only the requests
    that joined, left, or whose match may have changed."""

    keys: list[_Key] = field(default_factory=list)  # sorted: the order of the last pass
    order: list[Request] = field(default_factory=list)  # the keys' requests, in that order
    entries: dict[str, _Ranked] = field(default_factory=dict)
    members: set[Request] = field(default_factory=set)  # the requests ranked
    num_output: int = 0  # their output tokens, when last scored
    queue: list[Request] = field(default_factory=list)  # the last pass's queue, in order
    gone: set[Request] = field(default_factory=set)  # ranked then, not any more
    next_seq: int = 0  # a request that joins at the queue's tail gets the next sequence
    max_step: int = 0  # largest |step| or |since| ranked: bounds the keys' magnitude

    def place(self, removed: list[_Key], added: list[_Key]) -> None:
        """Take ``removed`` out of the sorted keys and put ``added`` in, requests alongside."""
        keys, order = self.keys, self.order
        if len(removed) + len(added) <= _BISECT_MAX + len(keys) // 4:
            for k in removed:
                i = bisect_left(keys, k)
                assert keys[i] is k, "a rank key must be in the ranking it leaves"
                del keys[i], order[i]
            for k in added:
                i = bisect_right(keys, k)
                keys.insert(i, k)
                order.insert(i, k[3])
            return
        if removed:
            dead = {k[2] for k in removed}  # sequences are unique: no tuple hashing
            keys = [k for k in keys if k[2] not in dead]
        added.sort()
        keys.extend(added)
        keys.sort()  # two sorted runs: Timsort merges them in one sweep
        self.keys, self.order = keys, list(map(_KEY_REQUEST, keys))

    def rebuild(self) -> None:
        """Sort every entry's key afresh (after the sequences were renumbered)."""
        self.keys = sorted(e.key for e in self.entries.values())
        self.order = list(map(_KEY_REQUEST, self.keys))


def _keys_exact(aging: float, max_step: int, max_cached: int) -> bool:
    """Whether ``cached + aging x waited`` and ``aging x since - cached`` are exact in
    binary floating point for every step, since and cached count up to these bounds. Then
    ordering by the latter (fixed while a request waits) is ordering by the former (the
    score, which moves with the step), ties included. An aging such as 4 or 0.5 is exact;
    0.1 is not (its rounding depends on the step, so near-ties could order differently)."""
    if aging == 0 or isinstance(aging, int):
        return True
    if not math.isfinite(aging):
        return False
    num, den = float(aging).as_integer_ratio()  # den is a power of two
    # waited = step - since spans up to 2 x max_step; one more bit for the sum's carry
    product_bits = abs(num).bit_length() + max_step.bit_length() + 1
    cached_bits = max_cached.bit_length() + den.bit_length() - 1
    return max(product_bits, cached_bits) + 1 <= _FLOAT_BITS


class LongestPrefixMatch(AgedPrefixOrder):
    """LPM with aging over hlserve's radix tree.

    The common implementation walks the radix tree from the root for every waiting request
    on every pass, which is why it falls back to FCFS above 128 waiting requests. Here each
    waiting request remembers the deepest node it matched: the next pass resumes from there
    (climbing past evicted nodes, descending into new children), so a walk costs O(1) per
    request when the tree changed little.

    And the ranking itself is incremental. A request's score, cached + aging x (step -
    since), moves with the step by the same amount for everyone, so the order is that of
    (aging x since - cached) ascending, then arrival, then queue position: a key that
    changes only when the request's match does. The keys stay sorted from pass to pass;
    the tree tells this policy (``TreeWatch``) where a child was added or a node evicted at
    the spot where a waiting request's walk stopped, and only those requests, and those
    that joined or left the queue (a set difference), are scored again. A pass that
    changes little costs a few C-level sweeps of the queue, not a Python call per request.
    It gives the very order of ``AgedPrefixOrder._rank`` (tests/test_lpm_incremental.py);
    where it could not (an aging whose float rounding varies with the step, a request
    queued twice), that full pass runs.
    """

    def __init__(self, kv: KVCacheManager, aging: float, fcfs_fallback: int | None) -> None:
        super().__init__(aging, fcfs_fallback)
        self.kv = kv
        self._state: dict[str, _Match] = {}
        self.lookups = 0  # tree lookups made, the cost that matters at thousands waiting
        self._watch: TreeWatch = kv.watch()
        self._ranking = _Ranking()
        self._max_cached = kv.num_pages * kv.page_size  # no match is longer than the pool

    def _state_for(self, req: Request, step: int) -> _Match:
        """The request's match state; a new one (from the root) when it first waits or has
        grown since (a retraction: its wait keeps counting from when it began)."""
        self._since.setdefault(req.request_id, step)
        st = self._state.get(req.request_id)
        if st is None or st.num_tokens != req.num_tokens:
            st = _Match(req.num_tokens, self.kv.root, 0)
            self._state[req.request_id] = st
        return st

    def cached_tokens(self, req: Request, step: int) -> int:
        ps = self.kv.page_size
        st = self._state.get(req.request_id)
        if (st is not None and st.num_tokens == req.num_tokens and not st.node.evicted
                and st.node.version == st.version):
            return st.depth * ps  # no child added where the walk stopped: nothing new to find
        st = self._state_for(req, step)
        node, depth = st.node, st.depth
        while node.evicted:
            node, depth = node.parent, depth - 1  # type: ignore[assignment]
        # the last token is always recomputed, so never count a page that ends the request
        limit = (req.num_tokens - 1) // ps
        node, depth, missing = self._walk(req, node, depth, limit)
        st.node, st.depth, st.missing = node, depth, missing
        st.version = -1 if missing is None else node.version
        return depth * ps

    def _walk(self, req: Request, node: Node, depth: int, limit: int) -> tuple[Node, int, tuple | None]:
        """Descend from ``node`` (``depth`` pages down) while the next page of ``req`` is
        cached, up to ``limit`` pages; returns where it stopped and the key it missed there
        (None: it reached ``limit``). The walk of a request that joins is most of a pass at
        thousands waiting, so the page keys are cut in C (one ``zip`` over one iterator, a
        tuple per page, made only as the walk reaches it) and the loop does nothing else."""
        if depth >= limit:
            return node, depth, None
        ps, kv, start = self.kv.page_size, self.kv, depth
        keys: Iterator[tuple] = zip(*[iter(req.tokens(depth * ps, limit * ps))] * ps,
                                    strict=False)  # a whole number of pages
        if node is kv.root and req.cache_salt is not None:  # a first page carries the salt
            keys = chain([kv.page_key(node, next(keys), req.cache_salt)], keys)
        missing = None
        for key in keys:
            child = node.children.get(key)
            if child is None:
                missing = key
                break
            node = child
            depth += 1
        self.lookups += depth - start + (missing is not None)
        return node, depth, missing

    def forget(self, req: Request) -> None:
        super().forget(req)
        self._state.pop(req.request_id, None)
        rk = self._ranking
        key = self._unrank(req.request_id)
        if key is not None:
            rk.place([key], [])
            if not rk.entries:  # the queue emptied: hold no finished request until it refills
                rk.queue, rk.gone = [], set()

    # ---- the incremental ranking -------------------------------------------------------------
    def _rank(self, waiting: list[Request], step: int) -> Iterator[Request]:
        rk = self._ranking
        rk.max_step = max(rk.max_step, abs(step))
        queued = set(waiting)
        if len(queued) < len(waiting) or not self._exact():
            return self._full_pass(waiting, step)  # a request queued twice, or inexact keys
        removed = [k for r in rk.members - queued if (k := self._unrank(r.request_id)) is not None]
        num_joined = len(queued) - len(rk.members)
        rebuild = not self._kept_queue_order(waiting, num_joined)
        if rebuild:
            # reordered, or joined other than at the tail (not the scheduler's append and
            # remove): ties go by queue position, so every key is rebuilt with its position
            joined = self._resequence(waiting)
        else:
            tail = waiting[len(waiting) - num_joined:]
            joined = list(zip(tail, range(rk.next_seq, rk.next_seq + num_joined), strict=True))
        if any(req.request_id in rk.entries for req, _ in joined):
            return self._full_pass(waiting, step)  # two request objects under one id
        rk.members = queued
        added: list[_Key] = []
        for rid in self._drain_changes() | self._grown(waiting, joined):
            entry = rk.entries[rid]
            key = self._rescore(entry, step)
            if key != entry.key:  # else the ranked tuple stays: removal finds it by identity
                if not rebuild:
                    removed.append(entry.key)
                    added.append(key)
                entry.key = key
        added.extend(self._join(req, step, seq) for req, seq in joined)
        if not self._exact():  # a since beyond the steps seen (set by a direct cached_tokens)
            return self._full_pass(waiting, step)
        if rebuild:
            rk.rebuild()
        else:
            rk.place(removed, added)
        rk.queue, rk.gone = list(waiting), set()
        return iter(rk.order.copy())  # a copy: the caller may forget requests as it goes

    def _exact(self) -> bool:
        return _keys_exact(self.aging, self._ranking.max_step, self._max_cached)

    def _full_pass(self, waiting: list[Request], step: int) -> Iterator[Request]:
        """Today's full pass; the ranking is rebuilt from scratch on a pass where it applies."""
        self._reset_ranking()
        return super()._rank(waiting, step)

    def _kept_queue_order(self, waiting: list[Request], num_joined: int) -> bool:
        """Whether the requests ranked in the last pass are the head of ``waiting``, in the
        order they had, and those that joined since its tail: then the sequence numbers
        given at joining order ties as queue positions do. (The scheduler only appends to
        its queue and removes from it.)"""
        rk = self._ranking
        kept = list(filterfalse(rk.gone.__contains__, rk.queue)) if rk.gone else rk.queue
        return waiting[: len(waiting) - num_joined] == kept

    def _resequence(self, waiting: list[Request]) -> list[tuple[Request, int]]:
        """Make every ranked request's sequence its position in ``waiting``; returns the
        requests not ranked yet, each with its position."""
        rk = self._ranking
        joined = []
        for i, req in enumerate(waiting):
            entry = rk.entries.get(req.request_id)
            if entry is None or entry.req is not req:
                joined.append((req, i))
            else:
                entry.key = (entry.key[0], req.arrival_time, i, req)
        rk.next_seq = max(rk.next_seq, len(waiting))
        return joined

    def _drain_changes(self) -> set[str]:
        """Ids of the ranked requests whose walk stopped at a spot of the tree that changed
        since the last pass."""
        at, dirty = self._watch.at, set()
        for node, key in self._watch.changed:
            spots = at.get(node)
            if spots is None:
                continue
            if key is None:  # evicted: every walk that stopped there climbs back
                for ids in spots.values():
                    dirty |= ids
            elif (ids := spots.get(key)) is not None:
                dirty |= ids
        self._watch.changed.clear()
        return dirty

    def _grown(self, waiting: list[Request], joined: list[tuple[Request, int]]) -> set[str]:
        """Ids of the ranked requests whose tokens grew while they stayed queued. The
        scheduler's never do (only a running request decodes, and a retracted one was
        forgotten when admitted), so one C-level total says so; outputs only grow, so an
        unchanged total means none grew."""
        rk = self._ranking
        total = sum(map(len, map(_OUTPUT, waiting))) - sum(len(r.output_token_ids) for r, _ in joined)
        if total == rk.num_output:
            return set()
        return {rid for rid, e in rk.entries.items() if len(e.req.output_token_ids) != e.num_output}

    def _join(self, req: Request, step: int, seq: int) -> _Key:
        """Rank a request that joined the queue; returns its key."""
        rk = self._ranking
        since = self._since.setdefault(req.request_id, step)
        cached = self.cached_tokens(req, step)
        st = self._state[req.request_id]
        key = (self.aging * since - cached, req.arrival_time, seq, req)
        entry = _Ranked(req, len(req.output_token_ids), key, st.node, st.missing)
        rk.entries[req.request_id] = entry
        rk.num_output += entry.num_output
        rk.next_seq = max(rk.next_seq, seq + 1)
        rk.max_step = max(rk.max_step, abs(since))
        self._file(entry)
        return key

    def _rescore(self, entry: _Ranked, step: int) -> _Key:
        """Score a ranked request again (the tree changed where its walk stopped, or its
        tokens grew) and watch where its walk stops now; returns its key (the caller puts
        it in place)."""
        rk, req = self._ranking, entry.req
        self._unfile(entry)
        since = self._since.setdefault(req.request_id, step)
        cached = self.cached_tokens(req, step)
        st = self._state[req.request_id]
        entry.node, entry.missing = st.node, st.missing
        num_output = len(req.output_token_ids)
        rk.num_output += num_output - entry.num_output
        entry.num_output = num_output
        self._file(entry)
        return (self.aging * since - cached, req.arrival_time, entry.key[2], req)

    def _unrank(self, rid: str) -> _Key | None:
        """Take a request out of the ranking (its key stays in ``keys`` for the caller to
        remove); returns that key, None if it was not ranked."""
        rk = self._ranking
        entry = rk.entries.pop(rid, None)
        if entry is None:
            return None
        self._unfile(entry)
        rk.members.discard(entry.req)
        rk.num_output -= entry.num_output
        rk.gone.add(entry.req)
        return entry.key

    def _file(self, entry: _Ranked) -> None:
        """Watch the spot where the request's walk stopped."""
        spots = self._watch.at.setdefault(entry.node, {})
        spots.setdefault(entry.missing, set()).add(entry.req.request_id)

    def _unfile(self, entry: _Ranked) -> None:
        at = self._watch.at
        spots = at[entry.node]
        ids = spots[entry.missing]
        ids.discard(entry.req.request_id)
        if not ids:  # unwatched spots cost the tree nothing
            del spots[entry.missing]
            if not spots:
                del at[entry.node]

    def _reset_ranking(self) -> None:
        self._ranking = _Ranking(next_seq=self._ranking.next_seq, max_step=self._ranking.max_step)
        self._watch.at.clear()
        self._watch.changed.clear()
