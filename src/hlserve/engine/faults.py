"""How the engine survives failures: :class:`FailureStreak`, the one rule for when failures
mean the runner is broken rather than one batch; :func:`bisect_forward`, which finds the
sequences a failed forward fails for; and :func:`stranded_requests`, the requests a step that
raised outside the forward left scheduled or inconsistent. ``engine/llm_engine.py`` ends those
requests with an error and keeps the rest."""

from __future__ import annotations

from collections.abc import Mapping

from hlserve.engine.batch import Batch, Runner, ScheduledSeq, StepResult
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.scheduler import Scheduler
from hlserve.errors import EngineDeadError
from hlserve.request import Request, RequestStatus

MAX_CONSECUTIVE_FAILURES = 3  # then the runner is broken, not one batch: the engine is dead


class FailureStreak:
    """The one rule for when failures mean the engine is broken rather than one batch:
    ``MAX_CONSECUTIVE_FAILURES`` failures in a row with no batch run in between. A failure is
    a forward that fails for every sequence, or a step that raises (inside the engine or in
    the loop that drives it); a batch that runs ends the streak."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_FAILURES) -> None:
        self.limit = limit
        self.count = 0

    def reset(self) -> None:
        self.count = 0

    def record(self, what: str, exc: BaseException) -> None:
        """Count one failure; raises :class:`EngineDeadError` once the streak is long enough."""
        self.count += 1
        if self.count >= self.limit:
            raise EngineDeadError(f"{self.count} {what} failed in a row; last: {exc}") from exc


def bisect_forward(runner: Runner, seqs: list[ScheduledSeq], exc: Exception
                   ) -> tuple[list[tuple[Batch, StepResult]], list[tuple[ScheduledSeq, Exception]]]:
    """A forward of ``seqs`` raised ``exc``: run its halves again, and theirs, down to single
    sequences. Returns (sub-batches that ran with their results, sequences that fail alone
    with their error). Re-running a sequence rewrites the same KV slots with the same
    values, so a retry loses nothing."""
    if len(seqs) == 1:
        return [], [(seqs[0], exc)]
    ok: list[tuple[Batch, StepResult]] = []
    failed: list[tuple[ScheduledSeq, Exception]] = []
    half = len(seqs) // 2
    for part in (seqs[:half], seqs[half:]):
        sub = Batch(seqs=part)
        try:
            ok.append((sub, runner.execute(sub)))
        except Exception as e:
            more_ok, more_failed = bisect_forward(runner, part, e)
            ok += more_ok
            failed += more_failed
    return ok, failed


def merge_runs(ok: list[tuple[Batch, StepResult]]) -> tuple[Batch, StepResult]:
    """The sub-batches that ran as one batch and one result (their times added)."""
    seqs = [seq for sub, _ in ok for seq in sub.seqs]
    merged = StepResult(tokens={}, elapsed=0.0)
    for _, res in ok:
        merged.tokens.update(res.tokens)
        merged.accepted.update(res.accepted)
        merged.logprobs.update(res.logprobs)
        merged.elapsed += res.elapsed
    return Batch(seqs=seqs), merged


def stranded_requests(sched: Scheduler, kv: KVCacheManager,
                      requests: Mapping[str, Request]) -> dict[str, Request]:
    """After a step raised outside the forward: every request the step was scheduling or
    running, every one it left inconsistent (pages held while waiting, running without pages,
    in neither queue) and every one admission rejected, by id."""
    victims = {s.request.request_id: s.request for s in sched.last_scheduled()}
    queued = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
    for r in sched.running:
        if r.status is not RequestStatus.RUNNING or not kv.holds(r.request_id):
            victims[r.request_id] = r
    for r in sched.waiting:
        if r.status is not RequestStatus.WAITING or kv.holds(r.request_id):
            victims[r.request_id] = r
    for rid, r in requests.items():
        if rid not in queued:
            victims[rid] = r
    for r in sched.rejected:
        victims[r.request_id] = r
    return victims
