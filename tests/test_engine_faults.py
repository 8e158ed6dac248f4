"""A failing forward fails only its own batch; a runner that keeps failing kills the engine."""

from __future__ import annotations

import pytest

from hlserve.config import EngineConfig
from hlserve.engine.engine import Engine
from hlserve.errors import EngineDeadError
from hlserve.request import SamplingParams
from hlserve.runner.base import Batch, StepResult
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
    engine = Engine(EngineConfig(model="-", max_num_seqs=1, check_invariants=True),
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
    engine = Engine(EngineConfig(model="-", max_num_seqs=1), runner)
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
