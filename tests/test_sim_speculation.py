"""Speculative decoding in the simulator (sim/acceptance_profile.py): drafts follow a measured
acceptance profile, the simulated runner verifies them as the real one verifies greedy drafts,
and the real scheduler, KV cache and cost model do the rest."""

from __future__ import annotations

import json
import random

import pytest

from hlserve.request import SamplingParams
from hlserve.sim.acceptance_profile import AcceptanceProfile
from hlserve.sim.build import SimOptions, build_sim_engine

NGRAM3 = json.dumps({"method": "ngram", "num_speculative_tokens": 3})


def run(profile: AcceptanceProfile | None, n: int = 16, **options):
    spec = {} if profile is None else {"speculative_config": NGRAM3}
    engine = build_sim_engine("Qwen2.5-0.5B", "H100", 1, sim=SimOptions(acceptance=profile),
                              mode="throughput", **spec, **options)
    rng = random.Random(0)
    # Named ids: the simulated draws hash the request id, and the default ids come from a
    # process-wide counter, so without names a run's draws would depend on the tests before it.
    ids = [engine.add_request([rng.randrange(3, 1000) for _ in range(500)],
                              SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                              request_id=f"r{i}").request_id for i in range(n)]
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    engine.kv.check_invariants()
    assert engine.kv.num_used == 0  # every page of every draft went back
    return engine, [out[i] for i in ids]


def within_sampling_error(hits: list[int], trials: list[int], p: list[float]) -> bool:
    """Every observed share hits/trials lies within four binomial standard errors of p: a
    bound on the sampling noise of the draws, not a fixed tolerance that a few hundred draws
    overstep once in a few runs."""
    return all(abs(h / n - q) <= 4 * (q * (1 - q) / n) ** 0.5
               for h, n, q in zip(hits, trials, p, strict=True))


def test_drafts_follow_the_profile_and_tokens_do_not_change() -> None:
    base, tokens = run(None)
    profile = AcceptanceProfile((0.8, 0.6, 0.4), propose_rate=0.9)
    spec, spec_tokens = run(profile)
    assert spec_tokens == tokens  # greedy verification is exact here as in the real runner
    s = spec.spec_stats
    assert within_sampling_error(s.accepted_per_pos, [s.num_drafts] * 3, [0.8, 0.6, 0.4])
    decode_steps = 16 * 199 - s.num_accepted_tokens  # every output token after the first
    assert s.num_drafts / decode_steps == pytest.approx(0.9, abs=0.04)
    # 1 + 1.8 tokens per decode step at 16 sequences, each step a little dearer
    assert spec.stats.steps < 0.5 * base.stats.steps
    assert spec.clock() < 0.6 * base.clock()


def test_drafts_nobody_accepts_cost_time_and_save_no_step() -> None:
    base, tokens = run(None)
    spec, spec_tokens = run(AcceptanceProfile((0.0, 0.0, 0.0)))
    assert spec_tokens == tokens
    assert spec.spec_stats.num_draft_tokens > 0 and spec.spec_stats.num_accepted_tokens == 0
    assert spec.stats.steps == base.stats.steps
    assert spec.clock() > base.clock()  # three extra query rows per sequence, every step


def test_a_simulated_speculating_engine_needs_a_profile() -> None:
    with pytest.raises(ValueError, match="acceptance profile"):
        build_sim_engine("Qwen2.5-0.5B", "H100", 1, speculative_config=NGRAM3)


def test_profile_checks_counts_and_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="do not increase"):
        AcceptanceProfile((0.3, 0.5))
    with pytest.raises(ValueError, match="share"):
        AcceptanceProfile((0.3,), propose_rate=1.5)
    p = AcceptanceProfile.from_counts(200, [150, 100, 40], decode_steps=400, name="coding")
    assert p.accept == (0.75, 0.5, 0.2) and p.propose_rate == 0.5
    assert p.expected_accepted() == pytest.approx(1.45)
    assert AcceptanceProfile.from_counts(0, [0, 0], 10).propose_rate == 0.0
    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"profiles": {"coding": {"accept": [0.7, 0.5],
                                                     "propose_rate": 0.6}}}))
    assert AcceptanceProfile.load(f, "coding") == AcceptanceProfile((0.7, 0.5), 0.6, "coding")
    with pytest.raises(ValueError, match="coding"):
        AcceptanceProfile.load(f, "agent")


def test_drafts_reach_as_far_as_the_profile_says() -> None:
    """A measured profile's reach: drafts are as long as real proposals were (only their
    rows cost), and acceptance is honoured among the drafts that reach a position."""
    _, tokens = run(None)
    profile = AcceptanceProfile((0.9, 0.8, 0.7), propose_rate=1.0, reach=(1.0, 0.5, 0.25))
    spec, spec_tokens = run(profile)
    assert spec_tokens == tokens
    s = spec.spec_stats
    assert s.drafted_per_pos[0] == s.num_drafts
    assert within_sampling_error(s.drafted_per_pos[1:], [s.num_drafts] * 2, [0.5, 0.25])
    assert within_sampling_error(s.accepted_per_pos, s.drafted_per_pos, [0.9, 0.8, 0.7])
    with pytest.raises(ValueError, match="reach"):
        AcceptanceProfile((0.5, 0.4), reach=(1.0,))
    with pytest.raises(ValueError, match="do not increase"):
        AcceptanceProfile((0.5, 0.4), reach=(0.5, 1.0))
