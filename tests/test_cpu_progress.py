"""The wedge check's CPU witness (server/runtime/progress.py): a thread that computes is seen to
progress, one that waits is not."""

from __future__ import annotations

import threading
import time

from hlserve.server.runtime.progress import CpuProgress


def _watched(target) -> tuple[CpuProgress, threading.Thread]:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    p = CpuProgress()
    p.watch(t)
    return p, t


def test_a_computing_thread_progresses() -> None:
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    p, t = _watched(spin)
    time.sleep(0.3)
    t0 = time.monotonic()
    assert p.last_advance() >= t0
    time.sleep(0.3)
    assert p.last_advance() > t0 + 0.2
    stop.set()
    t.join()


def test_a_waiting_thread_does_not() -> None:
    release = threading.Event()
    p, t = _watched(lambda: release.wait(10))
    first = p.last_advance()
    time.sleep(0.5)
    assert p.last_advance() == first  # no CPU used while it waits: no progress
    release.set()
    t.join()
    assert p.last_advance() == first  # and an exited thread is never progressing again
