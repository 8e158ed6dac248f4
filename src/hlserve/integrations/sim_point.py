"""One study point of another engine's scheduler, run in that engine's environment.

``python -m hlserve.integrations.sim_point`` reads a point's JSON on stdin (``spec``: the
study's spec as a dict; ``point``: system, knob, context, sessions; ``options``: flags laid
over the system's) and prints its record, in the study's point format
(:func:`hlserve.study.core.run_point`'s), as the last line of stdout. ``hlserve study``
starts it with the Python of the system's environment (vLLM and SGLang each live in their
own: ``.ci/vllm-harness-env``, ``.ci/sglang-env``); nothing here runs in hlserve's.

The systems (their names are ``hlserve.study.foreign.FOREIGN``'s):

- ``vllm-0.34``: vLLM 0.34's own scheduler as an H20 deployment runs it (async scheduling,
  ``--max-num-batched-tokens`` B = the knob, 8192 by default; ``long_prefill_token_threshold``
  option: C);
- ``vllm-0.34-chunked``: the same with ``--long-prefill-token-threshold`` C at B = the knob
  (512 by default: Sarathi-style chunking on vLLM's code);
- ``vllm-0.34+hlserve``: the same with ``--scheduler-cls``
  ``hlserve.integrations.vllm.ThroughputAsyncScheduler`` (B at the model length);
- ``sglang-0.5.23``: SGLang 0.5.23's scheduler, ``--chunked-prefill-size`` C = the knob (8192
  by default on a 96 GB GPU), its other defaults;
- ``sglang-0.5.23-mixed``: the same with ``--enable-mixed-chunk`` (a Sarathi-style chunked
  prefill with decodes mixed in, C = 512 by default);
- ``sglang-0.5.23+hlserve``: SGLang with hlserve's plugin.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from hlserve.driver.closed_loop import Loop, run_closed_loop
from hlserve.driver.loop_metrics import stall_metrics, turnover_metrics, window_metrics
from hlserve.driver.tool_time import parse_tool_time
from hlserve.driver.workloads import AgentWorkload
from hlserve.integrations.sim_engine import ForeignSimEngine, StepPricer

MAX_LEN_HEADROOM = 4096
CHUNKED_DEFAULT = 512  # vllm-0.34-chunked's C = B: Sarathi-Serve's strict chunk  # the model length a point's engine gets past its context (run_point's)


def _vllm(system: str, knob: int | None, max_len: int, opts: dict[str, Any],
          pricer: StepPricer) -> ForeignSimEngine:
    from hlserve.integrations.vllm.sim_vllm import VllmSimEngine, deployment

    plugin = system.endswith("+hlserve")
    chunked = system.endswith("-chunked")  # C = B = the knob: Sarathi-style on vLLM's code
    budget = (knob or CHUNKED_DEFAULT) if chunked else knob
    dep = deployment(plugin, max_len, budget=budget,
                     threshold=budget if chunked else opts.get("long_prefill_token_threshold"),
                     async_scheduling=opts.get("async_scheduling", True),
                     plugin_options=opts.get("hlserve"))
    return VllmSimEngine(dep, pricer, max_len)


def _sglang(system: str, knob: int | None, max_len: int, opts: dict[str, Any],
            pricer: StepPricer) -> ForeignSimEngine:
    from hlserve.integrations.sglang.sim_sglang import SglangSimEngine, deployment

    dep = deployment(plugin=system.endswith("+hlserve"), mixed=system.endswith("-mixed"),
                     chunk=knob, max_len=max_len, **opts)
    return SglangSimEngine(dep, pricer)


BUILDERS: dict[str, Callable[..., ForeignSimEngine]] = {
    "vllm-0.34": _vllm,
    "vllm-0.34-chunked": _vllm,
    "vllm-0.34+hlserve": _vllm,
    "sglang-0.5.23": _sglang,
    "sglang-0.5.23-mixed": _sglang,
    "sglang-0.5.23+hlserve": _sglang,
}


def run(spec: dict[str, Any], point: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The point's record (``run_point``'s format; ``options`` are the system's flags)."""
    system, ctx, n = point["system"], point["context"], point["sessions"]
    max_len = ctx + MAX_LEN_HEADROOM
    pricer = StepPricer(spec["model"], spec["hardware"], spec["tp"])
    engine = BUILDERS[system](system, point["knob"], max_len, options, pricer)
    workload = AgentWorkload.for_context(
        ctx, n, rounds=spec["rounds"], output_mean=spec["output_mean"],
        vocab=(3, min(pricer.model_config.vocab_size, 150000)), seed=spec["seed"],
        prefix_reuse=spec["prefix_reuse"], tool_time=parse_tool_time(spec["tool_time"]))
    loop = Loop(duration=spec["duration"], warmup=spec["warmup"], replace_finished=True,
                ramp=spec["warmup"] / 2, wall_limit=spec["wall_limit"], token_times=True)
    t = time.perf_counter()
    res = run_closed_loop(engine, workload.make_session, n, loop)  # type: ignore[arg-type]
    wall = time.perf_counter() - t
    c = pricer.counters
    metrics = {
        **window_metrics(res), **res.extra, **stall_metrics(res.records),
        **turnover_metrics(res, n),
        "retractions": c.retractions, "errors": res.errors, "iterations": c.iterations,
        "mixed_iterations": c.mixed_iterations,
        "prefill_tokens_computed": c.prefill_tokens_computed,
        "decode_tokens_computed": c.decode_tokens_computed,
        "sim_seconds": engine.clock(), "window_s": res.duration, "wall_s": wall,
        "truncated": res.duration < spec["duration"] - 1e-6, "stalled": res.stalled,
        "stalled_at_s": res.stalled_at,
    }
    # the deployment's flags as the engine's own names spell them
    flags = dataclasses.asdict(engine.dep)  # type: ignore[attr-defined]
    return {"point": point, "options": flags, "kv_pool_tokens": engine.kv_pool_tokens(),
            "metrics": metrics}


def main() -> None:
    job = json.loads(sys.stdin.read())
    rec = run(job["spec"], job["point"], job.get("options") or {})
    sys.stdout.write("\nRECORD " + json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
