"""SGLang's scheduler driven on the CPU: SGLang's scheduling code in, a runner's outputs out.

SGLang 0.5.23's ``Scheduler.__init__`` starts a model worker (CUDA kernels, a loaded model),
ZMQ sockets to its tokenizer and detokenizer processes and torch.distributed groups; none of
that runs on this CPU, and none of it decides what a step holds. So the harness builds the
scheduler object the narrowest way (``Scheduler.__new__``), sets what its constructor would
have set for a single-rank, non-overlap, text-only deployment, and runs SGLang's own
``init_*`` methods for the scheduling state (``init_running_status``,
``init_chunked_prefill``, ``init_schedule_policy``). The pools are SGLang's real ones on the
CPU (``ReqToTokenPool``, ``PagedTokenToKVPoolAllocator``, ``RadixCache``), and every step is
SGLang's ``get_next_batch_to_run`` (which runs ``get_new_batch_prefill``: its
``SchedulePolicy`` and ``PrefillAdder``; and ``update_running_batch``: its decode memory
check and ``retract_decode``), building real ``ScheduleBatch`` objects.

The boundary is the forward and its output processing: ``StandInRunner.run`` takes the
batch SGLang scheduled and does what ``run_batch`` + ``process_batch_result`` do with a
model's sampled tokens, with made-up tokens: each request that ends its prefill or decodes
gets one output token, its finish state is SGLang's (``Req.update_finish_state``: max
tokens), a finished request's KV goes back through SGLang's ``release_kv_cache`` (into the
radix cache) and a prefilled one's through ``checkpoint_kv_cache``. Its ``cost`` says how long
the step took (a cost model in the study; tokens x a constant by default), which is the
clock the plugin's budget controller reads.

docs/sglang.md says what is set by hand and why. This module imports SGLang: it runs in an
environment with SGLang 0.5.23 (``.ci/sglang-env``).
"""

from __future__ import annotations

import json
import tempfile
import zlib
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.runtime_context import SpawnRanks, get_context, get_schedule, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

# a llama-shaped config: SGLang's ModelConfig reads it; no weights are loaded
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1000, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


@dataclass(frozen=True)
class HarnessConfig:
    """A deployment's scheduling flags (SGLang's names) and the pool's size."""

    num_tokens: int = 4096  # KV pool, tokens
    page_size: int = 16
    max_running_requests: int = 8
    max_model_len: int = 4096
    chunked_prefill_size: int | None = 1024
    max_prefill_tokens: int = 4096
    schedule_policy: str = "lpm"
    enable_mixed_chunk: bool = False
    max_queued_requests: int | None = None


@dataclass(frozen=True)
class Request:
    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    # False: SGLang reserves only a fraction of its output (its new-token ratio), as for a
    # request that may stop early; the stand-in never emits EOS, so such requests overcommit
    # the pool and SGLang retracts
    ignore_eos: bool = True


@dataclass
class Step:
    """One step's decision as SGLang made it, and the pool after its forward."""

    index: int
    mode: str  # "prefill" | "mixed" | "decode" | "idle"
    sched: list[tuple[str, int, int, str]]  # (rid, first position, tokens, kind) per request
    prefill_tokens: int
    retracted: list[tuple[str, int]]  # (rid, tokens whose KV it had computed) per retraction
    waiting: int
    running: int
    elapsed: float
    free_tokens: int  # allocator, after the step's output processing
    evictable_tokens: int  # radix cache
    kv_usage: float = 0.0  # the pool's fraction live requests held when the step was decided
    stage: str | None = None  # the plugin's two-stage switch ("mix" | "decode_only"); stock: None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RunResult:
    steps: list[Step] = field(default_factory=list)
    finished: dict[str, list[int]] = field(default_factory=dict)  # rid -> output tokens
    aborted: dict[str, str] = field(default_factory=dict)


def model_dir(root: Path | None = None) -> Path:
    """A directory with the llama-shaped config.json SGLang's ModelConfig reads."""
    root = Path(root or tempfile.mkdtemp(prefix="hlserve-sglang-"))
    (root / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return root


def server_args(cfg: HarnessConfig, model: Path) -> ServerArgs:
    return ServerArgs(
        model_path=str(model), device="cpu", skip_tokenizer_init=True, load_format="dummy",
        disable_overlap_schedule=True, page_size=cfg.page_size,
        chunked_prefill_size=cfg.chunked_prefill_size or -1,
        max_prefill_tokens=cfg.max_prefill_tokens, schedule_policy=cfg.schedule_policy,
        max_running_requests=cfg.max_running_requests, enable_mixed_chunk=cfg.enable_mixed_chunk,
        context_length=cfg.max_model_len, max_queued_requests=cfg.max_queued_requests)


def build_scheduler(cfg: HarnessConfig, model: Path | None = None) -> Scheduler:
    """SGLang's ``Scheduler`` for ``cfg``, its scheduling state built by its own ``init_*``
    methods over real CPU pools; its model worker, IPC and distributed groups left out."""
    from sglang.srt.configs.model_config import ModelConfig

    args = server_args(cfg, model_dir(model))
    # one rank of one: the placement a launcher would hand this process
    publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    s = Scheduler.__new__(Scheduler)
    _set_constructor_fields(s, args, ModelConfig.from_server_args(args), cfg)
    s.init_running_status()
    s.init_chunked_prefill()
    s.init_metrics_collector()
    s.init_metrics_reporter()
    s.scheduler_stage_metrics = s.metrics_reporter.scheduler_stage_metrics
    s.init_schedule_policy()
    s.future_map = None  # the forward's input relay: the stand-in has no device inputs
    s.init_beam_coordinator()
    s.grammar_manager = _NoGrammars()  # GrammarManager syncs over the TP group
    s.weight_updater = SimpleNamespace(offload_tags=set())
    s.init_dp_attn_adapter()
    s.full_tokens_per_layer = s.swa_tokens_per_layer = None
    s.init_pool_stats_observer()
    s.init_load_inquirer()
    s.ngram_embedding_manager = _NoNgram()
    # where SGLang sends what it ends outside the output stream (aborts): the tokenizer's
    # socket in a server, a list here
    s.rust_server = None
    s.aborts = []
    s.ipc_channels = SimpleNamespace(send_to_tokenizer=SimpleNamespace(
        send_output=lambda output, req: s.aborts.append((req.rid, output))))
    return s


class _StandInModelRunner:
    """What the scheduling path reads of a model runner: its attention backend's prefill
    tile size (absent: SGLang's fallback) and whether prefill is SWA-aware."""

    prefill_aware_swa = False
    canary_manager = None

    def __init__(self) -> None:
        self.attn_backend = object()


class _NoGrammars:
    """No structured-output request waits for a grammar (its manager needs the TP group)."""

    def has_waiting_grammars(self) -> bool:
        return False


class _NoNgram:
    """A model without n-gram embeddings: the step's batch as it is."""

    def prepare_for_forward(self, batch: Any, *, chunked_req: Any) -> Any:
        return batch


class _StandInWorker:
    """Where SGLang's model worker would be: nothing of it runs (``StandInRunner`` replaces
    the forward)."""

    is_hybrid_swa = False

    def __init__(self, model_config: Any) -> None:
        self.model_runner = _StandInModelRunner()
        self.model_config = model_config


def _pools(cfg: HarnessConfig) -> tuple[ReqToTokenPool, PagedTokenToKVPoolAllocator, RadixCache]:
    req_pool = ReqToTokenPool(size=cfg.max_running_requests, max_context_len=cfg.max_model_len + 4,
                              device="cpu", enable_memory_saver=False)
    # the allocator hands out indices only: the KV tensors themselves (kvcache) are not needed
    allocator = PagedTokenToKVPoolAllocator(cfg.num_tokens, cfg.page_size, torch.float32, "cpu",
                                            kvcache=None, need_sort=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_pool,
                                      token_to_kv_pool_allocator=allocator,
                                      page_size=cfg.page_size))
    return req_pool, allocator, tree


def _set_constructor_fields(s: Scheduler, args: ServerArgs, model_config: Any,
                            cfg: HarnessConfig) -> None:
    """What ``Scheduler.__init__`` sets before and around its model worker, for one rank,
    no overlap, text only, nothing disaggregated (the values its own code reads from the
    published config, as its constructor reads them)."""
    sched = get_schedule()
    s.forward_ct = 0
    s.processed_tokens_counter = 0
    s.schedule_policy = sched.schedule_policy
    s.enable_priority_scheduling = sched.enable_priority_scheduling
    s.abort_on_priority_when_disabled = sched.abort_on_priority_when_disabled
    s.schedule_low_priority_values_first = sched.schedule_low_priority_values_first
    s.priority_scheduling_preemption_threshold = sched.priority_scheduling_preemption_threshold
    s.max_queued_requests = cfg.max_queued_requests
    s.enable_lora = False
    s.enable_overlap = False
    s.enable_hierarchical_cache = False
    s.enable_hicache_storage = False
    s.enable_lmcache = False
    s.enable_hisparse = False
    s.enable_unified_cache_external_linker = False
    s.spec_algorithm = SpeculativeAlgorithm.from_string(None)
    s.max_new_tokens_limit = None
    req_pool, allocator, tree = _pools(cfg)
    s.server_args = args
    s.model_config = model_config
    s.req_to_token_pool, s.token_to_kv_pool_allocator, s.tree_cache = req_pool, allocator, tree
    s.max_total_num_tokens = cfg.num_tokens
    s.max_running_requests = cfg.max_running_requests
    s.max_prefill_tokens = cfg.max_prefill_tokens
    s.max_req_len = cfg.max_model_len
    s.max_req_input_len = cfg.max_model_len - 1
    s.page_size = cfg.page_size
    s.device = "cpu"
    s.tp_worker = s.model_worker = _StandInWorker(model_config)
    s.draft_worker = None
    s.dllm_config = None
    s.disaggregation_mode = DisaggregationMode.NULL
    s.is_generation = True
    s.require_mlp_sync = False
    s.is_hybrid_swa = s.is_hybrid_ssm = False
    s.sliding_window_size = None
    s.kv_shard_widening = 1
    s.truncation_align_size = None
    s.decode_offload_manager = None
    s.hisparse_coordinator = None
    s.lora_drainer = None
    s.dynamic_chunk_sizer = None
    s.min_free_slots_delayer = None
    # as init_model_worker does: one pipeline stage holds up to max_running_requests
    get_context().override("scheduler.pp_max_micro_batch_size_default",
                           pp_max_micro_batch_size=cfg.max_running_requests)


def add_request(s: Scheduler, r: Request) -> Req:
    """What ``handle_generate_request`` does for a tokenized text request: a ``Req``, its
    ``max_new_tokens`` bounded by SGLang's own rule, and SGLang's queueing (which may abort
    it: the queued-requests limit)."""
    sp = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos)
    sp.normalize(None)
    req = Req(r.rid, "", array("q", r.prompt), sp, vocab_size=_MODEL_CONFIG["vocab_size"],
              eos_token_ids={_MODEL_CONFIG["eos_token_id"]})
    s.init_req_max_new_tokens(req)
    if req.to_finish is None:
        s._add_request_to_queue(req)
    return req


def _made_up_token(req: Req) -> int:
    # deterministic per request and position (not Python's salted hash), never EOS
    return 3 + (zlib.crc32(req.rid.encode()) + len(req.output_ids)) % 900


def tokens_cost(per_token: float = 1e-4, per_step: float = 1e-3) -> Callable[[ScheduleBatch], float]:
    """A step's time from its tokens: the default cost of the stand-in's steps."""
    def cost(batch: ScheduleBatch) -> float:
        return per_step + per_token * (int(batch.extend_num_tokens or 0) + batch.batch_size())
    return cost


class StandInRunner:
    """The model's forward and SGLang's output processing, with made-up tokens."""

    def __init__(self, s: Scheduler, cost: Callable[[ScheduleBatch], float] | None = None) -> None:
        self.s = s
        self.cost = cost or tokens_cost()
        self.clock = 0.0  # seconds of simulated forward time

    def run(self, batch: ScheduleBatch) -> float:
        """One step: the forward's time, then its outputs as ``process_batch_result`` would
        commit them."""
        elapsed = self.cost(batch)
        self.clock += elapsed
        self.s.forward_ct += 1
        decoding = set(batch.decoding_reqs or ()) if batch.forward_mode.is_extend() else None
        for req in batch.reqs:
            if req.finished() or req.is_retracted:
                continue
            if decoding is not None and req is self.s.chunked_req:
                continue  # a middle chunk: no token yet
            req.output_ids.append(_made_up_token(req))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.s.tree_cache, checkpoint=True)
            elif decoding is not None and req not in decoding:
                checkpoint_kv_cache(req, self.s.tree_cache)
        return elapsed


def _mode(batch: ScheduleBatch | None) -> str:
    if batch is None:
        return "idle"
    if batch.forward_mode.is_extend():
        return "mixed" if batch.decoding_reqs else "prefill"
    return "decode"


def _sched(batch: ScheduleBatch) -> list[tuple[str, int, int, str]]:
    """(rid, first position, tokens, "prefill" | "decode") per request in the batch (a mixed
    batch carries its decodes, ``decoding_reqs``, as one-token extends)."""
    def decode(r: Req) -> tuple[str, int, int, str]:
        return (r.rid, len(r.origin_input_ids) + len(r.output_ids) - 1, 1, "decode")
    if not batch.forward_mode.is_extend():
        return [decode(r) for r in batch.reqs]
    decoding = {id(r) for r in batch.decoding_reqs or ()}
    return [decode(r) if id(r) in decoding else (r.rid, int(r.prefix_len), int(n), "prefill")
            for r, n in zip(batch.reqs, list(batch.extend_lens), strict=False)]


def run(s: Scheduler, requests: Iterable[Request], runner: StandInRunner | None = None,
        max_steps: int = 10_000) -> RunResult:
    """All of ``requests`` (arrived at once) through SGLang's event loop, the forward
    replaced by ``runner``: SGLang's ``event_loop_normal`` without its socket reads."""
    runner = runner or StandInRunner(s)
    out = RunResult()
    reqs = [add_request(s, r) for r in requests]
    for req in reqs:
        if req.to_finish is not None:
            out.aborted[req.rid] = str(req.to_finish)
    for rid, output in s.aborts:
        out.aborted[rid] = str(getattr(output, "finished_reason", output))
    for i in range(max_steps):
        if not s.waiting_queue and s.running_batch.is_empty() and s.last_batch is None:
            break
        waiting_before = {r.rid for r in s.waiting_queue}
        usage = live_fraction(s)
        # what each running request had computed, should SGLang retract it in this step
        computed = {r.rid: int(r.kv.kv_committed_len)
                    for b in (s.running_batch, s.last_batch) if b is not None for r in b.reqs}
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch, batch = plan.running_batch, plan.batch_to_run
        sched = _sched(batch) if batch is not None else []
        prefill = sum(n for _, _, n, kind in sched if kind == "prefill")
        elapsed = runner.run(batch) if batch is not None else 0.0
        retracted = [(r.rid, computed.get(r.rid, 0)) for r in s.waiting_queue
                     if r.rid not in waiting_before]
        out.steps.append(Step(i, _mode(batch), sched, prefill, retracted, len(s.waiting_queue),
                              s.running_batch.batch_size(), elapsed,
                              s.token_to_kv_pool_allocator.available_size(),
                              s.tree_cache.evictable_size(), round(usage, 4), _stage(s)))
        s.last_batch = batch
    for req in reqs:
        if req.finished() and req.rid not in out.aborted:
            out.finished[req.rid] = list(req.output_ids)
    return out


def live_fraction(s: Scheduler) -> float:
    """The pool's fraction that live requests hold (neither free nor evictable cache)."""
    free = s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size()
    return max(0, s.max_total_num_tokens - free) / s.max_total_num_tokens


def _stage(s: Scheduler) -> str | None:
    """The plugin's two-stage switch as the step was decided (None: no plugin)."""
    state = getattr(s, "hlserve", None)
    if state is None:
        return None
    return "decode_only" if state.decode_only else "mix"


def kv_balanced(s: Scheduler) -> dict[str, int]:
    """The pool's books at the end of a run: every token free or held only by the radix
    cache (evictable), every request slot free. Returns the numbers; balanced when
    ``free + evictable == total`` and ``slots_free == slots``."""
    return {"total": s.max_total_num_tokens, "free": s.token_to_kv_pool_allocator.available_size(),
            "evictable": s.tree_cache.evictable_size(), "protected": s.tree_cache.protected_size(),
            "slots": s.req_to_token_pool.size, "slots_free": s.req_to_token_pool.available_size()}
