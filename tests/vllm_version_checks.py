"""Checks run inside one vLLM environment (tests/test_vllm_versions.py starts this script
with that environment's python and reads the JSON it prints on its last line).

``complete``: stock vLLM and the plugin, synchronous and asynchronous, on one request stream
through vLLM's own scheduler (``step_harness``): every request gets its ``max_tokens``, the
pool balances at the end, and the plugin's step trace is the plan it wrote.

``decisions``: hlserve's engine and vLLM with the plugin, on the same stream with prefix
caching on, in lock step on one virtual clock: each step's per-request scheduled tokens
(which carry the caps, the stage, the order and the admissions) compared; the first step
where they differ is reported with both sides.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import vllm

from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import VirtualClock
from hlserve.integrations.plugin_policy import VLLMCaps, parse_options, plugin_config
from hlserve.integrations.vllm.step_harness import (
    HarnessConfig,
    SchedulerHarness,
    StreamRequest,
)
from hlserve.request import SamplingParams
from support import HistoryRunner

OPTIONS = {"budget_min": 64, "budget_warmup": 3, "interactive_chunk_size": 32,
           "interactive_token_budget": 96}
OVERHEAD, PER_TOKEN = 1e-3, 5e-5
# Lock step needs the two hosts' mechanics to agree, and under pool pressure they do not
# (docs/vllm.md, "What differs"): vLLM preempts another victim than hlserve's retraction,
# and counts the blocks a prefix hit takes apart; so the pool here holds the stream.
DECISION_BLOCKS = 400
DECISION_SEEDS = (0, 1)


def step_time(num_tokens: int, num_requests: int) -> float:
    return OVERHEAD + PER_TOKEN * num_tokens  # HistoryRunner's cost, for the lock step


def stream(seed: int, n: int = 28, shared: bool = True) -> dict[int, list[StreamRequest]]:
    """Arrivals by iteration: agents whose prompts share a few long prefixes (so the prefix
    cache and the LPM order matter), some interactive, outputs short and long."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(8) for _ in range(rng.choice([64, 96, 128]))]
                for _ in range(3)]
    arrivals: dict[int, list[StreamRequest]] = {}
    for i in range(n):
        step = rng.randrange(0, 60)
        cls = "interactive" if i % 9 == 4 else "agent"
        head = rng.choice(prefixes) if shared and rng.random() < 0.7 else []
        prompt = head + [rng.randrange(8) for _ in range(rng.randrange(20, 200))]
        arrivals.setdefault(step, []).append(StreamRequest(
            f"r{i}", prompt, rng.choice([8, 24, 60, 120]), xargs={"request_class": cls}))
    return arrivals


def harness_config(**kw: Any) -> HarnessConfig:
    base = dict(num_blocks=49, block_size=16, max_num_batched_tokens=512, max_num_seqs=8,
                max_model_len=512, options=OPTIONS)
    return HarnessConfig(**{**base, **kw})


def complete() -> dict[str, Any]:
    arrivals = stream(0)
    wanted = {r.request_id: r.max_tokens for rs in arrivals.values() for r in rs}
    out: dict[str, Any] = {}
    for plugin in (False, True):
        for asynchronous in (False, True):
            h = SchedulerHarness(harness_config(plugin=plugin, async_scheduling=asynchronous),
                                 step_time)
            steps = h.run(arrivals)
            s = h.scheduler
            out[f"{'plugin' if plugin else 'stock'}-{'async' if asynchronous else 'sync'}"] = {
                "class": type(s).__name__,
                "steps": len(steps), "finished": len(h.finished),
                "tokens_ok": all(len(h.outputs[r]) == n for r, n in wanted.items()),
                "free": h.free_blocks(), "usable": h.usable_blocks(),
                "requests_left": len(s.requests),
                "preempted": sum(len(x.preempted) for x in steps),
                "max_step_tokens": max(x.num_tokens for x in steps),
                "budgets": sorted({x.budget for x in steps})[:3],
                "plugin_steps": getattr(getattr(s, "hl", None), "step", None),
            }
    return out


def _engine(caps: VLLMCaps):
    opts = parse_options({"hlserve": OPTIONS}, {})
    clock = VirtualClock()
    runner = HistoryRunner(caps.num_blocks, caps.block_size, overhead=OVERHEAD,
                           per_token=PER_TOKEN)
    config = plugin_config(opts, caps).replace(check_invariants=True)
    return build_engine(config, runner, clock=clock), runner


def decisions(seed: int, num_blocks: int = DECISION_BLOCKS,
              vllm_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Lock step: hlserve's engine and vLLM with the plugin, one stream. ``vllm_options``
    changes the plugin's options only (the check that the comparison can fail)."""
    trace = tempfile.mktemp(suffix=".jsonl")
    cfg = harness_config(plugin=True, num_blocks=num_blocks,
                         options={**OPTIONS, **(vllm_options or {}), "trace": trace})
    h = SchedulerHarness(cfg, step_time)
    caps = h.scheduler.hl.vllm
    engine, runner = _engine(caps)
    arrivals = stream(seed)
    seen = {"steps": 0, "decode_only": 0, "held": 0, "cached_hits": 0}
    for it in range(5000):
        for r in arrivals.get(it, ()):
            h.add(r)
            engine.add_request(list(r.prompt_token_ids),
                               SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                              ignore_eos=True),
                               request_id=r.request_id, request_class=r.xargs["request_class"])
        if not engine.has_unfinished() and not h.has_unfinished():
            if it > max(arrivals):
                break
            continue
        ran = len(runner.batches)
        engine.step()
        rec = h.step()
        mine = ({s.request.request_id: s.end - s.start for s in runner.batches[-1].seqs}
                if len(runner.batches) > ran else {})
        theirs = rec.scheduled if rec is not None else {}
        if mine != theirs:
            h.scheduler.hl_trace.close()
            last = Path(trace).read_text().splitlines()[-2:]
            return {"trace": [json.loads(x) for x in last],
                    "engine_waiting": [r.request_id for r in engine.scheduler.waiting],
                    "engine_running": [r.request_id for r in engine.scheduler.running],
                    "engine_free": engine.kv.available(),
                    "vllm_free": h.free_blocks(),"seed": seed, "agree": False, "step": it, "engine": mine, "vllm": theirs,
                    "engine_caps": str(engine.scheduler.caps), "vllm_budget":
                    rec.budget if rec else None, "seen": seen}
        seen["steps"] += 1
        seen["cached_hits"] += sum(rec.cached.values()) if rec is not None else 0
        seen["interactive"] = seen.get("interactive", 0) + (h.scheduler.hl.step > 0 and any(
            h.scheduler.hl.class_of(r) == "interactive" for r in h.scheduler.running))
        seen["budgets"] = seen.get("budgets", 0) + (rec is not None and rec.budget < 512)
        seen["decode_only"] += bool(getattr(engine.scheduler.mixing, "decode_only", False))
    return {"seed": seed, "agree": True, "seen": seen,
            "finished_both": not engine.has_unfinished() and not h.has_unfinished()}


# ---- agent sessions in the plugin ---------------------------------------------------------


def _until_done(h: SchedulerHarness, rid: str, limit: int = 5000) -> None:
    for _ in range(limit):
        if rid in h.finished:
            return
        h.step()
    raise RuntimeError(f"{rid} did not finish")


def sessions_survive(plugin: bool, ttl: float = 5.0, hint: float | None = None
                     ) -> dict[str, Any]:
    """Round 1 of a session, then, during its tool call, other traffic that passes more than
    twice the pool through it (one request at a time, each fitting beside the held round),
    then round 2 (round 1's context and output plus a tool result)."""
    opts = {"session_ttl": ttl} if plugin else {}
    h = SchedulerHarness(harness_config(plugin=plugin, num_blocks=65, max_model_len=1024,
                                        max_num_batched_tokens=1024, options=opts), step_time)
    rng = random.Random(7)
    context = [rng.randrange(8) for _ in range(320)]
    h.add(StreamRequest("s-r1", context, 16, session_id="sess", ttl=hint))
    _until_done(h, "s-r1")
    for i in range(12):  # 12 x 200-token prompts: 2400 tokens through a 1024-token pool
        h.add(StreamRequest(f"o{i}", [rng.randrange(8) for _ in range(200)], 8))
        _until_done(h, f"o{i}")
    round2 = context + h.outputs["s-r1"] + [rng.randrange(8) for _ in range(32)]
    h.add(StreamRequest("s-r2", round2, 8, session_id="sess"))
    _until_done(h, "s-r2")
    cached = next(s.cached["s-r2"] for s in h.steps if "s-r2" in s.cached)
    hold = getattr(h.scheduler, "hl_hold", None)
    return {"cached": cached, "context": len(context) + 16,
            "preempted": sum(len(s.preempted) for s in h.steps),
            "holds": hold.stats.as_dict() if hold is not None else None,
            "held_after": hold.held_blocks if hold is not None else 0,
            "free": h.free_blocks(), "usable": h.usable_blocks(), "gap": h.now}


def sessions_yield(plugin: bool) -> dict[str, Any]:
    """Three sessions' rounds end and are held (most of the pool), then one request that
    fits only in the blocks they hold arrives: it is admitted at once, nothing is
    preempted, and the holds it needed are released (oldest first)."""
    opts = {"session_ttl": 60.0} if plugin else {}
    h = SchedulerHarness(harness_config(plugin=plugin, num_blocks=65, max_model_len=1024,
                                        max_num_batched_tokens=1024, options=opts), step_time)
    rng = random.Random(8)
    for s in range(3):
        h.add(StreamRequest(f"s{s}-r1", [rng.randrange(8) for _ in range(300)], 4,
                            session_id=f"sess{s}"))
        _until_done(h, f"s{s}-r1")
    held = h.scheduler.hl_hold.held_blocks if plugin else 0
    big = [rng.randrange(8) for _ in range(700)]  # 44 blocks with its output: > 64 - 57
    h.add(StreamRequest("big", big, 16))
    first = len(h.steps)
    _until_done(h, "big")
    admitted_at = next(s.step for s in h.steps if "big" in s.admitted) - first
    hold = getattr(h.scheduler, "hl_hold", None)
    return {"held_before": held, "admitted_after_steps": admitted_at,
            "preempted": sum(len(s.preempted) for s in h.steps),
            "holds": hold.stats.as_dict() if hold is not None else None,
            "left_held": hold.held_blocks if hold is not None else 0}


def sessions() -> dict[str, Any]:
    runs = {f"{name}-{'plugin' if p else 'stock'}": f(p)
            for name, f in (("survive", sessions_survive), ("yield", sessions_yield))
            for p in (False, True)}
    runs["survive-plugin-short-ttl"] = sessions_survive(True, ttl=0.02)  # < the tool call
    # the request's own hint wins over the option (kv_hints on 0.34, else vllm_xargs)
    runs["survive-plugin-short-hint"] = sessions_survive(True, ttl=5.0, hint=0.02)
    return runs


def main() -> None:
    result: dict[str, Any] = {"vllm": vllm.__version__, "complete": complete(),
                              "decisions": [decisions(s) for s in DECISION_SEEDS],
                              "perturbed": decisions(DECISION_SEEDS[0],
                                                     vllm_options={"lpm_aging": 64.0}),
                              "sessions": sessions()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
