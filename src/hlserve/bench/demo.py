"""``hlserve demo``: the human tax, told truthfully. First SLO mode against throughput mode on
this machine (interleaved repeats, the ratio with its 95% interval, "no difference" said
plainly when the interval contains it); then where the tax does exist: a short simulated run of
the study's 32K case on 8×H20 (docs/study.md), with the tax it finds and its interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hlserve.driver.points import human_tax
from hlserve.driver.repeats import RepeatPlan, Run, run_repeats
from hlserve.driver.stats import ci_table, ratio_verdict

MODES = {"slo (vllm)": {"mode": "slo"}, "throughput": {"mode": "throughput"}}
BASELINE = "slo (vllm)"
THROUGHPUT = "total_token_throughput"


@dataclass(frozen=True)
class DemoSpec:
    model: str
    sessions: int = 16
    rounds: int = 4
    system_prompt_len: int = 1024
    repeats: int = 8  # per mode, interleaved; about 5 s a run on 2 CPU cores
    seed: int = 0  # workload seed of repeat 0
    sim: bool = True
    sim_repeats: int = 3  # seeds of the simulated 32K case
    sim_sessions: tuple[int, ...] = (16, 32, 64)
    sim_duration: float = 300.0  # simulated seconds measured (the study: 1200)
    sim_warmup: float = 150.0


# ---- this machine ------------------------------------------------------------------------------


def _real_run(spec: DemoSpec, common: dict[str, Any], options: dict[str, Any],
              seed: int) -> dict[str, Any]:
    from hlserve.driver.closed_loop import run_agent_sessions
    from hlserve.driver.workloads import AgentWorkload
    from hlserve.llm import LLM

    engine = LLM(spec.model, **{**common, **options}).engine
    workload = AgentWorkload(sessions=spec.sessions, rounds=spec.rounds,
                             system_prompt_len=spec.system_prompt_len, seed=seed)
    summary = run_agent_sessions(engine, workload, progress=False).summary()
    summary["retractions"] = engine.num_retractions
    return summary


def _progress(log: Callable[[str], None], total: int, metric: str = THROUGHPUT,
              ) -> Callable[[Run[Any], Any], None]:
    done = [0]

    def on_run(r: Run[Any], res: Any) -> None:
        done[0] += 1
        what = "warm-up, excluded" if r.warmup else f"repeat {r.repeat + 1}, seed {r.seed}"
        val = (f"error: {res}" if isinstance(res, BaseException)
               else f"{res[metric]:.0f} tok/s")
        log(f"  [{done[0]}/{total}] {r.name:<11} ({what}): {val}")

    return on_run


def run_local(spec: DemoSpec, common: dict[str, Any], log: Callable[[str], None] = print,
              ) -> dict[str, Any]:
    """Both modes, interleaved, one excluded warm-up first; ``run_repeats``'s result."""
    plan = RepeatPlan(repeats=spec.repeats, base_seed=spec.seed, warmup=1)

    def run(options: dict[str, Any], seed: int) -> dict[str, Any]:
        return _real_run(spec, common, options, seed)

    total = 2 * spec.repeats + 1
    return run_repeats(MODES, run, plan, baseline=BASELINE, on_run=_progress(log, total))


def local_table(res: dict[str, Any]) -> str:
    rows = ci_table(res["configs"], ("mode", 12), [
        ("tok/s", THROUGHPUT, "{:.0f}", 18),
        ("session p50 s", "median_session_time_s", "{:.2f}", 16),
        ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}", 16),
        ("TPOT p99 ms", "p99_tpot_ms", "{:.1f}", 14)])
    return "\n".join(rows)


def local_verdict(res: dict[str, Any]) -> str:
    """What the repeats support, and nothing more."""
    r = res["ratios"].get("throughput", {}).get(THROUGHPUT)
    if r is None:
        return "no ratio: a mode had no successful run"
    head = f"throughput mode against SLO mode, total token throughput: {r['text']}"
    n = r["n"]
    if r["ci95"] is None:
        return head + f"\n-> {n} repeat(s): no interval, so no claim either way."
    if r["within_noise"]:
        return (head + "\n-> this machine shows no difference between the two modes: the 95% "
                "interval contains 0 (" + f"{n} interleaved repeats each).")
    more = "more" if r["ratio"] > 1 else "less"
    return (head + f"\n-> throughput mode serves {more} here: the 95% interval excludes 0 "
            f"({n} interleaved repeats each). The SLO mode's human tax on this machine: "
            f"{100 * (1 - 1 / r['ratio']):.1f}% of throughput mode's throughput.")


# ---- the simulated 32K case ----------------------------------------------------------------------


def _sim_run(spec: DemoSpec, point: Any, seed: int) -> dict[str, Any]:
    from hlserve.study.core import StudySpec, run_point

    study = StudySpec(duration=spec.sim_duration, warmup=spec.sim_warmup, seed=seed)
    return run_point(study, point)["metrics"]


def run_sim(spec: DemoSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Throughput mode at 32K context on 8×H20 / Qwen2.5-32B, at each concurrency, over
    ``sim_repeats`` seeds; the tax at the production SLOs (TTFT p99 ≤ 2 s, TPOT p99 ≤ 100 ms)."""
    from hlserve.study.core import PRODUCTION_SLO, StudyPoint

    configs = {f"{n} sessions": StudyPoint("hlserve", None, 32768, n) for n in spec.sim_sessions}
    plan = RepeatPlan(repeats=spec.sim_repeats, base_seed=spec.seed, warmup=0)  # virtual clock

    def run(point: Any, seed: int) -> dict[str, Any]:
        return _sim_run(spec, point, seed)

    total = len(configs) * spec.sim_repeats
    out = run_repeats(configs, run, plan, ratio_metrics=(),
                      on_run=_progress(log, total, "window_token_throughput"))
    out["tax"] = sim_tax(out["configs"], PRODUCTION_SLO)
    return out


def sim_tax(configs: dict[str, dict[str, Any]], slo: tuple[float, float],
            metric: str = "window_token_throughput") -> dict[str, Any]:
    """1 − best meeting the SLO / best of all (chosen on the means, by the one SLO check and
    tax of :mod:`hlserve.driver.points`), with the paired interval."""
    points = [{"label": k, "metrics": s} for k, s in configs.items() if s.get("repeats")]
    tax, met, top = human_tax(points, *slo, metric)
    best = None if met is None else met["label"]
    out: dict[str, Any] = {"slo": slo, "best": best, "top": None if top is None else top["label"],
                           "tax": tax, "ci95": None}
    if met is None or top is None:
        return out
    v = ratio_verdict(top["metrics"]["repeat_values"][metric],
                      met["metrics"]["repeat_values"][metric])
    out["tax"] = 1 - v.ratio
    out["ci95"] = None if v.ci is None else [1 - v.ci[1], 1 - v.ci[0]]
    out["within_noise"] = v.within_noise
    return out


def sim_table(res: dict[str, Any]) -> str:
    rows = ci_table(res["configs"], ("throughput mode", 16), [
        ("tok/s (window)", "window_token_throughput", "{:.0f}", 20),
        ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}", 16),
        ("TPOT p99 ms", "p99_tpot_ms", "{:.0f}", 16)])
    return "\n".join(rows)


def sim_verdict(res: dict[str, Any]) -> str:
    t = res["tax"]
    slo = f"TTFT p99 ≤ {t['slo'][0] / 1e3:.0f} s, TPOT p99 ≤ {t['slo'][1]:.0f} ms"
    if t["best"] is None:
        return f"human tax at production SLOs ({slo}): 100% (no concurrency meets them)"
    if t["best"] == t["top"]:
        return f"human tax at production SLOs ({slo}): 0% ({t['best']} meets them and is best)"
    ci = ("" if t["ci95"] is None else
          f" [{100 * t['ci95'][0]:.1f}%, {100 * t['ci95'][1]:.1f}%]"
          + (": within noise" if t.get("within_noise") else ""))
    return (f"human tax at production SLOs ({slo}): {100 * t['tax']:.1f}%{ci}: the best that "
            f"meets them is {t['best']}, against {t['top']} without them; the SLO forces fewer "
            f"sessions per node.")


def run_demo(spec: DemoSpec, common: dict[str, Any], log: Callable[[str], None] = print,
             ) -> dict[str, Any]:
    t0 = time.perf_counter()
    log(f"1/2 this machine: {spec.sessions} agent sessions x {spec.rounds} rounds, closed loop, "
        f"on {spec.model}; SLO mode and throughput mode interleaved, {spec.repeats} repeats "
        "each (new workload seed per repeat) after one excluded warm-up")
    local = run_local(spec, common, log)
    log("\n" + local_table(local) + "\n(mean ± 95% interval half-width over the repeats)\n")
    log(local_verdict(local))
    out = {"local": local}
    if spec.sim:
        log(f"\n2/2 where the tax exists: the study's 32K case, simulated (Qwen2.5-32B on "
            f"8xH20, {spec.sim_duration:.0f} s window after {spec.sim_warmup:.0f} s warm-up, "
            f"{spec.sim_repeats} seeds): throughput mode at {len(spec.sim_sessions)} "
            "concurrencies")
        sim = run_sim(spec, log)
        log("\n" + sim_table(sim) + "\n")
        log(sim_verdict(sim))
        out["sim"] = sim
    log(f"\n({time.perf_counter() - t0:.0f} s)")
    return out
