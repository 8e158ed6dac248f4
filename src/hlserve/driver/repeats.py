"""Configurations x repeats, interleaved and mirrored (A B B A A B ..., not A B A B, not
A A B B), with an excluded warm-up and a new workload seed per repeat; every numeric metric
summarized as a mean with ``<metric>_ci95``.

Why interleaved: a machine drifts (thermal state, other jobs, page cache); running every repeat
of A before any of B puts that drift into the A/B difference. Interleaved, repeat i of every
configuration runs at about the same moment and with the same seed (``base_seed + i``), so
A_i and B_i are a pair and :func:`hlserve.driver.stats.ratio_ci` can use the pairing. Why mirrored:
in A B A B, B always runs second within a pair, so a steady drift still biases every pair the
same way (the peers benchmark measured 3% on a slowing machine); reversing the order on every
other repeat cancels a linear drift over each two repeats.
"""

from __future__ import annotations

import argparse
import math
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from hlserve.driver.stats import clean, mean_ci, ratio_verdict

C = TypeVar("C")
RATIO_METRICS = ("total_token_throughput", "output_throughput")


@dataclass(frozen=True)
class RepeatPlan:
    repeats: int = 1
    base_seed: int = 0
    warmup: int = 1  # excluded runs of the first configuration before any measured one

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warm-up runs must be >= 0, got {self.warmup}")


@dataclass(frozen=True)
class Run(Generic[C]):
    """One run of the schedule: a configuration, its repeat index (-1: warm-up), its seed."""

    name: str
    config: C
    repeat: int
    seed: int

    @property
    def warmup(self) -> bool:
        return self.repeat < 0


def schedule(configs: Mapping[str, C], plan: RepeatPlan) -> list[Run[C]]:
    """Warm-up runs first (the first configuration, on a seed no measured run uses, so that a
    long-lived server's prefix cache holds nothing a measured run asks for), then for each
    repeat i every configuration, in order on even repeats and in reverse on odd ones
    (A B, B A, A B, ...), on seed ``base_seed + i``."""
    if not configs:
        raise ValueError("no configuration to run")
    first = next(iter(configs))
    runs = [Run(first, configs[first], -1, plan.base_seed + plan.repeats + w)
            for w in range(plan.warmup)]
    items = list(configs.items())
    for i in range(plan.repeats):
        order = items if i % 2 == 0 else items[::-1]
        runs += [Run(name, cfg, i, plan.base_seed + i) for name, cfg in order]
    return runs


def _numeric(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def aggregate(results: Sequence[Mapping[str, Any]], seeds: Sequence[int] = ()) -> dict[str, Any]:
    """One summary of a configuration's repeats: each numeric metric is the mean over the
    repeats, with ``<metric>_ci95`` (``[low, high]``; None for one repeat) and its values in
    ``repeat_values``; other fields are the first repeat's. One repeat is returned as it was,
    with ``repeats: 1`` and ``_ci95`` None (no interval, rather than a fake one)."""
    if not results:
        return {"repeats": 0, "seeds": list(seeds)}
    out: dict[str, Any] = dict(results[0])
    values: dict[str, list[Any]] = {}
    # every key of any repeat: a metric added after some repeats were stored is averaged over
    # the repeats that have it (its values show which)
    firsts: dict[str, Any] = {}
    for r in results:
        for key, v in r.items():
            if firsts.get(key) is None:
                firsts[key] = v
    for key, first in firsts.items():
        if (not _numeric(first) and first is not None) or key.endswith("_ci95"):
            continue
        col = [r.get(key) for r in results]
        if not any(_numeric(v) for v in col):
            continue
        values[key] = col
        m, ci = mean_ci(clean(col))
        if len(results) > 1:
            out[key] = m
        out[f"{key}_ci95"] = None if ci is None else [ci[0], ci[1]]
    out.update(repeats=len(results), seeds=list(seeds), repeat_values=values)
    return out


def ratios(per_repeat: Mapping[str, Sequence[Mapping[str, Any] | None]], baseline: str,
           metrics: Sequence[str] = RATIO_METRICS) -> dict[str, dict[str, Any]]:
    """Each configuration against ``baseline``, metric by metric: ratio of means, its paired
    interval (repeats where both ran), and whether it is within noise."""
    out: dict[str, dict[str, Any]] = {}
    base = per_repeat[baseline]
    for name, runs in per_repeat.items():
        if name == baseline:
            continue
        row: dict[str, Any] = {}
        for metric in metrics:
            pairs = [(a.get(metric), b.get(metric)) for a, b in zip(base, runs, strict=True)
                     if a is not None and b is not None]
            pairs = [(float(x), float(y)) for x, y in pairs if _numeric(x) and _numeric(y)
                     and math.isfinite(x) and math.isfinite(y)]
            if not pairs:
                continue
            v = ratio_verdict([p[0] for p in pairs], [p[1] for p in pairs])
            row[metric] = {"ratio": v.ratio, "ci95": None if v.ci is None else list(v.ci),
                           "n": v.n, "within_noise": v.within_noise, "text": v.text()}
        out[name] = {"vs": baseline, **row}
    return out


Executor = Callable[[Sequence[Run[Any]], Callable[[Run[Any]], dict[str, Any]]],
                    list["dict[str, Any] | BaseException"]]


def run_in_order(runs: Sequence[Run[Any]], fn: Callable[[Run[Any]], dict[str, Any]],
                 ) -> list[dict[str, Any] | BaseException]:
    """The local executor: one run after the other, in the schedule's order; a run that raises
    is kept as its exception, the others go on."""
    out: list[dict[str, Any] | BaseException] = []
    for r in runs:
        try:
            out.append(fn(r))
        except Exception as e:
            out.append(e)
    return out


def run_repeats(configs: Mapping[str, C], run: Callable[[C, int], dict[str, Any]],
                plan: RepeatPlan, baseline: str | None = None,
                ratio_metrics: Sequence[str] = RATIO_METRICS,
                execute: Executor | None = None,
                on_run: Callable[[Run[C], dict[str, Any] | BaseException], None] | None = None,
                ) -> dict[str, Any]:
    """Run ``run(config, seed)`` over the interleaved schedule; returns ``configs`` (name ->
    :func:`aggregate` summary), ``ratios`` (against ``baseline``, default the first), ``order``
    (the runs as they were scheduled) and ``errors`` (name -> messages of failed repeats)."""
    runs = schedule(configs, plan)

    def one(r: Run[C]) -> dict[str, Any]:
        return run(r.config, r.seed)

    results = (execute or run_in_order)(runs, one)
    per_repeat: dict[str, list[dict[str, Any] | None]] = {n: [None] * plan.repeats for n in configs}
    errors: dict[str, list[str]] = {}
    for r, res in zip(runs, results, strict=True):
        if on_run is not None:
            on_run(r, res)
        if r.warmup:
            continue
        if isinstance(res, BaseException):
            errors.setdefault(r.name, []).append(
                f"repeat {r.repeat} (seed {r.seed}): {type(res).__name__}: {res}")
            continue
        per_repeat[r.name][r.repeat] = res
    summaries = {}
    for name, reps in per_repeat.items():
        ok = [(i, x) for i, x in enumerate(reps) if x is not None]
        summaries[name] = aggregate([x for _, x in ok], [plan.base_seed + i for i, _ in ok])
    base = baseline or next(iter(configs))
    return {"configs": summaries, "ratios": ratios(per_repeat, base, ratio_metrics),
            "order": [[r.name, r.repeat, r.seed] for r in runs], "errors": errors,
            "plan": {"repeats": plan.repeats, "base_seed": plan.base_seed,
                     "warmup": plan.warmup}}


def add_repeat_args(p: argparse.ArgumentParser, ray: bool = False, default: int = 1) -> None:
    """``--repeats N`` (and ``--ray [ADDRESS]``), shared by bench, sweep, demo and study."""
    g = p.add_argument_group("repeats")
    g.add_argument("--repeats", type=int, default=default,
                   help="runs per configuration, interleaved A B B A, on seeds --seed + i; "
                        "results carry 95%% intervals (*_ci95) and tables print "
                        f"mean ± half-width (default: {default})")
    if ray:
        g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="run every point and repeat as a Ray task: no ADDRESS starts a "
                            "local Ray, an ADDRESS (e.g. ray://head:10001, auto) joins a cluster")


def add_inprocess_args(p: argparse.ArgumentParser, out: Path, engine_example: str) -> None:
    """The flags every in-process A/B benchmark on one loaded model shares (benchmarks/
    speculation.py, benchmarks/sessions.py): repeats and their seeds, engine flags for every
    run, torch threads, the JSON out file, the progress bar."""
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per arm, interleaved and mirrored (A B B A) (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="repeat i runs workload seed SEED + i")
    p.add_argument("--engine-args", default="",
                   help=f"engine flags for every run, e.g. '{engine_example}'")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--no-progress", dest="progress", action="store_false")


def machine_info() -> dict[str, Any]:
    """Where a benchmark ran, for its JSON: the platform, torch's threads and version."""
    import torch  # the caller's runs loaded it already

    return {"platform": platform.platform(), "cpus": torch.get_num_threads(),
            "torch": torch.__version__}
