"""The suffix speculator's indexes in flat arrays: a size that is known (``nbytes``), a
lookup whose cost does not grow with the tree depth when nothing matches.

The counts the speculator reads are those of a count trie of depth ``d`` (every substring of
length <= d, counted once per occurrence; the trie it replaced, kept as the definition in
tests/suffix_trie_reference.py): the count of ``s`` followed by ``x`` is the number of occurrences of ``s`` that
``x`` follows. Here they are found from the occurrences themselves, in a token buffer: the
positions where the context's last token (or last two) ends, extended backwards one token at a
time while any still match (the longest matching suffix), then followed forwards (the walk).
A per-node dict trie holds ~d nodes per token (~200 B each: 3.4 GB for 1,000 outputs of 500
tokens at depth 24); these hold 16 bytes per token of the shared index, 12 of a request's own.

Buffers begin with ``SEP`` and hold ``SEP`` between outputs and past the end, so a match never
crosses a boundary and needs no bounds check: a backward step that reaches ``SEP`` fails, a
forward step that reaches it has no continuation.
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from collections.abc import Sequence

import numpy as np

SEP = -1  # not a token id
_RECENT_MIN = 1 << 13  # tokens the small segment may hold before it merges into the large one

_EMPTY = np.empty(0, np.int64)

Sources = list[tuple[np.ndarray, np.ndarray]]  # (buffer, positions in it) per segment


def longest_match(sources: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  tail: Sequence[int], cap: int) -> tuple[int, Sources]:
    """The longest suffix of ``tail`` (at most ``cap`` tokens) that occurs followed by a token,
    and where it ends in each source. A source is (buffer, ends of the last two tokens, ends of
    the last token), both already cut to live positions followed by a token. (0, []): none."""
    if cap >= 2 and any(p2.size for _, p2, _ in sources):
        found: Sources = [(buf, p2) for buf, p2, _ in sources if p2.size]
        m = 2
        while m < cap:  # a longer suffix occurs only where the shorter one does
            want = tail[-1 - m]
            longer = [(buf, p[buf[p - m] == want]) for buf, p in found]
            longer = [(buf, p) for buf, p in longer if p.size]
            if not longer:
                break
            found, m = longer, m + 1
        return m, found
    if cap >= 1 and any(p1.size for _, _, p1 in sources):
        return 1, [(buf, p1) for buf, _, p1 in sources if p1.size]
    return 0, []


def walk_counts(found: Sources, room: int, limit: int, min_prob: float
                ) -> tuple[list[int], float]:
    """The most frequent continuation (ties: the smallest token) from the occurrences ``found``,
    token by token while the product of each token's share stays >= ``min_prob``, for at most
    ``limit`` tokens and ``room`` (the trie's depth left below the match)."""
    out: list[int] = []
    prob = 1.0
    while len(out) < min(limit, room):
        nexts = [buf[p + 1] for buf, p in found]
        pooled = np.concatenate(nexts) if len(nexts) > 1 else nexts[0]
        if pooled.size <= 64:  # the usual few occurrences: a dict is cheaper than np.unique
            counts: dict[int, int] = {}
            for t in pooled.tolist():
                counts[t] = counts.get(t, 0) + 1
            counts.pop(SEP, None)
            if not counts:
                break
            tok = min(counts, key=lambda t: (-counts[t], t))  # ties: the smallest token
            count, total = counts[tok], sum(counts.values())
        else:
            pooled = pooled[pooled != SEP]
            if not pooled.size:
                break
            values, hits = np.unique(pooled, return_counts=True)
            i = int(np.argmax(hits))  # the first maximum: the smallest token among equals
            tok, count, total = int(values[i]), int(hits[i]), int(pooled.size)
        prob *= count / total
        if prob < min_prob:
            break
        out.append(tok)
        found = [(buf, p[n == tok] + 1) for (buf, p), n in zip(found, nexts, strict=True)]
    return out, prob


class ContextIndex:
    """A request's own context (prompt and output so far) as it grows: an int32 buffer
    (``SEP`` first and past the end, doubled when full) and each token value's positions (an
    int while it occurred once, an int32 array from its second occurrence: ~80 bytes a token
    when all are distinct, ~4 when they repeat)."""

    __slots__ = ("buf", "size", "where")

    def __init__(self) -> None:
        self.buf = np.full(64, SEP, np.int32)
        self.size = 1  # buf[0] is SEP
        self.where: dict[int, int | array] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        need = self.size + len(tokens) + 1  # one SEP past the end
        if need > len(self.buf):
            grown = np.full(max(need, 2 * len(self.buf)), SEP, np.int32)
            grown[:self.size] = self.buf[:self.size]
            self.buf = grown
        p = self.size
        self.buf[p:p + len(tokens)] = tokens
        where = self.where
        for tok in tokens:
            at = where.get(tok)
            if at is None:
                where[tok] = p
            elif type(at) is int:
                where[tok] = array("i", (at, p))
            else:
                at.append(p)
            p += 1
        self.size = p

    def tokens(self, start: int = 0) -> list[int]:
        """The context from token ``start`` on."""
        return self.buf[1 + start:self.size].tolist()

    def candidates(self, tail: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, ends of the last two tokens, ends of the last token), followed by a token
        (the context's own end is not: past it is ``SEP``)."""
        buf = self.buf
        at = self.where.get(tail[-1])
        if at is None:
            return buf, _EMPTY, _EMPTY
        if type(at) is int:  # one occurrence, the common case: no array work
            if at + 1 >= self.size:  # the context's own last token
                return buf, _EMPTY, _EMPTY
            p1 = np.array([at], np.int64)
            pair = len(tail) >= 2 and int(buf[at - 1]) == tail[-2]
            return buf, (p1 if pair else _EMPTY), p1
        p1 = np.array(at, np.int64)  # a copy: ``at`` may grow
        p1 = p1[buf[p1 + 1] != SEP]
        p2 = p1[buf[p1 - 1] == tail[-2]] if len(tail) >= 2 else p1[:0]
        return buf, p2, p1

    def nbytes(self) -> int:
        return (self.buf.nbytes + sys.getsizeof(self.where)
                + sum(sys.getsizeof(a) for a in self.where.values()))


class Segment:
    """Finished outputs, ``SEP`` before each and after the last, with every token position
    sorted by its key (token << 32 | previous token + 1): the positions of one token, and
    within them of one pair, are a range found by binary search."""

    __slots__ = ("keys", "order", "tokens")

    def __init__(self, tokens: np.ndarray, keys: np.ndarray, order: np.ndarray) -> None:
        self.tokens, self.keys, self.order = tokens, keys, order

    @classmethod
    def of(cls, outputs: Sequence[Sequence[int]]) -> Segment:
        parts = [np.array([SEP], np.int32)]
        for out in outputs:
            parts += [np.asarray(out, np.int32), np.array([SEP], np.int32)]
        tokens = np.concatenate(parts)
        pos = np.flatnonzero(tokens != SEP)
        keys = (tokens[pos].astype(np.int64) << 32) | (tokens[pos - 1].astype(np.int64) + 1)
        by_key = np.argsort(keys, kind="stable")
        return cls(tokens, keys[by_key], pos[by_key].astype(np.int32))

    def merged(self, newer: Segment) -> Segment:
        """This segment followed by ``newer`` (one pass: both are sorted by key)."""
        shift = len(self.tokens) - 1  # newer's leading SEP is this one's trailing SEP
        at = np.searchsorted(self.keys, newer.keys, side="right")
        return Segment(np.concatenate([self.tokens, newer.tokens[1:]]),
                       np.insert(self.keys, at, newer.keys),
                       np.insert(self.order, at, newer.order + shift))

    def dropped(self, cut: int) -> Segment:
        """Without the tokens before ``cut`` (a ``SEP``); positions shift down by ``cut``."""
        keep = self.order > cut
        return Segment(self.tokens[cut:].copy(), self.keys[keep], self.order[keep] - cut)

    def candidates(self, tail: Sequence[int], cut: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :meth:`ContextIndex.candidates`, live (after ``cut``) positions only."""
        last = int(tail[-1]) << 32
        pair = last | (int(tail[-2]) + 1) if len(tail) >= 2 else last
        lo, a, b, hi = np.searchsorted(self.keys, (last, pair, pair + 1, last + (1 << 32))
                                       ).tolist()
        if len(tail) < 2:
            a = b  # no pair to match
        if lo == hi:
            return self.tokens, _EMPTY, _EMPTY
        toks, order = self.tokens, self.order
        p1 = order[lo:hi].astype(np.int64)
        p1 = p1[(p1 > cut) & (toks[p1 + 1] != SEP)]
        p2 = order[a:b].astype(np.int64) if b > a else _EMPTY
        if p2.size:
            p2 = p2[(p2 > cut) & (toks[p2 + 1] != SEP)]
        return toks, p2, p1

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.keys.nbytes + self.order.nbytes


class SharedIndex:
    """The outputs of recently finished requests, oldest evicted first past ``max_requests``
    outputs or ``max_bytes`` of arrays. A new output joins a small segment (rebuilt: a copy of
    it), which merges into the large one once past an eighth of it (a linear merge), so a
    token is copied O(log) times. Evicted outputs are first only cut off by a position
    (``cut``); the arrays shrink when the bytes go over the budget: evicted down to 3/4 of it,
    then copied without them. Between, the arrays may hold up to 2x the budget for a moment
    (a merge builds its result before it frees its inputs)."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.large = Segment.of([])
        self.small = Segment.of([])
        self.spans: deque[int] = deque()  # tokens + 1 of each cached output, oldest first
        self.cut = 0  # the large segment's evicted prefix (its tokens before this SEP)

    def add(self, output: Sequence[int]) -> None:
        self.small = self.small.merged(Segment.of([output]))
        self.spans.append(len(output) + 1)
        if len(self.small.tokens) > max(_RECENT_MIN, len(self.large.tokens) // 8):
            self._merge()
        while len(self.spans) > self.max_requests:
            self._evict()
        if self.nbytes() > self.max_bytes:
            self._shrink()

    def _merge(self) -> None:
        self.large, self.small = self.large.merged(self.small), Segment.of([])

    def _evict(self) -> None:
        if self.cut + self.spans[0] >= len(self.large.tokens):  # the oldest is in the small one
            self._merge()
        self.cut += self.spans.popleft()

    def _shrink(self) -> None:
        self._merge()
        target = self.max_bytes * 3 // 4
        live = len(self.large.tokens) - self.cut
        while self.spans and 16 * live > target:  # 4 (token) + 8 (key) + 4 (position)
            live -= self.spans[0]
            self._evict()
        self.large, self.cut = self.large.dropped(self.cut), 0

    def candidates(self, tail: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [seg.candidates(tail, cut) for seg, cut in ((self.large, self.cut), (self.small, 0))
                if len(seg.tokens) > 1]

    def nbytes(self) -> int:
        """The arrays' bytes and the spans' (a deque and an int object each)."""
        return (self.large.nbytes + self.small.nbytes + sys.getsizeof(self.spans)
                + 32 * len(self.spans))
