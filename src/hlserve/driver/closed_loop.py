"""The one closed-loop agent driver for an in-process engine (wall or virtual clock): each
session has one request in flight, or none while its tool call runs. A session sends its
next round in the iteration its last one finished, or, when its workload has a tool time,
once that many seconds have passed on the engine's clock (slept on the wall clock, jumped on
a virtual one when every session is in a tool call; the engine steps the other sessions
meanwhile). Configured by a measurement window and by whether finished sessions are
replaced (a fixed set of sessions run to the end, or a steady state at constant
concurrency)."""

from __future__ import annotations

import functools
import gc
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tqdm import tqdm

from hlserve.driver.records import RequestRecord, RunResult
from hlserve.engine.llm_engine import Engine
from hlserve.errors import InvalidRequestError
from hlserve.request import Request, RequestOutput, SamplingParams

R = TypeVar("R")
# (record, prompt ids, output ids or None for a failed request): a sink (a JSONL writer)
OnRecord = Callable[[RequestRecord, list[int], list[int] | None], None]


def fewer_gc_passes(driver: Callable[..., R]) -> Callable[..., R]:
    """Under a virtual clock, a driver runs the cyclic garbage collector less often.

    A simulated hour creates hundreds of thousands of long-lived radix-tree nodes, and with
    the default thresholds the collector rescans them as they age: a fifth of the
    simulator's wall time (``benchmarks/sim_speed.py``). Nothing of a simulation is cyclic
    garbage in bulk, so fewer young-generation passes lose nothing. Real (wall-clock) runs
    keep the interpreter's defaults."""

    @functools.wraps(driver)
    def run(engine: Engine, *args: Any, **kwargs: Any) -> R:
        if not engine.virtual_time:
            return driver(engine, *args, **kwargs)
        old = gc.get_threshold()
        gc.set_threshold(100_000, 50, 100)
        try:
            return driver(engine, *args, **kwargs)
        finally:
            gc.set_threshold(*old)

    return run


def wait_until(engine: Engine, t: float) -> None:
    """Idle until engine clock time ``t``: jump a virtual clock, sleep on the wall clock."""
    now = engine.clock()
    if t <= now:
        return
    if engine.virtual_time:
        engine.skip_time(t - now)
    else:
        time.sleep(t - now)


def greedy(n: int, pin: bool = True) -> SamplingParams:
    """A workload request, greedy: ``n`` output tokens exactly (ignore_eos), or with ``pin``
    False up to ``n``, ending at the model's end of turn."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=pin)


@dataclass(frozen=True)
class Loop:
    """How a closed loop runs and what it measures (seconds on the engine's clock).

    ``duration`` None: run until every session has ended, measuring everything. Otherwise the
    window is ``[warmup, warmup + duration)`` from the start: a request is measured when it
    arrives and finishes inside it, a session when it starts and ends inside it.
    ``replace_finished``: a session that ends (or fails) is replaced by the next index, so
    concurrency stays constant (a steady state; needs a duration). The first sessions start
    evenly over ``ramp``. ``wall_limit`` (wall seconds) cuts a run short, and the window to
    the clock time reached. ``token_times`` keeps every token's time in the records (ITL)."""

    duration: float | None = None
    warmup: float = 0.0
    replace_finished: bool = False
    ramp: float = 0.0
    wall_limit: float | None = None
    token_times: bool = False

    def __post_init__(self) -> None:
        if self.replace_finished and self.duration is None:
            raise ValueError("replacing finished sessions needs a window duration")


@dataclass
class LoopResult(RunResult):
    """``records``: the measured requests (failed ones too, ``success`` False); ``duration``:
    the window, or the start to the last finish. ``extra``: the window's token throughput
    counted token by token (prompts when their prefill completes, outputs when generated,
    whether or not the request finished in the window): steadier than per-request
    completions when requests are long."""

    errors: int = 0  # requests that failed (rejected, aborted, errored)
    sessions_failed: int = 0  # sessions a failed request ended
    sessions_started: int = 0
    sessions_ended_in_window: int = 0  # ended inside the window, wherever they started
    stalled: bool = False  # the engine stopped scheduling anything with requests waiting
    stalled_at: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


def window_tokens(rec: RequestRecord, t0: float, t1: float) -> tuple[float, float]:
    """Tokens of a finished request served inside ``[t0, t1)``: its prompt when its first
    token came (the prefill is done then), its output tokens spread evenly from the first
    token to the finish."""
    first = rec.first if rec.first is not None else rec.start
    prompt = float(rec.prompt_tokens) if t0 <= first < t1 else 0.0
    n = rec.output_tokens
    if n <= 1 or rec.end <= first:
        return prompt, float(n) if t0 <= first < t1 else 0.0
    step = (rec.end - first) / (n - 1)
    lo = max(0, math.ceil((t0 - first) / step - 1e-9))
    hi = min(n - 1, math.ceil((t1 - first) / step - 1e-9) - 1)
    return prompt, float(max(0, hi - lo + 1))


def engine_record(req: Request, session_id: int, rnd: int, t0: float,
                  token_times: bool = False) -> RequestRecord:
    """A finished request's record: engine clock seconds from ``t0`` (the run's start)."""
    out = RequestOutput.of(req)
    m = out.metrics
    arrival = m["arrival_time"] or t0
    first = m["first_token_time"] or arrival
    reason = str(out.finish_reason)
    ok = out.error is None and reason in ("stop", "length") and bool(out.token_ids)
    return RequestRecord(
        request_id=f"s{session_id}-r{rnd}", session_id=session_id,
        round=rnd, start=arrival - t0, end=(m["finish_time"] or arrival) - t0,
        chunk_times=[t - t0 for t in req.token_times] if token_times else [],
        first_token=first - t0, prompt_tokens=len(out.prompt_token_ids),
        output_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens,
        expected_output_tokens=req.params.max_tokens, success=ok, finish_reason=reason,
        error=None if ok else f"finished with {reason}: {out.error or ''}".strip())


class _Run:
    """The state of one closed-loop run; :func:`run_closed_loop` is its driver."""

    def __init__(self, engine: Engine, new_session: Callable[[int], Any], sessions: int,
                 loop: Loop, on_record: OnRecord | None) -> None:
        self.engine, self.new_session, self.n, self.loop = engine, new_session, sessions, loop
        self.on_record = on_record
        self.t0 = engine.clock()
        self.w0 = loop.warmup
        self.w1 = math.inf if loop.duration is None else loop.warmup + loop.duration
        self.starts = [loop.ramp * i / sessions for i in range(sessions)]
        self.si = 0  # initial sessions started
        self.next_index = 0
        self.inflight: dict[str, tuple[Any, list[int]]] = {}
        # sessions in a tool call: (due, order, session), due in seconds from the start
        self.in_tool: list[tuple[float, int, Any]] = []
        self.tool_calls = 0
        self.session_start: dict[int, float] = {}
        self.res = LoopResult(records=[], duration=0.0, session_times=[])
        # prompt, output tokens served inside the window, and the prompt tokens among them
        # the engine computed (not found in the prefix cache)
        self.tokens = [0.0, 0.0, 0.0]

    def now(self) -> float:
        return self.engine.clock() - self.t0

    def start_due(self) -> None:
        while self.si < self.n and self.starts[self.si] <= self.now():
            self.si += 1
            self.start_session()

    def start_session(self) -> None:
        sess = self.new_session(self.next_index)
        self.next_index += 1
        self.session_start[sess.session_id] = self.now()
        self.submit(sess)

    def next_event(self) -> float | None:
        """When the next session comes back from its tool call or starts (seconds from the
        start), None when neither is left."""
        due = [self.in_tool[0][0]] if self.in_tool else []
        if self.si < self.n:
            due.append(self.starts[self.si])
        return min(due, default=None)

    def release_due(self) -> None:
        """Send the next round of every session whose tool call has ended, in due order."""
        while self.in_tool and self.in_tool[0][0] <= self.now():
            due, _, sess = heapq.heappop(self.in_tool)
            self.submit(sess, arrival=self.t0 + due)

    def submit(self, sess: Any, arrival: float | None = None) -> None:
        """Send the session's next round; ``arrival`` (engine clock): when it was due, if
        that was before the step that just ended finished (it waited for the engine as a
        server's queue would hold it)."""
        prompt, out_len = sess.next_request()
        try:
            # each round names its session: with --session-ttl its pages are retained between
            # rounds (engine/sessions.py); without it the name changes nothing
            # a session whose replies are real text (the coding workload) says so: its
            # lengths are the model's, not pinned
            req = self.engine.add_request(prompt, greedy(out_len, getattr(sess, "ignore_eos", True)),
                                          arrival_time=arrival,
                                          session_id=f"s{sess.session_id}")
        except InvalidRequestError as e:  # ends the session; never replaced (it would be again)
            now = self.now()
            rec = RequestRecord(request_id=f"s{sess.session_id}-r{sess.round}",
                                session_id=sess.session_id, round=sess.round, start=now,
                                end=now, prompt_tokens=len(prompt),
                                expected_output_tokens=out_len, error=f"rejected: {e}")
            self.measure(rec, prompt, None)
            self.res.errors += 1
            self.res.sessions_failed += 1
            return
        self.inflight[req.request_id] = (sess, prompt)

    def measure(self, rec: RequestRecord, prompt: list[int], output: list[int] | None) -> None:
        if rec.start >= self.w0 and rec.end <= self.w1:
            self.res.records.append(rec)
            if self.on_record is not None:
                self.on_record(rec, prompt, output)

    def finished(self, req: Request) -> None:
        sess, prompt = self.inflight.pop(req.request_id)
        rec = engine_record(req, sess.session_id, sess.round, self.t0, self.loop.token_times)
        self.measure(rec, prompt, list(req.output_token_ids) if rec.success else None)
        if self.loop.duration is not None:
            win_prompt, win_out = window_tokens(rec, self.w0, self.w1)
            self.tokens[0] += win_prompt
            self.tokens[1] += win_out
            if win_prompt:
                self.tokens[2] += win_prompt - rec.cached_tokens
        if rec.success:
            sess.complete(list(req.output_token_ids))
            if not sess.done:
                self.after_round(sess, rec.end - rec.start)
                return
            started = self.session_start.pop(sess.session_id)
            if self.w0 <= self.now() <= self.w1:
                self.res.sessions_ended_in_window += 1
            if started >= self.w0 and self.now() <= self.w1:
                self.res.session_times.append(self.now() - started)
        else:
            self.res.errors += 1
            self.res.sessions_failed += 1
            self.session_start.pop(sess.session_id, None)
        if self.loop.replace_finished:
            self.start_session()

    def after_round(self, sess: Any, served: float) -> None:
        """The session's tool call, then its next round: at once when the call takes no time
        (the zero-gap loop, unchanged), else queued until it is due. ``served``: the seconds
        the round took, sent to queued (a trace's recorded gap includes them)."""
        pause = sess.tool_pause(served) if hasattr(sess, "tool_pause") else 0.0
        if pause <= 0.0:
            self.submit(sess)
            return
        self.tool_calls += 1
        heapq.heappush(self.in_tool, (self.now() + pause, self.tool_calls, sess))

    def count_unfinished(self) -> None:
        """Requests still running at the end: their tokens inside the window so far, exactly."""
        for rid in self.inflight:
            req = self.engine.requests.get(rid)
            if req is None:
                continue
            first = req.first_token_time
            if first is not None and self.w0 <= first - self.t0 < self.w1:
                self.tokens[0] += req.num_prompt_tokens
                self.tokens[2] += req.num_prompt_tokens - req.num_cached_prompt
            self.tokens[1] += sum(1 for t in req.token_times if self.w0 <= t - self.t0 < self.w1)


@fewer_gc_passes
def run_closed_loop(engine: Engine, new_session: Callable[[int], Any], sessions: int,
                    loop: Loop = Loop(), on_record: OnRecord | None = None,
                    progress: bool = False) -> LoopResult:
    """Run ``sessions`` concurrent sessions (``new_session(i)`` makes session i) as ``loop``
    says. A failed request (rejected, aborted, an error, no output) ends its session. An
    engine that schedules nothing while requests wait is stalled: the run stops, and under a
    virtual clock the rest of the window passes with no progress (``stalled``)."""
    run = _Run(engine, new_session, sessions, loop, on_record)
    wall0 = time.perf_counter()
    bar = _progress_bar(loop, sessions, progress)
    cut = False
    run.start_due()
    while run.inflight or run.in_tool or run.si < run.n:
        run.start_due()
        run.release_due()
        if run.now() >= run.w1:
            break
        if not engine.has_unfinished():
            due = run.next_event()  # every live session is in a tool call or not started
            if due is None:
                break
            wait_until(engine, run.t0 + min(due, run.w1))
            continue
        if loop.wall_limit is not None and time.perf_counter() - wall0 > loop.wall_limit:
            cut = True
            break
        steps = engine.num_steps
        touched = engine.step_requests()  # only finished requests are read
        if not touched and engine.num_steps == steps:
            # nothing ran and nothing ended: in a closed loop no outside event can change
            # that (a budget controller ratcheted to zero, say)
            run.res.stalled, run.res.stalled_at = True, engine.clock()
            break
        done = [r for r in touched if r.finished and r.request_id in run.inflight]
        for req in done:
            run.finished(req)
        _advance_bar(bar, run, len(done))
    bar.close()
    return _result(run, cut)


def _result(run: _Run, cut: bool) -> LoopResult:
    res, loop, engine = run.res, run.loop, run.engine
    res.sessions_started = run.next_index
    if loop.duration is None:
        res.duration = max((r.end for r in res.records), default=0.0)
        return res
    run.count_unfinished()
    if res.stalled:
        if engine.virtual_time:
            wait_until(engine, run.t0 + run.w1)  # the window runs out with nothing done
        else:
            cut = True  # on the wall clock, do not sit out the window
    end = min(run.now(), run.w1) if cut else run.w1
    window = max(1e-9, end - run.w0)
    res.duration = window
    res.extra = {"window_token_throughput": (run.tokens[0] + run.tokens[1]) / window,
                 "window_output_throughput": run.tokens[1] / window,
                 "window_computed_token_throughput": (run.tokens[2] + run.tokens[1]) / window}
    return res


def _progress_bar(loop: Loop, sessions: int, progress: bool) -> tqdm:
    if loop.duration is None:
        return tqdm(desc="agent rounds", unit="req", disable=not progress)
    return tqdm(total=loop.duration + loop.warmup, desc="clock s", unit="s", disable=not progress,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}]")


def _advance_bar(bar: tqdm, run: _Run, finished: int) -> None:
    if bar.disable:
        return
    if run.loop.duration is None:
        bar.update(finished)
    elif run.now() - bar.n > 1.0:
        # never past the total: tqdm drops a total it has overrun, and the format fails
        bar.update(max(0.0, min(run.now() - bar.n, bar.total - bar.n)))


def run_agent_sessions(engine: Engine, workload: Any, progress: bool = False) -> LoopResult:
    """Every session of ``workload`` (``make_session(i)`` for i < ``sessions``) run to its
    end, one request in flight each: the offline benchmarks' and calibration's loop."""
    return run_closed_loop(engine, workload.make_session, workload.sessions, Loop(),
                           progress=progress)
