"""Drivers for simulated and real runs alike: steady-state closed-loop agents (the one closed
loop of :mod:`hlserve.driver.closed_loop`, with finished sessions replaced) and open-loop
arrivals (Poisson chat, trace timestamps). A trace's chains run closed loop on that one
driver too, as sessions (:func:`hlserve.driver.workloads.trace_sessions`).

They work with either clock. With a virtual clock (``clock.advance``) an idle engine jumps to
the next arrival; with the wall clock it sleeps until then. Results are ``RunResult``s
(records in engine clock seconds from the run's start; vLLM's key names in ``summary()``).
"""

from __future__ import annotations

from collections.abc import Iterable

from tqdm import tqdm

from hlserve.driver.closed_loop import (
    Loop,
    LoopResult,
    engine_record,
    fewer_gc_passes,
    greedy,
    run_closed_loop,
    wait_until,
)
from hlserve.driver.records import RequestRecord, RunResult
from hlserve.driver.workloads import AgentWorkload, Arrival
from hlserve.engine.llm_engine import Engine


def _done(records: list[RequestRecord], session_times: list[float]) -> RunResult:
    end = max((r.end for r in records), default=0.0)
    return RunResult(records=records, duration=max(1e-9, end), session_times=session_times)


def run_agent_steady(engine: Engine, workload: AgentWorkload, duration: float,
                     warmup: float = 0.0, progress: bool = False,
                     wall_limit: float | None = None, ramp: float = 0.0,
                     token_times: bool = False) -> LoopResult:
    """Closed loop at constant concurrency: ``workload.sessions`` sessions are always active;
    a session that ends is replaced by a new one (the next index), so the run reaches a
    steady state. The first sessions start evenly over ``ramp`` seconds (a fleet of agents
    ramps up; the engine sees light load first, as a server does after start-up). Requests
    are measured when they arrive after ``warmup`` and finish before ``warmup + duration``
    (clock seconds from the start); see :class:`~hlserve.driver.closed_loop.Loop`.
    ``token_times`` keeps each token's time in the records (ITL, stalls)."""
    loop = Loop(duration=duration, warmup=warmup, replace_finished=True, ramp=ramp,
                wall_limit=wall_limit, token_times=token_times)
    return run_closed_loop(engine, workload.make_session, workload.sessions, loop,
                           progress=progress)


@fewer_gc_passes
def run_open_loop(engine: Engine, arrivals: Iterable[Arrival], progress: bool = False) -> RunResult:
    """Submit each arrival at its time (seconds after the start), whatever the engine's state;
    run until every request has finished."""
    pending = sorted(arrivals, key=lambda a: a.time)
    start = engine.clock()
    inflight: dict[str, Arrival] = {}
    records: list[RequestRecord] = []
    i = 0
    bar = tqdm(total=len(pending), desc="requests", unit="req", disable=not progress)
    while i < len(pending) or inflight:
        while i < len(pending) and start + pending[i].time <= engine.clock():
            a = pending[i]
            req = engine.add_request(a.prompt, greedy(a.max_tokens))
            # it arrived during the step that just ended: the engine could only take it now,
            # but its latency counts from when it came (a real server queues it meanwhile)
            req.arrival_time = start + a.time
            inflight[req.request_id] = a
            i += 1
        if not engine.has_unfinished():
            if i < len(pending):
                wait_until(engine, start + pending[i].time)
                continue
            break
        for req in engine.step_requests():
            if req.finished and req.request_id in inflight:
                a = inflight.pop(req.request_id)
                records.append(engine_record(req, a.key, 0, start))
                bar.update(1)
    bar.close()
    return _done(records, [])
