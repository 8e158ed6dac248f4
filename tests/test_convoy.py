"""Throughput-mode admission never convoys.

A chat request without ``max_tokens`` gets the rest of the context as its limit; projected
in full, it would wait for an empty pool and hold every request behind it. It must be
admitted as soon as its prompt (and a fair share of the pool) fits, and a request that
waits must not stop those behind it that fit.
"""

from __future__ import annotations

import itertools
import random
import threading

from hlserve.config import EngineConfig
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import Engine
from hlserve.engine.policies.admission import Admit
from hlserve.engine.presets import DeviceInfo, resolve_options
from hlserve.request import SamplingParams
from support import HistoryRunner

PAGES, PAGE = 256, 16
CONTEXT = PAGES * PAGE  # the context window is the whole pool, as on a small machine


def throughput_engine(**knobs) -> Engine:
    opts = resolve_options({"mode": "throughput", **knobs}, DeviceInfo("cpu"))
    cfg = EngineConfig(model="-", max_model_len=CONTEXT, check_invariants=True, **opts)
    return build_engine(cfg, HistoryRunner(PAGES, PAGE, check=False))


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_a_request_without_max_tokens_is_admitted_while_long_streams_run() -> None:
    e = throughput_engine()
    streams = [e.add_request([1, 2, 3, i % 8] * 5, params(300)) for i in range(8)]
    for _ in range(5):
        e.step()
    assert all(r in e.scheduler.running for r in streams)
    prompt = [4, 5, 6] * 10
    chat = e.add_request(prompt, params(CONTEXT - len(prompt)))  # the chat default
    e.step()
    assert chat in e.scheduler.running, "the chat request waits for the 8 streams: a convoy"
    assert all(not r.finished for r in streams)


def test_a_chat_request_is_admitted_when_its_prompt_fits_a_nearly_full_pool() -> None:
    """The issue's convoy: 8 long streams hold more than 90% of the pool, less than a fair
    share (pool / 9) is free, and a chat request without max_tokens arrives. Its prompt and
    a page of growth per running request fit what is free, so it is admitted at once, not
    after the streams finish; retraction is the safety valve should the pool run out (here
    it does not: the streams end before the chat needs their pages).

    Mixing is ``always`` here, to test admission alone: throughput mode's two-stage mixing
    runs decode-only while KV use is over 90% and the pending prefill exceeds the evictable
    pages, whatever is free, so with it the chat would still wait for the streams."""
    e = throughput_engine(mixing="always")
    rngs = [random.Random(i) for i in range(8)]  # distinct prompts: no page shared
    streams = [e.add_request([rng.randrange(8) for _ in range(440)], params(40))
               for rng in rngs]  # 28 pages of prompt each, 30 at the end
    while e.scheduler.kv.num_used <= 0.9 * PAGES:
        e.step()
    assert all(r in e.scheduler.running and not r.finished for r in streams)
    free = PAGES - e.scheduler.kv.num_used
    assert free < PAGES // 9, "a fair share is free: not the convoy case"
    prompt = [4, 5, 6] * 10
    chat = e.add_request(prompt, params(CONTEXT - len(prompt)))  # the chat default
    e.step()
    assert chat in e.scheduler.running, "the chat request waits for the 8 streams: a convoy"
    assert all(not r.finished for r in streams)
    done = {}
    for _ in range(2 * CONTEXT):
        if not e.has_unfinished():
            break
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
    assert {r.request_id for r in (*streams, chat)} == set(done)
    assert all(o.finish_reason == "length" for o in done.values())
    assert len(done[chat.request_id].token_ids) == CONTEXT - len(prompt)
    assert e.scheduler.num_retractions == 0


def test_a_waiting_request_does_not_block_those_behind_it() -> None:
    """Backfill: one request too big for the headroom now waits; a small one behind it is
    admitted at once; the big one is admitted later and everything ends."""
    e = throughput_engine()
    hog = e.add_request([1] * 40, params(CONTEXT // 2 + 100))  # grows past half the pool
    for _ in range(CONTEXT // 2):
        e.step()
    big = e.add_request([2] * (CONTEXT // 2), params(32))  # more than the headroom now
    small = e.add_request([3] * 20, params(8))
    e.step()
    assert big in e.scheduler.waiting
    assert small in e.scheduler.running, "a waiting request stopped admission of one that fits"
    done = {}
    for _ in range(20000):
        if not e.has_unfinished():
            break
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
    assert {r.request_id for r in (hog, big, small)} <= set(done)
    assert all(o.finish_reason == "length" for o in done.values())


def test_offline_max_tokens_beyond_the_context_does_not_hang(tiny_llama) -> None:
    """LLM.generate in throughput mode with max_tokens > max_model_len ends each prompt at the
    model's length instead of waiting forever for a pool that could hold prompt +
    max_tokens. Several prompts and a pool of 2.5 contexts: admission projects each to the
    model's length (not to max_tokens), so several run at once; a prompt that does not fit
    now waits while short requests behind it that fit go ahead (backfill); and retraction
    makes room when the running ones outgrow the pool."""
    from hlserve.llm import LLM

    max_len = 64
    llm = LLM(str(tiny_llama), dtype="float32", mode="throughput", max_model_len=max_len,
              num_pages=10, page_size=16)
    eng = llm.engine
    sched = eng.scheduler
    verdicts: list[tuple[int, str]] = []  # (pass, verdict) of every admission decision
    busiest = 0
    decide = sched.admission.policy.decide

    def traced_decide(q, kv):
        nonlocal busiest
        verdict = decide(q, kv)
        idle = not sched.running and kv.num_used == 0  # then a wait is admitted anyway
        verdicts.append((sched.step, "idle" if idle else verdict))
        busiest = max(busiest, len(sched.running) + (verdict == Admit.YES))
        return verdict

    sched.admission.policy.decide = traced_decide
    lengths = [40, 44, 20, 44, 8, 30, 4, 6]
    max_tokens = [1000] * 6 + [8, 8]  # six past the context, then two short ones
    prompts = [[(7 * i + j) % 50 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    result: list = []
    t = threading.Thread(target=lambda: result.extend(llm.generate(
        prompts, [params(m) for m in max_tokens], use_tqdm=False)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "generate hung"
    assert [o.finish_reason for o in result] == ["length"] * len(prompts)
    assert [len(o.token_ids) for o in result] == [
        min(m, max_len - n) for n, m in zip(lengths, max_tokens, strict=True)]
    assert busiest >= 2, "one prompt at a time: each was projected to max_tokens"
    backfilled = [step for (step, v), (step2, v2) in itertools.pairwise(verdicts)
                  if step == step2 and v == Admit.WAIT and v2 == Admit.YES]
    assert backfilled, "no request was admitted behind one told to wait"
    assert sched.num_retractions > 0  # the pool was outgrown: retraction made room
    assert not eng.has_unfinished() and sched.kv.num_used == 0
    sched.check_invariants()
