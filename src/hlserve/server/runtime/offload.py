"""A request's heavy work off the event loop: bounded pools of the server's own, a limit per
client, and threads with stacks deep enough for what a grammar compiler recurses through.

The event loop serves every connection, ``/health`` included, so anything a request costs in
proportion to its input runs in a worker thread: parsing a large body, rendering a chat
template, tokenizing, building a large response (``prep``), and compiling a grammar
(``grammar``: up to seconds each). Two pools, so that compiles never queue ahead of a plain
request's tokenizing, and neither shares the loop's default executor, which anything may use.
A client (its API key, else its address) has at most ``per_client`` tasks running or queued
in each pool; more wait their turn on the loop (a coroutine, no thread), so one client's
backlog cannot fill a pool that the others need.

Worker threads get ``THREAD_STACK_BYTES`` of stack (address space; pages are committed only
as used): llguidance's grammar compiler and matcher recurse on the native stack by the
grammar's depth, and a Lark chain of 5,000 rules overflowed the default 8 MiB stack of a
thread, a segmentation fault that took the whole server down. 512 MiB holds the deepest
grammar the spec size limit admits (llguidance refuses it with an error past ~30,000 rules).
The engine thread, which advances matchers, is started the same way (:func:`start_thread`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
THREAD_STACK_BYTES = 512 << 20
KINDS = ("prep", "grammar")
_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


def start_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    """A daemon thread running ``target``, started with a THREAD_STACK_BYTES stack."""
    with _stack_lock:
        old = threading.stack_size(THREAD_STACK_BYTES)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    return thread


class WorkerPool:
    """``workers`` threads started at once (deep stacks), taking tasks in arrival order."""

    def __init__(self, workers: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self._threads = [start_thread(self._work, f"hlserve-{name}-{i}") for i in range(workers)]

    def submit(self, fn: Callable[[], T]) -> Future:
        fut: Future = Future()
        self._tasks.put((fut, fn))
        return fut

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            fut, fn = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller's await raises it
                fut.set_exception(e)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)


@dataclass(frozen=True)
class OffloadLimits:
    prep_workers: int = 4
    grammar_workers: int = 4  # more than per_client: one client never holds them all
    per_client: int = 2  # tasks one client may have running or queued in each pool


@dataclass
class _Slots:
    sem: asyncio.Semaphore
    users: int = 0


class Offload:
    """The server's pools (``prep``, ``grammar``) with a limit per client in each."""

    def __init__(self, limits: OffloadLimits | None = None) -> None:
        self.limits = limits or OffloadLimits()
        self._pools = {"prep": WorkerPool(self.limits.prep_workers, "prep"),
                       "grammar": WorkerPool(self.limits.grammar_workers, "grammar")}
        self._slots: dict[tuple[str, str], _Slots] = {}  # event loop only

    async def run(self, kind: str, client: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the ``kind`` pool, once ``client`` has a free slot there."""
        key = (kind, client)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = _Slots(asyncio.Semaphore(self.limits.per_client))
        slots.users += 1
        try:
            async with slots.sem:
                fut = self._pools[kind].submit(lambda: fn(*args))
                return await asyncio.wrap_future(fut)
        finally:
            slots.users -= 1
            if not slots.users:  # clients come and go: keep only those with work here
                del self._slots[key]

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
