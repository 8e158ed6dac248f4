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

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from hlserve.config import EngineConfig
from hlserve.engine.batch import Batch, ScheduledSeq
from hlserve.engine.kv_cache import KVCacheManager, Node
from hlserve.engine.policies.admission import Admission, Admit, AdmitPass, Candidate
from hlserve.engine.policies.budget import StepTimeCap, make_budget_controller
from hlserve.engine.policies.caps import (
    StepCaps,
    chunk_tokens,
    interactive_presence,
    step_caps,
)
from hlserve.engine.policies.lpm import LongestPrefixMatch
from hlserve.engine.policies.mixing import MixState, make_mixing, mix_state
from hlserve.engine.policies.order import interactive_first, make_order
from hlserve.engine.policies.retraction import make_retraction
from hlserve.engine.spec_decode import SpecDecoder
from hlserve.request import Request, RequestClass, RequestStatus

INTERACTIVE = RequestClass.INTERACTIVE
# SGLang's estimate of how much of its max_tokens a running request will still use
NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_STEPS = 0.7, 0.098, 600
SHARED_SPAN_PAGES = 2  # uncached pages two requests must share for one to wait for the other


def _is_interactive(r: Request) -> bool:
    return r.request_class is INTERACTIVE


def _is_decoding(r: Request) -> bool:
    return not r.in_prefill


@dataclass(slots=True)
class _Admitting:
    """What deciding found out about a waiting request, which committing its admission uses."""

    candidate: Candidate
    tokens: list[int]
    nodes: list[Node]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 max_model_len: int | None = None, spec: SpecDecoder | None = None) -> None:
        self.config = config
        self.kv = kv
        self.spec = spec  # speculative decoding (engine/spec_decode.py); None: off
        self.max_model_len = max_model_len or config.max_model_len
        self.order = make_order(config, lambda: LongestPrefixMatch(
            kv, config.lpm_aging, config.lpm_fcfs_fallback))
        self.mixing = make_mixing(config)
        self.admission = Admission(config, self.max_model_len)
        self.retraction = make_retraction(config)
        self.budget_controller = make_budget_controller(config, kv.num_pages * kv.page_size)
        self.time_cap = StepTimeCap(config.max_step_seconds)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order
        self.rejected: list[Request] = []  # refused by admission; the engine ends them
        self.step = 0
        self.num_retractions = 0
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._last_admit_step = -(10**9)
        self.caps = StepCaps(math.inf, 0)  # the last pass's caps (before it spent its budget)
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

    def remove(self, req: Request, retain_until: float | None = None) -> None:
        """Take a request out (finished or aborted) and release its pages to the cache,
        retained until ``retain_until`` if given (a finished session round)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._forget(req)
        if self.kv.holds(req.request_id):
            self._release(req, retain_until)

    def _forget(self, req: Request) -> None:
        """The request left the waiting queue (admitted, rejected or ended)."""
        self.order.forget(req)
        self.admission.forget(req.request_id)

    def _commit(self, req: Request) -> None:
        """Put the request's newly full, computed pages into the prefix tree, handing the KV
        manager only the tokens after those already there (not a copy of the context)."""
        start = self.kv.committed_tokens(req.request_id)
        self.kv.commit(req.request_id, req.tokens(start, req.num_computed), req.num_computed,
                       offset=start)

    def _release(self, req: Request, retain_until: float | None = None) -> None:
        """Release a request's pages; its computed full pages stay cached."""
        if self.kv.enable_prefix_caching:
            self._commit(req)
        self.kv.release(req.request_id, retain_until)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the pass -----------------------------------------------------------------------
    def schedule(self) -> Batch:
        self.step += 1
        self.caps = self._caps()
        self._chunk, self._budget = self.caps
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

    def _caps(self) -> StepCaps:
        """Chunk size and token budget of this iteration."""
        presence = interactive_presence(self.running, self.waiting, _is_interactive, _is_decoding)
        budget = min(self.budget_controller.budget, self.time_cap.limit)
        return step_caps(self.config, budget, presence)

    def _mix_state(self) -> MixState:
        return mix_state(self.mixing, self.kv.usage, self.kv.num_evictable, self.kv.page_size,
                         (r.num_uncomputed for r in self.waiting),
                         (r.num_uncomputed for r in self.running))

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
            # draft tokens take only what the decodes leave of the budget
            spare = self._budget - len(decoding)
            if self.spec is not None:
                self.spec.begin_step(len(decoding), spare)  # this step's k (adaptive)
            for req in decoding:
                if req.status is RequestStatus.RUNNING and req.request_id not in scheduled \
                        and self._reserve(req, req.num_computed + 1):
                    draft = self._draft(req, spare) if self.spec is not None else []
                    spare -= len(draft)
                    self._add(req, 1 + len(draft), draft)
        if prefill:
            for req in prefilling:
                if req.status is not RequestStatus.RUNNING or req.request_id in self._scheduled:
                    continue  # retracted earlier in this pass
                n = chunk_tokens(req.num_uncomputed, self._chunk, self._budget)
                if n >= 1 and self._reserve(req, req.num_computed + n):
                    self._add(req, n)

    def _draft(self, req: Request, spare: float) -> list[int]:
        """A decoding request's draft tokens, with KV slots: pages the pool gives without
        retracting anyone (a draft never costs another request its place), else as many
        drafts as the request's pages already hold."""
        assert self.spec is not None
        draft = self.spec.draft(req, spare, self.max_model_len)
        if draft and not self.kv.allocate(req.request_id, req.num_computed + 1 + len(draft)):
            room = len(self.kv.page_table(req.request_id)) * self.kv.page_size
            draft = draft[: max(0, room - req.num_computed - 1)]
        return draft

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
            if seq.is_prefill:
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
        return interactive_first(self.waiting, _is_interactive, self.order, self.step)

    def _admit_waiting(self) -> None:
        cfg = self.config
        if self._retracted or not self.waiting:
            return
        if cfg.prefill_delay and self.step - self._last_admit_step < cfg.prefill_delay \
                and any(not r.in_prefill for r in self.running):
            return  # the delayer holds new prefill to protect running decodes
        ap = self.admission.begin(self.step, len(self.running),
                                  sum(1 for r in self.running if r.in_prefill))
        computing: set[tuple[Node | str | None, tuple[int, ...]]] = set()  # (where, next tokens) in prefill
        for req in list(self._waiting_order()):
            if ap.full(self._budget, self._prefill_tokens):
                break
            verdict, adm = self._decide_admission(req, ap, computing)
            if verdict == Admit.STOP:
                break
            if verdict == Admit.REJECT:
                self.waiting.remove(req)
                self._forget(req)
                self.rejected.append(req)
            elif verdict == Admit.YES:
                assert adm is not None
                self._commit_admission(req, adm)
                ap.admitted(adm.candidate)

    def _decide_admission(self, req: Request, ap: AdmitPass,
                          computing: set[tuple[Node | str | None, tuple[int, ...]]],
                          ) -> tuple[str, _Admitting | None]:
        """Whether ``req`` is admitted now: the pass's verdict, and what committing needs.
        ``Admit.WAIT`` with nothing: skipped here (a sibling behind its leader, or a prefix
        another request prefills in this very iteration)."""
        cfg, ps = self.config, self.kv.page_size
        if self._follows_leader(req):
            return Admit.WAIT, None
        tokens = req.all_token_ids
        nodes = self.kv.match_prefix(tokens, len(tokens) - 1, req.cache_salt)
        cached = len(nodes) * ps
        n = chunk_tokens(len(tokens) - cached, self._chunk, self._budget)
        span = SHARED_SPAN_PAGES * ps
        if cfg.defer_shared_prefill and len(tokens) - cached >= span:
            # in-batch prefix sharing: a request whose next uncached tokens another
            # request is prefilling in this very iteration waits one iteration and then
            # finds them cached, instead of computing them a second time
            run = (nodes[-1] if nodes else req.cache_salt, tuple(tokens[cached : cached + span]))
            if run in computing:
                return Admit.WAIT, None
            computing.add(run)
        c = Candidate(req.request_id, len(tokens), req.params.max_tokens - len(req.output_token_ids),
                      cached, n, self.kv.pages_for(cached + n) - len(nodes),
                      sum(1 for nd in nodes if nd.ref == 0),
                      self._reserved_pages() if self.admission.policy.reserves else 0)
        available = self.kv.available()
        if cfg.session_hold and not req.returning and self.running:
            # Continuum's pinning (engine/sessions.py): a new program does not take the
            # pages other sessions keep through their tool calls while anything else runs
            available -= self.kv.num_pinned - self.kv.pinned_among(nodes)
        verdict = ap.decide(c, available, self.kv.num_used, self.kv)
        return verdict, _Admitting(c, tokens, nodes) if verdict == Admit.YES else None

    def _commit_admission(self, req: Request, adm: _Admitting) -> None:
        """Admit ``req``: lock its cached prefix, give it pages for its first chunk, and
        schedule that chunk in this pass."""
        tokens, n = adm.tokens, adm.candidate.num_new_tokens
        cached = self.kv.admit(req.request_id, tokens, len(tokens) - 1, matched=adm.nodes,
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
        self.order.admitted(req)
        self._forget(req)
        self.running.append(req)
        self._add(req, n)
        self._last_admit_step = self.step

    def _follows_leader(self, req: Request) -> bool:
        """A forked sibling (n > 1) waits until its leader has prefilled the shared prompt:
        then its full pages are cached and the sibling computes only the last partial one.
        (Admitted together, both would compute the whole prompt.)"""
        lead = req.leader
        return (lead is not None and self.kv.enable_prefix_caching and not lead.finished
                and lead.first_token_time is None)

    def _reserved_pages(self) -> int:
        """SGLang's reservation: the estimated remaining output of running requests (with
        ``reserve_fixed_length_in_full``, an ignore_eos request's in full, as SGLang 0.5.23)."""
        full = self.config.reserve_fixed_length_in_full
        estimated = fixed = 0
        for r in self.running:
            left = min(r.params.max_tokens - len(r.output_token_ids), 4096)
            if full and r.params.ignore_eos:
                fixed += left
            else:
                estimated += left
        return self.kv.pages_for(int(estimated * self.new_token_ratio) + fixed)

    def _add(self, req: Request, n: int, draft: list[int] | None = None) -> None:
        seq = ScheduledSeq(request=req, start=req.num_computed, num_tokens=n,
                           page_table=self.kv.page_table(req.request_id))
        if draft:
            seq.draft = draft
        self._scheduled[req.request_id] = seq
        self._budget -= n
        if seq.is_prefill:
            self._prefill_tokens += n

    def last_scheduled(self) -> list[ScheduledSeq]:
        """What the last (or the interrupted) pass scheduled: the requests a failed step touched."""
        return list(self._scheduled.values())

    def reset_pass(self) -> None:
        """Forget an interrupted pass's state (after the engine ended what it touched)."""
        self._scheduled = {}
        self._prefill_tokens = 0

    # ---- after the step -----------------------------------------------------------------
    def update(self, batch: Batch, accepted: Mapping[str, Sequence[int]] | None = None) -> None:
        """Advance each scheduled request past the tokens just computed; cache full pages.

        A speculating request advances past its last known token and its ``accepted`` drafts
        only, before the engine appends them: it may briefly count more computed tokens than
        it has, until the appends catch up (or it ends, and ``Engine._finish`` cuts it back);
        :meth:`settle_draft` then caches and trims its pages."""
        ps = self.kv.page_size
        for seq in batch.seqs:
            req = seq.request
            before = req.num_computed
            if seq.draft:
                req.num_computed = seq.start + 1 + len((accepted or {}).get(req.request_id, ()))
                continue
            req.num_computed = seq.end
            if self.kv.enable_prefix_caching and seq.end // ps > before // ps:
                self._commit(req)
        if batch.num_decodes:
            step = (NEW_TOKEN_RATIO_INIT - NEW_TOKEN_RATIO_MIN) / NEW_TOKEN_RATIO_STEPS
            self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - step)

    def settle_draft(self, req: Request) -> None:
        """After a speculating request's tokens were appended (and it goes on): cache its
        newly full pages, and free the pages that only rejected drafts used, so the pool
        balances as if it had decoded its tokens one by one."""
        if self.kv.enable_prefix_caching:
            self._commit(req)
        self.kv.trim(req.request_id, req.num_computed)

    def observe(self, batch: Batch, elapsed: float) -> None:
        """Feed the iteration's forward time to the budget controller, the time cap and
        speculation's step-cost fit."""
        self.budget_controller.observe(elapsed, batch.num_prefill_tokens > 0)
        self.time_cap.observe(elapsed, batch.num_tokens)
        if self.spec is not None:
            self.spec.observe_step(batch.num_tokens, elapsed)

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
