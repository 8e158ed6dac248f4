"""The scheduler: each iteration, which requests run and how many tokens each gets.

It knows nothing about tensors or time. One pass:

1. running requests first (in admission order): a decode takes one token, a request
   mid-prefill takes its next chunk. A request whose next token needs a page the pool cannot
   give retracts a victim (the retraction policy chooses) until it fits;
2. then waiting requests, in the order policy's order, while the running-request limit, the
   token budget and the pool allow; the first that does not fit stops admission (no
   overtaking, so a long prompt is not starved by short ones). Nothing is admitted in an
   iteration that retracted, or retraction would thrash.

The mixing policy decides whether decodes share an iteration with prefill. The token budget
bounds the whole iteration and ``chunk_size`` each prefill chunk; both may be unlimited.
"""

from __future__ import annotations

import math

from hlserve.config import EngineConfig
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.policies import make_mixing, make_order, make_retraction
from hlserve.request import Request, RequestStatus
from hlserve.runner.base import Batch, ScheduledSeq


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.order = make_order(config.order)
        self.mixing = make_mixing(config.mixing)
        self.retraction = make_retraction(config.retraction)
        self.chunk_size = config.chunk_size or math.inf
        self.token_budget = config.token_budget or math.inf
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order
        self.num_retractions = 0
        # per-pass state
        self._budget: float = 0
        self._scheduled: dict[str, ScheduledSeq] = {}
        self._retracted = False

    # ---- queue --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and release its pages to the cache."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv.holds(req.request_id):
            self.kv.release(req.request_id, req.all_token_ids, req.num_computed)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the pass -----------------------------------------------------------------------
    def schedule(self) -> Batch:
        self._budget = self.token_budget
        self._scheduled = {}
        self._retracted = False
        if self.mixing.decode_with_prefill():
            self._schedule_running(prefill=True, decode=True)
            self._admit_waiting()
        else:
            self._schedule_running(prefill=True, decode=False)
            self._admit_waiting()
            if not self._scheduled:
                self._schedule_running(prefill=False, decode=True)
        return Batch(seqs=list(self._scheduled.values()))

    def _schedule_running(self, prefill: bool, decode: bool) -> None:
        for req in list(self.running):
            if self._budget < 1:
                return
            if req.status is not RequestStatus.RUNNING or req.request_id in self._scheduled:
                continue  # retracted earlier in this pass
            if req.in_prefill:
                if not prefill:
                    continue
                n = int(min(req.num_uncomputed, self.chunk_size, self._budget))
            else:
                if not decode:
                    continue
                n = 1
            if self._reserve(req, req.num_computed + n):
                self._add(req, n)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages for ``num_tokens``, retracting others if need be. False if
        ``req`` itself had to be retracted."""
        while not self.kv.allocate(req.request_id, num_tokens):
            others = [r for r in self.running if r is not req]
            victim = self.retraction.victim(others) if others else req
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _retract(self, req: Request) -> None:
        """Free a running request's KV into the prefix cache and send it back to wait; its
        computed pages stay cached, so re-admission recomputes only what was evicted."""
        if (seq := self._scheduled.pop(req.request_id, None)) is not None:
            self._budget += seq.num_tokens
        self.kv.release(req.request_id, req.all_token_ids, req.num_computed)
        req.num_computed = 0
        req.num_retractions += 1
        self.running.remove(req)
        self.add(req)
        self.num_retractions += 1
        self._retracted = True

    def _admit_waiting(self) -> None:
        if self._retracted or not self.waiting:
            return
        ps = self.kv.page_size
        for req in self.order.order(self.waiting):
            if len(self.running) >= self.config.max_num_seqs or self._budget < 1:
                break
            tokens = req.all_token_ids
            nodes = self.kv.match_prefix(tokens, len(tokens) - 1)
            cached = len(nodes) * ps
            n = int(min(len(tokens) - cached, self.chunk_size, self._budget))
            need = self.kv.pages_for(cached + n) - len(nodes)
            # matched pages nobody holds are counted as evictable now but get locked
            if need > self.kv.available() - sum(1 for nd in nodes if nd.ref == 0):
                break
            cached = self.kv.admit(req.request_id, tokens, len(tokens) - 1)
            ok = self.kv.allocate(req.request_id, cached + n)
            assert ok, "admission checked the pool"
            if req.num_retractions == 0:
                req.num_cached_prompt = cached
            req.num_computed = cached
            req.status = RequestStatus.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            self._add(req, n)

    def _add(self, req: Request, n: int) -> None:
        self._scheduled[req.request_id] = ScheduledSeq(
            request=req, start=req.num_computed, num_tokens=n,
            page_table=self.kv.page_table(req.request_id),
        )
        self._budget -= n

    # ---- after the step -----------------------------------------------------------------
    def update(self, batch: Batch) -> None:
        """Advance each scheduled request past the tokens just computed; cache full pages."""
        ps = self.kv.page_size
        for seq in batch.seqs:
            req = seq.request
            before = req.num_computed
            req.num_computed = seq.end
            if self.kv.enable_prefix_caching and seq.end // ps > before // ps:
                self.kv.commit(req.request_id, req.all_token_ids, req.num_computed)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        if len(ids) != len(set(ids)):
            raise AssertionError("a request is queued twice")
        for r in self.running:
            if r.status is not RequestStatus.RUNNING or not self.kv.holds(r.request_id):
                raise AssertionError(f"{r.request_id} runs without pages")
        for r in self.waiting:
            if r.status is not RequestStatus.WAITING or self.kv.holds(r.request_id):
                raise AssertionError(f"{r.request_id} waits but holds pages")
