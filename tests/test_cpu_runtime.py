"""The CPU runtime: stated by default, vLLM's (tcmalloc, pinned threads) on request, applied
by re-executing the real process once; nothing the user set is overridden."""

from __future__ import annotations

import os
import subprocess
import sys

from hlserve.cpu_runtime import find_tcmalloc, vllm_like_env

PROBE = ("from hlserve.cpu_runtime import arrange; arrange('cpu'); import os; "
         "print(os.environ.get('OMP_NUM_THREADS'), os.environ.get('GOMP_CPU_AFFINITY'), "
         "os.environ.get('LD_PRELOAD'), sep='|')")


def run(env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "LD_PRELOAD", "OMP_PLACES",
                         "KMP_AFFINITY", "HLSERVE_CPU_RUNTIME", "HLSERVE_CPU_RUNTIME_APPLIED")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**base, **env},
                          capture_output=True, text=True, timeout=60, check=True)


def test_default_states_the_runtime_and_changes_nothing() -> None:
    p = run({})
    assert "re-executing" not in p.stderr
    assert "CPU runtime: glibc malloc" in p.stderr and "unpinned" in p.stderr
    assert p.stdout.strip().split("|")[:2] == ["None", "None"]


def test_vllm_runtime_re_executes_once_with_pinned_threads() -> None:
    p = run({"HLSERVE_CPU_RUNTIME": "vllm"})
    assert p.stderr.count("re-executing") == 1
    threads, affinity, preload = p.stdout.strip().split("|")
    cores = sorted(os.sched_getaffinity(0))
    assert threads == str(len(cores))
    assert affinity == " ".join(map(str, cores))
    tc = find_tcmalloc()
    assert (preload == tc) if tc else preload == "None"
    assert ("CPU runtime: tcmalloc" if tc else "CPU runtime: glibc") in p.stderr


def test_user_settings_win() -> None:
    add = vllm_like_env({"OMP_NUM_THREADS": "1", "KMP_AFFINITY": "x", "LD_PRELOAD": "/a.so"},
                        [0, 1], "/lib/libtcmalloc_minimal.so.4")
    assert add == {"LD_PRELOAD": "/lib/libtcmalloc_minimal.so.4:/a.so"}
