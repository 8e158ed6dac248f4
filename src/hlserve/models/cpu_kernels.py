"""C++ kernels for the CPU, built on first use; the plain-PyTorch path stays the fallback.

Only decode attention is here: over a long context a decode is memory-bound, and PyTorch has
no kernel that reads a sequence's KV pages in place (gathering them first, then SDPA, cost
~3x the pool read itself; docs/bench.md, "Engine speed"). ``decode_attention`` reads the
head-major page pool through each sequence's page table, one task per (sequence, KV head).

The extension is compiled by ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja)
with ``-march=native`` into a cache directory keyed by the source, torch's version and this
machine's CPU flags, so a shared cache never serves a build for another CPU. Where it cannot
be built, or ``HLSERVE_CPU_KERNELS=0``, ``decode_op()`` is None and attention takes the
PyTorch path; the reason is logged once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}

DecodeOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                     torch.Tensor, float], torch.Tensor]


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
    key = hashlib.sha256("\n".join([_SOURCE.read_text(), torch.__version__, _cpu_flags(),
                                    " ".join(_FLAGS)]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("HLSERVE_KERNEL_CACHE")
                or Path.home() / ".cache" / "hlserve" / "kernels")
    return root / f"decode_attention_{key}"


def _build() -> object:
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob("*.so")):
        log.warning("building the CPU decode-attention kernel (once per machine, about a "
                    "minute) into %s", out)
    return cpp_extension.load(name="hlserve_decode_attention", sources=[str(_SOURCE)],
                              extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                              build_directory=str(out), verbose=False)


HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # the head sizes the kernel is instantiated for
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim in HEAD_DIMS and dtype in DTYPES


def decode_op() -> DecodeOp | None:
    """The compiled decode attention, or None where it is off or cannot be built."""
    if "op" in _state:
        return _state["op"]  # type: ignore[return-value]
    with _lock:
        if "op" not in _state:
            _state["op"] = _load()
    return _state["op"]  # type: ignore[return-value]


def _load() -> DecodeOp | None:
    if os.environ.get("HLSERVE_CPU_KERNELS", "1") == "0":
        log.info("CPU kernels off (HLSERVE_CPU_KERNELS=0): decode attention in PyTorch")
        return None
    try:
        module = _build()
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path serves
        log.warning("CPU decode kernel not built (%s: %s); decode attention in PyTorch",
                    type(e).__name__, str(e).strip().splitlines()[-1:] or "")
        return None
    log.info("CPU decode kernel loaded from %s", build_dir())
    return module.decode_attention  # type: ignore[attr-defined,no-any-return]
