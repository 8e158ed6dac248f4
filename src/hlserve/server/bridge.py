"""The engine thread and its bridge to asyncio.

The engine is single-threaded and its ``step()`` blocks for a whole forward pass, so it runs
in one dedicated thread that owns it outright: nothing else calls into the engine.

- **In**: HTTP handlers post commands (``add`` a batch of requests, ``abort`` ids) to a
  deque guarded by a condition variable. The engine thread drains it between steps, and
  sleeps on the condition when it has nothing to do.
- **Out**: after each drain and each step the engine thread hands everything it produced to
  the event loop in one ``loop.call_soon_threadsafe`` call, which puts each event on the
  ``asyncio.Queue`` of the HTTP request it belongs to. Events are ``(kind, index, payload)``:
  ``added`` (the engine accepted the request), ``output`` (a cumulative
  :class:`RequestOutput`), ``error`` (an exception: rejected, or failed).
- **Faults**: a request the engine rejects fails alone (``error`` event, 400). A step that
  raises fails the requests that were running, is counted, and the loop goes on once the KV
  accounting checks out; three failed steps in a row, or any error outside a step, kill the
  loop: every pending request gets :class:`EngineDeadError` and ``/health`` answers 503.
- **Metrics** are recorded here, in the engine thread, as outputs arrive (counters,
  histograms) and after every iteration (gauges), so a scrape never touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hlserve.engine.engine import Engine
from hlserve.errors import EngineDeadError, InvalidRequestError
from hlserve.request import Request, RequestOutput, SamplingParams
from hlserve.server.args import REQUEST_CLASSES
from hlserve.server.metrics import FINISH_REASONS, ServerMetrics

log = logging.getLogger("hlserve.server")

MAX_CONSECUTIVE_STEP_FAILURES = 3

Event = tuple[str, int, Any]  # (kind, index, payload)


class RequestFailed(Exception):
    """A request the engine accepted and then could not finish (a failed step)."""


@dataclass(eq=False)
class Submission:
    """One engine request of an HTTP request (a batch prompt gives several)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    request_class: str | None  # None: the engine's default
    priority: int
    arrival: float  # the engine clock's time when the HTTP request arrived
    index: int
    sink: asyncio.Queue[Event]
    cache_salt: str | None = None  # the prefix-cache namespace (the API key's, by default)


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


class EngineBridge:
    def __init__(self, engine: Engine, metrics: ServerMetrics, idle_wait_s: float = 1.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._cmds = _Commands()
        self._pending = 0  # submitted, not yet added to the engine
        self._waiting = 0  # the engine's waiting queue, as of the last iteration
        self._stopping = False
        self._dead: BaseException | None = None
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failed_steps = 0
        self._last_totals = (0, 0)  # retractions, prefix-cache queries: engine totals seen

    # ---- lifecycle (event-loop side) -------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._main, name="hlserve-engine", daemon=True)
        self._thread.start()

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

    def health_problem(self) -> str | None:
        """None while the engine serves; else why it does not (for ``/health``)."""
        if self.alive:
            return None
        return self.dead_reason or "the engine is stopping"

    def num_queued(self) -> int:
        """Requests waiting for the engine: submitted but not added, plus the engine's queue."""
        return self._pending + self._waiting

    # ---- commands (event-loop side; never block) -----------------------------------------
    def submit(self, subs: Sequence[Submission]) -> None:
        with self._cv:
            if not self.alive:
                raise EngineDeadError(f"the engine is not running ({self.dead_reason})")
            self._cmds.adds.append(list(subs))
            self._pending += len(subs)
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
            with self._cv:
                if not (self._cmds.adds or self._cmds.aborts or self._stopping
                        or eng.has_unfinished()):
                    self._cv.wait(self.idle_wait_s)
                if self._stopping:
                    return
                cmds, self._cmds = self._cmds, _Commands()
            items: list[tuple[asyncio.Queue, Event]] = []
            self._handle(cmds, items)
            self._deliver(items)  # acks first: streams can start while the step runs
            if eng.has_unfinished():
                items = []
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
                    if eng.stats.steps > steps_before:  # a batch ran: the failure streak ends
                        self._failed_steps = 0
                    self._count_request_counters()
                    self._on_outputs(outputs, items)
                    if not outputs and eng.stats.steps == steps_before:
                        # nothing could be scheduled (should not happen): do not spin
                        with self._cv:
                            self._cv.wait(0.005)
                self._deliver(items)
            try:
                self._publish_gauges()
            except Exception:
                log.exception("publishing the engine gauges failed")

    def _handle(self, cmds: _Commands, items: list) -> None:
        eng = self.engine
        for batch in cmds.adds:
            added: list[Submission] = []
            failed = False
            for sub in batch:
                if failed:  # one prompt of a batch rejected: the rest is not started
                    items.append((sub.sink, ("error", sub.index, InvalidRequestError(
                        "another prompt of this request was rejected"))))
                    continue
                try:
                    req = eng.add_request(sub.prompt, sub.params, request_id=sub.request_id,
                                          request_class=sub.request_class,
                                          priority=sub.priority, arrival_time=sub.arrival,
                                          cache_salt=sub.cache_salt)
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
            if failed:
                for sub in added:  # undo the batch's accepted prompts
                    eng.abort(sub.request_id)
                    self._live.pop(sub.request_id, None)
            with self._cv:  # moved from pending to waiting in one go, for the queue cap
                self._pending -= len(batch)
                self._waiting = len(eng.scheduler.waiting)
        for rid in cmds.aborts:
            if rid in self._live:
                eng.abort(rid)  # pages go back now; the final output comes with the next step

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
        totals = (self.engine.scheduler.num_retractions, self.engine.kv.prefix_queries)
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
        self._failed_steps += 1
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self._failed_steps} engine steps failed in a row; "
                                  f"the last: {exc}") from exc
        running = {r.request_id for r in self.engine.scheduler.running}
        for rid in list(self._live):
            if rid not in running:
                continue
            live = self._live.pop(rid)
            self.engine.abort(rid)
            live.metrics.success["error"].inc()
            items.append((live.sub.sink, ("error", live.sub.index,
                                          RequestFailed(f"the engine failed on this request's "
                                                        f"batch: {type(exc).__name__}: {exc}"))))
        self.engine.scheduler.check_invariants()  # raises (and kills the loop) if broken

    def _publish_gauges(self) -> None:
        sched = self.engine.scheduler
        counts = {cls: [0, 0] for cls in REQUEST_CLASSES}
        for i, queue in enumerate((sched.running, sched.waiting)):
            for r in queue:
                cls = getattr(r.request_class, "value", r.request_class)
                if cls in counts:
                    counts[cls][i] += 1
        for cls, (running, waiting) in counts.items():
            self.metrics.c[cls].running.set(running)
            self.metrics.c[cls].waiting.set(waiting)
        self.metrics.kv_usage.labels(self.metrics.model_name).set(self.engine.kv.usage)
        self._waiting = len(sched.waiting)

    def _deliver(self, items: list[tuple[asyncio.Queue, Event]]) -> None:
        if not items or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is going away
            self._loop.call_soon_threadsafe(_put_all, items)

    def _die(self, exc: BaseException) -> None:
        with self._cv:
            if self._dead is None:
                self._dead = exc
            cmds, self._cmds = self._cmds, _Commands()
            self._pending = 0
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine loop died: {type(exc).__name__}: {exc}")
        items = [(live.sub.sink, ("error", live.sub.index, err)) for live in self._live.values()]
        items += [(sub.sink, ("error", sub.index, err)) for batch in cmds.adds for sub in batch]
        self._live.clear()
        self._deliver(items)


def _put_all(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for sink, event in items:
        sink.put_nowait(event)


class RequestGroup:
    """The engine requests of one HTTP request, seen from the event loop."""

    def __init__(self, bridge: EngineBridge, subs: list[Submission],
                 sink: asyncio.Queue[Event]) -> None:
        self.bridge = bridge
        self.subs = subs
        self.sink = sink
        self.finished: set[int] = set()
        self._early: list[Event] = []

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.subs]

    async def wait_added(self) -> None:
        """Return once the engine accepted every request; raise the first rejection."""
        pending = {s.index for s in self.subs}
        error: BaseException | None = None
        while pending:
            kind, index, payload = await self.sink.get()
            if kind == "added":
                pending.discard(index)
            elif kind == "error":
                pending.discard(index)
                self.finished.add(index)
                error = error or payload
            else:
                self._early.append((kind, index, payload))
        if error is not None:
            self.abort_unfinished()
            raise error

    async def events(self) -> AsyncIterator[list[tuple[int, RequestOutput | BaseException]]]:
        """Batches of ``(index, latest output or error)``, at most one entry per index per
        batch: when the consumer lags, cumulative outputs are coalesced."""
        while len(self.finished) < len(self.subs):
            if self._early:
                raw, self._early = self._early, []
            else:
                raw = [await self.sink.get()]
            while not self.sink.empty():
                raw.append(self.sink.get_nowait())
            latest: dict[int, RequestOutput | BaseException] = {}
            for kind, index, payload in raw:
                if index in self.finished:
                    continue
                if kind == "error":
                    latest[index] = payload
                    self.finished.add(index)
                elif kind == "output":
                    latest[index] = payload
                    if payload.finished:
                        self.finished.add(index)
            if latest:
                yield sorted(latest.items())

    def abort_unfinished(self) -> None:
        ids = [s.request_id for s in self.subs if s.index not in self.finished]
        self.finished.update(s.index for s in self.subs)
        self.bridge.abort(ids)
