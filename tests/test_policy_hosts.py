"""One policy core, two hosts: the same request stream through hlserve's scheduler and
through the vLLM plugin's decisions, compared step by step.

hlserve's ``Engine`` runs the stream on a virtual clock with the config the plugin builds
for a vLLM deployment (``plugin_config``). Before each step, the plugin's
``PluginPolicy.plan`` is given that step's state as vLLM would show it (requests with vLLM's
field names, free blocks counting the cached ones nobody holds, matched prefixes read like
vLLM's block pool), with its own budget controller, two-stage switch, order and admission
state, fed the same step times. Its plan must be what the engine then did: the same caps,
the same two-stage stage, and the same waiting requests admitted (backfill included).

The stream runs with prefix caching off. With it on, the running requests' pages, taken
before admission in either host's pass, may evict a cached page that a waiting request
matched: hlserve's scheduler decides after that, the plugin plans before vLLM's pass (and
vLLM's own admission then reads the cache afresh), so there the plugin's view can be a
step behind. The prefix-cache reading of the plugin is tested on its own
(tests/test_vllm_plugin_policy.py, and against vLLM in tests/test_vllm_plugin.py).
"""

from __future__ import annotations

import random

from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import VirtualClock
from hlserve.engine.policies.caps import INTERACTIVE_DECODING, INTERACTIVE_WAITING, NO_INTERACTIVE
from hlserve.integrations.plugin_policy import (
    PluginPolicy,
    VLLMCaps,
    parse_options,
    plugin_config,
)
from hlserve.request import SamplingParams
from plugin_views import TreePrefixCache, VReq
from support import HistoryRunner

CAPS = VLLMCaps("0.32.0", "tiny", max_num_batched_tokens=512, max_num_seqs=8,
                max_model_len=512, num_blocks=48, block_size=16,
                long_prefill_token_threshold=0, enable_prefix_caching=False,
                enable_chunked_prefill=True)
OPTIONS = {"budget_min": 64, "budget_warmup": 3, "interactive_chunk_size": 32,
           "interactive_token_budget": 96}


def _stream(seed: int) -> dict[int, list[tuple[int, int, str]]]:
    """Arrivals by step: (prompt length, max_tokens, class). Some outputs are bounded within
    a fair share of the pool, some not (backpressure then reserves only a growth margin);
    a few are interactive."""
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple[int, int, str]]] = {}
    for i in range(28):
        step = rng.randrange(0, 60)
        cls = "interactive" if i % 9 == 4 else "agent"
        max_tokens = rng.choice([8, 24, 60, 120])
        arrivals.setdefault(step, []).append((rng.randrange(40, 260), max_tokens, cls))
    return arrivals


def _run_both(seed: int) -> dict[str, int]:
    policy_opts = parse_options({"hlserve": OPTIONS}, {})
    clock = VirtualClock()
    runner = HistoryRunner(CAPS.num_blocks, CAPS.block_size, overhead=1e-3, per_token=5e-5)
    config = plugin_config(policy_opts, CAPS)
    engine = build_engine(config.replace(check_invariants=True), runner, clock=clock)
    sched, kv = engine.scheduler, engine.kv
    plugin = PluginPolicy(policy_opts, CAPS, TreePrefixCache(kv, config.lpm_aging))
    rng = random.Random(seed + 1)
    arrivals = _stream(seed)
    seen = {"steps": 0, "backfilled": 0, "held": 0, "decode_only": 0, "retracted": 0,
            NO_INTERACTIVE: 0, INTERACTIVE_WAITING: 0, INTERACTIVE_DECODING: 0}
    for step in range(5000):
        for n, (length, max_tokens, cls) in enumerate(arrivals.get(step, [])):
            engine.add_request([rng.randrange(8) for _ in range(length)],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                              ignore_eos=True),
                               request_id=f"r{step}.{n}", request_class=cls)
        if not engine.has_unfinished():
            if step > max(arrivals):
                break
            continue
        # the plugin's view of this step, from the state the engine is about to schedule
        waiting = [VReq.of(r) for r in sched.waiting]
        plugin.prune(waiting, engine.requests)
        plan = plugin.plan(waiting, [VReq.of(r) for r in sched.running], kv.available(),
                           kv.num_evictable, kv.usage)
        before = {r.request_id for r in sched.waiting}
        retractions, t0, ran = sched.num_retractions, clock(), len(runner.batches)
        engine.step()
        admitted = before - {r.request_id for r in sched.waiting}

        where = f"step {sched.step}"
        assert plan.caps == sched.caps, where
        assert plan.decode_only == getattr(sched.mixing, "decode_only", False), where
        assert [r.request_id for r in plan.admitted if r.request_id in admitted] \
            == [r.request_id for r in plan.admitted], f"{where}: the plugin admits more"
        assert {r.request_id for r in plan.admitted} == admitted, where
        if len(runner.batches) > ran:
            batch = runner.batches[-1]
            plugin.observe(clock() - t0, batch.num_tokens, len(batch))
        seen["steps"] += 1
        seen[plan.presence] += 1
        seen["decode_only"] += plan.decode_only
        seen["held"] += bool(plan.held)
        seen["retracted"] += sched.num_retractions > retractions
        order = [r.request_id for r in plan.order]
        seen["backfilled"] += any(order.index(h.request_id) < order.index(a.request_id)
                                  for h in plan.held for a in plan.admitted)
    assert not engine.has_unfinished(), "the stream did not finish"
    return seen


def test_plugin_plans_what_the_engine_does_step_by_step() -> None:
    totals: dict[str, int] = {}
    for seed in range(6):
        for k, v in _run_both(seed).items():
            totals[k] = totals.get(k, 0) + v
    # the stream reached every decision the comparison is about
    assert totals["backfilled"] > 0, totals
    assert totals["decode_only"] > 0, totals
    assert totals[INTERACTIVE_WAITING] > 0 and totals[INTERACTIVE_DECODING] > 0, totals
    assert totals["held"] > 0, totals
