"""SGLang's own scheduler under hlserve's simulated runner: a study point of SGLang.

``SglangSimEngine`` is a :class:`~hlserve.integrations.sim_engine.ForeignSimEngine` over the
scheduler :func:`hlserve.integrations.sglang.harness.build_scheduler` builds (SGLang 0.5.23's
``Scheduler`` with its real pools and radix cache): each step is SGLang's
``get_next_batch_to_run`` and the stand-in runner's output processing, its time hlserve's
``CostModel`` of the batch SGLang built (each request's extend length after its prefix, each
decode's context).

A deployment on a 96 GB GPU runs with SGLang's defaults: ``--chunked-prefill-size 8192``
(``ServerArgs`` by GPU memory), ``--max-prefill-tokens 16384``, ``--schedule-policy lpm``
(with its FCFS fallback past 128 waiting), page size 1, no mixed chunk, the prefill delayer
off. ``--max-running-requests`` is 256 here: SGLang sizes it from the pool, and no point of
the study has more than 128 requests to run, so it never binds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hlserve.integrations.sglang import harness as H
from hlserve.integrations.sim_engine import ForeignSimEngine, StepPricer
from hlserve.request import FinishReason, Request

DEFAULT_CHUNK = 8192  # --chunked-prefill-size on a GPU of 60-160 GB
MIXED_CHUNK = 512  # Sarathi-Serve's strict chunk, for --enable-mixed-chunk
MAX_RUNNING = 256


@dataclass(frozen=True)
class Deployment:
    chunked_prefill_size: int | None = DEFAULT_CHUNK
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = False
    page_size: int = 1
    max_running_requests: int = MAX_RUNNING
    max_model_len: int = 69632
    plugin: bool = False


def deployment(plugin: bool, mixed: bool, chunk: int | None, max_len: int,
               **flags: Any) -> Deployment:
    """SGLang's defaults, C = ``chunk`` (its default when None), ``--enable-mixed-chunk``
    when ``mixed``; ``flags`` any other ``Deployment`` field."""
    c = chunk if chunk is not None else (MIXED_CHUNK if mixed else DEFAULT_CHUNK)
    return Deployment(chunked_prefill_size=c, enable_mixed_chunk=mixed, max_model_len=max_len,
                      plugin=plugin, **flags)


def _load_plugin() -> None:
    """hlserve's plugin through SGLang's own discovery (entry points, ``SGLANG_PLUGINS``)."""
    from sglang.srt.plugins import load_plugins

    os.environ["SGLANG_PLUGINS"] = "hlserve"
    load_plugins()


class SglangSimEngine(ForeignSimEngine):
    def __init__(self, dep: Deployment, pricer: StepPricer) -> None:
        super().__init__(pricer)
        if dep.plugin:
            _load_plugin()
        per_step = max(dep.chunked_prefill_size or dep.max_model_len, dep.max_prefill_tokens)
        pool = pricer.pool_tokens(per_step + dep.max_running_requests, dep.max_running_requests)
        pool -= pool % dep.page_size
        self.dep = dep
        cfg = H.HarnessConfig(
            num_tokens=pool, page_size=dep.page_size,
            max_running_requests=dep.max_running_requests, max_model_len=dep.max_model_len,
            chunked_prefill_size=dep.chunked_prefill_size,
            max_prefill_tokens=dep.max_prefill_tokens, schedule_policy="lpm",
            enable_mixed_chunk=dep.enable_mixed_chunk)
        self.s = H.build_scheduler(cfg)
        self.runner = H.StandInRunner(self.s, self._price)
        if getattr(self.s, "hlserve", None) is not None:
            self.s.hlserve.clock = self.clock  # the EMA budget reads the simulated steps
        self._aborted: list[str] = []  # refused at intake, reported at the next step

    def kv_pool_tokens(self) -> int:
        return self.s.max_total_num_tokens

    def submit(self, req: Request) -> None:
        r = H.add_request(self.s, H.Request(req.request_id, tuple(req.prompt_token_ids),
                                            req.params.max_tokens))
        if r.to_finish is not None:
            self._aborted.append(req.request_id)

    def has_unfinished(self) -> bool:
        s = self.s
        return bool(self._aborted or s.waiting_queue or not s.running_batch.is_empty()
                    or s.last_batch is not None)

    def _segments(self, batch: Any) -> list[tuple[int, int, bool]]:
        if not batch.forward_mode.is_extend():
            return [(1, len(r.origin_input_ids) + len(r.output_ids) - 1, True) for r in batch.reqs]
        decoding = {id(r) for r in batch.decoding_reqs or ()}
        out = []
        for r, n in zip(batch.reqs, list(batch.extend_lens), strict=False):
            if id(r) in decoding:
                out.append((1, len(r.origin_input_ids) + len(r.output_ids) - 1, True))
                continue
            if r.rid in self.requests:
                self.admitted(r.rid, int(r.prefix_len), self._now)
            out.append((int(n), int(r.prefix_len), r is not self.s.chunked_req))
        return out

    def _price(self, batch: Any) -> float:
        return self.pricer.price(self._segments(batch))

    def step(self) -> list[str]:
        s = self.s
        done, self._aborted = self._aborted, []
        for rid in done:
            self.ended(rid, self._now, FinishReason.ABORT, "refused by SGLang at intake")
        running_before = {r.rid for b in (s.running_batch, s.last_batch) if b is not None
                          for r in b.reqs}
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch, batch = plan.running_batch, plan.batch_to_run
        s.last_batch = batch
        if batch is None:
            return done
        self._now += self.runner.run(batch)
        self.pricer.counters.retractions += sum(1 for r in s.waiting_queue if r.rid in running_before)
        for r in batch.reqs:
            mirror = self.requests.get(r.rid)
            if mirror is None:
                continue
            seen = len(mirror.output_token_ids)
            if len(r.output_ids) > seen:
                self.emitted(r.rid, r.output_ids[seen:], self._now)
            if r.finished():
                self.ended(r.rid, self._now)
                done.append(r.rid)
        return done
