"""The study's systems that are other engines' own schedulers: vLLM 0.34's and SGLang
0.5.23's code, stock and with hlserve's plugin, under the same simulated runner, cost model,
workloads and driver as hlserve's engine (``hlserve.integrations.sim_point`` runs a point).

Each engine lives in its own environment (``.ci/vllm-harness-env 0.34.0``,
``.ci/sglang-env``; ``HLSERVE_VLLM_0_34_0_PYTHON`` / ``HLSERVE_SGLANG_PYTHON`` name another
Python), so a point runs as a child process of that Python: the study sends the point's JSON
on stdin and reads its record back, in the point format of :func:`hlserve.study.core.run_point`.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE = Path.home() / ".cache" / "hlserve"
SRC = Path(__file__).resolve().parents[2]  # the directory holding this hlserve package


@dataclass(frozen=True)
class ForeignSystem:
    """A system whose scheduling code is another engine's: where it runs, and its knob."""

    env_var: str  # names another environment's Python
    env_dir: str  # under ~/.cache/hlserve, as .ci builds it
    knob: str  # the point's knob, in the study's letters (B: token budget, C: chunk, C=B)
    what: str

    def python(self) -> Path:
        return Path(os.environ.get(self.env_var) or CACHE / self.env_dir / "bin" / "python")


_VLLM = ("HLSERVE_VLLM_0_34_0_PYTHON", "venv-vllm-0.34.0")
_SGLANG = ("HLSERVE_SGLANG_PYTHON", "venv-sglang-0.5.23")
FOREIGN: dict[str, ForeignSystem] = {
    "vllm-0.34": ForeignSystem(*_VLLM, "B", "vLLM 0.34's scheduler, an H20 deployment's "
                               "defaults (async, B = 8192, FCFS, chunked prefill)"),
    "vllm-0.34-chunked": ForeignSystem(*_VLLM, "C=B", "vLLM 0.34 with "
                                       "--long-prefill-token-threshold C = B (512: Sarathi-style)"),
    "vllm-0.34+hlserve": ForeignSystem(*_VLLM, "B", "vLLM 0.34 with hlserve's "
                                       "ThroughputAsyncScheduler (B at the model length)"),
    "sglang-0.5.23": ForeignSystem(*_SGLANG, "C", "SGLang 0.5.23's scheduler, its defaults "
                                   "(C = 8192, max prefill 16384, LPM, prefill first)"),
    "sglang-0.5.23-mixed": ForeignSystem(*_SGLANG, "C", "SGLang 0.5.23 with "
                                         "--enable-mixed-chunk, C = 512 (Sarathi-style)"),
    "sglang-0.5.23+hlserve": ForeignSystem(*_SGLANG, "C", "SGLang 0.5.23 with hlserve's plugin"),
}


class ForeignRunError(RuntimeError):
    pass


def missing_environments(systems: tuple[str, ...]) -> list[str]:
    """What is missing to run ``systems`` here, one line each (empty: nothing)."""
    out = []
    for name in systems:
        sysdef = FOREIGN.get(name)
        if sysdef is not None and not sysdef.python().exists():
            out.append(f"{name}: no Python at {sysdef.python()} (build it with .ci/"
                       f"{'sglang-env' if 'sglang' in name else 'vllm-harness-env 0.34.0'}, "
                       f"or set {sysdef.env_var})")
    return out


def run_foreign(spec: dict[str, Any], point: dict[str, Any], options: dict[str, Any],
                timeout: float) -> dict[str, Any]:
    """The point's record from its engine's environment (``spec``: the study spec as a dict)."""
    sysdef = FOREIGN[point["system"]]
    py = sysdef.python()
    if not py.exists():
        raise ForeignRunError(missing_environments((point["system"],))[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "HLSERVE_SGLANG_"))}
    env.update(PYTHONPATH=str(SRC), HF_HUB_OFFLINE="1")
    job = json.dumps({"spec": spec, "point": point, "options": options})
    r = subprocess.run([str(py), "-m", "hlserve.integrations.sim_point"], input=job,
                       capture_output=True, text=True, timeout=timeout, env=env)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("RECORD "):
            return json.loads(line[len("RECORD "):])
    raise ForeignRunError(f"{point['system']} failed (rc {r.returncode}): {r.stderr[-3000:]}")
