"""In-process closed-loop driver: runs agent sessions on an :class:`Engine` and times them."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm

from hlserve.engine.engine import Engine
from hlserve.request import RequestOutput, SamplingParams
from hlserve.workloads import AgentWorkload

R = TypeVar("R")


def fewer_gc_passes(driver: Callable[..., R]) -> Callable[..., R]:
    """Under a virtual clock, a driver runs the cyclic garbage collector less often.

    (Used by the simulator drivers and the in-process sweep.) A simulated hour creates hundreds of thousands of long-lived radix-tree nodes, and with
    the default thresholds the collector rescans them as they age: a fifth of the
    simulator's wall time (``benchmarks/sim_speed.py``). Nothing of a simulation is cyclic
    garbage in bulk, so fewer young-generation passes lose nothing. Real (wall-clock) runs
    keep the interpreter's defaults."""

    @functools.wraps(driver)
    def run(engine: Engine, *args: Any, **kwargs: Any) -> R:
        if getattr(engine.clock, "advance", None) is None:
            return driver(engine, *args, **kwargs)
        old = gc.get_threshold()
        gc.set_threshold(100_000, 50, 100)
        try:
            return driver(engine, *args, **kwargs)
        finally:
            gc.set_threshold(*old)

    return run


@dataclass
class RequestRecord:
    session_id: int
    round: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    arrival: float
    first_token: float
    finish: float

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (n - 1), vLLM's definition; None for one-token outputs."""
        n = self.output_tokens
        return (self.finish - self.first_token) / (n - 1) if n > 1 else None


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float
    session_times: list[float]

    def summary(self) -> dict[str, float]:
        n_in = sum(r.prompt_tokens for r in self.records)
        n_out = sum(r.output_tokens for r in self.records)
        ttft = [r.ttft for r in self.records]
        tpot = [t for r in self.records if (t := r.tpot) is not None]
        return {
            "duration": self.duration,
            "completed": len(self.records),
            "total_input_tokens": n_in,
            "total_output_tokens": n_out,
            "cached_tokens": sum(r.cached_tokens for r in self.records),
            "output_throughput": n_out / self.duration,
            "total_token_throughput": (n_in + n_out) / self.duration,
            "median_ttft_ms": 1e3 * percentile(ttft, 50),
            "p99_ttft_ms": 1e3 * percentile(ttft, 99),
            "median_tpot_ms": 1e3 * percentile(tpot, 50),
            "p99_tpot_ms": 1e3 * percentile(tpot, 99),
            "median_session_time_s": percentile(self.session_times, 50),
            "p99_session_time_s": percentile(self.session_times, 99),
        }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as vLLM's benchmark uses)."""
    return float(np.percentile(values, q)) if values else float("nan")


def run_agent_sessions(engine: Engine, workload: AgentWorkload, progress: bool = True) -> RunResult:
    """Closed loop: every session has one request in flight; its next round is submitted
    in the same iteration that its last one finishes."""
    sessions = workload.sessions_list()
    inflight: dict[str, tuple[int, int]] = {}  # request id -> (session index, round)
    start = engine.clock()
    session_start = {i: start for i in range(len(sessions))}
    session_times: list[float] = []
    records: list[RequestRecord] = []

    def submit(i: int) -> None:
        prompt, out_len = sessions[i].next_request()
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        req = engine.add_request(prompt, params)
        inflight[req.request_id] = (i, sessions[i].round)

    for i in range(len(sessions)):
        submit(i)
    total = workload.sessions * workload.rounds
    with tqdm(total=total, desc="agent rounds", unit="req", disable=not progress) as bar:
        while inflight:
            for req in engine.step_requests():
                if req.finished and req.request_id in inflight:
                    out = RequestOutput.of(req)
                    i, rnd = inflight.pop(out.request_id)
                    records.append(record_of(out, i, rnd))
                    bar.update(1)
                    sessions[i].complete(out.token_ids)
                    if sessions[i].done:
                        session_times.append(engine.clock() - session_start[i])
                    else:
                        submit(i)
    return RunResult(records=records, duration=engine.clock() - start, session_times=session_times)


def record_of(out: RequestOutput, session: int, rnd: int) -> RequestRecord:
    """A finished request's timeline as a bench record (engine clock seconds)."""
    m = out.metrics
    arrival = m["arrival_time"] or 0.0
    return RequestRecord(
        session_id=session, round=rnd, prompt_tokens=len(out.prompt_token_ids),
        output_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens,
        arrival=arrival, first_token=m["first_token_time"] or arrival,
        finish=m["finish_time"] or arrival,
    )


def compare_configs(
    model: str,
    configs: dict[str, dict[str, object]],
    workload: AgentWorkload,
    progress: bool = True,
    **common: object,
) -> dict[str, dict[str, float]]:
    """Run the same closed-loop workload under each named engine configuration, one after
    the other in this process, and return each run's summary."""
    from hlserve.llm import build_engine

    results = {}
    for name, options in configs.items():
        engine = build_engine(model, **{**common, **options})
        summary = run_agent_sessions(engine, workload, progress=progress).summary()
        summary["retractions"] = engine.scheduler.num_retractions
        summary["iterations"] = engine.stats.steps
        results[name] = summary
    return results


def format_comparison(results: dict[str, dict[str, float]], baseline: str) -> str:
    """A side-by-side table; throughput ratios are against ``baseline``."""
    base = results[baseline]["total_token_throughput"]
    head = (f"{'config':<18}{'tok/s':>9}{'ratio':>7}{'out tok/s':>10}{'session p50/p99 s':>19}"
            f"{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}{'retract':>8}")
    rows = [head]
    for name, s in results.items():
        rows.append(
            f"{name:<18}{s['total_token_throughput']:>9.0f}"
            f"{s['total_token_throughput'] / base:>7.2f}{s['output_throughput']:>10.1f}"
            f"{s['median_session_time_s']:>10.1f}/{s['p99_session_time_s']:<8.1f}"
            f"{s['median_ttft_ms']:>9.0f}/{s['p99_ttft_ms']:<8.0f}"
            f"{s['median_tpot_ms']:>9.0f}/{s['p99_tpot_ms']:<8.0f}{s['retractions']:>8.0f}"
        )
    return "\n".join(rows)
