"""C++ kernels for the CPU, built on first use; the plain-PyTorch path stays the fallback.

Two attention kernels, both reading the head-major page pool in place through each
sequence's page table (PyTorch has no kernel that does; gathering first, then SDPA, cost ~3x
the pool read itself; docs/bench_results.md, "Engine speed"):

- ``decode_attention``: every decode of a batch, one task per (sequence, KV head); over a
  long context a decode is memory-bound.
- ``prefill_attention``: every prompt chunk of a batch over its whole context, tiled like a
  GEMM (flash attention's loop order) with bf16 dot-product instructions; compute-bound, and
  PyTorch's CPU flash kernel runs it at fp32 speed. Compiled only where the CPU has
  AVX512_BF16 (``prefill_op()`` is None elsewhere, and prefill stays in PyTorch). The kernel
  it replaced stays callable as ``prefill_op("rowpair")`` (or ``HLSERVE_PREFILL_KERNEL=rowpair``
  for the whole engine) so that ``benchmarks/prefill_attention.py`` measures both on one build.

And the fused elementwise ops of a layer in bf16 (RMSNorm with its residual add, SiLU x up,
RoPE; ``fused_ops()``, used by ``models/fused.py``), also AVX512_BF16 only.

And a bf16 linear over a weight packed for the bf16 dot-product instruction
(``pairs_linear_ops()``, used by ``models/packed_linear.py``'s ``PackedLinear``), AVX512_BF16
only: it streams the weight faster than oneDNN's GEMM at a decode step's few rows and is at
least as fast at a prompt's many; with SiLU x up in its epilogue for an MLP's merged gate/up
projection (``gate_up_silu_op()``).

And, for a CPU with AVX2 but no bf16 GEMM, a bf16 linear over few rows (``linear_op()``,
used by ``models/packed_linear.py``'s ``WideLinear`` at decode sizes): it reads the bf16
weight once and widens it in registers, where an fp32 copy would stream twice the bytes.

The extension is compiled by ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja)
with ``-march=native`` into a cache directory keyed by the source, torch's version, the flags
and this machine's CPU flags, so a shared cache never serves a build for another CPU.
``HLSERVE_CPU_ARCH=x86-64-v3`` builds for AVX2 + FMA without AVX-512 instead (the kernels an
AVX2-only host gets), so those paths can be tested on an AVX-512 machine. Where it cannot
be built, or ``HLSERVE_CPU_KERNELS=0``, ``decode_op()``, ``prefill_op()`` and ``fused_ops()``
are None: attention and the layer ops take the PyTorch path; the reason is logged once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("bindings.cpp", "decode_attention.cpp",
                                       "prefill_attention.cpp", "prefill_attention_rowpair.cpp",
                                       "fused_ops.cpp", "linear_bf16.cpp",
                                       "linear_pairs.cpp")]
# included by the sources: part of the build's key
_HEADERS = [_CSRC / name for name in ("avx512_math.h", "bf16_tile.h")]


def _flags() -> list[str]:
    """The compiler flags. ``HLSERVE_CPU_ARCH`` (default ``native``) is ``-march``'s target:
    ``x86-64-v3`` builds the AVX2 paths on an AVX-512 host, so they can be tested there."""
    return ["-O3", f"-march={os.environ.get('HLSERVE_CPU_ARCH') or 'native'}", "-ffast-math",
            "-fopenmp"]


_lock = threading.Lock()
_state: dict[str, object] = {}

DecodeOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                     torch.Tensor, float], torch.Tensor]
# (out, q, k_cache, v_cache, pages, page_lo, starts, num_new, ctx, scale) -> None
PrefillOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this machine's build lives (``HLSERVE_KERNEL_CACHE`` or ~/.cache/hlserve)."""
    texts = [src.read_text() for src in [*_SOURCES, *_HEADERS]]
    # the sources' directory too: ninja's build file names them by absolute path, so two
    # checkouts of the same sources sharing one directory rebuilt it for each other in turn
    return cache_root() / f"cpu_kernels_{build_key(texts, str(_SOURCES[0].parent.resolve()))}"


def build_key(texts: list[str], *extra: str) -> str:
    """A build's cache key: its sources' texts, then what else makes the binary differ (the
    torch version, this CPU's flags, the compiler flags) and ``extra``."""
    parts = [*texts, torch.__version__, _cpu_flags(), " ".join(_flags()), *extra]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_root() -> Path:
    """The directory kernel builds are kept in: ``HLSERVE_KERNEL_CACHE`` or ~/.cache/hlserve."""
    return Path(os.environ.get("HLSERVE_KERNEL_CACHE")
                or Path.home() / ".cache" / "hlserve" / "kernels")


@contextlib.contextmanager
def build_guard(out: Path) -> Iterator[None]:
    """Holds the build in ``out`` for this process while torch builds or loads it there.

    torch guards a build directory with a file (``lock``) that a build killed midway (a
    timeout, a stopped CI run) leaves behind, and every later load of that directory then
    waits on it forever. An ``flock`` dies with its process: holding one on ``out``, no live
    process of ours is building there, so a ``lock`` file found is a dead build's, removed."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = out / "lock"
            if stale.exists():
                log.warning("removing a kernel build's stale lock in %s", out)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _build() -> object:
    from torch.utils import cpp_extension

    out = build_dir()
    with build_guard(out):
        if not any(out.glob("*.so")):
            log.warning("building the CPU attention kernels (once per machine, about a "
                        "minute) into %s", out)
        return cpp_extension.load(name="hlserve_cpu_kernels",
                                  sources=[str(s) for s in _SOURCES], extra_cflags=_flags(),
                                  extra_ldflags=["-fopenmp"], build_directory=str(out),
                                  verbose=False)


HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # the head sizes the kernel is instantiated for
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim in HEAD_DIMS and dtype in DTYPES


PREFILL_HEAD_DIMS = (32, 64, 128, 256)


def supports_prefill(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim in PREFILL_HEAD_DIMS and dtype == torch.bfloat16


def _module() -> object | None:
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _load()
    return _state["module"]


def decode_op() -> DecodeOp | None:
    """The compiled decode attention, or None where it is off or cannot be built."""
    module = _module()
    return None if module is None else module.decode_attention  # type: ignore[attr-defined]


PREFILL_KERNELS = {"tiled": "prefill_attention", "rowpair": "prefill_attention_rowpair"}


def prefill_op(kernel: str | None = None) -> PrefillOp | None:
    """The compiled prefill attention, or None where it is off, cannot be built, or this
    CPU has no AVX512_BF16. ``kernel``: "tiled" (the default) or "rowpair" (the kernel it
    replaced, for side-by-side measurements); None reads ``HLSERVE_PREFILL_KERNEL``."""
    module = _module()
    if module is None or not module.prefill_attention_built():  # type: ignore[attr-defined]
        return None
    name = kernel or os.environ.get("HLSERVE_PREFILL_KERNEL") or "tiled"
    if name not in PREFILL_KERNELS:
        raise ValueError(f"unknown prefill kernel {name!r}: one of {sorted(PREFILL_KERNELS)}")
    return getattr(module, PREFILL_KERNELS[name])  # type: ignore[no-any-return]


def fused_ops() -> object | None:
    """The module with the fused bf16 layer ops (``rms_norm``, ``add_rms_norm_``,
    ``silu_mul``, ``rope_``), or None where they are off, cannot be built, or this CPU has no
    AVX512_BF16."""
    module = _module()
    if module is None or not module.fused_ops_built():  # type: ignore[attr-defined]
        return None
    return module


LinearOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear_op() -> LinearOp | None:
    """The compiled bf16 linear for few rows on an AVX2 CPU (``linear_bf16.cpp``), or None
    where the kernels are off, cannot be built, or the CPU has no AVX2 and FMA."""
    module = _module()
    if module is None or not module.linear_bf16_built():  # type: ignore[attr-defined]
        return None
    return module.linear_bf16  # type: ignore[attr-defined, no-any-return]


PairsLinear = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


def pairs_linear_ops() -> tuple[Callable[[torch.Tensor], torch.Tensor], PairsLinear] | None:
    """``(pack, linear)`` of ``linear_pairs.cpp``: ``pack(w)`` copies a bf16 weight [N, K]
    (K even) into the kernel's layout, ``linear(x, packed, N, bias)`` is ``x W^T + b`` for
    bf16 rows; None where the kernels are off, cannot be built, or the CPU has no
    AVX512_BF16."""
    module = _module()
    if module is None or not module.linear_pairs_built():  # type: ignore[attr-defined]
        return None
    return module.pack_bf16_pairs, module.linear_bf16_pairs  # type: ignore[attr-defined]


# (x, packed, inter, bias) -> bf16(bf16(silu(gate)) * up) [M, inter]
GateUpSilu = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


def gate_up_silu_op() -> GateUpSilu | None:
    """``linear_pairs.cpp``'s gate/up GEMM with SiLU x up in its epilogue, over a merged gate/up
    weight whose 16-row blocks of gate and up alternate, packed by ``pairs_linear_ops()``'s
    ``pack``; None where that kernel is not available."""
    module = _module()
    if module is None or not module.linear_pairs_built():  # type: ignore[attr-defined]
        return None
    return module.gate_up_silu  # type: ignore[attr-defined, no-any-return]


def _load() -> object | None:
    if os.environ.get("HLSERVE_CPU_KERNELS", "1") == "0":
        log.info("CPU kernels off (HLSERVE_CPU_KERNELS=0): attention and the fused layer ops "
                 "in PyTorch")
        return None
    try:
        module = _build()
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path serves
        log.warning("CPU kernels not built (%s: %s); attention and the fused layer ops in "
                    "PyTorch", type(e).__name__, str(e).strip().splitlines()[-1:] or "")
        return None
    built = module.prefill_attention_built()  # type: ignore[attr-defined]
    log.info("CPU attention kernels loaded from %s (prefill kernel: %s)", build_dir(),
             (os.environ.get("HLSERVE_PREFILL_KERNEL") or "tiled") if built else "no AVX512_BF16")
    return module
