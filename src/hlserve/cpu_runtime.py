"""Run on a CPU as vLLM's CPU build is run: tcmalloc preloaded, one OpenMP thread per core,
each pinned to its core.

Both must be in place before the process starts (the allocator is chosen by the dynamic
loader, OpenMP reads its affinity once when torch loads it), so :func:`arrange` re-executes
the current command once with the environment set, and says what it did. It changes nothing
the user already set (``LD_PRELOAD``, ``OMP_NUM_THREADS``, ``GOMP_CPU_AFFINITY``,
``KMP_AFFINITY``), nothing on a machine with a GPU, and nothing when ``HLSERVE_CPU_RUNTIME=0``.

Measured (benchmarks/peers, docs/bench.md "Engine speed"): see the table there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DONE = "HLSERVE_CPU_RUNTIME"  # set in the re-executed process (1) or by the user (0: off)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")


def find_tcmalloc() -> str | None:
    """Debian's ``libtcmalloc-minimal4`` (or the full tcmalloc), where the machine has it."""
    for d in LIB_DIRS:
        for name in TCMALLOC_NAMES:
            p = Path(d) / name
            if p.exists():
                return str(p)
    return None


def has_gpu() -> bool:
    """A CUDA or ROCm device node, checked without importing torch (we may re-exec)."""
    return any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd"))


def runtime_env(env: dict[str, str], cores: list[int], tcmalloc: str | None
                ) -> dict[str, str]:
    """What to add to ``env``: only the variables the user has not set themselves."""
    add: dict[str, str] = {}
    if tcmalloc and "tcmalloc" not in env.get("LD_PRELOAD", ""):
        add["LD_PRELOAD"] = ":".join(p for p in (tcmalloc, env.get("LD_PRELOAD")) if p)
    if "OMP_NUM_THREADS" not in env:
        add["OMP_NUM_THREADS"] = str(len(cores))
    if not any(k in env for k in ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES")):
        # libgomp (torch's CPU wheels): thread i on the i-th listed CPU
        add["GOMP_CPU_AFFINITY"] = " ".join(str(c) for c in cores)
        add["OMP_PROC_BIND"] = "true"
    return add


def arrange(device: str = "auto") -> None:
    """Re-execute this command once with the CPU runtime set; return when nothing to do."""
    if os.environ.get(DONE) == "1":
        sys.stderr.write(f"hlserve: CPU runtime: {describe(os.environ)}\n")
        return
    if os.environ.get(DONE) == "0" or device not in ("auto", "cpu") or (
            device == "auto" and has_gpu()):
        return
    cores = sorted(os.sched_getaffinity(0))
    add = runtime_env(dict(os.environ), cores, find_tcmalloc())
    if not add:
        return
    env = {**os.environ, **add, DONE: "1"}
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    sys.stderr.write(f"hlserve: re-executing with the CPU runtime: "
                     f"{' '.join(f'{k}={v}' for k, v in add.items())}\n")
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as e:  # carry on as we are: slower, not wrong
        sys.stderr.write(f"hlserve: CPU runtime not arranged ({e}); running with defaults\n")


def describe(env: os._Environ[str] | dict[str, str]) -> str:
    preload = env.get("LD_PRELOAD", "")
    alloc = "tcmalloc" if "tcmalloc" in preload else "glibc malloc"
    return (f"{alloc}, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'default')}, "
            f"affinity {env.get('GOMP_CPU_AFFINITY', env.get('KMP_AFFINITY', 'unpinned'))}")
