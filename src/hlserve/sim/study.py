"""The human-tax study: sweep the SLO knobs of each system over context length and
concurrency on a simulated machine, and trace the throughput-versus-SLO frontier.

A point is (system, C or B, context, sessions). Systems are the presets (``sglang`` sweeps
its chunk size C; ``sarathi`` its C = B; ``vllm`` its token budget B), throughput mode
(``hlserve``) and throughput mode with one component turned off at a time (the ablations
below). Each point runs the closed-loop agent workload at constant concurrency
(``run_agent_steady``) on an Engine with the real Scheduler and KV cache and a SimRunner, and
writes one JSON file; a sweep skips the points already written (resumable) and runs the rest
in parallel processes. ``report`` turns the stored points into the figures of study_plots.py
(pooled frontiers with the SLO targets and the tax marked, the tax against the TPOT target, the
components), a markdown table and ``summary.json``, without simulating anything
(``hlserve study --out DIR --report-only``).

Human tax at an SLO target (TTFT p99 <= x, TPOT p99 <= y), per context and concurrency:
``1 - best throughput among points meeting it / best throughput of all points``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hlserve.driver import records

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
    """Engine options of one point. ``knob`` is C (sglang), C = B (sarathi), B (vllm)."""
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
    raise ValueError(f"unknown system {system!r}: {', '.join(DEFAULT_SYSTEMS)}")


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
    prefix_reuse: bool = True  # False: no round's prompt reuses an earlier round's (workloads.py)
    wall_limit: float = 900.0
    seed: int = 0
    version: int = 3  # bump when a change invalidates stored points

    def fingerprint(self) -> dict[str, Any]:
        """What a stored point must agree on to be reused."""
        return {k: getattr(self, k) for k in ("hardware", "tp", "model", "duration", "warmup",
                                               "rounds", "output_mean", "prefix_reuse", "seed",
                                               "version")}

    def points(self) -> list[Point]:
        out = []
        for ctx in self.contexts:
            for n in self.sessions:
                for system in self.systems:
                    knobs = self.chunks if (self.chunks and system in SWEEPS) else SWEEPS.get(system, (None,))
                    for k in knobs:
                        out.append(Point(system, k, ctx, n))
        return out


@dataclass(frozen=True)
class Point:
    system: str
    knob: int | None  # C / B swept (None: unlimited or not applicable)
    context: int
    sessions: int

    @property
    def key(self) -> str:
        return f"ctx{self.context}_n{self.sessions}_{self.system}_{self.knob or 'inf'}"

    @property
    def label(self) -> str:
        if self.system not in SWEEPS:
            return self.system
        name = {"sglang": "C", "sarathi": "C=B", "vllm": "B"}[self.system]
        return f"{self.system} {name}={self.knob or 'inf'}"


def run_point(spec: StudySpec, point: Point, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Simulate one point; returns its JSON record. ``options`` adds engine options on top of
    the system's (the benchmarks' variants); ``spec.hardware`` may be a Hardware object."""
    from hlserve.sim.build import build_sim_engine
    from hlserve.sim.drive import run_agent_steady
    from hlserve.workloads import AgentWorkload

    opts = {**system_options(point.system, point.knob), **(options or {})}
    max_len = point.context + 4096
    engine = build_sim_engine(spec.model, spec.hardware, spec.tp, max_model_len=max_len, **opts)
    vocab_hi = min(engine.runner.model_config.vocab_size, 150000)
    workload = AgentWorkload.for_context(point.context, point.sessions, rounds=spec.rounds,
                                         output_mean=spec.output_mean, vocab=(3, vocab_hi),
                                         seed=spec.seed, prefix_reuse=spec.prefix_reuse)
    t = time.perf_counter()
    res = run_agent_steady(engine, workload, duration=spec.duration, warmup=spec.warmup,
                           wall_limit=spec.wall_limit, ramp=spec.warmup / 2, token_times=True)
    wall = time.perf_counter() - t
    s = res.summary() if res.records else {}
    runner = engine.runner
    metrics = {
        **s,
        **res.extra,
        **stall_metrics(res.records),
        **turnover_metrics(res, point.sessions),
        "sessions_per_hour": 3600 * len(res.session_times) / res.duration,
        "median_session_time_s": s.get("median_session_time_s", float("nan")),
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
    return {
        "point": dataclasses.asdict(point), "label": point.label, "spec": spec.fingerprint(),
        "options": opts, "kv_pool_tokens": runner.num_pages * runner.page_size,
        "metrics": metrics,
    }


def stall_metrics(recs: list[records.RequestRecord]) -> dict[str, float | None]:
    """What a per-request mean TPOT hides: the inter-token gaps pooled over the window's
    requests (ITL median / p99, vLLM's names) and each request's longest gap, its stall
    (median, p99 and max over requests), in ms."""
    itl = [g for r in recs if r.success for g in r.itls]
    longest = [max(r.itls) for r in recs if r.success and len(r.chunk_times) > 1]
    out: dict[str, float | None] = {}
    for name, values, hows in (("itl", itl, ("median", "p99")),
                               ("longest_stall", longest, ("median", "p99", "max"))):
        for how in hows:
            v = (max(values) if values else None) if how == "max" else records.stat(values, how)
            out[f"{how}_{name}_ms"] = None if v is None else 1e3 * v
    return out


def turnover_metrics(res: Any, sessions: int) -> dict[str, Any]:
    """Session throughput that does not drop long sessions: every session that ended inside
    the window counts, wherever it started (``sessions_per_hour`` counts only those that
    started inside it too). ``turnover`` is sessions ended per concurrent slot over the window:
    under 1, a session outlives the window and the point is a transient, not a steady state."""
    ended = res.sessions_ended_in_window
    return {"sessions_ended_per_hour": 3600 * ended / res.duration,
            "turnover": ended / max(1, sessions), "transient": ended < sessions}


def _worker(args: tuple[dict[str, Any], dict[str, Any], str]) -> str:
    spec_d, point_d, path = args
    spec = StudySpec(**{**spec_d, "contexts": tuple(spec_d["contexts"]),
                        "sessions": tuple(spec_d["sessions"]), "systems": tuple(spec_d["systems"])})
    from hlserve.sim.study_runs import write_record

    write_record(path, run_point(spec, Point(**point_d)))
    return path


# fingerprint fields added after points were stored: a stored point without one was made at
# its default
_LATER_FIELDS = {"output_mean": 200.0, "prefix_reuse": True}


def _done(path: Path, spec: StudySpec) -> bool:
    if not path.exists():
        return False
    try:
        stored = json.loads(path.read_text()).get("spec")
    except (json.JSONDecodeError, OSError):
        return False
    if not isinstance(stored, dict):
        return False
    return {**_LATER_FIELDS, **stored} == json.loads(json.dumps(spec.fingerprint()))


def _record_run(path: Path, spec: StudySpec) -> None:
    """Add this run's spec to the folder's list of runs: a folder extended with other contexts,
    concurrencies or systems records every spec that wrote points into it."""
    runs: list[dict[str, Any]] = []
    if path.exists():
        with contextlib.suppress(json.JSONDecodeError, OSError):
            old = json.loads(path.read_text())
            runs = old.get("runs", [old]) if isinstance(old, dict) else []
    this = json.loads(json.dumps(dataclasses.asdict(spec)))
    if this not in runs:
        runs.append(this)
    path.write_text(json.dumps({"runs": runs}, indent=1))


def run_study(spec: StudySpec, out: Path, jobs: int | None = None, progress: bool = True,
              repeats: int = 1, ray: str | None = None) -> list[Path]:
    """Run every point not already in ``out/points`` (same spec), on ``repeats`` workload seeds
    ``spec.seed + i`` (study_runs.py), locally or as Ray tasks; returns all point files."""
    from hlserve.sim.study_runs import point_path, run_tasks_on_ray

    pdir = Path(out) / "points"
    pdir.mkdir(parents=True, exist_ok=True)
    specs = [dataclasses.replace(spec, seed=spec.seed + i) for i in range(repeats)]
    for s in specs:
        _record_run(Path(out) / "spec.json", s)
    points = [(s, p) for p in spec.points() for s in specs]
    todo = [(s, p) for s, p in points if not _done(point_path(pdir, p.key, s.seed), s)]
    # longest first: the contexts and concurrencies that take longest start early
    todo.sort(key=lambda sp: -(sp[1].context * sp[1].sessions))
    tasks = [(dataclasses.asdict(s), dataclasses.asdict(p), str(point_path(pdir, p.key, s.seed)))
             for s, p in todo]
    paths = [point_path(pdir, p.key, s.seed) for s, p in points]
    if ray is not None:
        failures = run_tasks_on_ray(tasks, ray, progress)
        if failures:
            raise RuntimeError(f"{len(failures)} study point(s) failed: {'; '.join(failures)}")
        return paths
    jobs = jobs or os.cpu_count() or 1
    bar = tqdm(total=len(points), initial=len(points) - len(todo), desc="study points",
               unit="pt", disable=not progress)
    if jobs <= 1:
        for t in tasks:
            _worker(t)
            bar.update(1)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            futs = [ex.submit(_worker, t) for t in tasks]
            for f in as_completed(futs):
                f.result()
                bar.update(1)
    bar.close()
    return paths


# ---- analysis -------------------------------------------------------------------------------------


def load_points(out: Path) -> list[dict[str, Any]]:
    recs = []
    for path in sorted((Path(out) / "points").glob("*.json")):
        try:
            recs.append(json.loads(path.read_text()))
        except json.JSONDecodeError:
            continue
    from hlserve.sim.study_runs import merge_seeds

    return merge_seeds(recs)  # a point run on several seeds: one record, means and *_ci95


METRIC = "window_token_throughput"  # tokens served per second in the window (drive.py)


def throughput(r: dict[str, Any], metric: str = METRIC) -> float:
    """A point's throughput (tokens/s served in the window; 0 when it has none)."""
    v = r["metrics"].get(metric, r["metrics"].get("total_token_throughput", 0.0))
    return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def latency(r: dict[str, Any], key: str) -> float:
    """A point's latency metric ``key`` (ms); inf when it has none."""
    v = r["metrics"].get(key)
    return math.inf if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def group(recs: Iterable[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in recs:
        out.setdefault((r["point"]["context"], r["point"]["sessions"]), []).append(r)
    return out


def meets_slo(r: dict[str, Any], ttft_ms: float, tpot_ms: float,
              tpot_key: str = "p99_tpot_ms") -> bool:
    """Whether a point meets TTFT p99 <= ``ttft_ms`` and ``tpot_key`` <= ``tpot_ms``."""
    return latency(r, "p99_ttft_ms") <= ttft_ms and latency(r, tpot_key) <= tpot_ms


def human_tax(recs: list[dict[str, Any]], ttft_ms: float, tpot_ms: float,
              systems: Iterable[str] | None = None, metric: str = METRIC,
              tpot_key: str = "p99_tpot_ms",
              ) -> tuple[float, dict[str, Any] | None, dict[str, Any] | None]:
    """(tax, best point meeting the SLO, best point overall), by the one tax function
    (:func:`hlserve.driver.records.human_tax`); ``systems`` restricts the constrained choice
    (e.g. SGLang's own configurations); NaN when no point has a throughput. ``tpot_key``
    puts another per-token latency in TPOT's place (``p99_itl_ms``: the gaps a stream shows)."""
    allowed = set(systems) if systems is not None else None

    def meets(r: dict[str, Any]) -> bool:
        return (meets_slo(r, ttft_ms, tpot_ms, tpot_key)
                and (allowed is None or r["point"]["system"] in allowed))

    tax, best_c, best_u = records.human_tax(recs, lambda r: throughput(r, metric), meets)
    return (math.nan if tax is None else tax), best_c, best_u


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


def plots(groups: dict[tuple[int, int], list[dict[str, Any]]], out: Path) -> list[Path]:
    """Every figure of the study from the points (study_plots.py): pooled frontiers, the tax
    against the TPOT target, the components."""
    from hlserve.sim.study_plots import plot_components, plot_frontiers, plot_tax

    return [*plot_frontiers(groups, out), plot_tax(groups, out), plot_components(groups, out)]


def report(out: Path, slos: tuple[tuple[float, float], ...] = (PRODUCTION_SLO, STRICT_SLO)) -> list[Path]:
    """Frontier plots, tax plot, markdown table and summary.json from the stored points."""
    out = Path(out)
    recs = load_points(out)
    if not recs:
        raise FileNotFoundError(f"no study points in {out / 'points'}")
    groups = group(recs)
    paths = plots(groups, out)
    summary: dict[str, Any] = {"slos": [], "components": {}}
    for (ctx, n), rs in sorted(groups.items()):
        for ttft, tpot in slos:
            tax, bc, bu = human_tax(rs, ttft, tpot)
            per_sys = tax_within_systems(rs, ttft, tpot)
            summary["slos"].append({
                "context": ctx, "sessions": n, "ttft_p99_ms": ttft, "tpot_p99_ms": tpot,
                "tax": tax, "best_constrained": bc["label"] if bc else None,
                "best_unconstrained": bu["label"] if bu else None,
                "best_throughput": throughput(bu) if bu else None,
                "constrained_throughput": throughput(bc) if bc else 0.0, "tax_within_system": per_sys,
            })
        summary["components"][f"{ctx}/{n}"] = components(rs)
    # the operator's view: the concurrency a node serves is a choice too
    summary["slos_any_concurrency"] = []
    for ctx in sorted({c for c, _ in groups}):
        rs = [r for (c, _), g in groups.items() if c == ctx for r in g]
        for ttft, tpot in slos:
            tax, bc, bu = human_tax(rs, ttft, tpot)
            summary["slos_any_concurrency"].append({
                "context": ctx, "ttft_p99_ms": ttft, "tpot_p99_ms": tpot, "tax": tax,
                "tax_within_system": tax_within_systems(rs, ttft, tpot),
                "best_constrained": f"{bc['label']} @ {bc['point']['sessions']} sessions" if bc else None,
                "best_unconstrained": f"{bu['label']} @ {bu['point']['sessions']} sessions" if bu else None,
                "constrained_throughput": throughput(bc) if bc else 0.0,
                "best_throughput": throughput(bu) if bu else None,
            })
    sp = out / "summary.json"
    sp.write_text(json.dumps(summary, indent=1))
    tp = out / "table.md"
    tp.write_text(markdown(groups, summary))
    from hlserve.sim.study_seeds import report as seeds_report

    return [*paths, sp, tp, *seeds_report(out)]


def _pct(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.0f}%"


WITHIN_HEADER = "tax within sglang / sarathi / vllm (each against its own best)"
WITHIN_NOTE = ("\"Tax within\" a preset is 1 − its best configuration meeting the SLO / its own "
               "best configuration, both among that preset's points only.")


def _within(s: dict[str, Any]) -> str:
    return " / ".join(_pct(s.get("tax_within_system", {}).get(k)) for k in SWEEPS)


def markdown(groups: dict[tuple[int, int], list[dict[str, Any]]], summary: dict[str, Any]) -> str:
    lines = ["# Study points", ""]
    lines += ["## Human tax, concurrency chosen freely (per node)", "", WITHIN_NOTE, "",
              "| context | SLO (TTFT p99 / TPOT p99) | tax | best meeting it | best overall | "
              f"{WITHIN_HEADER} |", "|---|---|---|---|---|---|"]
    for s in summary.get("slos_any_concurrency", []):
        lines.append(f"| {s['context']} | {s['ttft_p99_ms']:.0f} ms / {s['tpot_p99_ms']:.0f} ms | "
                     f"{_pct(s['tax'])} | {s['best_constrained'] or 'none'} "
                     f"({s['constrained_throughput']:.0f} tok/s) | {s['best_unconstrained']} "
                     f"({s['best_throughput']:.0f} tok/s) | {_within(s)} |")
    lines += ["", "## Human tax at a given concurrency", "",
              "| context | sessions | SLO (TTFT p99 / TPOT p99) | tax | best meeting it | best overall | "
              f"{WITHIN_HEADER} |", "|---|---|---|---|---|---|---|"]
    for s in summary["slos"]:
        within = _within(s)
        lines.append(f"| {s['context']} | {s['sessions']} | {s['ttft_p99_ms']:.0f} ms / "
                     f"{s['tpot_p99_ms']:.0f} ms | {_pct(s['tax'])} | {s['best_constrained'] or 'none'} | "
                     f"{s['best_unconstrained']} | {within} |")
    lines += ["", "## Throughput mode by component (gain of throughput mode over each)", "",
              "| context/sessions | " + " | ".join([*ABLATIONS, "vs sglang (C=8192)",
                                                     "vs sarathi (C=B=512)", "vs best sglang",
                                                     "vs best sarathi"]) + " |",
              "|---|" + "---|" * (len(ABLATIONS) + 4)]
    for key, comp in summary["components"].items():
        cols = [*ABLATIONS, "vs sglang (C=8192)", "vs sarathi (C=B=512)", "vs best sglang",
                "vs best sarathi"]
        lines.append(f"| {key} | " + " | ".join(
            f"{100 * comp[c]:+.1f}%" if c in comp else "-" for c in cols) + " |")
    lines += ["", "## All points", "",
              "| context | sessions | config | tokens/s (window) | output tok/s (window) | TTFT p50 / p99 (s) | "
              "TPOT p50 / p99 (ms) | sessions/h ended | retractions | iterations (mixed) | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (ctx, n), rs in sorted(groups.items()):
        for r in sorted(rs, key=lambda r: -throughput(r)):
            m = r["metrics"]
            trunc = " (cut)" if m.get("truncated") else ""
            trunc += " (transient)" if m.get("transient") else ""
            # sessions ended in the window wherever they started, where the point has it
            per_hour = m.get("sessions_ended_per_hour", m.get("sessions_per_hour", 0))
            lines.append(
                f"| {ctx} | {n} | {r['label']}{trunc} | {throughput(r):.0f} | {throughput(r, 'window_output_throughput'):.0f} | "
                f"{latency(r, 'median_ttft_ms') / 1e3:.2f} / {latency(r, 'p99_ttft_ms') / 1e3:.2f} | "
                f"{latency(r, 'median_tpot_ms'):.0f} / {latency(r, 'p99_tpot_ms'):.0f} | "
                f"{per_hour:.0f} | {m.get('retractions', 0)} | "
                f"{m.get('iterations', 0)} ({m.get('mixed_iterations', 0)}) | {m.get('wall_s', 0):.0f} |")
    return "\n".join(lines) + "\n"
