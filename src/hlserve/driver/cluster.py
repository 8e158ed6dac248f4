"""Independent runs (sweep points, study points, their repeats) as Ray tasks: a local Ray when no
address is given, a cluster's when one is; progress as tasks complete; a failed task is kept as
its exception without losing the others."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
log = logging.getLogger(__name__)
LOCAL = "local"  # ``--ray`` without an address


@dataclass(frozen=True)
class Resources:
    """What one task declares to Ray's scheduler: a simulated point takes one CPU; a real-engine
    point its torch threads and, on CUDA, one GPU."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


SIMULATED = Resources()


def real_engine_resources(threads: int | None, device: str | None) -> Resources:
    gpu = 1.0 if device and device.startswith("cuda") else 0.0
    return Resources(num_cpus=float(threads or 1), num_gpus=gpu)


def _call(fn: Callable[[], T]) -> T:
    return fn()


def _init(address: str | None) -> bool:
    """Start or join Ray unless this process already has; True when this call did."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address and address != LOCAL:
        kwargs["address"] = address
    ray.init(**kwargs)
    return True


def _unwrap(e: BaseException) -> BaseException:
    """A task's own exception, not Ray's wrapper of it (the traceback text stays in str)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def run_on_ray(fns: Sequence[Callable[[], T]], address: str | None = None,
               resources: Resources | Sequence[Resources] = SIMULATED, desc: str = "points",
               progress: bool = True,
               on_done: Callable[[int, T | BaseException], None] | None = None,
               ) -> list[T | BaseException]:
    """Run every ``fn()`` as a Ray task (no retries: a point that failed once is reported, not
    rerun into a different result); returns their results in the order given, an exception in
    place of a task that raised. ``fns`` must pickle (module functions and ``partial``\\ s of
    them do); on a cluster, hlserve must be installed on every node."""
    import ray

    if not fns:
        return []
    res = [resources] * len(fns) if isinstance(resources, Resources) else list(resources)
    started = _init(address)
    try:
        task = ray.remote(_call)
        refs = [task.options(num_cpus=r.num_cpus, num_gpus=r.num_gpus, max_retries=0).remote(fn)
                for fn, r in zip(fns, res, strict=True)]
        where = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(fns)
        pending = list(refs)
        with tqdm(total=len(fns), desc=desc, unit="task", disable=not progress) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    i = where[ref]
                    try:
                        out[i] = ray.get(ref)
                    except Exception as e:  # one failed task; the others go on
                        out[i] = _unwrap(e)
                    bar.update(1)
                    if on_done is not None:
                        on_done(i, out[i])
        return out
    finally:
        if started:
            ray.shutdown()


def ray_executor(address: str | None, resources: Resources = SIMULATED, progress: bool = True,
                 ) -> Callable[[Sequence[Any], Callable[[Any], dict[str, Any]]],
                               list[dict[str, Any] | BaseException]]:
    """An executor for :func:`hlserve.driver.repeats.run_repeats`: every run of the schedule a
    task. ``fn`` is called as ``fn(run)``, so it must pickle too."""
    from functools import partial

    def execute(runs: Sequence[Any], fn: Callable[[Any], dict[str, Any]],
                ) -> list[dict[str, Any] | BaseException]:
        return run_on_ray([partial(fn, r) for r in runs], address, resources, progress=progress)

    return execute
