"""One request record and one summary, for every driver: the HTTP benchmark, the in-process
closed loop (demo, sweep, calibration) and the simulated study (the human tax over such
summaries: :mod:`hlserve.driver.points`).

Key names follow vLLM's ``bench serve`` result JSON where vLLM has the quantity, so results
from ``hlserve bench`` and ``vllm bench serve`` can be read by the same scripts; session keys
are ours. Every time of a record is in seconds from the run's start, on one clock, which
the result's ``clock`` key names:

- over HTTP (``hlserve bench``, a sweep's ``--server-cmd``): the client's clock
  (``time.perf_counter``); ``start`` is when the request was sent, ``chunk_times`` when each
  content chunk was received, ``end`` when the response ended;
- in-process (``hlserve demo``, the in-process sweep, calibration, the study): the engine's
  clock, ``wall`` (``time.monotonic``) or ``virtual`` (the simulator's, advanced by each
  step's predicted time); ``start`` is when the engine took the request (its
  ``arrival_time``), ``first_token`` / ``chunk_times`` when the engine produced the first /
  each token (one token per chunk), ``end`` when the engine finished it. No network or
  client is in between.

Definitions (n = output tokens of a request):

- ``ttft``  = first content chunk received (first token produced) − request sent (taken)
- ``e2el``  = last chunk received − request sent (end-to-end latency)
- ``tpot``  = (e2el − ttft) / (n − 1), requests with n > 1 only (vLLM's definition),
  computed as (end − first token) / (n − 1)
- ``itl``   = gaps between consecutive content chunks of a request, pooled over all
  requests (a chunk that carries several tokens is one gap, as in vLLM)
- ``duration`` = last request finished − benchmark started
- ``request_throughput`` = completed / duration
- ``output_throughput``  = total_output_tokens / duration
- ``total_token_throughput`` = (total_input_tokens + total_output_tokens) / duration;
  input tokens count every prompt token, prefix-cache hits included (``total_cached_tokens``
  says how many the server reported as cached; ``cached_token_ratio`` = that / the prompt
  tokens of the requests that reported it)
- session completion time = the session's last round finished − its first round sent, tool
  calls between its rounds included (the job's time: the headline of an agent run);
  ``session_completion_p50_s`` / ``_p90_s`` / ``_p99_s`` its percentiles (the same numbers
  as ``median`` / ``p90`` / ``p99_session_time_s``), ``sessions_per_hour`` = completed
  sessions / duration × 3600
- SLO: a request is *good* when it meets every target given (``ttft ≤ slo_ttft_ms``,
  ``tpot ≤ slo_tpot_ms``, ``e2el ≤ slo_e2el_ms``; a one-token request has no TPOT and meets
  that target); ``slo_attainment`` = good / completed; ``request_goodput`` = good / duration
  (vLLM's definition); ``token_goodput`` = tokens (in + out) of good requests / duration.
  With no target given, every completed request is good.
- Statistics: ``mean``, ``median``, ``std``, ``p90``, ``p99`` (linear-interpolated
  percentiles, numpy's default, as vLLM uses), in milliseconds for latencies; NaN-free:
  a statistic of no values is ``null`` in the JSON.

Token counts come from the server's ``usage`` when it sends one, else from the streamed
chunks. Failed requests (an HTTP error, an error event in the stream, a dropped connection)
count in ``failed`` and never in any throughput or latency; ``errors`` lists their messages.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from tqdm import tqdm

FORMULAS = {
    "ttft": "first content chunk received - request sent",
    "tpot": "(e2el - ttft) / (output_tokens - 1), requests with more than one output token",
    "itl": "gaps between consecutive content chunks of a request",
    "e2el": "last chunk received - request sent",
    "duration": "last request finished - benchmark started",
    "request_throughput": "completed / duration",
    "output_throughput": "total_output_tokens / duration",
    "total_token_throughput": "(total_input_tokens + total_output_tokens) / duration",
    "cached_token_ratio": "total_cached_tokens / prompt tokens of the requests that report "
                          "cached tokens",
    "session_time": "a session's last round finished - its first round sent (tool calls "
                    "between its rounds included)",
    "session_completion_pXX_s": "percentiles of session_time, seconds",
    "sessions_per_hour": "completed sessions / duration * 3600",
    "slo_attainment": "requests meeting every given SLO target / completed requests",
    "request_goodput": "requests meeting every given SLO target / duration",
    "token_goodput": "input + output tokens of requests meeting every SLO target / duration",
    "percentiles": "linear interpolation (numpy default), as vLLM",
}

STATS = ("mean", "median", "std", "p90", "p99")


@dataclass
class RequestRecord:
    """One request; times in seconds from the run's start, on the run's clock (above)."""

    request_id: str
    session_id: int | None = None
    round: int | None = None
    start: float = 0.0  # sent (HTTP) / taken by the engine (in-process)
    end: float = 0.0  # finished (success or failure)
    chunk_times: list[float] = field(default_factory=list)  # content chunks received / tokens
    first_token: float | None = None  # in-process: the first token, when chunk_times is not kept
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    expected_output_tokens: int | None = None  # what the workload asked for (max_tokens)
    success: bool = False
    error: str | None = None
    status: int | None = None  # HTTP status
    finish_reason: str | None = None
    scheduled_at: float | None = None  # when the workload meant it to be sent (open loop)

    @property
    def first(self) -> float | None:
        """When the first content chunk (token) came."""
        return self.chunk_times[0] if self.chunk_times else self.first_token

    @property
    def ttft(self) -> float | None:
        first = self.first
        return None if first is None else first - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        first = self.first
        if first is None or self.output_tokens < 2:
            return None
        return (self.end - first) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft"] = self.ttft
        d["tpot"] = self.tpot
        d["e2el"] = self.e2el
        return d


@dataclass(frozen=True)
class SLO:
    """Targets in milliseconds; None: no target on that quantity."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met(self, r: RequestRecord) -> bool:
        if not r.success:
            return False
        if self.ttft_ms is not None and (r.ttft is None or 1e3 * r.ttft > self.ttft_ms):
            return False
        tpot = r.tpot
        if self.tpot_ms is not None and tpot is not None and 1e3 * tpot > self.tpot_ms:
            return False
        return not (self.e2el_ms is not None and 1e3 * r.e2el > self.e2el_ms)


class Recorder:
    """Collects a run's records as they come, writes each to the per-request JSONL file
    ``path`` at once (a run cut short keeps what it did), and drives the progress bar: the
    HTTP benchmark and the in-process sweep alike. ``record_ids`` puts the prompt and output
    token ids in the JSONL."""

    def __init__(self, total: int, path: str | None = None, desc: str = "requests",
                 progress: bool = True, record_ids: bool = False) -> None:
        self.records: list[RequestRecord] = []
        self.session_times: list[float] = []
        self.sessions_failed = 0
        self.out_tokens = 0
        self.failed = 0
        self.t0 = time.perf_counter()
        self.record_ids = record_ids
        self.file: IO[str] | None = None
        self.path = path
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w")  # noqa: SIM115
        self.bar = tqdm(total=total, unit="req", desc=desc, disable=not progress,
                        dynamic_ncols=True)

    def add(self, rec: RequestRecord, prompt: list[int] | None = None,
            output: list[int] | None = None) -> None:
        self.records.append(rec)
        if rec.success:
            self.out_tokens += rec.output_tokens
        else:
            self.failed += 1
        if self.file is not None:
            row = rec.to_json()
            if self.record_ids:
                row["prompt_ids"] = prompt
                row["output_ids"] = output
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        elapsed = max(1e-9, time.perf_counter() - self.t0)
        self.bar.set_postfix(failed=self.failed, out_tok_s=f"{self.out_tokens / elapsed:.0f}",
                             refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()


def stat(values: Sequence[float], how: str) -> float | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    if how == "mean":
        return float(a.mean())
    if how == "median":  # the 50th percentile, interpolated as the others
        return float(np.percentile(a, 50))
    if how == "std":
        return float(a.std())
    if how.startswith("p"):
        return float(np.percentile(a, float(how[1:])))
    raise ValueError(how)


def _stats(values: Sequence[float], name: str, unit: str, scale: float) -> dict[str, float | None]:
    out = {}
    for how in STATS:
        v = stat(values, how)
        out[f"{how}_{name}_{unit}"] = None if v is None else v * scale
    return out


def summarize(records: Iterable[RequestRecord], duration: float, slo: SLO = SLO(),
              session_times: Sequence[float] = (), sessions_failed: int = 0,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result JSON: vLLM ``bench serve`` keys, then session and SLO keys."""
    recs = list(records)
    ok = [r for r in recs if r.success]
    bad = [r for r in recs if not r.success]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    dur = duration if duration > 0 else float("nan")
    good = [r for r in ok if slo.met(r)]
    ttft = [t for r in ok if (t := r.ttft) is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    itl = [g for r in ok for g in r.itls]
    e2el = [r.e2el for r in ok]
    reporting = [r for r in ok if r.cached_tokens is not None]
    cached = [r.cached_tokens for r in reporting]
    cached_of = sum(r.prompt_tokens for r in reporting)
    res: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(bad),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": len(good) / dur,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        res.update(_stats(values, name, "ms", 1e3))
    res.update({
        "total_cached_tokens": sum(cached) if cached else None,
        "cached_token_ratio": sum(cached) / cached_of if cached_of else None,
        "token_goodput": sum(r.prompt_tokens + r.output_tokens for r in good) / dur,
        "slo_attainment": len(good) / len(ok) if ok else None,
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        "slo_e2el_ms": slo.e2el_ms,
        "short_outputs": sum(1 for r in ok if r.expected_output_tokens is not None
                             and r.output_tokens < r.expected_output_tokens),
        "sessions_completed": len(session_times),
        "sessions_failed": sessions_failed,
        "sessions_per_hour": 3600.0 * len(session_times) / dur,
    })
    res.update(_stats(list(session_times), "session_time", "s", 1.0))
    res.update(session_completion(session_times))
    res["errors"] = error_counts(bad)
    res["formulas"] = FORMULAS
    if extra:
        res.update(extra)
    return {k: _clean(v) for k, v in res.items()}


COMPLETION_PERCENTILES = (50, 90, 99)


def session_completion(session_times: Sequence[float]) -> dict[str, float | None]:
    """``session_completion_p50_s`` etc.: percentiles of the sessions' completion times
    (linear interpolation, as every percentile here), None with no session completed."""
    return {f"session_completion_p{q}_s": stat(session_times, f"p{q}")
            for q in COMPLETION_PERCENTILES}


def headline(res: dict[str, Any]) -> str:
    """The one line an agent run is judged by: session completion p50/p90/p99 with the
    throughput beside it."""
    qs = [res.get(f"session_completion_p{q}_s") for q in COMPLETION_PERCENTILES]
    done = "/".join("n/a" if v is None else f"{v:.2f}" for v in qs)
    tput = res.get("total_token_throughput")
    tok = "n/a" if tput is None else f"{tput:.0f}"
    sph = res.get("sessions_per_hour")
    per_hour = "n/a" if sph is None else f"{sph:.1f}"
    return (f"Session completion p50/p90/p99: {done} s | throughput {tok} tok/s, "
            f"{per_hour} sessions/h")


def error_counts(failed: Iterable[RequestRecord], limit: int = 20) -> dict[str, int]:
    """Failure messages (cut to 300 characters) and how often each happened."""
    c = Counter((r.error or f"HTTP {r.status}")[:300] for r in failed)
    return dict(c.most_common(limit))


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


# ---- the short in-process summary ----------------------------------------------------------

# the keys of RunResult.summary(), from the full summary (in-process records never lack a
# cached count, so total_cached_tokens is reported as cached_tokens)
BRIEF_KEYS = {"duration": "duration", "completed": "completed",
              "total_input_tokens": "total_input_tokens",
              "total_output_tokens": "total_output_tokens", "cached_tokens": "total_cached_tokens",
              "output_throughput": "output_throughput",
              "total_token_throughput": "total_token_throughput",
              "median_ttft_ms": "median_ttft_ms", "p99_ttft_ms": "p99_ttft_ms",
              "median_tpot_ms": "median_tpot_ms", "p99_tpot_ms": "p99_tpot_ms",
              "median_session_time_s": "median_session_time_s",
              "p99_session_time_s": "p99_session_time_s"}


def brief(full: dict[str, Any]) -> dict[str, Any]:
    """The ``BRIEF_KEYS`` of a :func:`summarize` result, NaN (not None) where a statistic has
    no values."""
    return {k: math.nan if full[src] is None else full[src] for k, src in BRIEF_KEYS.items()}


@dataclass
class RunResult:
    """A closed-loop or open-loop run on an in-process engine: its records (times from the
    run's start, on the engine's clock), the measured duration and session times."""

    records: list[RequestRecord]
    duration: float
    session_times: list[float]

    def summary(self) -> dict[str, Any]:
        """The main keys of :func:`summarize` (NaN, not None, where there are no values)."""
        return brief(summarize(self.records, self.duration, session_times=self.session_times))
