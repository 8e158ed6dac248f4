"""The scheduler: each iteration, which requests run and how many tokens each gets.

It knows nothing about tensors or time sources (iteration times reach it only through
``observe``). One pass:

1. the iteration's caps: chunk size and token budget (from the budget controller), tightened
   to the interactive caps only where an interactive request would feel them;
2. the mixing policy says whether prefill may run and whether decodes share its iterations;
3. running requests first, in admission order: a decode takes one token (decodes are never
   starved by the budget, they only consume it), a request mid-prefill its next chunk. A
   request whose next token needs a page the pool cannot give retracts a victim (retraction
   policy) until it fits;
4. waiting requests, interactive ones first, then in the order policy's order, while the
   running-request limit, the budget, the prefill caps and the pool allow; the admission
   policy decides for each (admit, wait, reject). The first that waits stops admission (no
   overtaking), unless the policy backfills (throughput mode's backpressure): then those
   behind it that fit are admitted, and a request that has waited long has its pages held
   back from them. A policy never holds an idle pool: a request alone is admitted when its
   chunk fits. Nothing is admitted in an iteration that retracted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from hlserve.config import EngineConfig
from hlserve.engine.batch import Batch, ScheduledSeq
from hlserve.engine.kv_cache import KVCacheManager, Node
from hlserve.engine.policies import (
    Admit,
    AdmitQuery,
    MixState,
    make_admission,
    make_budget_controller,
    make_mixing,
    make_order,
    make_retraction,
)
from hlserve.request import Request, RequestClass, RequestStatus

INTERACTIVE = RequestClass.INTERACTIVE
# SGLang's estimate of how much of its max_tokens a running request will still use
NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_STEPS = 0.7, 0.098, 600
SHARED_SPAN_PAGES = 2  # uncached pages two requests must share for one to wait for the other
# backfilling admission: passes a request may wait while others overtake it before its pages
# are held back for it, and how many waiting requests one pass looks past (a pass over
# thousands waiting must stay cheap)
BACKFILL_PATIENCE_STEPS = 256
BACKFILL_MAX_SKIPS = 32


def _cap(value: int | None) -> float:
    return math.inf if value is None else value


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 max_model_len: int | None = None) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len or config.max_model_len
        self.order = make_order(config, kv)
        self.mixing = make_mixing(config)
        self.admission = make_admission(config)
        self.retraction = make_retraction(config)
        self.budget_controller = make_budget_controller(config, kv.num_pages * kv.page_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order
        self.rejected: list[Request] = []  # refused by admission; the engine ends them
        self.step = 0
        self.num_retractions = 0
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._last_admit_step = -(10**9)
        self._waiting_since: dict[str, int] = {}  # backfill: first pass a request was held
        # per-pass state
        self._budget: float = 0
        self._chunk: float = math.inf
        self._prefill_tokens = 0
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
        self._forget(req)
        if self.kv.holds(req.request_id):
            self._release(req)

    def _forget(self, req: Request) -> None:
        """The request left the waiting queue (admitted, rejected or ended)."""
        self.order.forget(req)
        self._waiting_since.pop(req.request_id, None)

    def _commit(self, req: Request) -> None:
        """Put the request's newly full, computed pages into the prefix tree, handing the KV
        manager only the tokens after those already there (not a copy of the context)."""
        start = self.kv.committed_tokens(req.request_id)
        self.kv.commit(req.request_id, req.tokens(start, req.num_computed), req.num_computed,
                       offset=start)

    def _release(self, req: Request) -> None:
        """Release a request's pages; its computed full pages stay cached."""
        if self.kv.enable_prefix_caching:
            self._commit(req)
        self.kv.release(req.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the pass -----------------------------------------------------------------------
    def schedule(self) -> Batch:
        self.step += 1
        self._chunk, self._budget = self._caps()
        self._prefill_tokens = 0
        self._scheduled = {}
        self._retracted = False
        prefill_ok, mix = self.mixing.plan(self._mix_state())
        if not prefill_ok:
            self._schedule_running(prefill=False, decode=True)
        elif mix:
            self._schedule_running(prefill=True, decode=True)
            self._admit_waiting()
        else:
            self._schedule_running(prefill=True, decode=False)
            self._admit_waiting()
            if not self._scheduled:
                self._schedule_running(prefill=False, decode=True)
        return Batch(seqs=list(self._scheduled.values()))

    def _caps(self) -> tuple[float, float]:
        """Chunk size and token budget of this iteration."""
        chunk = _cap(self.config.chunk_size)
        budget = self.budget_controller.budget
        if not any(r.request_class is INTERACTIVE for r in itertools.chain(self.running, self.waiting)):
            return chunk, budget  # nobody is waiting: pure throughput
        ichunk = _cap(self.config.interactive_chunk_size)
        if any(r.request_class is INTERACTIVE and not r.in_prefill for r in self.running):
            # an interactive request decodes in this iteration: bound its length (TPOT)
            return min(chunk, ichunk), min(budget, _cap(self.config.interactive_token_budget))
        # one waits for its first token: chunk others' prefill so it gets in soon (TTFT)
        return min(chunk, ichunk), budget

    def _mix_state(self) -> MixState:
        if not getattr(self.mixing, "needs_state", False):
            return MixState(0.0, 0, 0, 0)
        ps = self.kv.page_size
        pending = decoding = 0
        for r in itertools.chain(self.waiting, self.running):
            n = r.num_uncomputed
            if r.status is RequestStatus.WAITING or n > 1:
                pending += -(-n // ps)
            else:
                decoding += 1
        return MixState(self.kv.usage, pending, self.kv.num_evictable, decoding)

    def _schedule_running(self, prefill: bool, decode: bool) -> None:
        """Decodes first, then chunks of requests mid-prefill, so that a chunk takes what the
        decodes leave of the budget and the iteration never exceeds it."""
        # the split is computed once per pass (``in_prefill`` inlined: this loop runs for
        # every running request on every iteration, the simulator's hottest path)
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for r in self.running:
            n = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed
            (prefilling if n > 1 else decoding).append(r)
        if decode:
            scheduled = self._scheduled
            for req in decoding:
                if req.status is RequestStatus.RUNNING and req.request_id not in scheduled \
                        and self._reserve(req, req.num_computed + 1):
                    self._add(req, 1)
        if prefill:
            for req in prefilling:
                if req.status is not RequestStatus.RUNNING or req.request_id in self._scheduled:
                    continue  # retracted earlier in this pass
                n = int(min(req.num_uncomputed, self._chunk, self._budget))
                if n >= 1 and self._reserve(req, req.num_computed + n):
                    self._add(req, n)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages for ``num_tokens``; False if ``req`` had to be retracted.

        The victim policy ranks every running request, ``req`` included: while the pool
        cannot give the pages, the policy's victim is retracted, and if that is ``req``
        itself, it yields. So the request the policy ranks safest can always take pages
        from the others and always progresses: no two requests can retract each other
        forever (as a re-admitted prefill and a decode could if either could evict the
        other)."""
        while not self.kv.allocate(req.request_id, num_tokens):
            victim = self.retraction.victim(self.running)
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _retract(self, req: Request) -> None:
        """Free a running request's KV into the prefix cache and send it back to wait; its
        computed pages stay cached, so re-admission recomputes only what was evicted.
        Nothing is copied to host memory."""
        if (seq := self._scheduled.pop(req.request_id, None)) is not None:
            self._budget += seq.num_tokens
            if not seq.is_decode:
                self._prefill_tokens -= seq.num_tokens
        self._release(req)
        req.num_computed = 0
        req.num_retractions += 1
        self.running.remove(req)
        self.add(req)
        self.num_retractions += 1
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._retracted = True

    def _waiting_order(self) -> Iterator[Request]:
        inter = [r for r in self.waiting if r.request_class is INTERACTIVE]
        if not inter:
            return self.order.order(self.waiting, self.step)
        rest = [r for r in self.waiting if r.request_class is not INTERACTIVE]
        inter.sort(key=lambda r: (r.priority, r.arrival_time))
        return itertools.chain(inter, self.order.order(rest, self.step))

    def _admit_waiting(self) -> None:
        cfg = self.config
        if self._retracted or not self.waiting:
            return
        if cfg.prefill_delay and self.step - self._last_admit_step < cfg.prefill_delay \
                and any(not r.in_prefill for r in self.running):
            return  # the delayer holds new prefill to protect running decodes
        ps = self.kv.page_size
        mid_chunk = sum(1 for r in self.running if r.in_prefill)
        span = SHARED_SPAN_PAGES * ps
        computing: set[tuple[Node | str | None, tuple[int, ...]]] = set()  # (where, next tokens) in prefill
        held_back = skips = 0  # backfill: pages kept for long-waiting requests; requests passed
        for req in list(self._waiting_order()):
            if len(self.running) >= cfg.max_num_seqs or self._budget < 1:
                break
            if cfg.max_prefill_tokens is not None and self._prefill_tokens >= cfg.max_prefill_tokens:
                break  # SGLang's cap: the first prefill of an iteration may exceed it
            if self._follows_leader(req):
                continue
            tokens = req.all_token_ids
            nodes = self.kv.match_prefix(tokens, len(tokens) - 1, req.cache_salt)
            cached = len(nodes) * ps
            n = int(min(len(tokens) - cached, self._chunk, self._budget))
            if cfg.defer_shared_prefill and len(tokens) - cached >= span:
                # in-batch prefix sharing: a request whose next uncached tokens another
                # request is prefilling in this very iteration waits one iteration and then
                # finds them cached, instead of computing them a second time
                run = (nodes[-1] if nodes else req.cache_salt, tuple(tokens[cached : cached + span]))
                if run in computing:
                    continue
                computing.add(run)
            if n < len(tokens) - cached and cfg.max_chunked_prefills is not None \
                    and mid_chunk >= cfg.max_chunked_prefills:
                break
            chunk_pages = self.kv.pages_for(cached + n) - len(nodes)
            # matched pages nobody holds are counted as evictable now but get locked
            headroom = self.kv.available() - sum(1 for nd in nodes if nd.ref == 0) - held_back
            reserved = self._reserved_pages() if self.admission.reserves else 0
            query = AdmitQuery(req, cached, chunk_pages, headroom, reserved, len(self.running),
                               self.max_model_len)
            verdict = self.admission.decide(query, self.kv)
            if verdict == Admit.REJECT:
                self.waiting.remove(req)
                self._forget(req)
                self.rejected.append(req)
                continue
            if verdict == Admit.WAIT and not self.running and self.kv.num_used == 0:
                verdict = Admit.YES  # no policy may hold an idle pool: alone, it is admitted
            if verdict == Admit.WAIT or chunk_pages > headroom:
                if not self.admission.backfill:
                    break
                # backfill: those behind it that fit go first; once it has waited long, its
                # pages are held back from them, so it is not starved
                since = self._waiting_since.setdefault(req.request_id, self.step)
                if self.step - since >= BACKFILL_PATIENCE_STEPS:
                    held_back += min(max(headroom, 0), self.admission.need_pages(query, self.kv))
                skips += 1
                if skips >= BACKFILL_MAX_SKIPS:
                    break
                continue
            cached = self.kv.admit(req.request_id, tokens, len(tokens) - 1, matched=nodes,
                                   salt=req.cache_salt)
            req.num_prefix_queries += len(tokens)
            req.num_prefix_hits += cached
            ok = self.kv.allocate(req.request_id, cached + n)
            assert ok, "admission checked the pool"
            if req.num_retractions == 0:
                req.num_cached_prompt = cached
            req.num_computed = cached
            req.status = RequestStatus.RUNNING
            self.waiting.remove(req)
            self._forget(req)
            self.running.append(req)
            self._add(req, n)
            self._last_admit_step = self.step
            if n < len(tokens) - cached:
                mid_chunk += 1

    def _follows_leader(self, req: Request) -> bool:
        """A forked sibling (n > 1) waits until its leader has prefilled the shared prompt:
        then its full pages are cached and the sibling computes only the last partial one.
        (Admitted together, both would compute the whole prompt.)"""
        lead = req.leader
        return (lead is not None and self.kv.enable_prefix_caching and not lead.finished
                and lead.first_token_time is None)

    def _reserved_pages(self) -> int:
        """SGLang's reservation: the estimated remaining output of running requests."""
        tokens = sum(
            min(r.params.max_tokens - len(r.output_token_ids), 4096) for r in self.running
        )
        return self.kv.pages_for(int(tokens * self.new_token_ratio))

    def _add(self, req: Request, n: int) -> None:
        seq = ScheduledSeq(request=req, start=req.num_computed, num_tokens=n,
                           page_table=self.kv.page_table(req.request_id))
        self._scheduled[req.request_id] = seq
        self._budget -= n
        if not seq.is_decode:
            self._prefill_tokens += n

    def last_scheduled(self) -> list[ScheduledSeq]:
        """What the last (or the interrupted) pass scheduled: the requests a failed step touched."""
        return list(self._scheduled.values())

    def reset_pass(self) -> None:
        """Forget an interrupted pass's state (after the engine ended what it touched)."""
        self._scheduled = {}
        self._prefill_tokens = 0

    # ---- after the step -----------------------------------------------------------------
    def update(self, batch: Batch) -> None:
        """Advance each scheduled request past the tokens just computed; cache full pages."""
        ps = self.kv.page_size
        for seq in batch.seqs:
            req = seq.request
            before = req.num_computed
            req.num_computed = seq.end
            if self.kv.enable_prefix_caching and seq.end // ps > before // ps:
                self._commit(req)
        if batch.num_decodes:
            step = (NEW_TOKEN_RATIO_INIT - NEW_TOKEN_RATIO_MIN) / NEW_TOKEN_RATIO_STEPS
            self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - step)

    def observe(self, batch: Batch, elapsed: float) -> None:
        """Feed the iteration's forward time to the budget controller."""
        self.budget_controller.observe(elapsed, batch.num_prefill_tokens > 0)

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
