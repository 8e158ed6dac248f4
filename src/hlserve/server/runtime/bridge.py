"""The engine thread and its bridge to asyncio.

The engine is single-threaded and its ``step()`` blocks for a whole forward pass, so it runs
in one dedicated thread that owns it outright: nothing else calls into the engine.

- **In**: HTTP handlers post commands (``add`` a batch of requests, ``abort`` ids) to a
  deque guarded by a condition variable. The engine thread drains it between steps, and
  sleeps on the condition when it has nothing to do.
- **Out**: after each drain and each step the engine thread hands everything it produced to
  the event loop in one ``loop.call_soon_threadsafe`` call, which puts each event on the
  :class:`~hlserve.server.runtime.events.EventSink` of the HTTP request it belongs to. Events are
  ``(kind, index, payload)``: ``added`` (the engine accepted the request), ``output`` (a
  cumulative :class:`RequestOutput`), ``error`` (an exception: rejected, or failed). The
  request's side (sink, submissions, the group its handler reads) is
  :mod:`hlserve.server.runtime.events`.
- **Limits** (:class:`BridgeLimits`): queued requests and queued prompt tokens are capped
  (:class:`ServiceUnavailableError` ``queue_full``, 503 with Retry-After; a request that
  could never fit a cap is a 400), a request past its deadline is ended with an error, and
  ``health_problem`` reports a loop that has not come round within the iteration timeout
  while work is in flight ("engine wedged").
- **Faults**: a request the engine rejects fails with the rest of its batch, and nothing
  else (``error`` events, 400). The engine fails a request whose forward or output
  processing raises alone, and recovers from a step that raises outside the forward (each
  request it touched ends with an error); the engine's
  :class:`~hlserve.engine.faults.FailureStreak` (three failures in a row, counting steps
  that raise out of ``step()`` here), or any error outside a step, kill the loop: every
  pending request gets :class:`EngineDeadError`, ``/health`` answers 503, and the server
  process exits non-zero so that a supervisor restarts it.
- **Drain** (``start_drain``, SIGTERM): new requests get ``ServiceUnavailableError``
  ``draining``; what is in flight runs on until ``fail_all`` ends what remains.
- **Metrics** are recorded here, in the engine thread, as outputs arrive (counters,
  histograms) and after every iteration (gauges), so a scrape never touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hlserve.engine.llm_engine import Engine
from hlserve.errors import EngineDeadError, InvalidRequestError, ServiceUnavailableError
from hlserve.request import REQUEST_CLASSES, Request, RequestOutput
from hlserve.server.runtime.events import Event, EventSink, Submission
from hlserve.server.runtime.metrics import FINISH_REASONS, ServerMetrics
from hlserve.server.runtime.offload import start_thread
from hlserve.server.runtime.progress import CpuProgress
from hlserve.server.runtime.prompt_window import (
    Held,
    fit_window,
    prompt_tokens,
    sibling_rejected,
    timeout_error,
    units_of,
)
from hlserve.server.runtime.settings import (
    DEFAULT_ENGINE_ITERATION_TIMEOUT_S,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_QUEUED_TOKENS,
    DEFAULT_REQUEST_PREFILL_WINDOW,
)

log = logging.getLogger("hlserve.server")


class RequestFailed(Exception):
    """A request the engine accepted and then could not finish (a failed step)."""


@dataclass(frozen=True)
class BridgeLimits:
    """What the bridge refuses or ends (None: no limit)."""

    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS
    max_queued_tokens: int | None = DEFAULT_MAX_QUEUED_TOKENS
    request_timeout_s: float | None = None  # arrival to finish, per engine request
    engine_iteration_timeout_s: float = DEFAULT_ENGINE_ITERATION_TIMEOUT_S
    # prompt tokens of one request's prompts waiting for prefill in the engine at once
    request_prefill_window: int | None = DEFAULT_REQUEST_PREFILL_WINDOW
    retry_after_s: int = 1

    @classmethod
    def from_settings(cls, settings: Any) -> BridgeLimits:
        """From a ``ServerSettings`` (fields it lacks keep their defaults)."""
        names = ("max_queued_requests", "max_queued_tokens", "request_timeout_s",
                 "engine_iteration_timeout_s", "request_prefill_window", "retry_after_s")
        return cls(**{n: getattr(settings, n) for n in names if hasattr(settings, n)})


@dataclass(eq=False)
class _Live:
    sub: Submission
    req: Request
    metrics: Any  # metrics._ClassMetrics
    n_tokens: int = 0
    n_retractions: int = 0
    n_prefix_queries: int = 0
    n_prefix_hits: int = 0
    queue_time_seen: bool = False


@dataclass
class _Commands:
    adds: list[list[Submission]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    fail_all: BaseException | None = None  # end everything in flight with this error


class EngineBridge:
    def __init__(self, engine: Engine, metrics: ServerMetrics, limits: BridgeLimits | None = None,
                 idle_wait_s: float = 1.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = limits or BridgeLimits()
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._cmds = _Commands()
        self._pending = 0  # submitted, not yet added to the engine
        self._pending_tokens = 0
        self._waiting = 0  # the engine's waiting queue, as of the last iteration
        self._waiting_tokens = 0
        self._stopping = False
        self._draining = False
        self._beat = time.monotonic()  # the engine thread's last pass (for "wedged")
        self._cpu = CpuProgress()  # ... and when it last used CPU time
        self._deadlines: list[tuple[float, str]] = []  # (engine-clock deadline, request id)
        self._dead: BaseException | None = None
        self._live: dict[str, _Live] = {}
        self._held: list[Held] = []  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._last_totals = (0, 0)  # retractions, prefix-cache queries: engine totals seen

    # ---- lifecycle (event-loop side) -------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # a deep stack: the engine thread advances grammar matchers, which recurse natively
        self._thread = start_thread(self._main, "hlserve-engine")
        self._cpu.watch(self._thread)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return (self._dead is None and self._thread is not None and self._thread.is_alive()
                and not self._stopping)

    @property
    def dead_reason(self) -> str | None:
        if self._dead is not None:
            return f"{type(self._dead).__name__}: {self._dead}"
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread has exited"
        return None

    @property
    def draining(self) -> bool:
        return self._draining

    def health_problem(self) -> str | None:
        """None while the engine serves; else why it does not (for ``/health``):
        ``draining``, the reason the loop died, or ``engine wedged: ...`` when the loop has
        not come round, nor its forward progressed, within the iteration timeout while
        requests are in flight."""
        if self._draining:
            return "draining"
        if not self.alive:
            return self.dead_reason or "the engine is stopping"
        # a step that is long but progressing beats from inside its forward (a layer begun)
        # and uses CPU time: only a loop that neither comes round nor progresses is wedged
        progress = max(self._beat, self.engine.last_progress, self._cpu.last_advance())
        stalled = time.monotonic() - progress
        if stalled > self.limits.engine_iteration_timeout_s and self.num_in_flight():
            return (f"engine wedged: no engine step progressed in {stalled:.0f}s while "
                    f"{self.num_in_flight()} requests are in flight (limit "
                    f"{self.limits.engine_iteration_timeout_s:g}s)")
        return None

    def num_queued(self) -> int:
        """Requests waiting for the engine: submitted but not added, plus the engine's queue."""
        return self._pending + self._waiting

    def num_queued_tokens(self) -> int:
        """Prompt tokens of the requests :meth:`num_queued` counts."""
        return self._pending_tokens + self._waiting_tokens

    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet ended (what a drain waits for)."""
        return self._pending + len(self._live)

    # ---- commands (event-loop side; never block) -----------------------------------------
    def submit(self, subs: Sequence[Submission]) -> None:
        """Hand requests to the engine thread, or raise: :class:`InvalidRequestError` for
        one that could never fit a queue cap, :class:`ServiceUnavailableError` while
        draining or while the queue is full, :class:`EngineDeadError` once the loop died."""
        lim = self.limits
        n, tokens = len(subs), sum(prompt_tokens(s) for s in subs)
        if lim.max_queued_requests is not None and n > lim.max_queued_requests:
            raise InvalidRequestError(
                f"this request has {n} prompts; the server queues at most "
                f"{lim.max_queued_requests} (--max-queued-requests)")
        if lim.max_queued_tokens is not None and tokens > lim.max_queued_tokens:
            raise InvalidRequestError(
                f"this request has {tokens} prompt tokens; the server queues at most "
                f"{lim.max_queued_tokens} (--max-queued-tokens)")
        with self._cv:
            if self._draining:
                raise ServiceUnavailableError(
                    "The server is shutting down and takes no new requests; retry (another "
                    "replica)", code="draining", retry_after_s=lim.retry_after_s)
            if not self.alive:
                raise EngineDeadError(f"the engine is not running ({self.dead_reason})")
            self._check_queue(n, tokens)
            self._cmds.adds.append(list(subs))
            self._pending += n
            self._pending_tokens += tokens
            self._cv.notify()

    def _check_queue(self, n: int, tokens: int) -> None:
        lim = self.limits
        queued, queued_tokens = self.num_queued(), self.num_queued_tokens()
        if lim.max_queued_requests is not None and queued + n > lim.max_queued_requests:
            what = f"{queued} requests are waiting (limit {lim.max_queued_requests})"
        elif lim.max_queued_tokens is not None and queued_tokens + tokens > lim.max_queued_tokens:
            what = (f"{queued_tokens} prompt tokens are waiting (limit "
                    f"{lim.max_queued_tokens}); this request adds {tokens}")
        else:
            return
        self.metrics.reject("queue_full")
        raise ServiceUnavailableError(f"The server is overloaded: {what}; retry later",
                                      code="queue_full", retry_after_s=lim.retry_after_s)

    def start_drain(self) -> None:
        """Take no new requests (``draining``); what is in flight runs on."""
        with self._cv:
            self._draining = True

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with ``error`` (an error event in each stream)."""
        with self._cv:
            self._cmds.fail_all = error
            self._cv.notify()

    def abort(self, request_ids: Sequence[str]) -> None:
        if not request_ids:
            return
        with self._cv:
            self._cmds.aborts.extend(request_ids)
            self._cv.notify()

    # ---- the engine thread ----------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:
            log.critical("the engine loop died: %s", e, exc_info=True)
            self._die(e)
        else:
            self._die(EngineDeadError("the server is shutting down"))

    def _run(self) -> None:
        eng = self.engine
        while True:
            self._beat = time.monotonic()
            with self._cv:
                if not (self._cmds.adds or self._cmds.aborts or self._cmds.fail_all
                        or self._stopping or eng.has_unfinished() or self._held):
                    self._cv.wait(self.idle_wait_s)
                if self._stopping:
                    return
                cmds, self._cmds = self._cmds, _Commands()
            items: list[tuple[EventSink, Event]] = []
            self._handle(cmds, items)
            self._release_held(items)
            self._expire(items)
            self._deliver(items)  # acks first: streams can start while the step runs
            items = []
            if eng.has_unfinished():
                steps_before = eng.stats.steps
                failed_before = eng.stats.failed_steps
                try:
                    outputs = eng.step()
                except EngineDeadError:
                    raise  # the runner keeps failing: the loop dies, /health turns 503
                except Exception as e:
                    self._step_failed(e, items)
                else:
                    if eng.stats.failed_steps > failed_before:  # the engine failed a batch
                        self.metrics.engine_step_errors.labels(self.metrics.model_name).inc(
                            eng.stats.failed_steps - failed_before)
                    self._count_request_counters()
                    self._on_outputs(outputs, items)
                    if eng.stats.failed_steps > failed_before:
                        self._reconcile(items)
                    if not outputs and eng.stats.steps == steps_before:
                        # nothing could be scheduled (should not happen): do not spin
                        with self._cv:
                            self._cv.wait(0.005)
            # gauges before the step's outputs: a client that has its answer never scrapes
            # the gauges of the step before it
            try:
                self._publish_gauges()
            except Exception:
                log.exception("publishing the engine gauges failed")
            self._deliver(items)

    def _handle(self, cmds: _Commands, items: list) -> None:
        window = self.limits.request_prefill_window
        for batch in cmds.adds:
            units = units_of(batch)
            n = len(units) if window is None else fit_window(units, window, 0)
            if not self._add_subs([s for u in units[:n] for s in u], items):
                self._refuse([s for u in units[n:] for s in u], items)
            elif n < len(units):  # the rest are accepted now and handed over as these prefill
                self._held.append(Held(batch[0].sink, deque(units[n:])))
                items += [(s.sink, ("added", s.index, None)) for u in units[n:] for s in u]
        for rid in cmds.aborts:
            if rid in self._live:
                self.engine.abort(rid)  # pages go back now; the final output comes next step
            else:
                self._drop_held(rid)
        if cmds.fail_all is not None:
            for rid in list(self._live):
                self._end_with(rid, cmds.fail_all, items, "abort")
            for g in self._held:
                self._refuse([s for u in g.units for s in u], items, cmds.fail_all)
            self._held.clear()

    def _add_subs(self, subs: list[Submission], items: list, released: bool = False) -> bool:
        """Add one request's submissions to the engine, all or none: a prompt the engine
        rejects fails with the rest of them (those added are undone). A ``released`` prompt
        (held until now) enters the engine's queue as a request arriving now, so that it does
        not go ahead of those that came after its HTTP request (the deadline and the server's
        latency metrics still count from that request's arrival)."""
        now = self.engine.clock()
        eng = self.engine
        added: list[Submission] = []
        failed = False
        for sub in subs:
            if failed:  # one prompt of a batch rejected: the rest is not started
                items.append((sub.sink, ("error", sub.index, sibling_rejected())))
                continue
            try:
                req = eng.add_request(sub.prompt, sub.params, request_id=sub.request_id,
                                      request_class=sub.request_class,
                                      priority=sub.priority,
                                      arrival_time=now if released else sub.arrival,
                                      cache_salt=sub.cache_salt, follows=sub.follows,
                                      grammar=sub.grammar, session_id=sub.session)
            except Exception as e:  # a bad request never takes the engine down
                if not isinstance(e, InvalidRequestError):
                    log.exception("add_request failed for %s", sub.request_id)
                items.append((sub.sink, ("error", sub.index, e)))
                failed = True
                continue
            cls = getattr(req.request_class, "value", req.request_class)
            cls = cls if cls in REQUEST_CLASSES else "agent"
            self._live[sub.request_id] = _Live(sub, req, self.metrics.c[cls])
            added.append(sub)
            items.append((sub.sink, ("added", sub.index, None)))
            if self.limits.request_timeout_s is not None:
                heapq.heappush(self._deadlines,
                               (sub.arrival + self.limits.request_timeout_s, sub.request_id))
        if failed:
            for sub in added:  # undo the batch's accepted prompts
                eng.abort(sub.request_id)
                self._live.pop(sub.request_id, None)
        self._unpend(subs)
        return not failed

    def _unpend(self, subs: Sequence[Submission]) -> None:
        with self._cv:  # moved from pending to the engine (or ended) in one go, for the caps
            self._pending -= len(subs)
            self._pending_tokens -= sum(prompt_tokens(s) for s in subs)
            self._waiting = len(self.engine.waiting)

    def _refuse(self, subs: list[Submission], items: list,
                error: BaseException | None = None) -> None:
        """End submissions that never reach the engine, with ``error`` (by default: another
        prompt of their request was rejected)."""
        items += [(s.sink, ("error", s.index, error or sibling_rejected())) for s in subs]
        self._unpend(subs)

    def _drop_held(self, rid: str) -> None:
        """An abort of a prompt still held: its unit (its n > 1 siblings too) is dropped."""
        for g in self._held:
            for unit in g.units:
                if any(s.request_id == rid for s in unit):
                    g.units.remove(unit)
                    self._unpend(unit)
                    if not g.units:
                        self._held.remove(g)
                    return

    def _release_held(self, items: list) -> None:
        """Hand held prompts to the engine while their request's prompts in the engine that
        have not prefilled yet hold fewer than ``request_prefill_window`` tokens."""
        if not self._held:
            return
        unprefilled: dict[int, int] = {}
        for live in self._live.values():
            if live.n_tokens == 0 and live.sub.follows is None:
                key = id(live.sub.sink)
                unprefilled[key] = unprefilled.get(key, 0) + prompt_tokens(live.sub)
        window = self.limits.request_prefill_window or 0
        for g in list(self._held):
            if self._held_expired(g, items):
                continue
            n = fit_window(list(g.units), window, unprefilled.get(id(g.sink), 0))
            subs = [s for _ in range(n) for s in g.units.popleft()]
            if subs and not self._add_subs(subs, items, released=True):  # one was rejected
                for rid, live in list(self._live.items()):
                    if live.sub.sink is g.sink:
                        self._end_with(rid, sibling_rejected(), items, "abort")
                self._refuse([s for u in g.units for s in u], items)
                g.units.clear()
            if not g.units:
                self._held.remove(g)

    def _held_expired(self, g: Held, items: list) -> bool:
        """End a held request's prompts past its deadline (arrival + request timeout)."""
        timeout = self.limits.request_timeout_s
        if timeout is None or self.engine.clock() < g.units[0][0].arrival + timeout:
            return False
        self._refuse([s for u in g.units for s in u], items, timeout_error(timeout))
        self._held.remove(g)
        return True

    def _end_with(self, rid: str, error: BaseException, items: list, reason: str) -> None:
        """End a live request now with an error event (its pages go back at once)."""
        live = self._live.pop(rid)
        self.engine.abort(rid)
        live.metrics.success[reason].inc()
        items.append((live.sub.sink, ("error", live.sub.index, error)))

    def _expire(self, items: list) -> None:
        """End the requests whose deadline (arrival + request timeout) has passed."""
        if not self._deadlines:
            return
        now = self.engine.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self._live:
                self._end_with(rid, timeout_error(self.limits.request_timeout_s), items,
                               "abort")

    def _reconcile(self, items: list) -> None:
        """After a step the engine failed: every live request it ended must have had its
        final event; one that did not (an output lost in a failed step) gets an error now."""
        for rid, live in list(self._live.items()):
            if live.req.finished:
                self._live.pop(rid)
                live.metrics.success["error"].inc()
                items.append((live.sub.sink, ("error", live.sub.index, RequestFailed(
                    f"the engine failed on this request's step: {live.req.error}"))))

    def _on_outputs(self, outputs: list[RequestOutput], items: list) -> None:
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # failed earlier; its sink has been told
            if out.finish_reason == "error":  # its forward failed (the engine went on)
                del self._live[out.request_id]
                live.metrics.success["error"].inc()
                items.append((live.sub.sink, ("error", live.sub.index, RequestFailed(
                    f"the engine failed on this request's batch: {out.error}"))))
                continue
            try:
                self._account(live, out)
            except Exception:  # metrics must never take the engine down
                log.exception("metrics failed for %s", out.request_id)
            items.append((live.sub.sink, ("output", live.sub.index, out)))
            if out.finished:
                del self._live[out.request_id]

    def _account(self, live: _Live, out: RequestOutput) -> None:
        cm, arrival = live.metrics, live.sub.arrival
        times = out.metrics
        n = len(out.token_ids)
        if not live.queue_time_seen and times.get("first_scheduled_time") is not None:
            cm.queue_time.observe(max(0.0, times["first_scheduled_time"] - arrival))
            live.queue_time_seen = True
        if n > live.n_tokens:
            cm.generation_tokens.inc(n - live.n_tokens)
            if live.n_tokens == 0:
                cm.prompt_tokens.inc(len(out.prompt_token_ids))
                if times.get("first_token_time") is not None:
                    cm.ttft.observe(max(0.0, times["first_token_time"] - arrival))
            token_times = live.req.token_times
            if len(token_times) >= n:
                for i in range(max(live.n_tokens, 1), n):
                    cm.itl.observe(token_times[i] - token_times[i - 1])
            live.n_tokens = n
        if out.finished:
            if times.get("finish_time") is not None:
                cm.e2e.observe(max(0.0, times["finish_time"] - arrival))
            reason = out.finish_reason if out.finish_reason in FINISH_REASONS else "error"
            cm.success[reason].inc()

    def _count_request_counters(self) -> None:
        """Per-class preemptions and prefix-cache queries/hits. The engine counts them on each
        request; the live requests are scanned only in a step that changed a total."""
        totals = (self.engine.num_retractions, self.engine.prefix_cache_queries)
        if totals == self._last_totals:
            return
        self._last_totals = totals
        for live in self._live.values():
            req = live.req
            if req.num_retractions > live.n_retractions:
                live.metrics.preemptions.inc(req.num_retractions - live.n_retractions)
                live.n_retractions = req.num_retractions
            if req.num_prefix_queries > live.n_prefix_queries:
                live.metrics.prefix_queries.inc(req.num_prefix_queries - live.n_prefix_queries)
                live.metrics.prefix_hits.inc(req.num_prefix_hits - live.n_prefix_hits)
                live.n_prefix_queries, live.n_prefix_hits = req.num_prefix_queries, req.num_prefix_hits

    def _step_failed(self, exc: Exception, items: list) -> None:
        """Fail the requests the broken step was running; keep the rest if the engine's
        accounting still holds."""
        log.error("an engine step failed: %s", exc, exc_info=True)
        self.metrics.engine_step_errors.labels(self.metrics.model_name).inc()
        self.engine.record_failed_step(exc)  # raises once the engine is broken
        running = {r.request_id for r in self.engine.running}
        for rid in list(self._live):
            if rid not in running:
                continue
            live = self._live.pop(rid)
            self.engine.abort(rid)
            live.metrics.success["error"].inc()
            items.append((live.sub.sink, ("error", live.sub.index,
                                          RequestFailed(f"the engine failed on this request's "
                                                        f"batch: {type(exc).__name__}: {exc}"))))
        self._reconcile(items)
        self.engine.check_invariants()  # raises (and kills the loop) if broken

    def _publish_gauges(self) -> None:
        eng = self.engine
        counts = {cls: [0, 0] for cls in REQUEST_CLASSES}
        for i, queue in enumerate((eng.running, eng.waiting)):
            for r in queue:
                cls = getattr(r.request_class, "value", r.request_class)
                if cls in counts:
                    counts[cls][i] += 1
        for cls, (running, waiting) in counts.items():
            self.metrics.c[cls].running.set(running)
            self.metrics.c[cls].waiting.set(waiting)
        self.metrics.kv_usage.labels(self.metrics.model_name).set(eng.kv_usage)
        self.metrics.publish_sessions(eng.stats)
        self.metrics.publish_spec(eng.spec_stats)
        self._waiting = len(eng.waiting)
        self._waiting_tokens = sum(r.num_prompt_tokens for r in eng.waiting)

    def _deliver(self, items: list[tuple[EventSink, Event]]) -> None:
        if not items or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is going away
            self._loop.call_soon_threadsafe(_put_all, items)

    def _die(self, exc: BaseException) -> None:
        with self._cv:
            if self._dead is None:
                self._dead = exc
            cmds, self._cmds = self._cmds, _Commands()
            self._pending = self._pending_tokens = 0
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine loop died: {type(exc).__name__}: {exc}")
        items = [(live.sub.sink, ("error", live.sub.index, err)) for live in self._live.values()]
        items += [(sub.sink, ("error", sub.index, err)) for batch in cmds.adds for sub in batch]
        items += [(s.sink, ("error", s.index, err)) for g in self._held for u in g.units for s in u]
        self._live.clear()
        self._held.clear()
        self._deliver(items)


def _put_all(items: list[tuple[EventSink, Event]]) -> None:
    for sink, event in items:
        sink.put_nowait(event)
