"""Keep freed CPU memory in the process instead of returning it to the kernel.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
unmaps it on free. A forward allocates activations of tens to hundreds of MiB per layer, so
each one page-faults its memory in again: profiles of a 0.5B model's prefill showed a third
of the time in the kernel. vLLM's CPU backend asks for tcmalloc for the same reason; here the
allocator is simply told to keep what it has, which is what a serving process wants.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("hlserve.runner")

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_done = False


def keep_freed_memory() -> bool:
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**30) == 1
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _done = ok
    if ok:
        log.info("glibc malloc: mmap off, trim threshold 1 GiB (freed activations are reused)")
    return ok
