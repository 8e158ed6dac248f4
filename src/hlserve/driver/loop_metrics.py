"""The metrics of a steady-state closed-loop run that every study point records, whichever
engine ran it (hlserve's, or another's scheduler under the simulated runner,
``hlserve.integrations.sim_engine``): the window's requests summarized, the stalls a mean
TPOT hides, and session turnover."""

from __future__ import annotations

from typing import Any

from hlserve.driver import records
from hlserve.driver.closed_loop import LoopResult


def window_metrics(res: LoopResult) -> dict[str, Any]:
    """The window's requests summarized by :func:`hlserve.driver.records.summarize`: its brief
    keys (``RunResult.summary()``'s), the failed requests, ITL, sessions per hour and the
    session completion percentiles."""
    full = records.summarize(res.records, res.duration, session_times=res.session_times)
    keep = ("failed", "median_itl_ms", "p99_itl_ms", "sessions_per_hour",
            *records.session_completion(()).keys())
    return {**records.brief(full), **{k: full[k] for k in keep}}


def stall_metrics(recs: list[records.RequestRecord]) -> dict[str, float | None]:
    """What a per-request mean TPOT hides: each request's longest inter-token gap, its stall
    (median, p99 and max over requests), in ms (the pooled gaps, ITL, are the summary's)."""
    longest = [max(r.itls) for r in recs if r.success and len(r.chunk_times) > 1]
    out: dict[str, float | None] = {}
    for how in ("median", "p99", "max"):
        v = (max(longest) if longest else None) if how == "max" else records.stat(longest, how)
        out[f"{how}_longest_stall_ms"] = None if v is None else 1e3 * v
    return out


def turnover_metrics(res: Any, sessions: int) -> dict[str, Any]:
    """Session throughput that does not drop long sessions: every session that ended inside
    the window counts, wherever it started (``sessions_per_hour`` counts only those that
    started inside it too). ``turnover`` is sessions ended per concurrent slot over the window:
    under 1, a session outlives the window and the point is a transient, not a steady state."""
    ended = res.sessions_ended_in_window
    return {"sessions_ended_per_hour": 3600 * ended / res.duration,
            "turnover": ended / max(1, sessions), "transient": ended < sessions}
