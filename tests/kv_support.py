"""Test-only helpers over the KV cache manager: commit-then-release, pages held, emptying
the prefix cache, and the two references the incremental LPM order is checked (and
benchmarked, benchmarks/scheduler_overhead.py) against: the plain radix walk, and the LPM
pass that scores every waiting request afresh."""

from __future__ import annotations

from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.policies.lpm import LongestPrefixMatch
from hlserve.engine.policies.order import AgedPrefixOrder
from hlserve.request import Request


def release_cached(kv: KVCacheManager, req_id: str, tokens: list[int], num_computed: int,
                   offset: int = 0) -> None:
    """Release a request's pages after committing its computed full pages to the tree (what
    the scheduler does at release); ``tokens[0]`` is token number ``offset``."""
    kv.commit(req_id, tokens, num_computed, offset)
    kv.release(req_id)


def num_seq_pages(kv: KVCacheManager, req_id: str) -> int:
    """Pages the request holds (0 if it holds none)."""
    return len(kv.page_table(req_id)) if kv.holds(req_id) else 0


def reset_prefix_cache(kv: KVCacheManager) -> int:
    """Evict every unreferenced cached page; returns how many were freed."""
    return kv.evict(kv.num_evictable)


def plain_radix_walk_order(kv: KVCacheManager, waiting: list[Request]) -> list[Request]:
    """The baseline LPM: a fresh walk from the root for every waiting request."""
    scored = [(-len(kv.match_prefix(r.all_token_ids, r.num_tokens - 1, r.cache_salt)),
               r.arrival_time, i)
              for i, r in enumerate(waiting)]
    return [waiting[i] for _, _, i in sorted(scored)]


class FullPassLPM(LongestPrefixMatch):
    """LPM as it ranked before its ranking was incremental: each pass scores every waiting
    request (resuming its walk where the last one stopped) and sorts them all. The order
    ``LongestPrefixMatch`` must give, pass by pass (tests/test_lpm_incremental.py)."""

    _rank = AgedPrefixOrder._rank
