"""Throughput mode's per-step choice of k (engine/spec_adaptive.py, issue 24).

The choice itself: the acceptance EMA per position, the step-cost fit, the k with the most
expected tokens per second (all drafts where a step's fixed cost dominates, none where its
rows do: high concurrency), none when the decodes fill the budget, probes while k is 0.
Then the real engine on the tiny Llama: with acceptance ~0 k falls to 0 after the warm-up
(the random-weights model sampled at temperature 1 on random prompts: its greedy output
repeats itself, which n-gram drafts predict, so sampling is what makes its tokens
unpredictable), with a repetitive prompt it stays above 0; greedy outputs stay identical to
those without speculation; the choice shows in the caps block and on /metrics.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx
import pytest

from hlserve import LLM, SamplingParams
from hlserve.engine.args import make_config, parse_engine_args
from hlserve.engine.spec_adaptive import MIN_GAIN, AdaptiveK, StepCostFit
from hlserve.server.runtime.launch import ExternalServer, free_port
from servers import BASE_ARGS, metric

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def fitted(t0: float, t_row: float, sizes: list[int]) -> StepCostFit:
    fit = StepCostFit()
    for rows in sizes:
        fit.observe(rows, t0 + t_row * rows)
    return fit


def test_the_cost_fit_recovers_the_line_and_wants_spread() -> None:
    fit = fitted(0.02, 0.001, [1, 40, 7, 300, 12, 64, 3, 128, 9, 16])
    t0, t_row = fit.estimate()
    assert t0 == pytest.approx(0.02) and t_row == pytest.approx(0.001)
    assert fitted(0.02, 0.001, [64] * 20).estimate() is None  # no spread: no slope
    assert fitted(0.02, 0.001, [1, 300, 2]).estimate() is None  # too few steps


def test_acceptance_ema_and_the_choice_of_k() -> None:
    a = AdaptiveK(3)
    assert a.best_k(8) == 3  # the prior: speculate fully until measured
    for _ in range(30):
        a.observe_draft(3, 0)  # rejected at position 0: later positions not seen
    assert a.accept[0] < MIN_GAIN and a.accept[1:] == [1.0, 1.0]
    assert a.best_k(8) == 0
    b = AdaptiveK(3)
    for _ in range(30):
        b.observe_draft(3, 1)  # the first accepted, the second never
    assert b.accept[0] > 0.9 and b.accept[1] < MIN_GAIN and b.best_k(8) == 1


def test_the_fixed_cost_against_the_rows_decides() -> None:
    a = AdaptiveK(3)
    a.accept = [0.7, 0.7, 0.7]  # g = 0.7, 0.49, 0.34: E(3) = 1.53
    # a step's fixed cost dominates (memory-bound): every draft pays
    a.cost = fitted(0.010, 0.00001, [1, 40, 7, 300, 12, 64, 3, 128, 9, 16])
    assert a.best_k(4) == 3
    # the rows dominate (a large batch): (1 + E(k)) / (1 + k) falls, so none
    assert a.best_k(4096) == 0
    # in between, fewer than k_max
    assert 0 < a.best_k(300) < 3


def test_reach_counts_only_the_rows_drafts_fill() -> None:
    """A lookup allowed k drafts only as far as its match goes: positions it did not reach
    fall, positions past what it was allowed learn nothing, a lookup without a match is a
    miss at every allowed position."""
    a = AdaptiveK(3)
    for _ in range(40):
        a.observe_lookup(3, 1)
    assert a.reach[0] == 1.0 and a.reach[1] < 0.02 and a.reach[2] < 0.02
    a.observe_lookup(1, 0)
    assert a.reach[0] == pytest.approx(0.9) and a.reach[1] < 0.02
    before = list(a.reach)
    a.observe_lookup(1, 1)
    assert a.reach[1:] == before[1:]


def test_short_drafts_make_later_positions_cheap() -> None:
    """Expected tokens and rows both weigh position j by its reach: with the same acceptance
    and cost, drafts that rarely get past the first token make allowing more of them nearly
    free, so k is at least what full-length drafts would give, and the rate is the
    formula's."""
    a = AdaptiveK(3)
    a.accept = [0.9, 0.5, 0.5]
    a.cost = fitted(0.010, 0.0001, [1, 40, 7, 300, 12, 64, 3, 128, 9, 16])
    full = a.best_k(16)
    a.reach = [0.6, 0.15, 0.1]
    assert a.best_k(16) == 3 > full == 2

    def rate(k: int, d: int = 16) -> float:
        g = [0.9, 0.45, 0.225]
        gain = sum(a.reach[j] * g[j] for j in range(k))
        return (1 + gain) / (0.010 + 0.0001 * d * (1 + sum(a.reach[:k])))

    assert max(range(4), key=lambda k: (rate(k), k)) == 3
    assert max(range(4), key=lambda k: (rate(k, 300), k)) == a.best_k(300) == 1


def test_choose_none_without_budget_and_probe_while_zero() -> None:
    a = AdaptiveK(3, probe_every=4)
    assert a.choose(8, spare=0) == (0, False)  # the decodes fill the budget
    assert a.choose(0, spare=100) == (0, False)  # no decodes: no step counted
    assert a.steps_by_k == [1, 0, 0, 0]
    assert a.choose(8, spare=100) == (3, False)
    for _ in range(40):
        a.observe_draft(3, 0)
    picks = [a.choose(8, spare=100) for _ in range(8)]
    assert [k for k, _ in picks] == [0] * 8
    assert [p for _, p in picks] == [False, False, False, True] * 2


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random permutations' heads of the tiny vocabulary: a last token is often found earlier
    in the prompt, so the n-gram proposer (n >= 1) drafts what followed it there."""
    rng = random.Random(seed)
    return [rng.sample(range(3, 4096), length) for _ in range(n)]


def test_k_falls_to_zero_when_nothing_is_accepted(tiny_llama: Path) -> None:
    sp = SamplingParams(max_tokens=96, temperature=1.0, seed=7, ignore_eos=True)
    prompts = random_prompts(4, 1500, 1)
    fixed = LLM(str(tiny_llama), dtype="float32", mode="throughput", speculative_config=NGRAM,
                speculative_adaptive=False)
    fixed.generate(prompts, sp, use_tqdm=False)
    llm = LLM(str(tiny_llama), dtype="float32", mode="throughput", speculative_config=NGRAM,
              check_invariants=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(len(o.token_ids) == 96 for o in outs)
    stats, ad = llm.engine.spec_stats, llm.engine.spec_stats.adaptive
    assert ad is not None and fixed.engine.spec_stats.adaptive is None
    assert stats.num_accepted_tokens <= 0.05 * stats.num_draft_tokens  # acceptance ~0
    assert ad.accept[0] < MIN_GAIN
    # the warm-up speculated, then k fell to 0: the last steps chose 0 (probes aside)
    assert ad.steps_by_k[3] > 0 and ad.steps_by_k[0] > 2 * sum(ad.steps_by_k[1:])
    assert llm.engine.scheduler.spec._step_k == 0
    assert ad.probes > 0
    assert stats.num_draft_tokens < fixed.engine.spec_stats.num_draft_tokens / 2
    assert llm.engine.kv.num_used == 0


def test_k_stays_up_on_a_repetitive_prompt_and_greedy_is_exact(tiny_llama: Path) -> None:
    rng = random.Random(3)
    phrase = [rng.randrange(3, 4096) for _ in range(10)]
    prompts = [phrase * 5, phrase * 3 + [rng.randrange(3, 4096) for _ in range(7)]]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama), dtype="float32", mode="throughput")
    want = [o.token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(tiny_llama), dtype="float32", mode="throughput", speculative_config=NGRAM,
              check_invariants=True)
    got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    ad = llm.engine.spec_stats.adaptive
    assert ad.accept[0] > 0.5
    assert sum(ad.steps_by_k[1:]) >= 0.9 * sum(ad.steps_by_k)
    assert llm.engine.stats.steps < plain.engine.stats.steps
    assert "k chosen per step in 0..3 (adaptive" in llm.engine.caps_report


def test_the_switch_is_a_flag_and_throughput_modes_default(tiny_llama: Path) -> None:
    assert make_config(str(tiny_llama), mode="throughput").speculative_adaptive
    assert not make_config(str(tiny_llama), mode="slo").speculative_adaptive
    opts = parse_engine_args(["--mode", "throughput", "--speculative-adaptive", "off"])
    assert not make_config(str(tiny_llama), **opts).speculative_adaptive
    assert parse_engine_args(["--speculative-adaptive", "on"])["speculative_adaptive"] is True
    with pytest.raises(SystemExit):
        parse_engine_args(["--speculative-adaptive", "maybe"])


def test_adaptive_counters_on_a_real_server(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "hlserve.cli", "serve", str(tiny_llama), "--host",
           "127.0.0.1", "--port", str(port), *BASE_ARGS, "--mode", "throughput",
           "--speculative-config", json.dumps(NGRAM)]
    rng = random.Random(3)
    prompt = [rng.randrange(3, 4096) for _ in range(10)] * 5
    with ExternalServer(cmd, "127.0.0.1", port, tmp_path / "server.log",
                        health_timeout=180) as srv, httpx.Client(base_url=srv.url,
                                                                 timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = c.get("/metrics").text
    log = (tmp_path / "server.log").read_text()
    assert "k chosen per step in 0..3 (adaptive" in log
    steps = [metric(text, "hlserve:spec_decode_adaptive_steps_total", k=str(k))
             for k in range(4)]
    assert sum(steps) > 0 and steps[3] > 0, text
    assert 0 < metric(text, "hlserve:spec_decode_adaptive_acceptance", position="0") <= 1
    assert "vllm:spec_decode_adaptive" not in text  # hlserve's own, not vLLM's
