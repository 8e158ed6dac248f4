"""``hlserve sweep``: one benchmark across serving configurations, and the human tax.

The SLO knobs are the prefill chunk size C (TTFT) and the per-iteration token budget B
(TPOT). Each point of the sweep is one configuration, run with the same closed-loop agent
workload, on a fresh engine or server (nothing cached, nothing queued, from one point to the
next). Three ways to run a point:

- **in-process hlserve, real runner** (default): ``build_engine(model, **base, chunk_size=C,
  token_budget=B)``, driven directly (no HTTP), timed on the wall clock;
- **in-process hlserve, simulated runner** (``--sim HARDWARE``): the same scheduler on the
  cost model of a GPU (``hlserve.runner.sim_runner``), timed on the virtual clock;
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hlserve.bench import report
from hlserve.bench.client import ServerInfo
from hlserve.bench.driver import fewer_gc_passes
from hlserve.bench.metrics import RequestRecord, summarize
from hlserve.bench.serve_bench import BenchSpec, _agent_sessions, _Recorder, run_bench
from hlserve.errors import InvalidRequestError
from hlserve.request import RequestOutput, SamplingParams
from hlserve.server.launch import ExternalServer, free_port

UNLIMITED = ("none", "unlimited", "inf", "off")


# ---- points -------------------------------------------------------------------------------


@dataclass
class Point:
    label: str
    chunk_size: int | None = None
    token_budget: int | None = None
    args: list[str] = field(default_factory=list)  # extra engine/server flags of this point

    @property
    def knobs(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "token_budget": self.token_budget}


def parse_sizes(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        out.append(None if part in UNLIMITED else int(part))
    return out


def make_points(chunk_sizes: list[int | None], token_budgets: str = "same",
                add_points: list[str] = ()) -> list[Point]:
    """The grid C x B (``token_budgets``: ``same`` for B = C, as vLLM's one knob; ``none``
    for no budget; or a list), then the ``LABEL=FLAGS`` points of ``add_points``."""
    points: list[Point] = []
    budgets: list[int | None] | None = None
    if token_budgets.strip().lower() != "same":
        budgets = parse_sizes(token_budgets)
    for c in chunk_sizes:
        for b in ([c] if budgets is None else budgets):
            name = f"C={c or 'none'}" if budgets is None else f"C={c or 'none'},B={b or 'none'}"
            points.append(Point(name, c, b))
    for spec in add_points:
        label, _, flags = spec.partition("=")
        if not label or not flags:
            raise ValueError(f"--add-point takes LABEL=FLAGS, got {spec!r}")
        points.append(Point(label.strip(), None, None, shlex.split(flags)))
    return points


# ---- in-process ---------------------------------------------------------------------------


def engine_options_from_args(argv: list[str]) -> dict[str, Any]:
    """hlserve engine flags (``--mode throughput --dtype bfloat16 ...``) as engine options."""
    import argparse

    from hlserve.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser(prog="engine-args", add_help=False)
    add_engine_args(p)
    return engine_options(p.parse_args(argv))


def session_rounds(s: Any) -> int:
    """Rounds of an AgentSession or a TraceSession."""
    return len(s.rounds_spec) if hasattr(s, "rounds_spec") else s.workload.rounds


@fewer_gc_passes
def run_engine_agent(engine: Any, sessions: list[Any], spec: BenchSpec) -> dict[str, Any]:
    """The agent closed loop on an in-process engine: each session's next round is added in
    the iteration its last one finished. Times on the engine's clock (wall or virtual); one
    token per chunk, so ITL is the gap between tokens."""
    clock = engine.clock
    rec = _Recorder(spec, sum(session_rounds(s) for s in sessions))
    t0 = clock()
    inflight: dict[str, tuple[Any, RequestRecord, list[int]]] = {}
    started: dict[int, float] = {}

    def submit(s: Any) -> None:
        prompt, out_len = s.next_request()
        r = RequestRecord(request_id=f"s{s.session_id}-r{s.round}", session_id=s.session_id,
                          round=s.round, start=clock() - t0, prompt_tokens=len(prompt),
                          expected_output_tokens=out_len)
        started.setdefault(s.session_id, r.start)
        try:
            req = engine.add_request(prompt, SamplingParams(max_tokens=out_len, temperature=0.0,
                                                            ignore_eos=True))
        except InvalidRequestError as e:
            r.end, r.error = r.start, f"rejected: {e}"
            rec.add(r, prompt, None)
            rec.sessions_failed += 1
            return
        inflight[req.request_id] = (s, r, prompt)

    try:
        for s in sessions:
            submit(s)
        while inflight:
            for req in engine.step_requests():  # only finished requests are read
                if not req.finished or req.request_id not in inflight:
                    continue
                s, r, prompt = inflight.pop(req.request_id)
                out = RequestOutput.of(req)
                r.chunk_times = [t - t0 for t in req.token_times]
                r.end = (out.metrics.get("finish_time") or clock()) - t0
                r.output_tokens = len(out.token_ids)
                r.cached_tokens = out.num_cached_tokens
                r.finish_reason = str(out.finish_reason)
                if r.finish_reason not in ("stop", "length") or not out.token_ids:
                    r.error = f"finished with {r.finish_reason}: {out.error or ''}".strip()
                    rec.add(r, prompt, None)
                    rec.sessions_failed += 1
                    continue
                r.success = True
                rec.add(r, prompt, out.token_ids)
                s.complete(out.token_ids)
                if s.done:
                    rec.session_times.append(r.end - started[s.session_id])
                else:
                    submit(s)
    finally:
        rec.close()
    duration = max((r.end for r in rec.records), default=0.0)
    return summarize(rec.records, duration, spec.slo, rec.session_times, rec.sessions_failed,
                     {"backend": "in-process", "label": spec.label, "workload": "agent",
                      "max_concurrency": len(sessions), "num_prompts": len(rec.records),
                      "request_file": rec.path, "clock": "virtual" if hasattr(clock, "advance")
                      else "wall"})


def _warm_up(engine: Any) -> None:
    engine.add_request([5, 6, 7, 8] * 8, SamplingParams(max_tokens=4, temperature=0.0,
                                                         ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_inprocess_point(model: str, base: dict[str, Any], point: Point, spec: BenchSpec,
                        sim: str | None = None, tp: int = 1) -> dict[str, Any]:
    opts = dict(base)
    own = engine_options_from_args(point.args)
    if {"mode", "preset"} & own.keys():  # a point with its own preset replaces the base's
        opts.pop("mode", None)
        opts.pop("preset", None)
    opts.update(own)
    if not point.args:  # a grid point: its knobs win
        opts["chunk_size"] = point.chunk_size
        opts["token_budget"] = point.token_budget
    opts = {k: v for k, v in opts.items() if v is not None or k in ("chunk_size", "token_budget")}
    if sim:
        from hlserve.sim.build import build_sim_engine

        engine = build_sim_engine(model, sim, tp=tp, **opts)
    else:
        from hlserve.llm import build_engine

        engine = build_engine(model, **opts)
        _warm_up(engine)
    try:
        info = ServerInfo(model=model, max_model_len=engine.max_model_len)
        sessions, extra = _agent_sessions(spec, info)
        res = run_engine_agent(engine, sessions, spec)
        res.update(extra)
        res["engine_options"] = dict(opts)  # as asked
        res["engine_config"] = dataclasses.asdict(engine.config)  # as resolved (presets)
        res["engine_caps"] = getattr(engine, "caps_report", None)
        res["retractions"] = engine.scheduler.num_retractions
        return res
    finally:
        del engine
        gc.collect()


# ---- servers on their own ports: hlserve.server.launch ------------------------------------


def server_command(template: str, point: Point, model: str, host: str, port: int,
                   unlimited_value: int | None) -> list[str]:
    def knob(v: int | None, name: str) -> str:
        if v is not None:
            return str(v)
        if unlimited_value is None and "{" + name + "}" in template:
            raise ValueError(f"point {point.label} has no {name} (unlimited) and the server "
                             f"command uses {{{name}}}: give --unlimited-value N")
        return str(unlimited_value)

    text = template.format(model=model, host=host, port=port, label=point.label,
                           chunk_size=knob(point.chunk_size, "chunk_size"),
                           token_budget=knob(point.token_budget, "token_budget"),
                           args=shlex.join(point.args))
    return shlex.split(text)


def run_server_point(template: str, model: str, point: Point, spec: BenchSpec, out_dir: Path,
                     unlimited_value: int | None, health_timeout: float,
                     env: dict[str, str] | None = None) -> dict[str, Any]:
    host = "127.0.0.1"
    port = free_port(host)
    cmd = server_command(template, point, model, host, port, unlimited_value)
    log = out_dir / "points" / f"{_slug(point.label)}.server.log"
    with ExternalServer(cmd, host, port, log, env, health_timeout) as srv:
        res = run_bench(replace(spec, base_url=srv.url))
    res["server_command"] = shlex.join(cmd)
    res["server_log"] = str(log)
    return res


# ---- the sweep ----------------------------------------------------------------------------


@dataclass
class SweepSpec:
    model: str
    points: list[Point]
    bench: BenchSpec
    out_dir: Path
    engine_args: list[str] = field(default_factory=list)
    server_cmd: str | None = None
    unlimited_value: int | None = None
    health_timeout: float = 600.0
    sim: str | None = None
    tp: int = 1
    targets: list[tuple[float | None, float | None]] | None = None
    threads: int | None = None  # torch threads in-process; OMP_NUM_THREADS for a server
    command: str = ""
    title: str = ""
    repeats: int = 1  # interleaved repeats per point, seeds bench.seed + i (bench/repeated.py)
    ray: str | None = None  # run the points as Ray tasks: "local" or a cluster's address


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def run_sweep(sw: SweepSpec, log: Any = print) -> dict[str, Any]:
    out = sw.out_dir
    (out / "points").mkdir(parents=True, exist_ok=True)
    base = engine_options_from_args(sw.engine_args) if sw.server_cmd is None else {}
    env = None
    if sw.threads:
        env = {"OMP_NUM_THREADS": str(sw.threads)}  # for a --server-cmd
        if sw.server_cmd is None:
            base.setdefault("cpu_threads", sw.threads)
    extra: dict[str, Any] = {}
    if sw.repeats > 1 or sw.ray is not None:  # repeats with intervals, or Ray tasks
        from hlserve.bench.repeated import run_points_repeated

        results, extra = run_points_repeated(sw, base, env, log)
    else:
        results = _run_points(sw, base, env, log)
    rows = report.tax_rows(results, sw.targets)
    if extra:
        from hlserve.bench.repeated import add_tax_intervals

        add_tax_intervals(rows, results)
    png = report.frontier_plot(results, out / "frontier.png", sw.title)
    table = report.points_table(results)
    tax = report.tax_table(rows)
    (out / "tax.md").write_text(
        f"# Sweep: {sw.title or sw.model}\n\nCommand:\n\n```\n{sw.command}\n```\n\n"
        f"## Points\n\n{table}\n\n## Human tax\n\nTax = 1 − best throughput meeting the "
        f"target / best throughput of any point (total token throughput).\n\n{tax}\n")
    summary = {"command": sw.command, "model": sw.model, "engine_args": sw.engine_args,
               "threads": sw.threads,
               "server_cmd": sw.server_cmd, "sim": sw.sim, "points": results,
               "tax": rows, "frontier_png": str(png), "python": sys.version.split()[0],
               "repeats": sw.repeats, **extra}
    (out / "sweep.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    log("\n" + table + "\n\n" + tax)
    return summary


def _run_points(sw: SweepSpec, base: dict[str, Any], env: dict[str, str] | None,
                log: Any) -> list[dict[str, Any]]:
    """Every point once, one after the other."""
    out = sw.out_dir
    results: list[dict[str, Any]] = []
    for i, point in enumerate(sw.points):
        log(f"[{i + 1}/{len(sw.points)}] {point.label} {point.knobs} {shlex.join(point.args)}")
        path = out / "points" / f"{_slug(point.label)}.json"
        spec = replace(sw.bench, label=point.label, result_file=str(path))
        t = time.perf_counter()
        try:
            if sw.server_cmd is not None:
                res = run_server_point(sw.server_cmd, sw.model, point, spec, out,
                                       sw.unlimited_value, sw.health_timeout, env)
            else:
                res = run_inprocess_point(sw.model, base, point, spec, sw.sim, sw.tp)
                path.write_text(json.dumps(res, indent=2) + "\n")
        except Exception as e:  # one broken point is reported, the sweep goes on
            log(f"    point {point.label} failed: {type(e).__name__}: {e}")
            res = {"completed": 0, "failed": None, "error": f"{type(e).__name__}: {e}"}
        res["wall_s"] = time.perf_counter() - t
        results.append({"label": point.label, "knobs": point.knobs, "args": point.args,
                        "result": res})
        if res.get("completed"):
            log(f"    {res['total_token_throughput']:.0f} tok/s total, "
                f"{res['output_throughput']:.1f} out; p99 TTFT {res['p99_ttft_ms']:.0f} ms, "
                f"p99 TPOT {res['p99_tpot_ms'] or float('nan'):.0f} ms; session p50 "
                f"{res['median_session_time_s'] or float('nan'):.1f}s; failed {res['failed']}; "
                f"{res['wall_s']:.0f}s")
    return results
