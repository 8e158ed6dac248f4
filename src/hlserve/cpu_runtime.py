"""The CPU runtime a server runs under: allocator and OpenMP threads, stated at start-up.

vLLM's CPU build is run with tcmalloc preloaded and one OpenMP thread pinned per core.
hlserve can run the same way (``HLSERVE_CPU_RUNTIME=vllm``): :func:`arrange` then re-executes
the command once with ``LD_PRELOAD`` (Debian's ``libtcmalloc-minimal4``), ``OMP_NUM_THREADS``
and ``GOMP_CPU_AFFINITY`` set, since both must be in place before the process starts (the
dynamic loader picks the allocator; OpenMP reads its affinity once, when torch loads it).

It is not the default because on this engine it measured slower: the agent workload of
benchmarks/peers (16 sessions x 3 rounds, 0.5B shape, 2 cores), interleaved, two repeats each:
912-922 total tok/s with glibc malloc (told to keep freed memory, runner/cpu_alloc.py) and
torch's own threads, against 860-867 with tcmalloc and pinned threads and 878-879 with
tcmalloc alone (docs/bench.md, "Engine speed"). By default the server states the runtime it
has and changes nothing. Nothing is changed either on a machine with a GPU, or for a variable
the user set (``LD_PRELOAD``, ``OMP_NUM_THREADS``, ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``,
``OMP_PLACES``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHOICE = "HLSERVE_CPU_RUNTIME"  # "default" (as it is) or "vllm" (tcmalloc, pinned threads)
APPLIED = "HLSERVE_CPU_RUNTIME_APPLIED"  # set in the re-executed process
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


def vllm_like_env(env: dict[str, str], cores: list[int], tcmalloc: str | None
                  ) -> dict[str, str]:
    """What vLLM's CPU runtime adds to ``env``: only the variables the user has not set."""
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
    """State the CPU runtime; with ``HLSERVE_CPU_RUNTIME=vllm``, first re-execute this command
    once under vLLM's. Returns when there is nothing (more) to do."""
    on_cpu = device == "cpu" or (device == "auto" and not has_gpu())
    choice = os.environ.get(CHOICE, "default")
    if choice not in ("default", "vllm"):
        raise ValueError(f"{CHOICE}={choice!r}: choose default or vllm")
    if on_cpu and choice == "vllm" and os.environ.get(APPLIED) != "1":
        add = vllm_like_env(dict(os.environ), sorted(os.sched_getaffinity(0)), find_tcmalloc())
        if add:
            argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
            sys.stderr.write("hlserve: re-executing with vLLM's CPU runtime: "
                             f"{' '.join(f'{k}={v}' for k, v in add.items())}\n")
            sys.stderr.flush()
            try:
                os.execve(sys.executable, argv, {**os.environ, **add, APPLIED: "1"})
            except OSError as e:  # carry on as we are: slower or faster, never wrong
                sys.stderr.write(f"hlserve: could not re-execute ({e}); runtime unchanged\n")
    if on_cpu:
        sys.stderr.write(f"hlserve: CPU runtime: {describe(os.environ)}\n")


def describe(env: os._Environ[str] | dict[str, str]) -> str:
    preload = env.get("LD_PRELOAD", "")
    alloc = "tcmalloc" if "tcmalloc" in preload else "glibc malloc (freed memory kept)"
    pinned = env.get("GOMP_CPU_AFFINITY")
    threads = f"pinned to {pinned}" if pinned else "unpinned"
    return (f"{alloc}, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'torch default')}, "
            f"threads {threads} ({CHOICE}={env.get(CHOICE, 'default')})")
