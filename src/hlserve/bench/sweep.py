"""``hlserve sweep``: one benchmark across serving configurations, and the human tax.

The SLO knobs are the prefill chunk size C (TTFT) and the per-iteration token budget B
(TPOT). Each point of the sweep is one configuration, run with the same closed-loop agent
workload, on a fresh engine or server (nothing cached, nothing queued, from one point to the
next). Three ways to run a point:

- **in-process hlserve, real runner** (default): the engine of ``LLM(model, **base,
  chunk_size=C, token_budget=B)``, driven directly (no HTTP), timed on the wall clock;
- **in-process hlserve, simulated runner** (``--sim HARDWARE``): the same scheduler on the
  cost model of a GPU (``hlserve.sim.sim_runner``), timed on the virtual clock;
- **an external server per point** (``--server-cmd TEMPLATE``): the template is formatted
  with ``{model} {host} {port} {chunk_size} {token_budget} {label} {args}``, started in its
  own process group, waited for (``GET /health`` answers 200), benchmarked over HTTP with
  ``hlserve bench``'s client, then stopped (SIGINT, then SIGTERM, then SIGKILL to the whole
  group) and its port checked free before the next point starts.

Output (``--out DIR``): ``points/<label>.json`` (each point's full result) and
``points/<label>.requests.jsonl``, ``sweep.json`` (every result, the knobs, the command),
``frontier.png`` and ``tax.md`` (the per-point table and the human-tax table).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from hlserve.bench import report
from hlserve.bench.client import ServerInfo
from hlserve.bench.repeated import add_tax_intervals, run_points_repeated
from hlserve.bench.serve_bench import BenchSpec, agent_sessions, recorder, run_bench
from hlserve.config import parse_cap
from hlserve.driver.closed_loop import Loop, greedy, run_closed_loop
from hlserve.driver.machine import host
from hlserve.driver.points import slug
from hlserve.driver.records import headline, summarize
from hlserve.driver.tiers import DEFAULT_TIERS, Tier, tier_rows, tier_table
from hlserve.engine.args import parse_engine_args
from hlserve.engine.llm_engine import Engine
from hlserve.server.runtime.launch import ExternalServer, free_port

# ---- points -------------------------------------------------------------------------------


@dataclass
class SweepPoint:
    """One configuration of ``hlserve sweep``'s grid: its caps (chunk size, token budget) or
    extra engine/server flags, under a label (its record is in driver/points.py's format)."""

    label: str
    chunk_size: int | None = None
    token_budget: int | None = None
    args: list[str] = field(default_factory=list)  # extra engine/server flags of this point

    @property
    def knobs(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "token_budget": self.token_budget}


def parse_sizes(text: str) -> list[int | None]:
    """``--chunk-sizes 64,1024,none``: each item read by :func:`hlserve.config.parse_cap`
    (None: no cap), empty items skipped."""
    return [parse_cap(part) for part in text.split(",") if part.strip()]


def make_points(chunk_sizes: list[int | None], token_budgets: str = "same",
                add_points: list[str] = ()) -> list[SweepPoint]:
    """The grid C x B (``token_budgets``: ``same`` for B = C, as vLLM's one knob; ``none``
    for no budget; or a list), then the ``LABEL=FLAGS`` points of ``add_points``."""
    points: list[SweepPoint] = []
    budgets: list[int | None] | None = None
    if token_budgets.strip().lower() != "same":
        budgets = parse_sizes(token_budgets)
    for c in chunk_sizes:
        for b in ([c] if budgets is None else budgets):
            name = f"C={c or 'none'}" if budgets is None else f"C={c or 'none'},B={b or 'none'}"
            points.append(SweepPoint(name, c, b))
    for spec in add_points:
        label, _, flags = spec.partition("=")
        if not label or not flags:
            raise ValueError(f"--add-point takes LABEL=FLAGS, got {spec!r}")
        points.append(SweepPoint(label.strip(), None, None, shlex.split(flags)))
    return points


# ---- in-process ---------------------------------------------------------------------------


def point_options(base: dict[str, Any], point: SweepPoint) -> dict[str, Any]:
    """A point's engine options: the sweep's (``--engine-args``, parsed once), then the
    point's own flags (a point with its own preset replaces the base's), then a grid point's
    C and B (None, no cap, winning over any preset's like any option given)."""
    opts = dict(base)
    own = parse_engine_args(point.args)
    if {"mode", "preset"} & own.keys():
        opts.pop("mode", None)
        opts.pop("preset", None)
    opts.update(own)
    if not point.args:  # a grid point: its knobs win
        opts["chunk_size"] = point.chunk_size
        opts["token_budget"] = point.token_budget
    return opts


def session_rounds(s: Any) -> int:
    """Rounds of an AgentSession or a TraceSession."""
    return len(s.rounds_spec) if hasattr(s, "rounds_spec") else s.workload.rounds


def run_engine_agent(engine: Engine, sessions: list[Any], spec: BenchSpec) -> dict[str, Any]:
    """The agent closed loop (:mod:`hlserve.driver.closed_loop`) on an in-process engine,
    every session run to its end. Times on the engine's clock (wall or virtual, named in the
    result's ``clock``), from when the engine took a request to when it finished it; one
    token per chunk, so ITL is the gap between tokens."""
    rec = recorder(spec, sum(session_rounds(s) for s in sessions))
    try:
        res = run_closed_loop(engine, sessions.__getitem__, len(sessions),
                              Loop(token_times=True), on_record=rec.add)
    finally:
        rec.close()
    virtual = engine.virtual_time
    return summarize(res.records, res.duration, spec.slo, res.session_times,
                     res.sessions_failed,
                     {"backend": "in-process", "label": spec.label, "workload": spec.workload,
                      "max_concurrency": len(sessions), "num_prompts": len(res.records),
                      "request_file": rec.path, "clock": "virtual" if virtual else "wall"})


def _warm_up(engine: Engine) -> None:
    engine.add_request([5, 6, 7, 8] * 8, greedy(4))
    while engine.has_unfinished():
        engine.step()


def run_inprocess_point(model: str, base: dict[str, Any], point: SweepPoint, spec: BenchSpec,
                        sim: str | None = None, tp: int = 1) -> dict[str, Any]:
    opts = point_options(base, point)
    if sim:
        from hlserve.sim.build import build_sim_engine

        engine = build_sim_engine(model, sim, tp=tp, **opts)
    else:
        from hlserve.llm import LLM

        engine = LLM(model, **opts).engine
        _warm_up(engine)
    try:
        info = ServerInfo(model=model, max_model_len=engine.max_model_len)
        sessions, extra = agent_sessions(spec, info, chat=engine.tokenizer)
        res = run_engine_agent(engine, sessions, spec)
        res.update(extra)
        res["engine_options"] = opts  # as asked (no cap as null)
        res["engine_config"] = dataclasses.asdict(engine.config)  # as resolved (presets)
        res["engine_caps"] = engine.caps_report
        res["retractions"] = engine.num_retractions
        return res
    finally:
        del engine
        gc.collect()


# ---- servers on their own ports: hlserve.server.runtime.launch ----------------------------


def server_command(template: str, point: SweepPoint, model: str, host: str,
                   port: int) -> list[str]:
    """The template formatted for ``point``; no cap is the word ``none``, as ``hlserve serve``
    reads it (a server without a word for it, e.g. vLLM, is given its number in the list)."""
    def knob(v: int | None) -> str:
        return "none" if v is None else str(v)

    text = template.format(model=model, host=host, port=port, label=point.label,
                           chunk_size=knob(point.chunk_size),
                           token_budget=knob(point.token_budget),
                           args=shlex.join(point.args))
    return shlex.split(text)


def run_server_point(template: str, model: str, point: SweepPoint, spec: BenchSpec, out_dir: Path,
                     health_timeout: float,
                     env: dict[str, str] | None = None) -> dict[str, Any]:
    host = "127.0.0.1"
    port = free_port(host)
    cmd = server_command(template, point, model, host, port)
    log = out_dir / "points" / f"{slug(point.label)}.server.log"
    with ExternalServer(cmd, host, port, log, env, health_timeout) as srv:
        res = run_bench(replace(spec, base_url=srv.url))
    res["server_command"] = shlex.join(cmd)
    res["server_log"] = str(log)
    return res


# ---- the sweep ----------------------------------------------------------------------------


@dataclass
class SweepSpec:
    model: str
    points: list[SweepPoint]
    bench: BenchSpec
    out_dir: Path
    engine_args: list[str] = field(default_factory=list)
    server_cmd: str | None = None
    health_timeout: float = 600.0
    sim: str | None = None
    tp: int = 1
    targets: list[tuple[float | None, float | None]] | None = None
    threads: int | None = None  # torch threads in-process; OMP_NUM_THREADS for a server
    command: str = ""
    title: str = ""
    repeats: int = 1  # interleaved repeats per point, seeds bench.seed + i (bench/repeated.py)
    ray: str | None = None  # run the points as Ray tasks: "local" or a cluster's address
    tiers: tuple[Tier, ...] = DEFAULT_TIERS  # agents per node at these SLO tiers

    def point_file(self, label: str, suffix: str = ".json") -> Path:
        """Where a point's file goes: ``points/<label><suffix>``, the label made a file name
        (its result, requests and server log are named by it)."""
        return self.out_dir / "points" / f"{slug(label)}{suffix}"


def run_one(sw: SweepSpec, base: dict[str, Any], env: dict[str, str] | None, point: SweepPoint,
            spec: BenchSpec) -> dict[str, Any]:
    """One run of one point, on its own server (``--server-cmd``) or in this process
    (module-level, so that a partial of it pickles into a Ray task)."""
    if sw.server_cmd is not None:
        return run_server_point(sw.server_cmd, sw.model, point, spec, sw.out_dir,
                                sw.health_timeout, env)
    return run_inprocess_point(sw.model, base, point, spec, sw.sim, sw.tp)


def run_sweep(sw: SweepSpec, log: Any = print) -> dict[str, Any]:
    out = sw.out_dir
    (out / "points").mkdir(parents=True, exist_ok=True)
    base = parse_engine_args(sw.engine_args) if sw.server_cmd is None else {}
    env = None
    if sw.threads:
        env = {"OMP_NUM_THREADS": str(sw.threads)}  # for a --server-cmd
        if sw.server_cmd is None:
            base.setdefault("cpu_threads", sw.threads)
    extra: dict[str, Any] = {}
    run = partial(run_one, sw, base, env)
    if sw.repeats > 1 or sw.ray is not None:  # repeats with intervals, or Ray tasks
        results, extra = run_points_repeated(sw, run, _executor(sw, base), log)
    else:
        results = _run_points(sw, run, log)
    rows = report.tax_rows(results, sw.targets)
    if extra:
        add_tax_intervals(rows, results)
    png = report.frontier_plot(results, out / "frontier.png", sw.title)
    table = report.points_table(results)
    tax = report.tax_table(rows)
    tiers = tier_rows(results, sw.tiers, report.THROUGHPUT)
    (out / "tax.md").write_text(
        f"# Sweep: {sw.title or sw.model}\n\nCommand:\n\n```\n{sw.command}\n```\n\n"
        f"## Points\n\n{table}\n\n## Human tax\n\nTax = 1 − best throughput meeting the "
        f"target / best throughput of any point (total token throughput).\n\n{tax}\n\n"
        f"## Agents per node at SLO tiers\n\n{TIERS_NOTE}\n\n"
        f"{tier_table(tiers, sw.tiers)}\n")
    summary = {"command": sw.command, "model": sw.model, "engine_args": sw.engine_args,
               "threads": sw.threads,
               "server_cmd": sw.server_cmd, "sim": sw.sim, "points": results,
               "tax": rows, "tiers": tiers, "frontier_png": str(png),
               "python": sys.version.split()[0], "machine": host(),
               "repeats": sw.repeats, **extra}
    (out / "sweep.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    log("\n" + table + "\n\n" + tax)
    return summary


TIERS_NOTE = ("Per tier (p99 TTFT / p99 TPOT), the most concurrent sessions a configuration "
              "serves while meeting it (its points' closed-loop sessions), the throughput there, "
              "and the tax against the tier none: 1 − its best throughput meeting the tier / "
              "its best throughput. The last row pools every configuration.")


def _executor(sw: SweepSpec, base: dict[str, Any]) -> Any:
    """Ray's executor for ``--ray``, None for local runs."""
    if sw.ray is None:
        return None
    from hlserve.driver.cluster import SIMULATED, ray_executor, real_engine_resources

    if sw.server_cmd is not None:
        raise ValueError("--ray runs in-process points (real or --sim), not --server-cmd")
    res = SIMULATED if sw.sim else real_engine_resources(sw.threads, base.get("device"))
    return ray_executor(sw.ray, res, progress=sw.bench.progress)


def _run_points(sw: SweepSpec, run: Callable[[SweepPoint, BenchSpec], dict[str, Any]],
                log: Any) -> list[dict[str, Any]]:
    """Every point once, one after the other."""
    results: list[dict[str, Any]] = []
    for i, point in enumerate(sw.points):
        log(f"[{i + 1}/{len(sw.points)}] {point.label} {point.knobs} {shlex.join(point.args)}")
        path = sw.point_file(point.label)
        spec = replace(sw.bench, label=point.label, result_file=str(path))
        t = time.perf_counter()
        try:
            res = run(point, spec)
            if sw.server_cmd is None:  # a server point's run_bench wrote its own
                path.write_text(json.dumps(res, indent=2) + "\n")
        except Exception as e:  # one broken point is reported, the sweep goes on
            log(f"    point {point.label} failed: {type(e).__name__}: {e}")
            res = {"completed": 0, "failed": None, "error": f"{type(e).__name__}: {e}"}
        res["wall_s"] = time.perf_counter() - t
        results.append({"label": point.label, "knobs": point.knobs, "args": point.args,
                        "metrics": res})
        if res.get("completed"):
            log(f"    {headline(res)}")
            log(f"    {res['output_throughput']:.1f} out tok/s; p99 TTFT "
                f"{res['p99_ttft_ms']:.0f} ms, p99 TPOT {res['p99_tpot_ms'] or float('nan'):.0f}"
                f" ms; failed {res['failed']}; {res['wall_s']:.0f}s")
    return results
