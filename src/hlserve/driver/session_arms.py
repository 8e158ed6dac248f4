"""The session policies the agent-session benchmarks compare, as engine options on top of
throughput mode: ``benchmarks/sessions.py`` on the real engine and
``benchmarks/study_sessions.py`` on the simulator (issue 25). Arms are a benchmark's notion,
so they live here, above the engine, and name only engine options."""

from __future__ import annotations

SESSION_ARMS = ("hold+program", "retain+program", "lpm", "fcfs")


def session_arm_options(arm: str, median: float, ttl_factor: float = 3.0,
                        ttl_policy: str = "fixed") -> dict[str, object]:
    """Engine options of a compared arm: retention for ``ttl_factor`` x the median tool time
    with program order (and the hold), or none with LPM or FCFS order. ``retain+lpm`` and
    ``program`` are the two halves of ``retain+program`` apart (not in ``SESSION_ARMS``)."""
    if arm in ("retain+program", "hold+program"):
        return {"session_ttl": ttl_factor * median, "session_ttl_policy": ttl_policy,
                "order": "program", "session_hold": arm == "hold+program"}
    if arm == "retain+lpm":
        return {"session_ttl": ttl_factor * median, "session_ttl_policy": ttl_policy}
    if arm == "program":
        return {"order": "program"}
    if arm == "lpm":
        return {}
    if arm == "fcfs":
        return {"order": "fcfs"}
    raise ValueError(f"unknown arm {arm!r}: {', '.join(SESSION_ARMS)}, retain+lpm, program")
