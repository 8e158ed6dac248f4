"""``hlserve study --repeats N --ray [ADDRESS]``: the study's points over several workload seeds,
and as Ray tasks. A point's seed-``s`` record is ``<key>.seed<s>.json`` beside the seed-0
``<key>.json`` (so stored seed-0 points stay valid); :func:`merge_seeds` folds a point's seeds
into one record whose metrics are means with ``*_ci95`` (hlserve.driver.repeats).

Only seeds are threaded through here: the report's cells, plots and text use the means and do
not yet print the intervals (the study revision of issue 14 does that).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from hlserve.driver.repeats import aggregate


def point_path(pdir: Path, key: str, seed: int) -> Path:
    return pdir / (f"{key}.json" if seed == 0 else f"{key}.seed{seed}.json")


def merge_seeds(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per point: a point stored under several seeds gets its metrics averaged,
    with ``<metric>_ci95``, ``seeds`` and ``repeat_values``; a point with one seed is as it was."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        p = r["point"]
        key = f"{p['context']}/{p['sessions']}/{p['system']}/{p['knob']}"
        by.setdefault(key, []).append(r)
    out = []
    for group in by.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        group.sort(key=lambda r: r.get("spec", {}).get("seed", 0))
        seeds = [r.get("spec", {}).get("seed", 0) for r in group]
        merged = dict(group[0])
        merged["metrics"] = aggregate([r["metrics"] for r in group], seeds)
        # a flag is not averaged: transient in any seed is transient
        for flag in ("transient", "truncated", "stalled"):
            if any(r["metrics"].get(flag) for r in group):
                merged["metrics"][flag] = True
        out.append(merged)
    return out


def _record(spec_d: dict[str, Any], point_d: dict[str, Any]) -> dict[str, Any]:
    """One point's record (module-level, so that it pickles into a Ray task)."""
    from hlserve.sim.study import Point, StudySpec, run_point

    spec = StudySpec(**{**spec_d, "contexts": tuple(spec_d["contexts"]),
                        "sessions": tuple(spec_d["sessions"]), "systems": tuple(spec_d["systems"])})
    return run_point(spec, Point(**point_d))


def write_record(path: str, rec: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.rename(path)


def run_tasks_on_ray(tasks: list[tuple[dict[str, Any], dict[str, Any], str]], address: str,
                     progress: bool, log: Callable[[str], None] = print) -> list[str]:
    """Every (spec, point, path) as a Ray task of one CPU; records are written here, on the
    driver, as they arrive; a failed point is reported and the others kept. Returns the
    failures' messages."""
    from hlserve.driver.cluster import SIMULATED, run_on_ray

    failures: list[str] = []

    def done(i: int, res: Any) -> None:
        path = tasks[i][2]
        if isinstance(res, BaseException):
            failures.append(f"{Path(path).name}: {type(res).__name__}: {res}")
            log(f"study point {Path(path).name} failed: {type(res).__name__}: {res}")
        else:
            write_record(path, res)

    run_on_ray([partial(_record, s, p) for s, p, _ in tasks], address, SIMULATED,
               desc="study points", progress=progress, on_done=done)
    return failures
