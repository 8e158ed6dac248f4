"""A failing forward fails only its own batch; a runner that keeps failing kills the engine."""

from __future__ import annotations

import pytest

from hlserve.config import EngineConfig
from hlserve.engine.batch import Batch, StepResult
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import Engine
from hlserve.errors import EngineDeadError
from hlserve.request import SamplingParams
from support import HistoryRunner

POISON = 7


class FlakyRunner(HistoryRunner):
    """Fails any batch that holds the poison token; ``always`` fails every batch."""

    always = False

    def execute(self, batch: Batch) -> StepResult:
        if self.always or any(POISON in s.request.prompt_token_ids for s in batch.seqs):
            raise RuntimeError("device error")
        return super().execute(batch)


def test_a_failed_forward_fails_its_batch_and_the_rest_is_served() -> None:
    engine = build_engine(EngineConfig(model="-", max_num_seqs=1, check_invariants=True),
                    FlakyRunner(64, 4))
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    good = engine.add_request([1, 2, 3], greedy)
    bad = engine.add_request([1, POISON], greedy)
    after = engine.add_request([4, 5], greedy)
    ended = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = out
    assert ended[bad.request_id].finish_reason == "error"
    assert "device error" in (ended[bad.request_id].error or "")
    assert ended[good.request_id].finish_reason == "length"
    assert ended[after.request_id].finish_reason == "length"
    assert engine.kv.num_used == 0 and engine.stats.failed_steps == 1


def test_a_runner_that_keeps_failing_kills_the_engine() -> None:
    runner = FlakyRunner(64, 4)
    runner.always = True
    engine = build_engine(EngineConfig(model="-", max_num_seqs=1), runner)
    for i in range(5):
        engine.add_request([1, i + 1], SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError, match="3 forwards failed in a row"):
        for _ in range(10):
            engine.step()


def test_cpu_threads_knob(tiny_llama) -> None:
    """``cpu_threads`` sets torch's intra-op threads when the runner starts on a CPU (the
    sweeps' ``--threads 1``, as an engine option); it must be positive."""
    import torch

    from hlserve.llm import LLM

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(str(tiny_llama), dtype="float32", num_pages=64, cpu_threads=1)
        assert torch.get_num_threads() == 1
        out = llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert len(out[0].token_ids) == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(model="-", cpu_threads=0)


class PickyRunner(HistoryRunner):
    """Fails any batch that holds the poison token; the rest of a batch runs when it runs
    without the poisoned sequence."""

    def execute(self, batch: Batch) -> StepResult:
        if any(POISON in s.request.prompt_token_ids for s in batch.seqs):
            raise RuntimeError("device error")
        return super().execute(batch)


def test_a_forward_that_fails_for_one_request_fails_that_request_alone() -> None:
    """Requests batched with the poisoned one carry on: the batch is split until the
    failing sequence is found, and the runner is not counted as broken."""
    engine = build_engine(EngineConfig(model="-", check_invariants=True), PickyRunner(64, 4))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    good = [engine.add_request([1, 2, i], greedy) for i in range(3)]
    bad = [engine.add_request([1, POISON, i], greedy) for i in range(3)]  # 3 in a row: no death
    ended = run_to_end(engine)
    for r in good:
        assert ended[r.request_id].finish_reason == "length"
        assert len(ended[r.request_id].token_ids) == 6
    for r in bad:
        assert ended[r.request_id].finish_reason == "error"
    assert engine.kv.num_used == 0 and engine.stats.failed_steps >= 1


def run_to_end(engine: Engine, limit: int = 1000) -> dict:
    ended: dict = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in ended, "a request ended twice"
                ended[out.request_id] = out
    assert not engine.has_unfinished()
    return ended


@pytest.mark.parametrize("where", ["schedule", "update", "output"])
def test_a_step_that_raises_outside_the_runner_ends_what_it_touched(where, monkeypatch) -> None:
    """schedule / update / output building raise for a step holding the poison: every
    request of that step gets its final output (an error), the others carry on, and the KV
    accounting balances."""
    from hlserve.engine.scheduler import Scheduler
    from hlserve.request import RequestOutput

    def poisoned(reqs) -> bool:
        return any(POISON in r.prompt_token_ids for r in reqs)

    if where == "schedule":
        orig = Scheduler.schedule

        def schedule(self):
            batch = orig(self)  # pages already allocated: a half-done step
            if poisoned(s.request for s in batch.seqs):
                raise RuntimeError("injected fault in schedule")
            return batch

        monkeypatch.setattr(Scheduler, "schedule", schedule)
    elif where == "update":
        orig_update = Scheduler.update

        def update(self, batch):
            if poisoned(s.request for s in batch.seqs):
                raise RuntimeError("injected fault in update")
            return orig_update(self, batch)

        monkeypatch.setattr(Scheduler, "update", update)
    else:
        orig_of = RequestOutput.of.__func__

        def of(cls, req):
            if poisoned([req]) and req.output_token_ids:
                raise RuntimeError("injected fault in output building")
            return orig_of(cls, req)

        monkeypatch.setattr(RequestOutput, "of", classmethod(of))
    engine = build_engine(EngineConfig(model="-", check_invariants=True), HistoryRunner(64, 4))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    early = [engine.add_request([3, 2, i], greedy) for i in range(2)]
    engine.step()
    engine.step()
    bad = engine.add_request([1, POISON], greedy)  # joins the running batch
    later = engine.add_request([4, 5, 6], greedy)
    ended = run_to_end(engine)
    assert set(ended) == {r.request_id for r in [*early, bad, later]}, "a request never ended"
    assert ended[bad.request_id].finish_reason == "error"
    assert where in (ended[bad.request_id].error or "") or "output" in (ended[bad.request_id].error or "")
    assert ended[later.request_id].finish_reason in ("length", "error")
    if where == "output":  # output building fails per request: the others are untouched
        assert all(ended[r.request_id].finish_reason == "length" for r in [*early, later])
    engine.scheduler.check_invariants()
    assert engine.kv.num_used == 0
    # the engine still serves
    ok = engine.add_request([7 % 6, 1], greedy)
    assert run_to_end(engine)[ok.request_id].finish_reason == "length"
