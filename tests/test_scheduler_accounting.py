"""Scheduler + KV accounting under random workloads (hypothesis).

The model is not under test here, so a stand-in runner produces tokens as a pure function
of each request's token history: a retracted and recomputed request must then produce the
very same tokens, which checks that retraction loses nothing.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hlserve.config import EngineConfig
from hlserve.engine.factory import build_engine
from hlserve.errors import InvalidRequestError
from hlserve.request import FinishReason, SamplingParams
from support import VOCAB, HistoryRunner


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(hash(tuple(seq)) % VOCAB)
    return seq[len(prompt) :]


workload = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2), min_size=1, max_size=60),  # small alphabet: shared prefixes
        st.integers(1, 24),  # max_tokens
        st.integers(0, 3),  # arrival step
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=120, deadline=None)
@given(
    work=workload,
    num_pages=st.integers(6, 40),
    page_size=st.sampled_from([1, 4, 16]),
    chunk=st.sampled_from([None, 1, 3, 16]),
    budget=st.sampled_from([None, 8, 64]),
    mixing=st.sampled_from(["always", "prefill_first"]),
    retraction=st.sampled_from(["fewest_generated", "lifo"]),
    caching=st.booleans(),
    max_num_seqs=st.integers(1, 8),
    aborts=st.lists(st.integers(0, 13), max_size=3),
)
def test_random_workloads_balance_and_end_once(
    work, num_pages, page_size, chunk, budget, mixing, retraction, caching, max_num_seqs, aborts
) -> None:
    cfg = EngineConfig(
        model="-", chunk_size=chunk, token_budget=budget, mixing=mixing, retraction=retraction,
        enable_prefix_caching=caching, max_num_seqs=max_num_seqs, check_invariants=True,
    )
    runner = HistoryRunner(num_pages, page_size)
    engine = build_engine(cfg, runner)
    ended: dict[str, int] = {}
    finals = {}
    expected = {}
    accepted: list[str] = []
    for step in range(5000):  # thrashing configs (chunk 1, no cache) are slow, not stuck
        for i, (prompt, max_tokens, at) in enumerate(work):
            if at == step:
                try:
                    req = engine.add_request(
                        prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                    )
                except InvalidRequestError:
                    # only a request that the whole pool could never hold is refused
                    assert -(-(len(prompt) + max_tokens) // page_size) > num_pages
                    continue
                expected[req.request_id] = reference_tokens(prompt, max_tokens)
                accepted.append(req.request_id)
                for a in aborts:
                    if a == i and step == 1:
                        engine.abort(req.request_id)
        if step == 2:
            for a in aborts:
                if a < len(accepted):
                    engine.abort(accepted[a])
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = ended.get(out.request_id, 0) + 1
                finals[out.request_id] = out
        if step > 4 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the engine stalled with work left"
    assert sorted(ended) == sorted(accepted), "a request never ended"
    assert all(c == 1 for c in ended.values()), "a request ended twice"
    for rid, out in finals.items():
        if out.finish_reason == FinishReason.ABORT.value:
            assert out.token_ids == expected[rid][: len(out.token_ids)]
        else:
            assert out.token_ids == expected[rid], "retraction or chunking changed the tokens"
    kv = engine.kv
    kv.check_invariants()
    assert kv.num_used == 0, "pages still referenced after every request ended"
    assert kv.num_free + kv.num_evictable == kv.num_pages


class FaultyRunner(HistoryRunner):
    """Raises for any batch that holds a poisoned request: the engine must find and fail
    those alone (their batch-mates carry on)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poisoned: set[str] = set()

    def execute(self, batch):
        if any(s.request.request_id in self.poisoned for s in batch.seqs):
            raise RuntimeError("injected device fault")
        return super().execute(batch)


rich_workload = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2), min_size=1, max_size=60),
        st.integers(1, 24),  # max_tokens
        st.integers(0, 4),  # arrival step
        st.booleans(),  # interactive
        st.integers(0, 3),  # priority
        st.booleans(),  # poisoned: the runner fails every batch that holds it
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=150, deadline=None)
@given(
    work=rich_workload,
    num_pages=st.integers(6, 40),
    page_size=st.sampled_from([1, 4, 16]),
    chunk=st.sampled_from([None, 1, 3, 16]),
    budget=st.sampled_from([None, 8, 64]),
    mixing=st.sampled_from(["always", "prefill_first", "two_stage"]),
    order=st.sampled_from(["fcfs", "lpm", "priority"]),
    admission=st.sampled_from(["chunk", "reserve", "abort_guard", "backpressure"]),
    retraction=st.sampled_from(["fewest_generated", "lifo", "priority"]),
    defer_shared_prefill=st.booleans(),
    lpm_aging=st.sampled_from([0.0, 4.0]),
    caching=st.booleans(),
    max_num_seqs=st.integers(1, 8),
    aborts=st.lists(st.integers(0, 13), max_size=3),
)
def test_every_knob_with_faults_balances_and_ends_once(
    work, num_pages, page_size, chunk, budget, mixing, order, admission, retraction,
    defer_shared_prefill, lpm_aging, caching, max_num_seqs, aborts,
) -> None:
    """Throughput mode's knobs (LPM, two-stage, backpressure, reserve, deferred shared
    prefill) and the presets' others, interactive requests, priority retraction and runner
    faults: the KV accounting balances after every step (check_invariants), every request
    ends exactly once, and every request the faults did not touch gets its exact tokens."""
    cfg = EngineConfig(
        model="-", chunk_size=chunk, token_budget=budget, mixing=mixing, order=order,
        admission=admission, retraction=retraction, defer_shared_prefill=defer_shared_prefill,
        lpm_aging=lpm_aging, enable_prefix_caching=caching, max_num_seqs=max_num_seqs,
        two_stage_high=0.6, two_stage_low=0.3, check_invariants=True,
    )
    runner = FaultyRunner(num_pages, page_size)
    engine = build_engine(cfg, runner)
    ended: dict[str, int] = {}
    finals = {}
    expected = {}
    accepted: list[str] = []
    for step in range(5000):
        for prompt, max_tokens, at, interactive, priority, poisoned in work:
            if at != step:
                continue
            try:
                req = engine.add_request(
                    prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                    request_class="interactive" if interactive else "agent", priority=priority)
            except InvalidRequestError:
                assert -(-(len(prompt) + max_tokens) // page_size) > num_pages
                continue
            expected[req.request_id] = reference_tokens(prompt, max_tokens)
            accepted.append(req.request_id)
            if poisoned and len(runner.poisoned) < 2:  # three failing alone in a row would
                runner.poisoned.add(req.request_id)  # rightly kill the engine
        if step == 2:
            for a in aborts:
                if a < len(accepted):
                    engine.abort(accepted[a])
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = ended.get(out.request_id, 0) + 1
                finals[out.request_id] = out
        kv = engine.kv
        assert kv.num_used + kv.num_free + kv.num_evictable == kv.num_pages
        if step > 5 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the engine stalled with work left"
    assert sorted(ended) == sorted(accepted), "a request never ended"
    assert all(c == 1 for c in ended.values()), "a request ended twice"
    for rid, out in finals.items():
        if rid in runner.poisoned:
            assert out.finish_reason in ("error", "abort")
        elif out.finish_reason in ("abort", "error"):
            assert out.finish_reason == "abort", f"a fault reached a clean request: {out.error}"
            assert out.token_ids == expected[rid][: len(out.token_ids)]
        else:
            assert out.token_ids == expected[rid], "retraction or chunking changed the tokens"
    kv = engine.kv
    kv.check_invariants()
    assert kv.num_used == 0, "pages still referenced after every request ended"
