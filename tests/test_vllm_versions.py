"""The plugin on each supported vLLM, in vLLM's own scheduler (``step_harness``), no model.

Per version, one run of tests/vllm_version_checks.py in that version's environment:

- 0.32: vLLM's CPU build (``~/.cache/hlserve/venv-vllm``, or ``HLSERVE_VLLM_PYTHON``);
- 0.33.0, 0.34.0: the CUDA wheels installed ``--no-deps`` beside torch 2.13.0 CPU
  (``.ci/vllm-harness-env <version>``: ``~/.cache/hlserve/venv-vllm-<version>``, or
  ``HLSERVE_VLLM_<0_34_0>_PYTHON``).

A version whose environment is missing is skipped with the reason; .ci/run builds them all.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "hlserve"
VERSIONS = {
    "0.32": Path(os.environ.get("HLSERVE_VLLM_PYTHON") or CACHE / "venv-vllm" / "bin" / "python"),
    **{v: Path(os.environ.get(f"HLSERVE_VLLM_{v.replace('.', '_')}_PYTHON")
               or CACHE / f"venv-vllm-{v}" / "bin" / "python") for v in ("0.33.0", "0.34.0")},
}
pytestmark = pytest.mark.slow


@functools.cache
def _checks(version: str) -> dict[str, Any]:
    py = VERSIONS[version]
    if not py.exists():
        pytest.skip(f"vLLM {version}'s environment is not installed ({py.name} under "
                    f"{py.parent.parent.name}; .ci/run builds it)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([str(py), str(ROOT / "tests" / "vllm_version_checks.py")],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["vllm"].startswith(version), result["vllm"]
    return result


@pytest.mark.parametrize("version", list(VERSIONS))
def test_stock_and_plugin_complete_a_stream_sync_and_async(version: str) -> None:
    runs = _checks(version)["complete"]
    assert {k: v["class"] for k, v in runs.items()} == {
        "stock-sync": "Scheduler", "stock-async": "AsyncScheduler",
        "plugin-sync": "ThroughputScheduler", "plugin-async": "ThroughputAsyncScheduler"}
    for name, run in runs.items():
        assert run["finished"] == 28 and run["tokens_ok"], (name, run)
        assert run["free"] == run["usable"] and run["requests_left"] == 0, (name, run)
        assert run["preempted"] > 0, (name, run)  # the pool was under pressure
    for name in ("plugin-sync", "plugin-async"):
        run = runs[name]
        # the plugin's pass ran every step and set budgets of its own (the EMA's, the
        # interactive cap's), and greedy prefill took more than a 512-token chunk allows
        assert run["plugin_steps"] == run["steps"], run
        assert min(run["budgets"]) < 512, run
    assert runs["stock-sync"]["budgets"] == [512]


@pytest.mark.parametrize("version", list(VERSIONS))
def test_plugin_decides_what_hlserves_engine_does_step_by_step(version: str) -> None:
    result = _checks(version)
    for run in result["decisions"]:
        assert run["agree"], run
        assert run["finished_both"], run
        seen = run["seen"]
        # the stream reached what the comparison is about: prefix hits (prefix caching on),
        # an interactive request beside agents, the EMA budget below the hard cap
        assert seen["cached_hits"] > 0 and seen["interactive"] > 0 and seen["budgets"] > 0, run
    # and the comparison can fail: the plugin with another LPM aging than the engine's
    assert not result["perturbed"]["agree"], result["perturbed"]


@pytest.mark.parametrize("version", list(VERSIONS))
def test_a_session_round_survives_other_traffic_and_never_blocks_an_admission(
        version: str) -> None:
    runs = _checks(version)["sessions"]
    stock, plugin = runs["survive-stock"], runs["survive-plugin"]
    # two pools' worth of other traffic went through during the tool call: stock vLLM's LRU
    # evicted round 1; the plugin held it, and round 2 found all of round 1 that was
    # computed (its full blocks: the last output token is never fed back)
    assert stock["cached"] == 0, stock
    assert plugin["cached"] == (plugin["context"] - 1) // 16 * 16, plugin
    assert plugin["holds"]["hits"] == 1 and plugin["holds"]["evicted"] == 0, plugin
    assert plugin["free"] + plugin["held_after"] == plugin["usable"], plugin  # balanced
    short = runs["survive-plugin-short-ttl"]  # a TTL shorter than the tool call
    assert short["cached"] == 0 and short["holds"]["expired"] >= 1, short
    hinted = runs["survive-plugin-short-hint"]  # the same, asked by round 1 itself
    assert hinted["cached"] == 0 and hinted["holds"]["expired"] >= 1, hinted
    # held rounds fill most of the pool; a request that fits only in their blocks is
    # admitted in the same step as on stock vLLM, with no preemption; the holds go oldest
    # first, only as many as it needs
    y_stock, y_plugin = runs["yield-stock"], runs["yield-plugin"]
    assert y_plugin["held_before"] > 64 - 44, y_plugin
    assert y_plugin["admitted_after_steps"] == y_stock["admitted_after_steps"] == 0
    assert y_plugin["preempted"] == 0, y_plugin
    assert 1 <= y_plugin["holds"]["evicted"] < 3 and y_plugin["left_held"] > 0, y_plugin
