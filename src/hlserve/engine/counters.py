"""What the engine counts of its own work: :class:`Counters`, the running totals only the
engine changes, and :class:`EngineStats`, the frozen snapshot of them (with agent sessions'
retention) that ``Engine.stats`` offers its callers (the server's /metrics, the drivers, the
benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    """The engine's running totals, which only the engine changes."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of finished requests
    generation_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (recompute included)
    busy_time: float = 0.0
    failed_steps: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the engine has done, at one moment (:attr:`Engine.stats`): its counters, and
    agent sessions' retention (engine/sessions.py), which /metrics' session gauges show."""

    steps: int
    prompt_tokens: int
    generation_tokens: int
    computed_tokens: int
    busy_time: float
    failed_steps: int
    retained_pages: int  # cached pages of finished rounds under their retention deadline
    retained_hits: int  # rounds that found their retained pages
    retained_expired: int  # retained pages whose deadline passed
    retained_evicted: int  # retained pages evicted before their deadline
    reprefilled_tokens: int  # retained context computed again (evicted before reuse)
