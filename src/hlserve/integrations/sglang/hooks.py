"""hlserve's throughput mode as an SGLang plugin: hooks on SGLang's own scheduler classes.

Registered under SGLang's entry-point group ``sglang.srt.plugins`` as ``hlserve`` (see
pyproject.toml); SGLang's scheduler process calls ``load_plugins()`` before it builds its
``Scheduler``, which runs ``register`` and applies the hooks (``HookRegistry``). A deployment
that restricts plugins names it: ``SGLANG_PLUGINS=hlserve``. Options are the vLLM plugin's
(``plugin_policy.parse_options``), from ``HLSERVE_SGLANG_<OPTION>`` variables.

What each hook changes (docs/sglang.md):

- ``Scheduler.init_chunked_prefill`` (after): greedy prefill, no chunk cap
  (``chunked_prefill_size`` None), no prefill/decode interval; mixing on for ``two_stage`` and
  ``always`` (SGLang's ``is_mixed_chunk``);
- ``Scheduler.init_schedule_policy`` (after): the prefill delayer off; the plugin's state
  built and every cap in force logged;
- ``Scheduler.get_new_batch_prefill`` (around): hlserve's ``TwoStage`` switch (its
  decode-only stage forms no prefill batch), and the EMA budget as SGLang's per-step
  ``max_prefill_tokens``;
- ``Scheduler.get_next_batch_to_run`` (around): the step's time, from one step's scheduling
  to the next, fed to the budget controller; the per-step trace;
- ``SchedulePolicy._determine_active_policy`` (around): LPM at any queue depth (SGLang falls
  back to FCFS past 128 waiting), ranked with hlserve's aging (``_sort_by_longest_prefix``);
- ``Scheduler._abort_on_queued_limit`` (around): soft backpressure: a request past
  ``--max-queued-requests`` waits instead of being aborted;
- ``PrefillAdder.add_one_req`` (around): hlserve's admission pass (``AdmitPass``, with the
  ``backpressure`` policy and backfill): a request that does not fit sits out and those
  behind it that fit go ahead (SGLang stops its pass at the first that does not fit);
- ``schedule_batch.release_req`` (around), within ``ScheduleBatch.retract_decode`` (around):
  a retracted request's computed full pages go into the radix cache before its row is freed
  (SGLang frees them), so its recompute is a hit.

The rules are ``hlserve.engine.policies``' (``TwoStage``, ``EMABudget``, the caps block);
this module only reads SGLang's objects and writes its knobs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import sglang

from hlserve.config import EngineConfig
from hlserve.engine.policies.admission import (
    BACKFILL_MAX_SKIPS,
    Admission,
    Admit,
    AdmitPass,
    Candidate,
    PoolShape,
)
from hlserve.engine.policies.budget import BudgetController, make_budget_controller
from hlserve.engine.policies.caps import HostCaps, describe_caps
from hlserve.engine.policies.mixing import MixingPolicy, make_mixing, mix_state
from hlserve.integrations.plugin_policy import PluginOptions, Trace, parse_options

# The hooks name SGLang's internal methods, which move between releases: each supported
# version was read and tested; anything else is refused when the plugin loads.
SUPPORTED_SGLANG: tuple[str, ...] = ("0.5.23",)
ENV_PREFIX = "HLSERVE_SGLANG_"
logger = logging.getLogger("sglang.hlserve")


class UnsupportedSGLangError(RuntimeError):
    pass


def check_sglang_version(version: str) -> None:
    if version not in SUPPORTED_SGLANG:
        raise UnsupportedSGLangError(
            f"hlserve's SGLang plugin supports SGLang {', '.join(SUPPORTED_SGLANG)}, found "
            f"SGLang {version!r}. Its hooks name SGLang's internal scheduler methods, which "
            "change between releases: install a supported SGLang, or leave the plugin out "
            "(SGLANG_PLUGINS without hlserve).")


# ---- the plugin's state, one per scheduler ----------------------------------------------------


class ThroughputState:
    """Throughput mode's policies for one SGLang scheduler, and its step bookkeeping."""

    def __init__(self, s: Any, opts: PluginOptions) -> None:
        total = int(s.max_total_num_tokens)
        self.opts = opts
        self.total_tokens, self.page_size = total, int(s.page_size)
        c = opts.config
        self.config: EngineConfig = c.replace(
            model=str(getattr(s.model_config, "model_path", "")), chunk_size=None,
            max_num_seqs=int(s.max_running_requests), max_model_len=int(s.max_req_len),
            page_size=self.page_size, num_pages=total // self.page_size,
            budget_max=min(c.budget_max or total, total))
        self.budget: BudgetController = make_budget_controller(self.config, total)
        self.mixing: MixingPolicy = make_mixing(self.config)
        self.trace = Trace(opts.trace)
        self.clock: Callable[[], float] = time.monotonic  # the harness sets its own
        self.step = 0
        self.decode_only = False
        self._since: dict[str, int] = {}  # rid -> step it was first ranked (LPM aging)
        self._pending: tuple[float, dict[str, Any]] | None = None
        self.held_back = 0  # requests past --max-queued-requests that waited instead
        # hlserve's admission pass over SGLang's queue (its PrefillAdder still checks each
        # admitted request against its own budget)
        self.admission = Admission(self.config, int(s.max_req_len))
        self.pool = PoolShape(self.page_size, total // self.page_size)
        self.admit_pass: AdmitPass | None = None
        self.pass_taken = 0  # pages the pass admitted (SGLang allocates them after it)
        self.backfilled = 0  # requests admitted past one that sat out
        self.retract_cached = 0  # tokens of retracted requests kept in the radix cache

    def describe(self, s: Any) -> str:
        notes = (f"  sglang  chunked_prefill_size off (greedy prefill); prefill delayer off; "
                 f"mixed batches {'on' if s.is_mixed_chunk else 'off'}; "
                 f"max_queued_requests {s.max_queued_requests} "
                 f"{'(waits, no abort)' if self.config.admission == 'backpressure' else ''}",
                 "  sglang  admission: hlserve's pass with backfill, then SGLang's PrefillAdder "
                 "budget for each admitted; a retracted request's computed pages kept in the "
                 "radix cache")
        host = HostCaps(f"hlserve throughput mode on SGLang {sglang.__version__}: caps in force",
                        self.total_tokens // self.page_size, self.page_size,
                        int(s.max_req_len), "pages",
                        (("safety", "max_running_requests", s.max_running_requests,
                          "SGLang's running-request limit"),),
                        notes)
        return describe_caps(self.config, host, self.budget)

    def kv_view(self, s: Any) -> tuple[float, int]:
        """(fraction of the pool live requests hold, evictable pages)."""
        free = s.token_to_kv_pool_allocator.available_size()
        evictable = s.tree_cache.evictable_size()
        used = max(0, self.total_tokens - free - evictable)
        return used / self.total_tokens, evictable // self.page_size


def state_of(s: Any) -> ThroughputState | None:
    return getattr(s, "hlserve", None)


def _options() -> PluginOptions:
    opts = parse_options(None, os.environ, ENV_PREFIX)
    # the options the vLLM plugin runs and this one does not yet: refused, not ignored
    c = opts.config
    unsupported = {
        "session_ttl": c.session_ttl is not None, "order": c.order not in ("lpm", "fcfs"),
        "admission": c.admission != "backpressure",
        "interactive_priority": opts.interactive_priority is not None,
    }
    if bad := [k for k, v in unsupported.items() if v]:
        raise ValueError(f"hlserve's SGLang plugin does not run option(s) {', '.join(bad)} "
                         "yet (docs/sglang.md): unset them")
    return opts


# ---- the hooks ----------------------------------------------------------------------------------


def after_init_chunked_prefill(result: Any, s: Any) -> None:
    opts = _options()
    s.chunked_prefill_size = None  # greedy prefill: a prompt goes in one step
    s.prefill_decode_interval = 0  # a latency cap: decode steps forced between prefills
    s.is_mixed_chunk = opts.config.mixing in ("two_stage", "always")


def after_init_schedule_policy(result: Any, s: Any) -> None:
    s.prefill_delayer = None  # a latency cap: holds new prefill while decodes run
    s.hlserve = ThroughputState(s, _options())
    logger.info("%s", s.hlserve.describe(s))


def around_get_new_batch_prefill(original: Callable[..., Any], s: Any, running_batch: Any) -> Any:
    st = state_of(s)
    if st is None:
        return original(s, running_batch)
    usage, evictable = st.kv_view(s)
    state = mix_state(st.mixing, usage, evictable, st.page_size,
                      (len(r.origin_input_ids) + len(r.output_ids) for r in s.waiting_queue),
                      (1 for _ in running_batch.reqs))
    prefill_ok, _ = st.mixing.plan(state)
    st.decode_only = not prefill_ok
    if st.decode_only and not running_batch.is_empty():
        from sglang.srt.managers.schedule_batch import NextBatchPlan
        return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
    saved = s.max_prefill_tokens
    s.max_prefill_tokens = max(1, int(st.budget.budget))
    st.admit_pass = st.admission.begin(st.step, len(running_batch.reqs),
                                       int(s.chunked_req is not None))
    # a mixed step also grows each decode by a token: a page where its last one is full
    st.pass_taken = (sum(r.kv.kv_committed_len % st.page_size == 0 for r in running_batch.reqs)
                     if s.is_mixed_chunk else 0)
    try:
        return original(s, running_batch)
    finally:
        s.max_prefill_tokens = saved
        st.admit_pass = None


def around_get_next_batch_to_run(original: Callable[..., Any], s: Any, *args: Any,
                                 **kwargs: Any) -> Any:
    st = state_of(s)
    if st is None:
        return original(s, *args, **kwargs)
    now = st.clock()
    if st._pending is not None:  # the last step's forward and output processing are done
        t0, record = st._pending
        st.budget.observe(now - t0, record["mode"] in ("prefill", "mixed"))
        record.update(elapsed=round(now - t0, 6), budget_after=round(st.budget.budget, 1),
                      tau=getattr(st.budget, "tau", None))
        st.trace.write(record)
        st._pending = None
    budget = int(st.budget.budget)
    plan = original(s, *args, **kwargs)
    batch = plan.batch_to_run
    if batch is not None:
        st.step += 1
        usage, _ = st.kv_view(s)
        mode = ("decode" if not batch.forward_mode.is_extend()
                else "mixed" if batch.decoding_reqs else "prefill")
        st._pending = (st.clock(), {
            "step": st.step, "stage": "decode_only" if st.decode_only else "mix",
            "mode": mode, "budget": budget, "chunk": None, "kv_usage": round(usage, 4),
            "waiting": len(s.waiting_queue), "running": plan.running_batch.batch_size(),
            "sched": [r.rid for r in batch.reqs][:64],
            "extend_tokens": int(batch.extend_num_tokens or 0)})
    return plan


def around_determine_active_policy(original: Callable[..., Any], policy: Any,
                                   waiting_queue: list[Any]) -> Any:
    from sglang.srt.managers.schedule_policy import CacheAwarePolicy
    if _ACTIVE.get("order") == "lpm" and policy.policy == CacheAwarePolicy.LPM:
        return policy.policy  # LPM at any depth: no FCFS fallback past 128 waiting
    return original(policy, waiting_queue)


def around_sort_by_longest_prefix(original: Callable[..., Any], waiting_queue: list[Any],
                                  temporary_deprioritized: set[Any]) -> None:
    st = _ACTIVE.get("state")
    if st is None or st.config.order != "lpm":
        return original(waiting_queue, temporary_deprioritized)
    step, aging, since = st.step, st.config.lpm_aging, st._since
    def key(r: Any) -> tuple[float, float]:
        if r.rid in temporary_deprioritized:  # SGLang's in-batch prefix sharing, kept
            return (float("inf"), 0.0)
        waited = step - since.setdefault(r.rid, step)
        return (-(r.num_matched_prefix_tokens + aging * waited), 0.0)
    waiting_queue.sort(key=key)  # stable: ties keep the queue's (arrival) order
    if len(since) > 4 * len(waiting_queue) + 1024:  # forget the admitted
        alive = {r.rid for r in waiting_queue}
        st._since = {k: v for k, v in since.items() if k in alive}
    return None


def around_abort_on_queued_limit(original: Callable[..., Any], s: Any, req: Any) -> bool:
    st = state_of(s)
    if st is None or st.config.admission != "backpressure":
        return original(s, req)
    if s.max_queued_requests is not None and len(s.waiting_queue) + 1 > s.max_queued_requests:
        st.held_back += 1  # soft backpressure: it waits, as everything past the pool does
    return False


def _unheld_cached_pages(tree: Any, node: Any, page_size: int) -> int:
    """Pages of a request's matched prefix that no running request holds: the pool counts
    them as evictable, but admitting the request locks them."""
    pages = 0
    while node is not None and node is not tree.root_node:
        if node.lock_ref == 0:
            pages += len(node.value) // page_size
        node = node.parent
    return pages


def _candidate(st: ThroughputState, adder: Any, req: Any) -> Candidate:
    """A waiting request as hlserve's pass sees it, after SGLang matched its prefix."""
    num_tokens = len(req.origin_input_ids) + len(req.output_ids)
    cached = min(int(req.prefix_len), num_tokens - 1)
    new = num_tokens - cached
    if adder.rem_chunk_tokens is not None:
        new = max(1, min(new, int(adder.rem_chunk_tokens)))
    pool = st.pool
    return Candidate(req.rid, num_tokens,
                     max(0, req.sampling_params.max_new_tokens - len(req.output_ids)), cached,
                     new, pool.pages_for(cached + new) - cached // pool.page_size,
                     _unheld_cached_pages(adder.tree_cache, req.last_node, pool.page_size))


def around_add_one_req(original: Callable[..., Any], adder: Any, req: Any, *args: Any,
                       **kwargs: Any) -> Any:
    """hlserve's admission pass with backfill on SGLang's PrefillAdder: ``Admit.WAIT`` (the
    request does not fit the pool's real headroom) passes over the request, which stays
    queued, and the pass goes on; SGLang's own check still runs for each admitted one, and
    a request it refuses for want of tokens is passed over the same way."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    st = _ACTIVE.get("state")
    ap = st.admit_pass if st is not None else None
    if ap is None:
        return original(adder, req, *args, **kwargs)
    c = _candidate(st, adder, req)
    free = adder.token_to_kv_pool_allocator.available_size() + adder.tree_cache.evictable_size()
    available = free // st.page_size - st.pass_taken
    verdict = ap.decide(c, available, st.pool.num_pages - available, st.pool)
    if verdict == Admit.STOP:
        return AddReqResult.OTHER
    if verdict != Admit.YES:  # sits out; those behind it are looked at
        return AddReqResult.CONTINUE
    skipped = ap.skips
    res = original(adder, req, *args, **kwargs)
    if res == AddReqResult.NO_TOKEN and adder.budget_state() != AddReqResult.NO_TOKEN:
        # SGLang's budget refused this one but has room left: pass over it too
        ap.skips += 1
        return res if ap.skips >= BACKFILL_MAX_SKIPS else AddReqResult.CONTINUE
    if req in adder.can_run_list or adder.new_chunked_req is req:
        ap.admitted(c)
        st.admission.forget(req.rid)
        st.pass_taken += c.chunk_pages + c.locked_pages
        st.backfilled += skipped > 0
    return res


def around_release_req(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A retracted request's computed full pages go into the radix cache before SGLang
    frees its row: they become evictable rather than free (SGLang's retraction loop and
    its allocator evict them where the room is needed), and its recompute after
    re-admission matches them. Only in ``retract_decode`` (SGLang's other callers retract
    for a weight update, whose KV must not be reused), and only where that insert is
    SGLang's plain one: a radix cache without mamba or sliding-window state or bigram
    (EAGLE) keys, not in decode disaggregation (which backs the KV up to the host instead),
    not a request being aborted or barred from the cache."""
    req, tree = kwargs["req"], kwargs["tree_cache"]
    st = _ACTIVE.get("state")
    if (st is not None and _ACTIVE.get("retracting") and kwargs.get("offload_kv", True)
            and kwargs.get("hisparse_coordinator") is None and req.to_finish is None
            and not req.finished() and req.kv.holds_kv and not req.skip_radix_cache_insert
            and _plain_radix(tree)):
        from sglang.srt.runtime_context import get_disagg
        if get_disagg().disaggregation_mode != "decode":
            _insert_in_pieces(req, tree, st)
    return original(*args, **kwargs)


# at most this many radix nodes per retracted request (its pages, in pieces)
RETRACT_PIECES = 32


def _insert_in_pieces(req: Any, tree: Any, st: ThroughputState) -> None:
    """release_kv_cache(checkpoint=True)'s insert (``RadixCache.checkpoint``), for a request
    that goes on later, in pieces: each becomes a radix node of its own, so that SGLang's
    eviction, which frees whole leaves from the tail, takes only the pages it needs. In one
    piece, the first eviction right after the retraction (``release_req`` makes room for the
    next decode steps, and in a full pool nothing else is evictable) would take all of the
    decoded tokens' pages at once."""
    req.refresh_fill_ids()
    page = int(tree.page_size)
    start = int(req.kv.cache_protected_len) // page * page
    end = int(req.owned_kv_len()) // page * page
    if end <= start:
        return
    step = page * max(1, -(-(end - start) // page // RETRACT_PIECES))
    for up_to in [*range(start + step, end, step), end]:
        tree.checkpoint(req, up_to=up_to)
    st.retract_cached += max(0, int(req.kv.cache_protected_len) - start)


def around_retract_decode(original: Callable[..., Any], batch: Any, *args: Any,
                          **kwargs: Any) -> Any:
    """Marks the releases that ``retract_decode`` makes (the decode memory check's)."""
    _ACTIVE["retracting"] = True
    try:
        return original(batch, *args, **kwargs)
    finally:
        _ACTIVE["retracting"] = False


def _plain_radix(tree: Any) -> bool:
    from sglang.srt.mem_cache.radix_cache import RadixCache
    return (type(tree) is RadixCache and not tree.disable and not tree.supports_mamba()
            and not getattr(tree, "is_eagle", False))


# SchedulePolicy's hooks have no scheduler in hand: the process's one scheduler's state
_ACTIVE: dict[str, Any] = {}


def _track_active(result: Any, s: Any) -> None:
    _ACTIVE["state"] = s.hlserve
    _ACTIVE["order"] = s.hlserve.config.order


_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_POLICY = "sglang.srt.managers.schedule_policy.SchedulePolicy"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_BATCH = "sglang.srt.managers.schedule_batch"


def register() -> None:
    """SGLang's entry point (group ``sglang.srt.plugins``, name ``hlserve``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_sglang_version(sglang.__version__)
    _options()  # an invalid option fails here, at start-up, with EngineConfig's message
    after, around = HookType.AFTER, HookType.AROUND
    for target, hook, kind in (
        (f"{_SCHED}.init_chunked_prefill", after_init_chunked_prefill, after),
        (f"{_SCHED}.init_schedule_policy", after_init_schedule_policy, after),
        (f"{_SCHED}.init_schedule_policy", _track_active, after),
        (f"{_SCHED}.get_new_batch_prefill", around_get_new_batch_prefill, around),
        (f"{_SCHED}.get_next_batch_to_run", around_get_next_batch_to_run, around),
        (f"{_SCHED}._abort_on_queued_limit", around_abort_on_queued_limit, around),
        (f"{_POLICY}._determine_active_policy", around_determine_active_policy, around),
        (f"{_POLICY}._sort_by_longest_prefix", around_sort_by_longest_prefix, around),
        (f"{_ADDER}.add_one_req", around_add_one_req, around),
        (f"{_BATCH}.release_req", around_release_req, around),
        (f"{_BATCH}.ScheduleBatch.retract_decode", around_retract_decode, around),
    ):
        HookRegistry.register(target, hook, kind)
