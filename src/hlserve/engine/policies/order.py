"""The order of the waiting queue: who is considered for admission first.

``OrderPolicy`` is the knob's base; ``FCFS`` and ``PriorityOrder`` sort, and
``AgedPrefixOrder`` is longest cached prefix first with aging, whatever says how many of a
request's tokens are cached (hlserve's radix tree in ``lpm.py``, vLLM's block pool in
``hlserve.integrations.vllm``). ``ProgramOrder`` orders by agent program: the next rounds of
sessions already started ahead of sessions not started, each class in another order's order
(hlserve: LPM), with an aging limit. ``interactive_first`` puts interactive requests ahead of
that order, in both hosts. ``ORDERS`` is the knob's registry of names and ``make_order``
builds the one a config names.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from itertools import chain
from operator import attrgetter
from typing import Any

from hlserve.config import EngineConfig
from hlserve.engine.sessions import MAX_SESSIONS
from hlserve.request import Request

# one started session in ProgramOrder.started: its 32-character key and its dict slot
STARTED_ENTRY_BYTES = 160  # 102 measured
STARTED_MAX_BYTES = MAX_SESSIONS * STARTED_ENTRY_BYTES


class OrderPolicy(abc.ABC):
    """Who is considered for admission first. Returns an iterator so that a pass that
    admits k of n waiting requests need not order all n."""

    @abc.abstractmethod
    def order(self, waiting: list[Request], step: int) -> Iterator[Request]: ...

    def forget(self, req: Request) -> None:  # noqa: B027 (optional hook)
        """The request left the queue (admitted or ended)."""

    def admitted(self, req: Request) -> None:  # noqa: B027 (optional hook)
        """The request was admitted (called before ``forget``)."""


class FCFS(OrderPolicy):
    def order(self, waiting: list[Request], step: int) -> Iterator[Request]:
        # a retracted request keeps its arrival time, so it goes back near the front
        return iter(sorted(waiting, key=lambda r: r.arrival_time))


class PriorityOrder(OrderPolicy):
    """vLLM's priority scheduling: lower ``priority`` value first, then arrival."""

    def order(self, waiting: list[Request], step: int) -> Iterator[Request]:
        return iter(sorted(waiting, key=lambda r: (r.priority, r.arrival_time)))


class AgedPrefixOrder(OrderPolicy):
    """Longest cached prefix first, with aging so that a cold request is not starved.

    Score = cached tokens + ``aging`` x iterations waited; ties go to the earlier arrival.
    Subclasses say how many of a request's tokens are cached (``cached_tokens``): hlserve's
    radix tree here, vLLM's block-hash pool in ``hlserve.integrations.vllm``; the ranking,
    the aging and the FCFS fallback are this one class wherever it runs. A request needs only
    ``request_id``, ``arrival_time`` and ``num_tokens``.
    """

    def __init__(self, aging: float, fcfs_fallback: int | None) -> None:
        self.aging = aging
        self.fcfs_fallback = fcfs_fallback
        self._since: dict[str, int] = {}  # step each waiting request (re)entered the queue

    @abc.abstractmethod
    def cached_tokens(self, req: Request, step: int) -> int: ...

    def _waited(self, req: Request, step: int) -> int:
        """Iterations waited; the wait counts from the first pass that saw the request."""
        return step - self._since.setdefault(req.request_id, step)

    def order(self, waiting: list[Request], step: int) -> Iterator[Request]:
        if self.fcfs_fallback is not None and len(waiting) > self.fcfs_fallback:
            return FCFS().order(waiting, step)
        if len(waiting) == 1:  # nothing to rank (the common case in a closed loop): no walk,
            self._waited(waiting[0], step)  # but its wait counts from now, for aging
            return iter(waiting)
        return self._rank(waiting, step)

    def _rank(self, waiting: list[Request], step: int) -> Iterator[Request]:
        """Every waiting request scored afresh: the pass for a ``cached_tokens`` that can
        change without notice (vLLM's block pool), and the reference for the incremental
        ranking of ``LongestPrefixMatch``."""
        # one tight loop and one C-level sort: at 4,096 waiting, per-request Python calls and
        # a heap pop per request were most of the pass (benchmarks/scheduler_overhead.py)
        since, aging, cached = self._since, self.aging, self.cached_tokens
        keys = []
        for r in waiting:
            waited = step - since.setdefault(r.request_id, step)
            keys.append((-(cached(r, step) + aging * waited), r.arrival_time))
        ranked = sorted(range(len(waiting)), key=keys.__getitem__)  # stable: ties by position
        return (waiting[i] for i in ranked)

    def forget(self, req: Request) -> None:
        self._since.pop(req.request_id, None)


class ProgramOrder(OrderPolicy):
    """Program-level ordering (Continuum, arXiv 2511.02230): an agent session is one program,
    and a program that has started is finished before new ones start.

    Two classes, each in ``inner``'s order (hlserve: LPM, longest cached prefix, with its
    own aging): first the next rounds of started sessions (a request whose session has had a
    round admitted before) and every request that has waited ``aging_steps`` iterations or
    more; then the rest (new sessions' first rounds, requests with no session). The aging
    limit keeps a new session from waiting forever behind a stream of next rounds; the aged
    do not go ahead of the class they join. An aged class ahead of both, by arrival or even
    in LPM's order, is FCFS-like in overload, where most of the queue passes the limit: it
    puts the rounds whose pages were evicted ahead of the ones whose context is cached, and
    the pool thrashes (docs/study.md, section 9: 0.59x of LPM at 64K and 128 sessions). A
    session counts as started from its first admitted round; the most recent
    ``MAX_SESSIONS`` are remembered. A session is its key (``session_key``'s digest, in
    both hosts), not the name a client sent, so each remembered session costs at most
    ``STARTED_ENTRY_BYTES`` (measured, tests/test_session_memory.py) and the map at most
    ``STARTED_MAX_BYTES`` (10 MiB), whatever the names' lengths.
    """

    def __init__(self, inner: OrderPolicy, aging_steps: int,
                 session_of: Callable[[Any], str | None] = attrgetter("session")) -> None:
        self.inner = inner
        # a request's session: hlserve's Request.session; the vLLM plugin reads vLLM's
        self.session_of = session_of
        self.aging_steps = aging_steps
        self.started: dict[str, None] = {}  # sessions with an admitted round, least recent first
        self._since: dict[str, int] = {}  # step each waiting request (re)entered the queue

    def order(self, waiting: list[Request], step: int) -> Iterator[Request]:
        since = self._since
        for r in waiting:
            since.setdefault(r.request_id, step)
        ranked = self.inner.order(waiting, step)
        if len(waiting) == 1:
            return ranked
        limit, started, session_of = self.aging_steps, self.started, self.session_of
        first: list[Request] = []
        rest: list[Request] = []
        for r in ranked:
            if ((session := session_of(r)) is not None and session in started) \
                    or step - since[r.request_id] >= limit:
                first.append(r)
            else:
                rest.append(r)
        return chain(first, rest)

    def admitted(self, req: Request) -> None:
        if (session := self.session_of(req)) is not None:
            self.started.pop(session, None)
            self.started[session] = None  # most recent last
            if len(self.started) > MAX_SESSIONS:
                del self.started[next(iter(self.started))]
        self.inner.admitted(req)

    def forget(self, req: Request) -> None:
        self._since.pop(req.request_id, None)
        self.inner.forget(req)


# how a host builds its LPM order (an ``AgedPrefixOrder`` over its own prefix cache: hlserve's
# radix tree in lpm.py, vLLM's block pool in the plugin), asked only by the names that use it
LongestPrefix = Callable[[], AgedPrefixOrder]

# the knob's names, each with its constructor from the config and the host's LPM order: what
# ``--order`` lists, what a config is checked against (engine/policies/names.py) and what
# ``make_order`` builds, in hlserve's scheduler and in the vLLM plugin alike
ORDERS: dict[str, Callable[[EngineConfig, LongestPrefix], OrderPolicy]] = {
    "fcfs": lambda config, lpm: FCFS(),
    "lpm": lambda config, lpm: lpm(),
    "priority": lambda config, lpm: PriorityOrder(),
    # by session, each class in the host's LPM order (throughput mode's)
    "program": lambda config, lpm: ProgramOrder(lpm(), config.program_aging_steps),
}


def make_order(config: EngineConfig, longest_prefix: LongestPrefix) -> OrderPolicy:
    """The order the config names; ``longest_prefix`` builds the host's LPM order."""
    return ORDERS[config.order](config, longest_prefix)


def interactive_first(waiting: list[Any], is_interactive: Callable[[Any], bool],
                      order: OrderPolicy, step: int) -> Iterator[Any]:
    """Interactive requests first (by priority, then arrival), then the rest in the order
    policy's order. A request needs ``priority`` and ``arrival_time`` (hlserve's and vLLM's
    both have them)."""
    inter = [r for r in waiting if is_interactive(r)]
    if not inter:
        return order.order(waiting, step)
    rest = [r for r in waiting if not is_interactive(r)]
    inter.sort(key=lambda r: (r.priority, r.arrival_time))
    return chain(inter, order.order(rest, step))
