"""One HTTP request's side of the engine bridge, on the event loop.

The handler turns a request into :class:`Submission` s (one per prompt and sequence), all
sharing one :class:`EventSink` that the engine thread fills through the loop with
``(kind, index, payload)`` events: ``added``, ``output`` (a cumulative
:class:`~hlserve.request.RequestOutput`) and ``error``. :class:`RequestGroup` reads that
sink as the handler needs it: wait until every prompt is accepted, then batches of the
latest output (or error) per prompt, and abort what is unfinished when the answer ends early.
The engine thread's side is :mod:`hlserve.server.runtime.bridge`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hlserve.request import RequestOutput, SamplingParams
from hlserve.structured.grammar import GrammarState

Event = tuple[str, int, Any]  # (kind, index, payload)


class EventSink:
    """The events of one HTTP request, filled by the engine thread (through the loop) and
    read by its handler (its methods are named as ``asyncio.Queue``'s are).

    Control events (``added``, ``error``) are kept in order; of the cumulative outputs only
    the latest per index is kept, so a reader that has not kept up finds one output with
    everything produced meanwhile, and a stalled one holds O(1) outputs, not one per step.
    Control events are read first: an error then supersedes its index's pending output."""

    def __init__(self) -> None:
        self._control: deque[Event] = deque()
        self._outputs: dict[int, Event] = {}  # index -> latest ("output", index, out)
        self._ready = asyncio.Event()

    def put_nowait(self, event: Event) -> None:
        if event[0] == "output":
            self._outputs[event[1]] = event
        else:
            self._control.append(event)
        self._ready.set()

    def empty(self) -> bool:
        return not self._control and not self._outputs

    def get_nowait(self) -> Event:
        if self._control:
            return self._control.popleft()
        if self._outputs:
            return self._outputs.pop(next(iter(self._outputs)))
        raise asyncio.QueueEmpty

    async def get(self) -> Event:
        while self.empty():
            self._ready.clear()
            await self._ready.wait()
        return self.get_nowait()


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
    sink: EventSink
    cache_salt: str | None = None  # the prefix-cache namespace (the API key's, by default)
    follows: str | None = None  # n > 1: the first sibling's request id (see Engine.add_request)
    grammar: GrammarState | None = None  # its constraint's matcher, compiled off the engine
    session: str | None = None  # the agent session it is a round of (engine/sessions.py)


class RequestGroup:
    """The engine requests of one HTTP request, seen from the event loop."""

    def __init__(self, subs: list[Submission], sink: EventSink,
                 abort: Callable[[Sequence[str]], None]) -> None:
        self.subs = subs
        self.sink = sink
        self.finished: set[int] = set()
        self._early: list[Event] = []
        self._abort = abort  # the bridge's: ends these ids in the engine thread

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
        self._abort(ids)
