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
- **soft backpressure**: requests whose projected blocks exceed what the pool can give sit
  out the pass (head of line), instead of being admitted into a preemption.

Options: ``--additional-config '{"hlserve": {...}}'`` or ``HLSERVE_VLLM_<OPTION>``
environment variables (``plugin_policy.PluginOptions``). ``trace`` names a JSONL file with
one line per step. Supported vLLM: ``plugin_policy.SUPPORTED_VLLM``; any other version fails
at start-up with a message saying so.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import vllm

from hlserve.integrations.plugin_policy import (
    AGENT,
    INTERACTIVE,
    INTERACTIVE_DECODING,
    INTERACTIVE_WAITING,
    NO_INTERACTIVE,
    TAG_KEY,
    PluginOptions,
    Trace,
    VLLMCaps,
    admitted_prefix,
    cdiv,
    check_vllm_version,
    describe_caps,
    parse_options,
    projected_blocks,
    request_class,
    step_caps,
)

# before vLLM's internals are imported: a version whose internals moved fails here, with a
# message that says so, not with an ImportError from deep inside vLLM
check_vllm_version(vllm.__version__)

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.request_queue import SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from hlserve.engine.policies import (  # noqa: E402
    AgedPrefixOrder,
    AlwaysMix,
    BudgetController,
    EMABudget,
    FixedBudget,
    MixingPolicy,
    MixState,
    TwoStage,
)

__all__ = ["BlockHashPrefixOrder", "ThroughputAsyncScheduler", "ThroughputScheduler"]

# a child of vLLM's logger: the start-up block appears in vLLM's log, in its format
logger = init_logger("vllm.hlserve")
_ADMISSIBLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class BlockHashPrefixOrder(AgedPrefixOrder):
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
        if not self._enabled or req.skip_reading_prefix_cache:
            return 0
        depth = self._depth.get(req.request_id, 0)
        while depth > 0 and self._blocks(req, depth - 1) is None:
            depth -= 1
        # the last token is always recomputed: never count a block that ends the request
        limit = min(len(req.block_hashes), (req.num_tokens - 1) // self._bs)
        while depth < limit and self._blocks(req, depth) is not None:
            depth += 1
        self._depth[req.request_id] = depth
        return depth * self._bs

    def unheld_cached_blocks(self, req: Request) -> int:
        """Matched blocks that nobody holds: they count as free in vLLM's pool, but
        admitting ``req`` takes them out of it."""
        n = 0
        for i in range(self._depth.get(req.request_id, 0)):
            blocks = self._blocks(req, i)
            n += blocks is not None and blocks[0].ref_cnt == 0
        return n

    def forget(self, req: Request) -> None:
        super().forget(req)
        self._depth.pop(req.request_id, None)


class _ThroughputMixin:
    """The policies, over whichever vLLM scheduler class it is mixed into."""

    hl_options: PluginOptions
    hl_budget: BudgetController
    hl_mixing: MixingPolicy
    hl_order: BlockHashPrefixOrder

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.vllm_config
        additional = cfg.additional_config if isinstance(cfg.additional_config, dict) else {}
        self.hl_options = opts = parse_options(additional)
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(
                "hlserve's ThroughputScheduler orders the waiting queue itself (interactive "
                "requests first, then longest cached prefix with aging): run it with vLLM's "
                "default --scheduling-policy fcfs, and mark interactive requests with "
                'vllm_xargs {"request_class": "interactive"} or the interactive_priority '
                "option")
        sc = self.scheduler_config
        hard = sc.max_num_batched_tokens
        ceiling = min(opts.budget_max or hard, hard)  # vLLM's input budget caps every step
        floor = min(opts.budget_min, ceiling)
        start = opts.budget_start or ceiling
        if opts.budget_controller == "ema":
            self.hl_budget = EMABudget(start, opts.ema_alpha, opts.budget_warmup, floor, ceiling)
        else:
            self.hl_budget = FixedBudget(ceiling)
        self._hl_ceiling = ceiling
        self._hl_base_chunk = sc.long_prefill_token_threshold
        self.hl_mixing = (TwoStage(opts.two_stage_high, opts.two_stage_low)
                          if opts.mixing == "two_stage" else AlwaysMix())
        self.hl_order = BlockHashPrefixOrder(
            self.kv_cache_manager.block_pool, list(range(len(self.kv_cache_config.kv_cache_groups))),
            self.hash_block_size, opts.lpm_aging, self.cache_config.enable_prefix_caching)
        self.hl_trace = Trace(opts.trace)
        self._hl_step = 0
        self._hl_pending: dict[int, tuple[float, bool, dict[str, Any] | None]] = {}
        self._hl_classes: dict[str, str] = {}
        self._hl_last_waiting: dict[str, Request] = {}
        num_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # less the null block
        self._hl_pool_blocks = num_blocks
        logger.info("%s", describe_caps(opts, VLLMCaps(
            version=vllm.__version__, max_num_batched_tokens=hard, max_num_seqs=sc.max_num_seqs,
            max_model_len=self.max_model_len, num_blocks=num_blocks, block_size=self.block_size,
            long_prefill_token_threshold=sc.long_prefill_token_threshold,
            enable_prefix_caching=bool(self.cache_config.enable_prefix_caching),
            enable_chunked_prefill=bool(sc.enable_chunked_prefill)),
            self.hl_budget.budget, floor, ceiling))

    # ---- the pass ------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._hl_step += 1
        step, opts = self._hl_step, self.hl_options
        waiting = list(self.waiting)
        self._hl_prune(waiting)
        decoding = sum(1 for r in self.running if not r.is_prefill_chunk)
        presence = self._hl_presence(waiting)
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        prefill_ok, _ = self.hl_mixing.plan(self._hl_mix_state(waiting, decoding, free))
        decode_only = not prefill_ok
        ordered = self._hl_ordered(waiting, step)
        held: list[Request] = []
        if opts.admission == "backpressure" and ordered and not decode_only:
            n = admitted_prefix(self._hl_needs(ordered), free - self._hl_running_growth(),
                                len(self.running))
            held = ordered[n:]
            ordered = ordered[:n]
        if held or (opts.order == "lpm" and len(waiting) > 1) or presence != NO_INTERACTIVE:
            self._hl_requeue(ordered)
        caps = step_caps(self.hl_budget.budget, self._hl_ceiling, self._hl_base_chunk, decoding,
                         presence, opts)
        self.max_num_scheduled_tokens = caps.token_budget
        sc = self.scheduler_config
        saved_bound = self.prefill_capacity_bound
        sc.long_prefill_token_threshold = caps.chunk
        if decode_only:
            # vLLM's own prefill throttle (DP balancing) defers running prefill chunks and
            # admits nothing; its saturation escape is what two-stage must not take
            self.prefill_capacity_bound = False
        try:
            out = super().schedule(throttle_prefills or decode_only)
        finally:
            sc.long_prefill_token_threshold = self._hl_base_chunk
            if decode_only:
                self.prefill_capacity_bound = saved_bound
            for r in held:  # back in the queue for the next pass, which orders it again
                self.waiting.add_request(r)
        has_prefill = out.total_num_scheduled_tokens > len(out.num_scheduled_tokens)
        record = None
        if self.hl_trace.enabled:
            record = self._hl_record(step, out, caps.token_budget, caps.chunk, presence,
                                     decode_only, free, waiting, ordered, held)
        self._hl_pending[id(out)] = (time.monotonic(), has_prefill, record)
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any):
        now = time.monotonic()
        t0, has_prefill, record = self._hl_pending.pop(id(scheduler_output), (None, False, None))
        if t0 is not None:
            # schedule() returned at t0 and the engine core calls this once the forward is
            # done: the step's time, which is what the budget controller follows
            self.hl_budget.observe(now - t0, has_prefill)
            if record is not None:
                record["elapsed"] = round(now - t0, 6)
                record["budget_after"] = round(self.hl_budget.budget, 1)
                record["tau"] = getattr(self.hl_budget, "tau", None)
                self.hl_trace.write(record)
        return super().update_from_output(scheduler_output, model_runner_output)

    def shutdown(self) -> None:
        super().shutdown()
        self.hl_trace.close()

    # ---- the pieces ----------------------------------------------------------------------

    def _hl_class(self, req: Request) -> str:
        cls = self._hl_classes.get(req.request_id)
        if cls is None:
            sp = req.sampling_params
            cls = request_class(sp.extra_args if sp is not None else None, req.priority,
                                self.hl_options)
            self._hl_classes[req.request_id] = cls
        return cls

    def _hl_prune(self, waiting: list[Request]) -> None:
        """Forget the order state of requests that left the queue (admitted or ended), and
        the classes of those that left the scheduler."""
        now = {r.request_id: r for r in waiting}
        for rid, req in self._hl_last_waiting.items():
            if rid not in now:
                self.hl_order.forget(req)
        self._hl_last_waiting = now
        if len(self._hl_classes) > 2 * len(self.requests) + 64:
            self._hl_classes = {k: v for k, v in self._hl_classes.items() if k in self.requests}

    def _hl_presence(self, waiting: list[Request]) -> str:
        seen = NO_INTERACTIVE
        for r in self.running:
            if self._hl_class(r) == INTERACTIVE:
                if not r.is_prefill_chunk:
                    return INTERACTIVE_DECODING
                seen = INTERACTIVE_WAITING
        if seen == NO_INTERACTIVE and any(self._hl_class(r) == INTERACTIVE for r in waiting):
            seen = INTERACTIVE_WAITING
        return seen

    def _hl_mix_state(self, waiting: list[Request], decoding: int, free: int) -> MixState:
        if not isinstance(self.hl_mixing, TwoStage):
            return MixState(0.0, 0, 0, decoding)
        bs = self.block_size
        pending = sum(cdiv(r.num_tokens - r.num_computed_tokens, bs) for r in waiting)
        pending += sum(cdiv(r.num_tokens - r.num_computed_tokens, bs)
                       for r in self.running if r.is_prefill_chunk)
        # vLLM counts cached blocks nobody holds as free: "what can be evicted" is all of it
        return MixState(self.kv_cache_manager.usage, pending, free, decoding)

    def _hl_ordered(self, waiting: list[Request], step: int) -> list[Request]:
        inter = [r for r in waiting if self._hl_class(r) == INTERACTIVE]
        rest = [r for r in waiting if self._hl_class(r) == AGENT] if inter else waiting
        inter.sort(key=lambda r: (r.priority, r.arrival_time))
        if self.hl_options.order == "lpm":
            rest = list(self.hl_order.order(rest, step))
        return inter + rest

    def _hl_running_growth(self) -> int:
        """Blocks the running requests take in this pass: the rest of a prefill, or one
        more block for a decode that crosses a block boundary."""
        bs = self.block_size
        return sum(cdiv(r.num_tokens, bs) - cdiv(r.num_computed_tokens, bs)
                   for r in self.running)

    def _hl_needs(self, ordered: list[Request]) -> Iterator[int]:
        bs, running = self.block_size, len(self.running)
        for r in ordered:
            if r.status not in _ADMISSIBLE or r.num_computed_tokens > 0:
                yield 0  # remote-KV or otherwise blocked: vLLM's own rules apply
                continue
            cached = self.hl_order.cached_tokens(r, self._hl_step)
            yield projected_blocks(r.num_tokens, r.max_tokens - r.num_output_tokens, cached, bs,
                                   self.max_model_len, self._hl_pool_blocks, running) \
                + self.hl_order.unheld_cached_blocks(r)

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

    def _hl_record(self, step: int, out: SchedulerOutput, budget: int, chunk: int,
                   presence: str, decode_only: bool, free: int, waiting: list[Request],
                   ordered: list[Request], held: list[Request]) -> dict[str, Any]:
        sched = []
        for rid, n in out.num_scheduled_tokens.items():
            r = self.requests[rid]
            sched.append([self._hl_label(r), r.num_prompt_tokens, r.num_computed_tokens - n, n,
                          self._hl_class(r)])
        return {
            "step": step, "t": round(time.time(), 6), "stage": "decode_only" if decode_only
            else "mix", "budget": budget, "chunk": chunk, "interactive": presence,
            "kv_usage": round(self.kv_cache_manager.usage, 4), "free_blocks": free,
            "waiting": len(waiting), "running": len(self.running), "held": len(held),
            "order": [self._hl_label(r) for r in (ordered + held)[:32]],
            "preempted": len(out.preempted_req_ids or ()), "sched": sched,
        }


class ThroughputScheduler(_ThroughputMixin, Scheduler):
    """hlserve's throughput mode over vLLM's synchronous scheduler (what vLLM's CPU
    platform always runs, and what a GPU deployment runs with async scheduling off)."""


class ThroughputAsyncScheduler(_ThroughputMixin, AsyncScheduler):
    """The same over vLLM's async scheduler (GPU deployments with async scheduling). Its step
    time is measured from one schedule() to that step's output, which the next step's
    scheduling overlaps. Not exercised by the test suite: vLLM's CPU build never schedules
    asynchronously."""
