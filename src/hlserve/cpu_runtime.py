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
tcmalloc alone (docs/bench_results.md, "Engine speed"). By default the server states the runtime it
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


def loaded_libgomp() -> str | None:
    """The path of the GNU OpenMP runtime this process has loaded (torch's CPU wheels bundle
    one), from ``/proc/self/maps``; None where none is loaded or there is no procfs."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        if len(fields) == 6 and "/libgomp" in fields[5]:
            return fields[5]
    return None


def release_openmp_workers() -> bool:
    """Give back the OpenMP worker threads of the calling thread; True where it did.

    libgomp keeps a pool of workers for every thread that has run a parallel region. Once it
    manages more threads than the process may run on CPUs, it cuts the spin of every idle
    worker from ~300,000 iterations (a few ms) to 100, so workers sleep at once between
    parallel regions and each region starts with a futex wake. A server builds its engine
    (loading and packing the weights: parallel regions) on the main thread and then steps it
    on the engine thread: two pools, three managed threads on two CPUs. Decode steps, a few
    hundred short regions each, then ran 1.15-1.18x slower than on the loading thread (measured
    on this engine, 2 threads, docs/bench_results.md). The thread that built the engine calls this
    once, before the engine thread starts stepping: its pool goes, and only the engine
    thread's remains (``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0; libgomp frees
    the caller's pool). Nothing is done under another OpenMP runtime, where the counts differ
    (Intel's keeps its own block time), or inside a parallel region.
    """
    path = loaded_libgomp()
    if path is None:
        return False
    import ctypes

    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0 (GCC 9)
        return False
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn(1) == 0  # omp_pause_soft; -1 inside a parallel region
