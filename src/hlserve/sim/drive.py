"""Drivers for simulated and real runs alike: steady-state closed-loop agents, open-loop
arrivals (Poisson chat, trace timestamps), closed-loop trace chains.

They work with either clock. With a virtual clock (``clock.advance``) an idle engine jumps to
the next arrival; with the wall clock it sleeps until then. Results are the bench driver's
``RunResult`` (vLLM's key names in ``summary()``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tqdm import tqdm

from hlserve.bench.driver import RequestRecord, RunResult, fewer_gc_passes, record_of
from hlserve.engine.engine import Engine
from hlserve.request import RequestOutput, SamplingParams
from hlserve.workloads import AgentWorkload, Arrival, MooncakeTrace


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _wait_until(engine: Engine, t: float) -> None:
    """Idle until clock time ``t``: jump a virtual clock, sleep on the wall clock."""
    now = engine.clock()
    if t <= now:
        return
    advance = getattr(engine.clock, "advance", None)
    if advance is not None:
        advance(t - now)
    else:
        time.sleep(t - now)


@dataclass
class SteadyResult(RunResult):
    """A run measured over a window: ``records`` are the requests that arrived after the
    warm-up and finished inside the window; ``duration`` is the window. ``extra`` holds the
    window's token throughput counted token by token (``window_token_throughput``: prompts
    when their prefill completes, outputs when generated, whether or not the request finished
    in the window): steadier than per-request completions when requests are long."""

    errors: int = 0
    sessions_started: int = 0
    stalled: bool = False  # the engine stopped scheduling anything with requests waiting
    stalled_at: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


def _window_tokens(rec: RequestRecord, t0: float, t1: float) -> tuple[float, float]:
    """Tokens of a finished request served inside ``[t0, t1)``: its prompt when its first
    token came (the prefill is done then), its output tokens spread evenly from the first
    token to the finish."""
    prompt = float(rec.prompt_tokens) if t0 <= rec.first_token < t1 else 0.0
    n = rec.output_tokens
    if n <= 1 or rec.finish <= rec.first_token:
        return prompt, float(n) if t0 <= rec.first_token < t1 else 0.0
    step = (rec.finish - rec.first_token) / (n - 1)
    lo = max(0, math.ceil((t0 - rec.first_token) / step - 1e-9))
    hi = min(n - 1, math.ceil((t1 - rec.first_token) / step - 1e-9) - 1)
    return prompt, float(max(0, hi - lo + 1))


@fewer_gc_passes
def run_agent_steady(engine: Engine, workload: AgentWorkload, duration: float,
                     warmup: float = 0.0, progress: bool = False,
                     wall_limit: float | None = None, ramp: float = 0.0) -> SteadyResult:
    """Closed loop at constant concurrency: ``workload.sessions`` sessions are always active;
    a session that ends is replaced by a new one (the next index), so the run reaches a
    steady state. The first sessions start evenly over ``ramp`` seconds (a fleet of agents
    ramps up; the engine sees light load first, as a server does after start-up). Requests
    are measured when they arrive after ``warmup`` and finish before ``warmup + duration``
    (clock seconds from the start); throughput counts the tokens of those requests over the
    window. ``wall_limit`` (seconds) stops a run early; the window is then cut to the clock
    time reached. An engine that schedules nothing while requests wait is stalled: the
    window then runs out with no progress (``stalled``)."""
    start = engine.clock()
    t0, t1 = start + warmup, start + warmup + duration
    inflight: dict[str, tuple[object, int, int]] = {}  # request id -> (session, index, round)
    session_start: dict[int, float] = {}
    records: list[RequestRecord] = []
    session_times: list[float] = []
    errors = 0
    next_index = 0
    window_tokens = [0.0, 0.0]  # prompt tokens, output tokens served inside the window
    wall0 = time.perf_counter()

    def submit(sess) -> None:
        prompt, out_len = sess.next_request()
        req = engine.add_request(prompt, _params(out_len))
        inflight[req.request_id] = (sess, sess.session_id, sess.round)

    def start_session() -> None:
        nonlocal next_index
        sess = workload.make_session(next_index)
        session_start[next_index] = engine.clock()
        next_index += 1
        submit(sess)

    n = workload.sessions
    starts = [start + ramp * i / n for i in range(n)]
    si = 0

    def start_due() -> None:
        nonlocal si
        while si < n and starts[si] <= engine.clock():
            start_session()
            si += 1

    start_due()
    bar = tqdm(total=duration + warmup, desc="simulated s", unit="s", disable=not progress,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}]")
    last = start
    cut = stalled = False
    while inflight or si < n:
        start_due()
        now = engine.clock()
        if now >= t1:
            break
        if not engine.has_unfinished():
            _wait_until(engine, starts[si])  # only unstarted sessions are left
            continue
        if wall_limit is not None and time.perf_counter() - wall0 > wall_limit:
            cut = True
            break
        steps = engine.stats.steps
        touched = engine.step_requests()
        if not touched and engine.stats.steps == steps:
            # nothing ran and nothing ended: in a closed loop no outside event can change
            # that (a budget controller ratcheted to zero, say): the engine is stalled, and
            # the rest of the window passes with no progress
            stalled = True
            break
        for req in touched:
            if not req.finished or req.request_id not in inflight:
                continue
            out = RequestOutput.of(req)
            sess, idx, rnd = inflight.pop(out.request_id)
            if out.error is not None or out.finish_reason == "abort":
                errors += 1
            rec = record_of(out, idx, rnd)
            if rec.arrival >= t0 and rec.finish <= t1:
                records.append(rec)
            win_prompt, win_out = _window_tokens(rec, t0, t1)
            window_tokens[0] += win_prompt
            window_tokens[1] += win_out
            sess.complete(out.token_ids)  # type: ignore[attr-defined]
            if sess.done or out.finish_reason == "abort":  # type: ignore[attr-defined]
                if session_start[idx] >= t0 and engine.clock() <= t1:
                    session_times.append(engine.clock() - session_start[idx])
                session_start.pop(idx, None)
                start_session()
            else:
                submit(sess)
        if progress and engine.clock() - last > 1.0:
            # never past the total: tqdm drops a total it has overrun, and the format fails
            bar.update(max(0.0, min(engine.clock() - last, bar.total - bar.n)))
            last = engine.clock()
    bar.close()
    for rid in inflight:  # requests still running: their tokens so far, exactly
        req = engine.requests.get(rid)
        if req is None:
            continue
        if req.first_token_time is not None and t0 <= req.first_token_time < t1:
            window_tokens[0] += req.num_prompt_tokens
        window_tokens[1] += sum(1 for t in req.token_times if t0 <= t < t1)
    stalled_at = engine.clock() if stalled else None
    if stalled:
        if getattr(engine.clock, "advance", None) is not None:
            _wait_until(engine, t1)  # the window runs out with nothing done
        else:
            cut = True  # on the wall clock, do not sit out the window
    end = min(engine.clock(), t1) if cut else t1
    window = max(1e-9, end - t0)
    extra = {"window_token_throughput": (window_tokens[0] + window_tokens[1]) / window,
             "window_output_throughput": window_tokens[1] / window}
    return SteadyResult(records=records, duration=window, session_times=session_times,
                        errors=errors, sessions_started=next_index, stalled=stalled,
                        stalled_at=stalled_at, extra=extra)


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
            req = engine.add_request(a.prompt, _params(a.max_tokens))
            # it arrived during the step that just ended: the engine could only take it now,
            # but its latency counts from when it came (a real server queues it meanwhile)
            req.arrival_time = start + a.time
            inflight[req.request_id] = a
            i += 1
        if not engine.has_unfinished():
            if i < len(pending):
                _wait_until(engine, start + pending[i].time)
                continue
            break
        for req in engine.step_requests():
            if req.finished and req.request_id in inflight:
                out = RequestOutput.of(req)
                a = inflight.pop(out.request_id)
                records.append(record_of(out, a.key, 0))
                bar.update(1)
    bar.close()
    end = max((r.finish for r in records), default=start)
    return RunResult(records=records, duration=max(1e-9, end - start), session_times=[])


@fewer_gc_passes
def run_trace_closed(engine: Engine, trace: MooncakeTrace, concurrency: int | None = None,
                     time_scale: float = 1.0, progress: bool = False) -> RunResult:
    """Closed loop along the trace's chains: a request that continues an earlier one is sent
    the moment that one finishes (zero think time). Chain roots start at their timestamps
    (divided by ``time_scale``), or, with ``concurrency``, whenever fewer than that many
    chains are active (then timestamps only give the order)."""
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for r in trace.requests:
        if r.parent is None:
            roots.append(r.index)
        else:
            children.setdefault(r.parent, []).append(r.index)
    chain_of: dict[int, int] = {}
    for root in roots:  # every request belongs to its root's chain
        stack = [root]
        while stack:
            k = stack.pop()
            chain_of[k] = root
            stack.extend(children.get(k, ()))
    open_children = {root: 1 for root in roots}  # requests of the chain not yet finished
    start = engine.clock()
    inflight: dict[str, int] = {}
    records: list[RequestRecord] = []
    session_times: list[float] = []
    chain_start: dict[int, float] = {}
    active = 0
    ri = 0
    bar = tqdm(total=len(trace), desc="requests", unit="req", disable=not progress)

    def send(k: int) -> None:
        r = trace.requests[k]
        req = engine.add_request(trace.prompt(r), _params(max(1, r.output_length)))
        inflight[req.request_id] = k

    def can_start() -> bool:
        if ri >= len(roots):
            return False
        if concurrency is not None:
            return active < concurrency
        return start + trace.requests[roots[ri]].timestamp / time_scale <= engine.clock()

    while ri < len(roots) or inflight:
        while can_start():
            root = roots[ri]
            ri += 1
            active += 1
            chain_start[root] = engine.clock()
            send(root)
        if not engine.has_unfinished():
            if ri < len(roots) and concurrency is None:
                _wait_until(engine, start + trace.requests[roots[ri]].timestamp / time_scale)
                continue
            if not inflight:
                break
        for req in engine.step_requests():
            if not req.finished or req.request_id not in inflight:
                continue
            out = RequestOutput.of(req)
            k = inflight.pop(out.request_id)
            root = chain_of[k]
            records.append(record_of(out, root, k))
            bar.update(1)
            kids = children.get(k, [])
            open_children[root] += len(kids) - 1
            for c in kids:
                send(c)
            if open_children[root] == 0:
                active -= 1
                session_times.append(engine.clock() - chain_start[root])
    bar.close()
    end = max((r.finish for r in records), default=start)
    return RunResult(records=records, duration=max(1e-9, end - start), session_times=session_times)
