"""The study's shared pieces: its systems and SLOs, ``StudySpec`` and ``StudyPoint``,
``run_point`` (one point simulated, its JSON record), and the analysis every other module of
the study reads points with (throughput, latency, the SLO check, the tax, the frontier,
the components).

A point's record is in the one point format of :mod:`hlserve.driver.points`: ``label`` and
``metrics`` (:func:`hlserve.driver.records.summarize`'s keys for the window's requests, plus
the window throughput, stalls and turnover), beside ``point``, ``spec``, ``options`` and
``kv_pool_tokens``. Its SLO check and tax are the sweep's too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hlserve.driver import points as shared
from hlserve.driver.loop_metrics import stall_metrics, turnover_metrics, window_metrics
from hlserve.driver.tool_time import parse_tool_time
from hlserve.driver.workloads import AgentWorkload
from hlserve.engine.args import make_config
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import VirtualClock
from hlserve.sim.build import SimOptions, device_info
from hlserve.sim.hardware import get_hardware
from hlserve.sim.sim_runner import SimRunner
from hlserve.study.drive import run_agent_steady
from hlserve.study.foreign import FOREIGN, run_foreign

# system -> (options, knob swept, default sweep)
ABLATIONS: dict[str, tuple[dict[str, Any], str]] = {
    "hlserve-chunked": ({"chunk_size": 8192}, "greedy prefill off: chunks of 8192 (SGLang's H20 default)"),
    "hlserve-mix_always": ({"mixing": "always"}, "two-stage mixing off: naive mixing every iteration"),
    "hlserve-prefill_first": ({"mixing": "prefill_first"}, "two-stage mixing off: prefill-first (no mixing)"),
    "hlserve-ratchet": ({"budget_controller": "ratchet"}, "EMA budget off: the ratchet baseline controller"),
    "hlserve-no_budget": ({"budget_controller": "fixed"}, "EMA budget off: no budget at all"),
    "hlserve-fcfs": ({"order": "fcfs"}, "LPM off: FCFS order"),
}
SWEEPS: dict[str, tuple[int | None, ...]] = {
    "sglang": (512, 1024, 2048, 4096, 8192, None),
    "sarathi": (256, 512, 1024, 2048, 4096, 8192),
    # below 8192, vLLM's budget B is the same policy as Sarathi's C = B (mixed, FCFS, LIFO)
    "vllm": (8192, 16384, None),
}
DEFAULT_SYSTEMS = ("sglang", "sarathi", "vllm", "hlserve", *ABLATIONS)
PRODUCTION_SLO = (2000.0, 100.0)  # TTFT p99 ms, TPOT p99 ms
STRICT_SLO = (1000.0, 50.0)


def system_options(system: str, knob: int | None) -> dict[str, Any]:
    """Engine options of one point. ``knob`` is C (sglang), C = B (sarathi), B (vllm); a
    system that is another engine's code (:data:`FOREIGN`) has its own flags, none here."""
    if system in FOREIGN:
        return {}
    if system == "sglang":
        return {"preset": "sglang", "chunk_size": knob}
    if system == "sarathi":
        return {"preset": "sarathi", "chunk_size": knob, "token_budget": knob}
    if system == "vllm":
        return {"preset": "vllm", "token_budget": knob}
    if system == "hlserve":
        return {"mode": "throughput"}
    if system in ABLATIONS:
        return {"mode": "throughput", **ABLATIONS[system][0]}
    raise ValueError(f"unknown system {system!r}: {', '.join((*DEFAULT_SYSTEMS, *FOREIGN))}")


@dataclass(frozen=True)
class StudySpec:
    hardware: str = "H20"
    tp: int = 8
    model: str = "Qwen2.5-32B"
    contexts: tuple[int, ...] = (8192, 32768, 65536)
    sessions: tuple[int, ...] = (16, 64, 128)
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    chunks: tuple[int, ...] | None = None  # overrides every system's sweep
    duration: float = 1200.0
    warmup: float = 600.0
    rounds: int = 8
    output_mean: float = 200.0  # mean output tokens per round (Mooncake's tool&agent: 182)
    prefix_reuse: bool = True  # False: no round's prompt reuses an earlier round's (driver/workloads.py)
    wall_limit: float = 900.0
    seed: int = 0
    # the tool call between a session's rounds (hlserve.driver.tool_time's spec); "0": none, the
    # zero-gap study every stored point was made with
    tool_time: str = "0"
    version: int = 3  # bump when a change invalidates stored points

    @classmethod
    def of(cls, d: dict[str, Any]) -> StudySpec:
        """The spec from its JSON form (``dataclasses.asdict`` through JSON: lists for tuples)."""
        return cls(**{**d, "contexts": tuple(d["contexts"]), "sessions": tuple(d["sessions"]),
                      "systems": tuple(d["systems"])})

    def fingerprint(self) -> dict[str, Any]:
        """What a stored point must agree on to be reused."""
        return {k: getattr(self, k) for k in ("hardware", "tp", "model", "duration", "warmup",
                                               "rounds", "output_mean", "prefix_reuse", "seed",
                                               "tool_time", "version")}

    def points(self) -> list[StudyPoint]:
        out = []
        for ctx in self.contexts:
            for n in self.sessions:
                for system in self.systems:
                    swept = system in SWEEPS or system in FOREIGN  # FOREIGN: B (vLLM), C (SGLang)
                    knobs = self.chunks if (self.chunks and swept) else SWEEPS.get(system, (None,))
                    for k in knobs:
                        out.append(StudyPoint(system, k, ctx, n))
        return out


@dataclass(frozen=True)
class StudyPoint:
    """One cell of the study's grid: a system with its swept knob, at a context length and a
    number of concurrent sessions (its record is in driver/points.py's point format)."""

    system: str
    knob: int | None  # C / B swept (None: unlimited or not applicable)
    context: int
    sessions: int

    @property
    def key(self) -> str:
        return f"ctx{self.context}_n{self.sessions}_{self.system}_{self.knob or 'inf'}"

    @property
    def label(self) -> str:
        if self.system in FOREIGN:  # knob None: the system's own default
            knob = FOREIGN[self.system].knob
            return self.system if self.knob is None else f"{self.system} {knob}={self.knob}"
        if self.system not in SWEEPS:
            return self.system
        name = {"sglang": "C", "sarathi": "C=B", "vllm": "B"}[self.system]
        return f"{self.system} {name}={self.knob or 'inf'}"


def run_point(spec: StudySpec, point: StudyPoint, options: dict[str, Any] | None = None,
              sim: SimOptions | None = None) -> dict[str, Any]:
    """Simulate one point; returns its JSON record. ``options`` adds engine options on top of
    the system's (the benchmarks' variants); ``spec.hardware`` may be a Hardware object;
    ``sim`` the simulation's own options (an acceptance profile for speculation). A system
    of another engine's code runs in that engine's environment (:mod:`hlserve.study.foreign`)."""
    if point.system in FOREIGN:
        rec = run_foreign(dataclasses.asdict(spec), dataclasses.asdict(point), options or {},
                          timeout=spec.wall_limit + 600)
        return {"point": rec["point"], "label": point.label, "spec": spec.fingerprint(),
                "options": rec["options"], "kv_pool_tokens": rec["kv_pool_tokens"],
                "metrics": rec["metrics"]}
    opts = {**system_options(point.system, point.knob), **(options or {})}
    sim = sim or SimOptions()
    hw = get_hardware(spec.hardware)
    # build_sim_engine's parts, built here: the study reads the runner's own counters
    config = make_config(spec.model, device_info=device_info(hw),
                         max_model_len=point.context + 4096, **opts)
    runner = SimRunner(config, hw, spec.tp, **sim.runner_options())
    engine = build_engine(config, runner, clock=VirtualClock(),
                          speculator=sim.speculator(config, runner))
    vocab_hi = min(engine.model_config.vocab_size, 150000)
    workload = AgentWorkload.for_context(point.context, point.sessions, rounds=spec.rounds,
                                         output_mean=spec.output_mean, vocab=(3, vocab_hi),
                                         seed=spec.seed, prefix_reuse=spec.prefix_reuse,
                                         tool_time=parse_tool_time(spec.tool_time))
    t = time.perf_counter()
    res = run_agent_steady(engine, workload, duration=spec.duration, warmup=spec.warmup,
                           wall_limit=spec.wall_limit, ramp=spec.warmup / 2, token_times=True)
    wall = time.perf_counter() - t
    metrics = {
        **window_metrics(res),
        **res.extra,
        **stall_metrics(res.records),
        **turnover_metrics(res, point.sessions),
        "retractions": engine.num_retractions,
        "errors": res.errors,
        "iterations": engine.stats.steps,
        "mixed_iterations": runner.mixed_steps,
        "stage_switches": engine.stage_switches,
        "prefill_tokens_computed": runner.prefill_tokens,
        "decode_tokens_computed": runner.decode_tokens,
        "sim_seconds": engine.clock(),
        "window_s": res.duration,
        "wall_s": wall,
        "truncated": res.duration < spec.duration - 1e-6,
        "stalled": res.stalled,
        "stalled_at_s": res.stalled_at,
    }
    st = engine.spec_stats
    if st is not None:  # only then: stored points without speculation stay as they are
        metrics |= {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
                    "spec_num_accepted_tokens": st.num_accepted_tokens,
                    "spec_num_lookups": st.num_lookups}
        if st.adaptive is not None:  # throughput mode: the steps by the k it chose
            metrics["spec_steps_by_k"] = list(st.adaptive.steps_by_k)
    return {
        "point": dataclasses.asdict(point), "label": point.label, "spec": spec.fingerprint(),
        "options": opts, "kv_pool_tokens": runner.num_pages * runner.page_size,
        "metrics": metrics,
    }


# ---- analysis ---------------------------------------------------------------------------------


METRIC = "window_token_throughput"  # tokens served per second in the window (drive.py)


# Tokens the engine computed per second: the measured requests' prompt tokens not found in
# the cache, plus their output tokens, over the window (per request, as vLLM's
# ``total_token_throughput``, which counts cached prompt tokens too). Derived from a point's
# stored metrics by :func:`with_computed`, so it works on every stored point.
COMPUTED_METRIC = "computed_token_throughput"
# The window's token-by-token count over computed tokens, the twin of :data:`METRIC`
# (``hlserve.driver.closed_loop``): recorded by points run since it was added.
WINDOW_COMPUTED_METRIC = "window_computed_token_throughput"


def computed_token_throughput(r: dict[str, Any]) -> float:
    """A point's :data:`COMPUTED_METRIC` from its stored metrics (NaN without a duration)."""
    m = r["metrics"]
    if not m.get("duration"):
        return math.nan
    return (m["total_input_tokens"] - (m.get("cached_tokens") or 0)
            + m["total_output_tokens"]) / m["duration"]


def with_computed(recs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points with :data:`COMPUTED_METRIC` among their metrics (copies: stored points
    are left as they are), for :func:`human_tax` with ``metric=COMPUTED_METRIC``."""
    return [{**r, "metrics": {**r["metrics"], COMPUTED_METRIC: computed_token_throughput(r)}}
            for r in recs]


def throughput(r: dict[str, Any], metric: str = METRIC) -> float:
    """A point's throughput (tokens/s served in the window; 0 when it has none)."""
    return shared.throughput(r, metric)


def latency(r: dict[str, Any], key: str) -> float:
    """A point's latency metric ``key`` (ms) for drawing and ordering points: inf when it has
    none (it sorts last and falls off a frontier; whether it meets an SLO is
    :func:`hlserve.driver.points.meets_slo`'s to say)."""
    v = shared.value(r, key)
    return math.inf if math.isnan(v) else v


def group(recs: Iterable[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in recs:
        out.setdefault((r["point"]["context"], r["point"]["sessions"]), []).append(r)
    return out


def human_tax(recs: list[dict[str, Any]], ttft_ms: float, tpot_ms: float,
              systems: Iterable[str] | None = None, metric: str = METRIC,
              tpot_key: str = "p99_tpot_ms",
              ) -> tuple[float, dict[str, Any] | None, dict[str, Any] | None]:
    """(tax, best point meeting the SLO, best point overall), by the sweep's tax function
    (:func:`hlserve.driver.points.human_tax`, NaN when no point has a throughput) on the
    window throughput; ``systems`` restricts the constrained choice (e.g. SGLang's own
    configurations); ``tpot_key`` puts another per-token latency in TPOT's place
    (``p99_itl_ms``: the gaps a stream shows)."""
    names = set(systems) if systems is not None else None
    allowed = None if names is None else (lambda r: r["point"]["system"] in names)
    return shared.human_tax(recs, ttft_ms, tpot_ms, metric, tpot_key, allowed)


def pareto(xs: list[float], ys: list[float]) -> list[int]:
    """Indices of points no other point beats on both lower x and higher y, by x."""
    order = sorted(range(len(xs)), key=lambda i: (xs[i], -ys[i]))
    front, best = [], -math.inf
    for i in order:
        if ys[i] > best and math.isfinite(xs[i]):
            front.append(i)
            best = ys[i]
    return front


def components(recs: list[dict[str, Any]], metric: str = METRIC) -> dict[str, float]:
    """Throughput mode against each ablation and each preset's default: gain of ours."""
    by = {(r["point"]["system"], r["point"]["knob"]): r for r in recs}
    ours = by.get(("hlserve", None))
    if ours is None:
        return {}
    base = throughput(ours, metric)
    out: dict[str, float] = {}
    for name in ABLATIONS:
        if (name, None) in by and throughput(by[(name, None)], metric) > 0:
            out[name] = base / throughput(by[(name, None)], metric) - 1
    for sys_, knob, name in (("sglang", 8192, "vs sglang (C=8192)"),
                             ("sarathi", 512, "vs sarathi (C=B=512)"),
                             ("sarathi", 2048, "vs sarathi-relaxed (C=B=2048)"),
                             ("vllm", 8192, "vs vllm (B=8192)"),
                             ("sglang", None, "vs sglang (unchunked)")):
        if (sys_, knob) in by and throughput(by[(sys_, knob)], metric) > 0:
            out[name] = base / throughput(by[(sys_, knob)], metric) - 1
    for sys_ in SWEEPS:
        cands = [r for r in recs if r["point"]["system"] == sys_]
        if cands:
            best = max(throughput(r, metric) for r in cands)
            if best > 0:
                out[f"vs best {sys_}"] = base / best - 1
    return out


def tax_within_systems(recs: list[dict[str, Any]], ttft_ms: float, tpot_ms: float,
                       ) -> dict[str, float | None]:
    """Each preset's own human tax: its best configuration meeting the SLO against its own best
    configuration (not against the best of all systems); None for a system not in ``recs``."""
    out: dict[str, float | None] = {}
    for system in SWEEPS:
        own = [r for r in recs if r["point"]["system"] == system]
        out[system] = human_tax(own, ttft_ms, tpot_ms)[0] if own else None
    return out


