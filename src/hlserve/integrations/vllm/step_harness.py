"""vLLM's own scheduler driven on the CPU with no model: a request stream in, the scheduler's
step decisions out.

vLLM's v1 ``Scheduler``, ``AsyncScheduler`` and ``KVCacheManager`` are Python; vLLM's own
tests (``tests/v1/core``) build them from a ``VllmConfig`` and feed them made-up
``ModelRunnerOutput``s. This module does the same for any supported version, stock or with
hlserve's plugin, the way vLLM's ``EngineCore`` does:

- the scheduler class is resolved by vLLM (``SchedulerConfig.get_scheduler_cls``: stock
  ``Scheduler`` / ``AsyncScheduler``, or ``--scheduler-cls``'s qualified name);
- requests are vLLM ``Request``s with vLLM's own block hasher (prefix caching as deployed);
- synchronous: schedule, run, ``update_from_output``, one step at a time; asynchronous:
  vLLM's batch queue of two, the next step scheduled before the last one's output arrives.

The one stand-in is the model runner: ``runner_output`` gives each scheduled request a
made-up token (a pure function of its id and position), none for a prefill chunk that ends
mid-prompt, as vLLM's runner discards those. Time is virtual: a step takes
``step_time(num_tokens, num_requests)`` (a linear default; the study gives its cost model),
and the plugin's budget controller reads that clock (``hl_clock``). What this leaves out:
the GPU's and the model's own effects (none reach the scheduler but the tokens and the
time), the engine-core process and its queues (which carry the same objects).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# the harness builds vLLM's config from a local directory: never look for a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hlserve.integrations.vllm.seams import (
    request_fields,
    resumed_ids,
    runner_output,
)

PLUGIN_SYNC = "hlserve.integrations.vllm.ThroughputScheduler"
PLUGIN_ASYNC = "hlserve.integrations.vllm.ThroughputAsyncScheduler"
EOS = 1  # the tiny config's end token; made-up tokens never take it
BATCH_QUEUE = 2  # vLLM's engine core keeps two steps in flight with async scheduling


def linear_step_time(num_tokens: int, num_requests: int) -> float:
    """A forward's time: 1 ms plus 50 us per token (a small model's shape on a CPU)."""
    return 1e-3 + 5e-5 * num_tokens + 1e-5 * num_requests


@dataclass(frozen=True)
class HarnessConfig:
    """vLLM's flags for one run. ``num_blocks`` counts vLLM's null block, as
    ``--num-gpu-blocks-override`` does."""

    num_blocks: int = 64
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    plugin: bool = False  # hlserve's ThroughputScheduler (or its async class)
    options: Mapping[str, Any] = field(default_factory=dict)  # --additional-config "hlserve"
    vocab_size: int = 512

    @property
    def scheduler_cls(self) -> str | None:
        if not self.plugin:
            return None  # vLLM picks Scheduler or AsyncScheduler
        return PLUGIN_ASYNC if self.async_scheduling else PLUGIN_SYNC


@dataclass(frozen=True)
class StreamRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    priority: int = 0
    xargs: Mapping[str, Any] = field(default_factory=dict)  # vllm_xargs
    session_id: str | None = None
    ttl: float | None = None  # the request's own retention hint (kv_hints or vllm_xargs)


@dataclass(frozen=True)
class StepRecord:
    """One ``schedule()``: what vLLM decided, and the pool and queues after it."""

    step: int
    time: float  # virtual time the step was scheduled at
    budget: int  # the scheduler's max_num_scheduled_tokens for the pass
    scheduled: dict[str, int]  # request id -> tokens scheduled
    admitted: tuple[str, ...]  # new requests (and resumed ones) scheduled this step
    cached: dict[str, int]  # new request id -> prompt tokens it found in the prefix cache
    preempted: tuple[str, ...]
    finished: tuple[str, ...]  # finished by the output delivered in this call
    free_blocks: int
    num_waiting: int
    num_running: int

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())


def _tiny_model_dir(vocab_size: int, max_len: int) -> str:
    """A directory with a tiny Llama's config.json: all vLLM's ``ModelConfig`` reads."""
    path = tempfile.mkdtemp(prefix="hlserve-vllm-harness-")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": vocab_size, "rms_norm_eps": 1e-5,
              "max_position_embeddings": max_len, "torch_dtype": "float32",
              "bos_token_id": 0, "eos_token_id": EOS}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def build_vllm_config(cfg: HarnessConfig) -> VllmConfig:
    model = ModelConfig(model=_tiny_model_dir(cfg.vocab_size, cfg.max_model_len),
                        skip_tokenizer_init=True, max_model_len=cfg.max_model_len,
                        dtype="float32", seed=0)
    sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens,
                            max_model_len=cfg.max_model_len, is_encoder_decoder=False,
                            enable_chunked_prefill=True,
                            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                            async_scheduling=cfg.async_scheduling,
                            scheduler_cls=cfg.scheduler_cls)
    cache = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
    cache.num_gpu_blocks = cfg.num_blocks
    additional = {"hlserve": dict(cfg.options)} if cfg.options else {}
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                        device_config=DeviceConfig(device="cpu"), additional_config=additional)
    # vLLM's CPU platform turns async scheduling off (its executor runs one step at a time);
    # the scheduler config of a GPU deployment keeps it, and that is the one modelled here
    config.scheduler_config.async_scheduling = cfg.async_scheduling
    return config


def made_up_token(request_id: str, position: int, vocab_size: int) -> int:
    """The stand-in runner's token: the same for a request at a position in every run."""
    return 2 + zlib.crc32(f"{request_id}:{position}".encode()) % (vocab_size - 2)


class SchedulerHarness:
    """One vLLM scheduler, stock or the plugin, on a virtual clock."""

    def __init__(self, cfg: HarnessConfig,
                 step_time: Callable[[int, int], float] = linear_step_time,
                 step_cost: Callable[[SchedulerOutput, Any], float] | None = None,
                 record_steps: bool = True) -> None:
        self.cfg = cfg
        self.vllm_config = build_vllm_config(cfg)
        kv = KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(
                block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        cls = self.vllm_config.scheduler_config.get_scheduler_cls()
        self.scheduler: Any = cls(
            vllm_config=self.vllm_config, kv_cache_config=kv, block_size=cfg.block_size,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            log_stats=True)
        self.now = 0.0
        self._gpu_free_at = 0.0
        self.step_time = step_time
        # the study's cost model: the step's seconds from vLLM's output and scheduler (each
        # request's new tokens and the context before them), in place of ``step_time``
        self.step_cost = step_cost
        self.record_steps = record_steps  # False: a long run keeps no step history
        if hasattr(self.scheduler, "hl_clock"):
            self.scheduler.hl_clock = lambda: self.now
        self._hasher = None
        if cfg.enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self._hasher = get_request_block_hasher(cfg.block_size, hash_fn)
        self._inflight: deque[tuple[SchedulerOutput, Any, float]] = deque()
        self.steps: list[StepRecord] = []
        self.num_scheduled = 0
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, float] = {}  # request id -> virtual time it finished
        self.arrived: dict[str, float] = {}

    # ---- requests ------------------------------------------------------------------------

    def add(self, r: StreamRequest) -> Request:
        fields, session_xargs = request_fields(r.session_id, r.ttl)
        xargs = {**r.xargs, **session_xargs}
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                                extra_args=xargs or None)
        req = Request(request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                      sampling_params=params, pooling_params=None, arrival_time=self.now,
                      priority=r.priority, block_hasher=self._hasher, **fields)
        self.scheduler.add_request(req)
        self.arrived[r.request_id] = self.now
        self.outputs[r.request_id] = []
        return req

    def has_unfinished(self) -> bool:
        return bool(self._inflight) or self.scheduler.has_unfinished_requests()

    # ---- steps ---------------------------------------------------------------------------

    def step(self) -> StepRecord | None:
        """One engine-core iteration: schedule a step and, synchronously, deliver its output;
        asynchronously, deliver the oldest step's output once two are in flight (or nothing
        more could be scheduled)."""
        record = None
        if len(self._inflight) < BATCH_QUEUE and self.scheduler.has_unfinished_requests():
            record = self._schedule()
        if self._inflight and (not self.cfg.async_scheduling or record is None
                               or len(self._inflight) >= BATCH_QUEUE):
            finished = self._deliver()
            if record is not None:
                record = _with_finished(record, finished)
                if self.record_steps:
                    self.steps[-1] = record
        return record

    def _schedule(self) -> StepRecord:
        s = self.scheduler
        out = s.schedule()
        budget = s.max_num_scheduled_tokens  # the plugin's for this pass, or vLLM's own
        ids = list(out.num_scheduled_tokens)
        sampled = [self._tokens(rid) for rid in ids]
        # the forward runs once the previous one is done: async scheduling overlaps this
        # step's scheduling with it, and nothing else
        start = max(self.now, self._gpu_free_at)
        if self.step_cost is not None:
            elapsed = self.step_cost(out, s)
        else:
            elapsed = self.step_time(out.total_num_scheduled_tokens, len(ids))
        self._gpu_free_at = start + elapsed
        self._inflight.append((out, runner_output(ids, sampled), self._gpu_free_at))
        admitted = tuple(r.req_id for r in out.scheduled_new_reqs) + resumed_ids(out)
        self.num_scheduled += 1
        record = StepRecord(
            step=self.num_scheduled - 1, time=self.now, budget=budget,
            scheduled=dict(out.num_scheduled_tokens), admitted=admitted,
            cached={r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs},
            preempted=tuple(sorted(out.preempted_req_ids or ())), finished=(),
            free_blocks=s.kv_cache_manager.block_pool.get_num_free_blocks(),
            num_waiting=len(s.waiting), num_running=len(s.running))
        if self.record_steps:
            self.steps.append(record)
        return record

    def _tokens(self, rid: str) -> list[int]:
        req = self.scheduler.requests[rid]
        if req.is_prefill_chunk:  # a chunk that ends mid-prompt samples nothing
            return []
        pos = req.num_tokens + getattr(req, "num_output_placeholders", 0)
        return [made_up_token(rid, pos, self.cfg.vocab_size)]

    def _deliver(self) -> tuple[str, ...]:
        out, result, done_at = self._inflight.popleft()
        self.now = max(self.now, done_at)
        engine_outputs = self.scheduler.update_from_output(out, result)
        finished = []
        for eco in engine_outputs.values():
            for o in eco.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished.append(o.request_id)
                    self.finished[o.request_id] = self.now
        return tuple(finished)

    def run(self, arrivals: Mapping[int, Sequence[StreamRequest]],
            max_steps: int = 100_000) -> list[StepRecord]:
        """Feed ``arrivals`` (iteration -> requests added before it) and step until all are
        done."""
        last = max(arrivals, default=0)
        for i in range(max_steps):
            for r in arrivals.get(i, ()):
                self.add(r)
            if not self.has_unfinished():
                if i > last:
                    return self.steps
                continue
            self.step()
        raise RuntimeError(f"the stream did not finish in {max_steps} iterations")

    # ---- accounting ----------------------------------------------------------------------

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def usable_blocks(self) -> int:
        return self.cfg.num_blocks - 1  # less vLLM's null block


def _with_finished(r: StepRecord, finished: tuple[str, ...]) -> StepRecord:
    return dataclasses.replace(r, finished=finished)
