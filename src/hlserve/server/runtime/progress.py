"""Whether the engine thread is computing: the wedge check's second witness.

The forward's heartbeat (``Runner.last_progress``) beats between layers, sublayers and
attention segments; one operation inside them (a Linear over 86K tokens on a loaded 2-core
machine) can still run longer than the iteration timeout. A thread that computes uses CPU
time; a stuck one (waiting on a lock, an event, a dead peer) does not. So the thread's own
CPU clock moving since the last look counts as progress too. What it cannot see: a kernel
spinning forever on the CPU, or a CUDA sync that spins, looks alive.
"""

from __future__ import annotations

import threading
import time

# CPU seconds the thread must have used since the last look to count as progressing: well
# above what a thread blocked on a condition uses, far below any real forward's share
MIN_CPU_S = 0.01


class CpuProgress:
    """The last monotonic time a watched thread's CPU clock was seen to advance."""

    def __init__(self) -> None:
        self._clock: int | None = None
        self._cpu = 0.0
        self._seen = 0.0
        self._lock = threading.Lock()

    def watch(self, thread: threading.Thread) -> None:
        """Follow ``thread``'s CPU clock (a no-op where the platform has no per-thread clock)."""
        get_clock = getattr(time, "pthread_getcpuclockid", None)
        if get_clock is None or thread.ident is None:
            return
        try:
            self._clock = get_clock(thread.ident)
            self._cpu = time.clock_gettime(self._clock)
        except OSError:  # the thread is gone, or the platform refuses
            self._clock = None

    def last_advance(self) -> float:
        """When the thread's CPU clock last moved by :data:`MIN_CPU_S`, as far as looks
        (this call) have seen; 0.0 when it is not watched."""
        if self._clock is None:
            return 0.0
        with self._lock:
            try:
                cpu = time.clock_gettime(self._clock)
            except OSError:  # the thread has exited: no progress from here on
                self._clock = None
                return self._seen
            if cpu - self._cpu >= MIN_CPU_S:
                self._cpu, self._seen = cpu, time.monotonic()
            return self._seen
