"""``hlserve serve`` with a fault injected, for tests on a real server process.

``python tests/faulty_server.py FAULT serve MODEL ...``: FAULT is where a step breaks when its
batch holds a request whose ``max_tokens`` is ``POISON`` (13):

- ``update``: ``Scheduler.update`` raises (outside the runner, after the forward);
- ``schedule``: ``Scheduler.schedule`` raises after building the batch (pages allocated);
- ``hang``: the forward sleeps ``HANG_S`` seconds, once (a wedged engine that recovers);
- ``dead``: every forward raises (the engine dies after three).
"""

from __future__ import annotations

import sys
import time

from hlserve.cli import main
from hlserve.engine.scheduler import Scheduler
from hlserve.runner.torch_runner import TorchRunner

POISON = 13
HANG_S = 6.0


def poisoned(batch) -> bool:
    return any(s.request.params.max_tokens == POISON for s in batch.seqs)


def install(fault: str) -> None:
    if fault == "update":
        update = Scheduler.update

        def broken_update(self, batch):
            if poisoned(batch):
                raise RuntimeError("injected fault in update")
            return update(self, batch)

        Scheduler.update = broken_update
    elif fault == "schedule":
        schedule = Scheduler.schedule

        def broken_schedule(self):
            batch = schedule(self)
            if poisoned(batch):
                raise RuntimeError("injected fault in schedule")
            return batch

        Scheduler.schedule = broken_schedule
    elif fault in ("hang", "dead"):
        execute = TorchRunner.execute

        hung = []

        def broken_execute(self, batch):
            if fault == "dead":
                raise RuntimeError("injected device failure")
            if poisoned(batch) and not hung:  # once: then the request finishes, the test ends
                hung.append(True)
                time.sleep(HANG_S)
            return execute(self, batch)

        TorchRunner.execute = broken_execute
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
