"""Agent sessions' blocks held in vLLM's pool across tool calls (Continuum, arXiv 2511.02230).

vLLM frees a finished request's blocks at once: they stay cached only until other traffic
evicts them, so an agent's next round, back from a tool call seconds later, often prefills
its whole context again. vLLM has no retention API (RFC vllm#37003 is open); its
``KVCacheManager.pop_blocks_for_free`` does let a scheduler take a finished request's blocks
without returning them to the pool. ``SessionHold`` keeps them, one hold per session (its
latest round), until:

- the session's next round is admitted (its prefix lookup found the held blocks and took
  its own reference: the hold is released, a hit);
- the deadline passes (``fixed``: ``session_ttl`` after the round; ``learned``: from the
  session's own tool gaps; the same ``engine.sessions.Sessions`` hlserve's engine runs; a
  request's own hint, ``kv_hints``/``vllm_xargs``, wins), an expiry;
- or the pool needs them: the plugin plans each pass as if held blocks were free, and
  before vLLM's pass releases holds, oldest first, until what the plan takes fits: holding
  never blocks an admission, nor causes a preemption, that would fit without it.

A released hold goes back to the pool the way vLLM frees (tail blocks evicted first): its
blocks stay cached until evicted. A hold taken in the last ``FENCE_STEPS`` steps is
released under pressure last of all: with async scheduling a step in flight may still write
a finished request's last block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hlserve.engine.sessions import Sessions

FENCE_STEPS = 2  # vLLM's batch queue: steps that may be in flight when a request finishes


@dataclass(slots=True)
class Hold:
    blocks: list[Any]  # vLLM's KVCacheBlocks, in allocation order, each with our reference
    until: float  # deadline on the scheduler's clock
    step: int  # scheduler pass the round finished in
    tokens: int  # context tokens the blocks hold


@dataclass(slots=True)
class HoldStats:
    holds: int = 0  # rounds whose blocks were held
    hits: int = 0  # next rounds admitted while their session's blocks were held
    hit_tokens: int = 0  # prompt tokens those rounds found cached
    expired: int = 0  # holds released at their deadline
    evicted: int = 0  # holds released early because the pool needed the blocks
    evicted_blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class SessionHold:
    """Per-session holds on vLLM's block pool, released by hit, deadline or pressure."""

    def __init__(self, sessions: Sessions, block_pool: Any, num_blocks: int) -> None:
        self.sessions = sessions
        self.pool = block_pool
        self.num_blocks = num_blocks
        self.holds: OrderedDict[str, Hold] = OrderedDict()  # oldest first
        self.held_blocks = 0
        self.stats = HoldStats()

    def deadline(self, key: str, now: float, tokens: int, num_blocks: int,
                 ttl_hint: float | None) -> float | None:
        """When a finished round's blocks go back (None: free them now, as vLLM would)."""
        until = self.sessions.retain_until(key, now, tokens, num_blocks, self.num_blocks)
        if ttl_hint is not None:
            until = now + ttl_hint if ttl_hint > 0 else None
        return until

    def take(self, key: str, blocks: list[Any], until: float, step: int, tokens: int) -> None:
        """Hold a finished round's blocks (popped from vLLM's bookkeeping, references kept)."""
        if key in self.holds:  # a session holds its latest round only
            self._release(key)
        self.holds[key] = Hold(blocks, until, step, tokens)
        self.held_blocks += len(blocks)
        self.stats.holds += 1

    def expire(self, now: float) -> None:
        for key in [k for k, h in self.holds.items() if h.until <= now]:
            self._release(key)
            self.stats.expired += 1

    def make_room(self, blocks: int, step: int) -> int:
        """Release holds, oldest first (the last ``FENCE_STEPS`` steps' last of all), until
        ``blocks`` blocks have gone back; returns how many did."""
        freed = 0
        young = [k for k, h in self.holds.items() if h.step > step - FENCE_STEPS]
        for key in [k for k in self.holds if k not in young] + young:
            if freed >= blocks:
                break
            n = self._release(key)
            freed += n
            self.stats.evicted += 1
            self.stats.evicted_blocks += n
        return freed

    def admitted(self, key: str, arrival: float, cached_tokens: int) -> None:
        """A round of ``key`` was admitted with ``cached_tokens`` found cached: the learned
        TTL's tool gap, and the session's hold released (the round holds its blocks now)."""
        self.sessions.on_admit(key, arrival, cached_tokens)
        if key in self.holds:
            self._release(key)
            if cached_tokens > 0:
                self.stats.hits += 1
                self.stats.hit_tokens += cached_tokens

    def release_all(self) -> None:
        for key in list(self.holds):
            self._release(key)

    def _release(self, key: str) -> int:
        hold = self.holds.pop(key)
        self.held_blocks -= len(hold.blocks)
        # as vLLM frees a request: tail blocks first in the eviction order
        self.pool.free_blocks(reversed(hold.blocks))
        return len(hold.blocks)
