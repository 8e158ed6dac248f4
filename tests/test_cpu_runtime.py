"""The CPU runtime: stated by default, vLLM's (tcmalloc, pinned threads) on request, applied
by re-executing the real process once; nothing the user set is overridden."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (loads libgomp, which needs_libgomp looks for)

from hlserve.cpu_runtime import find_tcmalloc, loaded_libgomp, vllm_like_env

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


# How often the OpenMP worker of a thread that did not build the engine sleeps over 300
# back-to-back parallel regions (voluntary context switches: a spinning worker has none).
SPIN_PROBE = """
import os, sys, threading, torch
torch.set_num_threads(2)
if sys.argv[1] == "engine":  # as a server builds it: hlserve.server.app.serve
    from hlserve.config import EngineConfig
    from hlserve.cpu_runtime import release_openmp_workers
    from hlserve.engine.factory import build_engine
    from hlserve.runner.torch_runner import TorchRunner
    from hlserve.tokenizer import Tokenizer
    build_engine(EngineConfig(model=sys.argv[2], dtype="float32", num_pages=64), TorchRunner,
                 tokenizer=Tokenizer.from_dir)
    release_openmp_workers()
x = torch.randn(2_000_000)  # (one thread's fill: no parallel region)
if sys.argv[1] != "engine":
    x + 1  # this thread's pool, as loading the weights makes one
if sys.argv[1] == "release":
    from hlserve.cpu_runtime import release_openmp_workers
    assert release_openmp_workers()
before = set(os.listdir("/proc/self/task"))
out = {}

def step_thread():
    y = x + 1  # this thread's pool: one new worker
    (worker,) = set(os.listdir("/proc/self/task")) - before - {str(threading.get_native_id())}
    def sleeps():
        with open(f"/proc/self/task/{worker}/status") as f:
            return int(next(ln for ln in f if ln.startswith("voluntary_ctxt")).split()[1])
    s0 = sleeps()
    for _ in range(300):
        torch.add(x, 1, out=y)
    out["sleeps"] = sleeps() - s0

t = threading.Thread(target=step_thread)
t.start()
t.join()
print(out["sleeps"])
"""


def worker_sleeps(*args: str) -> int:
    p = subprocess.run([sys.executable, "-c", SPIN_PROBE, *args], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.split()[-1])


needs_libgomp = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or loaded_libgomp() is None,
    reason="needs 2 CPUs and torch on GNU OpenMP")


@needs_libgomp
def test_released_workers_let_another_threads_workers_spin() -> None:
    """A second thread's OpenMP worker sleeps at every parallel region while the first
    thread keeps its pool (libgomp throttles spinning past one managed thread per CPU), and
    spins once the first thread's workers are given back."""
    kept, released = worker_sleeps("keep"), worker_sleeps("release")
    assert kept >= 150, kept  # ~one sleep per region: the throttled spin
    assert released < kept / 4, (released, kept)


@needs_libgomp
def test_the_server_gives_back_the_loading_threads_workers(tiny_llama: Path) -> None:
    """What ``hlserve serve`` builds its engine with leaves only the engine thread's pool."""
    assert worker_sleeps("engine", str(tiny_llama)) < worker_sleeps("keep") / 4


def test_release_needs_libgomp_in_the_process() -> None:
    p = subprocess.run([sys.executable, "-c",
                        "from hlserve.cpu_runtime import loaded_libgomp as f; print(f())"],
                       capture_output=True, text=True, timeout=60, check=True)
    assert p.stdout.strip() == "None"  # torch not imported: nothing to release


def test_engine_thread_benchmark_runs_its_table(tiny_llama: Path) -> None:
    """benchmarks/engine_thread.py on the tiny model: one round, both batches, both ways."""
    bench = Path(__file__).parents[1] / "benchmarks" / "engine_thread.py"
    p = subprocess.run([sys.executable, str(bench), "--model", str(tiny_llama), "--rounds", "1",
                        "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith(("| decode", "| prefill"))]
    assert len(rows) == 2, p.stdout
    assert all(ln.count("|") == 5 and "x (" in ln for ln in rows), rows
