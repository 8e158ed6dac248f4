"""hlserve's throughput mode inside vLLM: a subclass of vLLM's v1 scheduler.

Turn it on in an existing deployment (hlserve installed into vLLM's environment, see
docs/vllm.md)::

    vllm serve MODEL --scheduler-cls hlserve.integrations.vllm.ThroughputScheduler \\
        --max-num-batched-tokens <max-model-len>

What it changes, each step, before vLLM's own pass runs (vLLM's pass then does the
allocation, preemption and bookkeeping exactly as it would):

- **token budget**: hlserve's ``EMABudget`` sets vLLM's per-step ``max_num_scheduled_tokens``
  (fed the measured step time; prefill steps only, warm-up skipped, a floor and a ceiling
  independent of the start); ``--max-num-batched-tokens`` stays the hard safety cap;
- **greedy prefill**: no chunk cap for agent requests (vLLM's
  ``long_prefill_token_threshold`` stays 0 unless the deployment set one), so a prompt that
  fits the budget is prefilled in one step;
- **request classes**: an interactive request (``vllm_xargs: {"request_class":
  "interactive"}``, or ``priority <= interactive_priority``) goes first, and while it waits
  for its first token or decodes, the chunk and token caps are tightened to the interactive
  caps for that step only;
- **two-stage mixing**: hlserve's ``TwoStage`` state machine; in its decode-only stage the
  pass runs with vLLM's own ``throttle_prefills`` (running prefills deferred, no admission);
- **order**: the waiting queue is rewritten in hlserve's ``AgedPrefixOrder`` (longest
  cached prefix first, with aging, at any depth), the cached prefix read from vLLM's block
  hashes incrementally;
- **admission**: hlserve's scheduler's own pass (soft backpressure with backfill): a
  request whose projected blocks do not fit what the pool can give sits out the pass while
  those behind it that fit go ahead, instead of being admitted into a preemption.

Every decision is ``plugin_policy.PluginPolicy``'s, which runs hlserve's policy code on a
view of vLLM's queue and pool; this module only reads vLLM's objects and writes the plan
back. Options: ``--additional-config '{"hlserve": {...}}'`` or ``HLSERVE_VLLM_<OPTION>``
environment variables (``plugin_policy.parse_options``). ``trace`` names a JSONL file with
one line per step. Supported vLLM: ``plugin_policy.SUPPORTED_VLLM``; any other version fails
at start-up with a message saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import vllm
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from hlserve.engine.policies.caps import NO_INTERACTIVE
from hlserve.engine.sessions import Sessions
from hlserve.integrations.plugin_policy import (
    TAG_KEY,
    PluginPolicy,
    PrefixCacheOrder,
    StepPlan,
    Trace,
    VLLMCaps,
    parse_options,
)
from hlserve.integrations.vllm.seams import cache_read_limit, session_hints, session_of
from hlserve.integrations.vllm.session_hold import SessionHold

__all__ = ["BlockHashPrefixOrder", "ThroughputAsyncScheduler", "ThroughputScheduler"]

# a child of vLLM's logger: the start-up block appears in vLLM's log, in its format
logger = init_logger("vllm.hlserve")
_ADMISSIBLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# a round that ended on its own (not aborted): its blocks may be held for the session
_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class BlockHashPrefixOrder(PrefixCacheOrder):
    """hlserve's LPM with aging over vLLM's prefix cache, which is a map from block hash to
    block rather than a tree. Each waiting request remembers how many leading blocks it
    matched; the next pass first steps back past blocks evicted since, then tries the next
    ones, so a pass costs O(1) per request when the cache changed little."""

    def __init__(self, block_pool: Any, group_ids: list[int], hash_block_size: int,
                 aging: float, enabled: bool) -> None:
        super().__init__(aging, fcfs_fallback=None)
        self._pool = block_pool
        self._groups = group_ids
        self._bs = hash_block_size
        self._enabled = enabled
        self._depth: dict[str, int] = {}
        self.lookups = 0

    def _blocks(self, req: Request, i: int) -> list[Any] | None:
        self.lookups += 1
        return self._pool.get_cached_block(req.block_hashes[i], self._groups)

    def cached_tokens(self, req: Request, step: int) -> int:
        limit_tokens = cache_read_limit(req) if self._enabled else 0
        if limit_tokens == 0:
            return 0
        depth = self._depth.get(req.request_id, 0)
        while depth > 0 and self._blocks(req, depth - 1) is None:
            depth -= 1
        # the last token is always recomputed: never count a block that ends the request
        limit = min(len(req.block_hashes), (req.num_tokens - 1) // self._bs)
        if limit_tokens is not None:  # 0.34: a request may read only its first tokens
            limit = min(limit, limit_tokens // self._bs)
        while depth < limit and self._blocks(req, depth) is not None:
            depth += 1
        self._depth[req.request_id] = depth
        return depth * self._bs

    def unheld_cached_blocks(self, req: Request) -> int:
        n = 0
        for i in range(self._depth.get(req.request_id, 0)):
            blocks = self._blocks(req, i)
            n += blocks is not None and blocks[0].ref_cnt == 0
        return n

    def forget(self, req: Request) -> None:
        super().forget(req)
        self._depth.pop(req.request_id, None)


class _ThroughputMixin:
    """The plan of ``PluginPolicy``, written into whichever vLLM scheduler class it is mixed
    into."""

    hl: PluginPolicy
    # the step's time is measured on this clock; the harness (step_harness) gives a virtual one
    hl_clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.vllm_config
        additional = cfg.additional_config if isinstance(cfg.additional_config, dict) else {}
        opts = parse_options(additional)
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(
                "hlserve's ThroughputScheduler orders the waiting queue itself (interactive "
                "requests first, then longest cached prefix with aging): run it with vLLM's "
                "default --scheduling-policy fcfs, and mark interactive requests with "
                'vllm_xargs {"request_class": "interactive"} or the interactive_priority '
                "option")
        sc = self.scheduler_config
        self._hl_base_chunk = sc.long_prefill_token_threshold
        caps = VLLMCaps(
            version=vllm.__version__, model=str(cfg.model_config.model),
            max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
            max_model_len=self.max_model_len,
            num_blocks=self.kv_cache_manager.block_pool.num_gpu_blocks - 1,  # less the null block
            block_size=self.block_size, long_prefill_token_threshold=sc.long_prefill_token_threshold,
            enable_prefix_caching=bool(self.cache_config.enable_prefix_caching),
            enable_chunked_prefill=bool(sc.enable_chunked_prefill))
        prefix = BlockHashPrefixOrder(
            self.kv_cache_manager.block_pool, list(range(len(self.kv_cache_config.kv_cache_groups))),
            self.hash_block_size, opts.config.lpm_aging, caps.enable_prefix_caching)
        self.hl = PluginPolicy(opts, caps, prefix, _own_rules, session_of)
        config = self.hl.config
        self.hl_hold: SessionHold | None = None
        if config.session_ttl is not None:
            if not caps.enable_prefix_caching:
                raise ValueError("hlserve option session_ttl holds a session's blocks for its "
                                 "next round's prefix lookup: it needs vLLM's prefix caching "
                                 "(drop --no-enable-prefix-caching)")
            self.hl_hold = SessionHold(Sessions(config.session_ttl, config.session_ttl_policy),
                                       self.kv_cache_manager.block_pool, caps.num_blocks)
        self._hl_arrival: dict[str, float] = {}
        self.hl_trace = Trace(opts.trace)
        self._hl_pending: dict[int, tuple[float, dict[str, Any] | None]] = {}
        logger.info("%s", self.hl.describe())

    # ---- the pass ------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        waiting = list(self.waiting)
        self.hl.prune(waiting, self.requests)
        hold = self.hl_hold
        if hold is not None:
            hold.expire(self.hl_clock())
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        held = hold.held_blocks if hold is not None else 0
        # vLLM counts cached blocks nobody holds as free: "what can be evicted" is all of it;
        # held session blocks are planned with as free, and given back below if needed
        usage = max(0.0, self.kv_cache_manager.usage - held / max(1, self.hl.vllm.num_blocks))
        plan = self.hl.plan(waiting, list(self.running), free + held, free + held, usage)
        if hold is not None and plan.blocks > free:
            hold.make_room(plan.blocks - free, self.hl.step)
        if plan.held or (self.hl.config.order == "lpm" and len(waiting) > 1) \
                or plan.presence != NO_INTERACTIVE:
            self._hl_requeue(plan.queue)
        self.max_num_scheduled_tokens = plan.knobs.token_budget
        sc = self.scheduler_config
        saved_bound = self.prefill_capacity_bound
        sc.long_prefill_token_threshold = plan.knobs.chunk
        if plan.decode_only:
            # vLLM's own prefill throttle (DP balancing) defers running prefill chunks and
            # admits nothing; its saturation escape is what two-stage must not take
            self.prefill_capacity_bound = False
        try:
            out = super().schedule(throttle_prefills or plan.decode_only)
        finally:
            sc.long_prefill_token_threshold = self._hl_base_chunk
            if plan.decode_only:
                self.prefill_capacity_bound = saved_bound
            for r in plan.held:  # back in the queue for the next pass, which orders it again
                self.waiting.add_request(r)
        if hold is not None:
            self._hl_admitted(out.scheduled_new_reqs)
            if len(self._hl_arrival) > 2 * len(self.requests) + 64:  # aborted while waiting
                self._hl_arrival = {k: v for k, v in self._hl_arrival.items()
                                    if k in self.requests}
        record = self._hl_record(out, plan, free, len(waiting)) if self.hl_trace.enabled else None
        self._hl_pending[id(out)] = (self.hl_clock(), record)
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any):
        now = self.hl_clock()
        t0, record = self._hl_pending.pop(id(scheduler_output), (None, None))
        if t0 is not None:
            # schedule() returned at t0 and the engine core calls this once the forward is
            # done: the step's time, which is what the budget controller follows
            self.hl.observe(now - t0, scheduler_output.total_num_scheduled_tokens,
                            len(scheduler_output.num_scheduled_tokens))
            if self.hl_hold is not None:  # the learned TTL prices a reload at this rate
                self.hl_hold.sessions.observe(now - t0, scheduler_output.total_num_scheduled_tokens)
            if record is not None:
                record["elapsed"] = round(now - t0, 6)
                record["budget_after"] = round(self.hl.budget.budget, 1)
                record["tau"] = getattr(self.hl.budget, "tau", None)
                self.hl_trace.write(record)
        return super().update_from_output(scheduler_output, model_runner_output)

    def shutdown(self) -> None:
        if self.hl_hold is not None:
            logger.info("hlserve session holds: %s", self.hl_hold.stats.as_dict())
            self.hl_hold.release_all()
        super().shutdown()
        self.hl_trace.close()

    # ---- agent sessions (session_ttl) ----------------------------------------------------

    def _free_request_blocks(self, request: Request) -> None:
        """vLLM frees a finished request's blocks here; a session's round that ended on its
        own keeps them, held until its next round, its deadline or pressure (session_hold)."""
        hold = self.hl_hold
        key = session_of(request) if hold is not None else None
        if hold is None or key is None or request.status not in _HOLDABLE:
            return super()._free_request_blocks(request)
        try:
            ttl = session_hints(request).get("ttl")
        except ValueError as e:  # the request's own hint is unreadable: the option's TTL
            logger.warning("hlserve: request %s: %s", request.request_id, e)
            ttl = None
        tokens = request.num_computed_tokens
        blocks_needed = -(-tokens // self.block_size)
        until = hold.deadline(key, self.hl_clock(), tokens, blocks_needed, ttl)
        if until is None:
            return super()._free_request_blocks(request)
        hold.take(key, self.kv_cache_manager.pop_blocks_for_free(request), until,
                  self.hl.step, tokens)
        return None

    def add_request(self, request: Request) -> None:
        if self.hl_hold is not None and session_of(request) is not None:
            # its arrival on the plugin's clock (vLLM's arrival_time is wall time): the end
            # of the session's last round to this arrival is the tool gap the TTL learns
            self._hl_arrival[request.request_id] = self.hl_clock()
        super().add_request(request)

    def _hl_admitted(self, new_requests: list[Any]) -> None:
        assert self.hl_hold is not None
        for data in new_requests:
            arrival = self._hl_arrival.pop(data.req_id, None)
            req = self.requests.get(data.req_id)
            key = session_of(req) if req is not None else None
            if key is not None and arrival is not None:
                self.hl_hold.admitted(key, arrival, data.num_computed_tokens)

    # ---- the pieces ----------------------------------------------------------------------

    def _hl_requeue(self, ordered: list[Request]) -> None:
        """Rewrite vLLM's waiting queue in this pass's order (its FCFS queue is a deque:
        vLLM's pass admits from the front)."""
        while self.waiting:
            self.waiting.pop_request()
        for r in ordered:
            self.waiting.add_request(r)

    def _hl_label(self, req: Request) -> str:
        sp = req.sampling_params
        tag = (sp.extra_args or {}).get(TAG_KEY) if sp is not None else None
        return str(tag) if tag is not None else req.request_id

    def _hl_record(self, out: SchedulerOutput, plan: StepPlan, free: int,
                   num_waiting: int) -> dict[str, Any]:
        sched = []
        for rid, n in out.num_scheduled_tokens.items():
            r = self.requests[rid]
            sched.append([self._hl_label(r), r.num_prompt_tokens, r.num_computed_tokens - n, n,
                          self.hl.class_of(r)])
        return {
            "step": self.hl.step, "t": round(time.time(), 6),
            "stage": "decode_only" if plan.decode_only else "mix",
            "budget": plan.knobs.token_budget, "chunk": plan.knobs.chunk,
            "interactive": plan.presence, "kv_usage": round(self.kv_cache_manager.usage, 4),
            "free_blocks": free, "waiting": num_waiting, "running": len(self.running),
            "held": len(plan.held), "order": [self._hl_label(r) for r in plan.order[:32]],
            "preempted": len(out.preempted_req_ids or ()), "sched": sched,
            **({"held_blocks": self.hl_hold.held_blocks, "holds": self.hl_hold.stats.as_dict()}
               if self.hl_hold is not None else {}),
        }


def _own_rules(r: Request) -> bool:
    """A waiting request that vLLM's own rules govern (remote KV, a grammar not ready): the
    plugin leaves it in the queue, in order."""
    return r.status not in _ADMISSIBLE or r.num_computed_tokens > 0


class ThroughputScheduler(_ThroughputMixin, Scheduler):
    """hlserve's throughput mode over vLLM's synchronous scheduler (what vLLM's CPU
    platform always runs, and what a GPU deployment runs with async scheduling off)."""


class ThroughputAsyncScheduler(_ThroughputMixin, AsyncScheduler):
    """The same over vLLM's async scheduler: the class for a GPU deployment, where async
    scheduling is vLLM's default (a plugin over the synchronous ``Scheduler`` would quietly
    give up the overlap of scheduling with the forward). Its step time is measured from one
    schedule() to that step's output, which the next step's scheduling overlaps. vLLM's CPU
    build never schedules asynchronously: the suite runs this class in the harness
    (``step_harness``, tests/test_vllm_versions.py) on each supported version."""
