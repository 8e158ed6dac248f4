"""vLLM's own scheduler under hlserve's simulated runner: a study point of vLLM.

``VllmSimEngine`` is a :class:`~hlserve.integrations.sim_engine.ForeignSimEngine` over
:class:`~hlserve.integrations.vllm.step_harness.SchedulerHarness`: vLLM's ``Scheduler`` (or
``AsyncScheduler``, or the plugin's classes) built by vLLM from a ``VllmConfig`` with the
deployment's flags, each step priced by hlserve's ``CostModel`` from vLLM's
``SchedulerOutput`` (every request's new tokens and the tokens it had computed before them).

A GPU deployment of vLLM 0.34 on an H20-class GPU (96 GB: over vLLM's 70 GiB tier, not an
A100) runs with ``--max-num-batched-tokens 8192`` and ``--max-num-seqs 1024`` (vLLM's
``_set_default_max_num_seqs_and_batched_tokens_args`` for the API server), prefix caching
on, block size 16 and async scheduling (``VllmConfig`` turns it on where the executor
supports it): :func:`deployment` gives those flags, the study's knobs laid over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput

from hlserve.integrations.sim_engine import ForeignSimEngine, StepPricer
from hlserve.integrations.vllm.step_harness import HarnessConfig, SchedulerHarness, StreamRequest
from hlserve.request import Request

BLOCK_SIZE = 16  # vLLM's default for CUDA
DEFAULT_BUDGET = 8192  # --max-num-batched-tokens, API server, >= 70 GiB (not A100)
DEFAULT_MAX_SEQS = 1024


@dataclass(frozen=True)
class Deployment:
    """The flags of one vLLM deployment the study simulates (vLLM's names)."""

    max_num_batched_tokens: int = DEFAULT_BUDGET
    long_prefill_token_threshold: int = 0
    max_num_seqs: int = DEFAULT_MAX_SEQS
    async_scheduling: bool = True
    plugin: bool = False
    plugin_options: tuple[tuple[str, Any], ...] = ()


def deployment(plugin: bool, max_model_len: int, budget: int | None = None,
               threshold: int | None = None, async_scheduling: bool = True,
               plugin_options: dict[str, Any] | None = None) -> Deployment:
    """Stock vLLM: its defaults, ``budget`` its ``--max-num-batched-tokens`` (B) and
    ``threshold`` its ``--long-prefill-token-threshold`` (C). The plugin: deployed as
    docs/vllm.md says, ``--max-num-batched-tokens`` at the model length (the EMA budget
    sets each step's), the async class."""
    b = budget if budget is not None else (max_model_len if plugin else DEFAULT_BUDGET)
    # vLLM refuses to start with fewer batched tokens than sequences: a small B comes with
    # --max-num-seqs at B (no point of the study runs more than 128 sequences)
    return Deployment(max_num_batched_tokens=b, long_prefill_token_threshold=threshold or 0,
                      max_num_seqs=min(DEFAULT_MAX_SEQS, b),
                      async_scheduling=async_scheduling, plugin=plugin,
                      plugin_options=tuple(sorted((plugin_options or {}).items())))


class VllmSimEngine(ForeignSimEngine):
    def __init__(self, dep: Deployment, pricer: StepPricer, max_model_len: int) -> None:
        super().__init__(pricer)
        self.dep = dep
        # the activations of the largest step are reserved before the KV pool, as vLLM's
        # profile run does with max_num_batched_tokens
        pool = pricer.pool_tokens(dep.max_num_batched_tokens + dep.max_num_seqs, dep.max_num_seqs)
        cfg = HarnessConfig(
            num_blocks=pool // BLOCK_SIZE + 1, block_size=BLOCK_SIZE,
            max_num_batched_tokens=dep.max_num_batched_tokens, max_num_seqs=dep.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=dep.long_prefill_token_threshold,
            async_scheduling=dep.async_scheduling, plugin=dep.plugin,
            options=dict(dep.plugin_options),
            vocab_size=pricer.model_config.vocab_size)
        self.harness = SchedulerHarness(cfg, step_cost=self._price, record_steps=False)

    def kv_pool_tokens(self) -> int:
        return self.harness.usable_blocks() * BLOCK_SIZE

    def clock(self) -> float:
        return self.harness.now

    def skip_time(self, dt: float) -> None:
        self.harness.now += dt

    def _price(self, out: SchedulerOutput, scheduler: Any) -> float:
        segments = []
        for rid, n in out.num_scheduled_tokens.items():
            req = scheduler.requests[rid]
            # schedule() has advanced num_computed_tokens past this step's tokens already
            segments.append((n, req.num_computed_tokens - n, not req.is_prefill_chunk))
        self.pricer.counters.retractions += len(out.preempted_req_ids or ())
        return self.pricer.price(segments)

    def submit(self, req: Request) -> None:
        self.harness.add(StreamRequest(req.request_id, req.prompt_token_ids, req.params.max_tokens))

    def has_unfinished(self) -> bool:
        return self.harness.has_unfinished()

    def step(self) -> list[str]:
        h = self.harness
        record = h.step()
        now = h.now
        if record is not None:
            for rid, cached in record.cached.items():
                self.admitted(rid, cached, record.time)
        for rid, mirror in self.requests.items():  # the requests vLLM still has
            got, seen = h.outputs[rid], len(mirror.output_token_ids)
            if len(got) > seen:
                self.emitted(rid, got[seen:], now)
        done = [rid for rid in self.requests if rid in h.finished]
        for rid in done:
            self.ended(rid, h.finished.pop(rid))
            del h.outputs[rid], h.arrived[rid]
        return done
