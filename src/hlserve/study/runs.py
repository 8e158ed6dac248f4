"""Running the study and loading its points: ``run_study`` runs every point not already stored
(resumable: a point whose file agrees with the spec is kept), in parallel processes or as Ray
tasks (``hlserve study --ray``), on ``--repeats N`` workload seeds; ``load_points`` reads them
back. A point's seed-``s`` record is ``<key>.seed<s>.json`` beside the seed-0 ``<key>.json`` (so
stored seed-0 points stay valid); :func:`merge_seeds` folds a point's seeds into one record
whose metrics are means with ``*_ci95`` (hlserve.driver.repeats).

Only seeds are threaded through here: the report's cells, plots and text use the means, and
the study over seeds (seeds.py) gives the intervals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hlserve.driver.cluster import SIMULATED, run_on_ray
from hlserve.driver.repeats import aggregate
from hlserve.study.core import StudyPoint, StudySpec, run_point


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
    return run_point(StudySpec.of(spec_d), StudyPoint(**point_d))


def write_record(path: str, rec: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.rename(path)


def run_tasks_on_ray(tasks: list[tuple[dict[str, Any], dict[str, Any], str]], address: str,
                     progress: bool, log: Callable[[str], None] = print) -> list[str]:
    """Every (spec, point, path) as a Ray task of one CPU; records are written here, on the
    driver, as they arrive; a failed point is reported and the others kept. Returns the
    failures' messages."""
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


def _worker(args: tuple[dict[str, Any], dict[str, Any], str]) -> str:
    spec_d, point_d, path = args
    write_record(path, _record(spec_d, point_d))
    return path


# fingerprint fields added after points were stored: a stored point without one was made at
# its default
_LATER_FIELDS = {"output_mean": 200.0, "prefix_reuse": True, "tool_time": "0"}


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
    ``spec.seed + i``, locally or as Ray tasks; returns all point files."""
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


def load_points(out: Path) -> list[dict[str, Any]]:
    """The stored points of ``out/points``, one record per point (a point run on several
    seeds: means and ``*_ci95``)."""
    recs = []
    for path in sorted((Path(out) / "points").glob("*.json")):
        try:
            recs.append(json.loads(path.read_text()))
        except json.JSONDecodeError:
            continue
    return merge_seeds(recs)
