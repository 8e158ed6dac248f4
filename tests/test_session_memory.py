"""What sessions cost in memory: the state kept per agent session (engine/sessions.py's
``Sessions``, ``ProgramOrder.started`` of engine/policies/order.py) is keyed by a fixed-size
digest of the name a client sent, so thousands of distinct long ``session_id`` /
``prompt_cache_key`` / ``user`` values hold at most the documented bytes per session, and a
session is forgotten once its longest deadline has passed. Measured with ``tracemalloc``
(the Python allocations this process makes, which is where the names used to stay)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hlserve.config import EngineConfig
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import VirtualClock
from hlserve.engine.policies.order import FCFS, STARTED_ENTRY_BYTES, ProgramOrder
from hlserve.engine.sessions import (
    LEARNED_CAP,
    MAX_GAPS,
    SESSION_ENTRY_BYTES,
    Sessions,
    session_key,
)
from hlserve.request import Request, SamplingParams
from support import HistoryRunner

SLACK = 64 * 1024  # the allocator's and the dict's own steps: a constant, not per session
NAME_CHARS = 10_000  # each name: 10 KB, as a client may send (2 MB in the report)


def long_name(i: int) -> str:
    return f"{i:08d}" + "x" * NAME_CHARS


@contextmanager
def held() -> Iterator[Callable[[], int]]:
    """The bytes allocated and still held since entering (call it inside the block)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield lambda: (gc.collect(), tracemalloc.get_traced_memory()[0] - base)[1]
    finally:
        tracemalloc.stop()


def test_thousands_of_long_session_names_cost_the_documented_bytes_each() -> None:
    """4,000 sessions named by 10 KB each: the state holds at most SESSION_ENTRY_BYTES per
    session (before: the names themselves, 40 MB); 500 of them with every gap slot used
    (the largest a session's state gets)."""
    n, full, ttl = 4_000, 500, 1000.0
    s = Sessions(ttl, "learned")
    with held() as growth:
        for i in range(n):
            key = session_key(long_name(i), salt="tenant")
            for r in range(MAX_GAPS + 2 if i < full else 1):
                s.on_admit(key, 2.0 * r + 0.5, 0)
                s.retain_until(key, 2.0 * r + 1.0, 100, 7, 100)
        used = growth()
    assert len(s.state) == n
    assert used <= n * SESSION_ENTRY_BYTES + SLACK, (used / n, SESSION_ENTRY_BYTES)


def test_sessions_are_forgotten_after_their_longest_deadline() -> None:
    """A session is remembered LEARNED_CAP x TTL after its last round ended, not until
    65,536 others push it out: 2,000 one-round sessions are gone by then, and their memory
    with them."""
    ttl = 5.0
    s = Sessions(ttl)
    with held() as growth:
        for i in range(2_000):
            assert s.retain_until(session_key(long_name(i)), float(i) * 1e-3, 10, 1, 100) \
                == float(i) * 1e-3 + ttl
        before = growth()
        late = 2.0 + LEARNED_CAP * ttl + 1.0  # past every one's horizon
        s.retain_until(session_key("next"), late, 10, 1, 100)
        after = growth()
    assert set(s.state) == {session_key("next")}
    assert after <= SESSION_ENTRY_BYTES + SLACK < before, (before, after)
    # one that came back within its horizon is kept (its round end moved it to the back)
    s.retain_until(session_key("kept"), late + 1.0, 10, 1, 100)
    s.retain_until(session_key("next"), late + LEARNED_CAP * ttl, 10, 1, 100)
    assert set(s.state) == {session_key("kept"), session_key("next")}


def test_program_order_remembers_started_sessions_in_constant_bytes() -> None:
    """ProgramOrder.started over 5,000 distinct 10 KB names: STARTED_ENTRY_BYTES each."""
    n = 5_000
    order = ProgramOrder(FCFS(), aging_steps=8)
    params = SamplingParams(max_tokens=1)
    with held() as growth:
        for i in range(n):
            req = Request(prompt_token_ids=[1], params=params, arrival_time=0.0,
                          session=session_key(None, long_name(i)))
            order.admitted(req)
            order.forget(req)
            del req
        used = growth()
    assert len(order.started) == n
    assert used <= n * STARTED_ENTRY_BYTES + SLACK, (used / n, STARTED_ENTRY_BYTES)


def _engine_rounds(n: int, name_chars: int) -> tuple[int, int]:
    """``n`` one-round sessions through an engine with --session-ttl, each named by
    ``name_chars`` characters in session_id, prompt_cache_key or user (in turn); the bytes
    still held after, and the sessions remembered."""
    cfg = EngineConfig(model="-", check_invariants=True, page_size=4, session_ttl=600.0)
    engine = build_engine(cfg, HistoryRunner(64, 4, 2e-3, 1e-4, check=False),
                          clock=VirtualClock())
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    fields = ("session_id", "prompt_cache_key", "user")
    with held() as growth:
        for i in range(n):
            name = f"{i:06d}".ljust(name_chars, "y")
            engine.add_request([1, 2, 3, 4, 5], params, **{fields[i % 3]: name})
            del name
            while engine.has_unfinished():
                engine.step()
        return growth(), len(engine.sessions.state)


def test_the_engine_keeps_no_session_name_past_its_request() -> None:
    """Through the engine: 300 sessions named by 100 KB each hold what 300 named by 6
    characters hold (before: 30 MB more, the names)."""
    n = 300
    short, kept_short = _engine_rounds(n, 6)
    long, kept_long = _engine_rounds(n, 100_000)
    assert kept_short == kept_long == n
    assert long <= short + SLACK, (short / n, long / n)
