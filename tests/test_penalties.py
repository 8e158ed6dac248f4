"""logit_bias and the repetition / presence / frequency penalties, checked against
transformers' logits of the same weights adjusted by hand, token by token (greedy)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hlserve import LLM, SamplingParams
from hlserve.errors import InvalidRequestError

N = 16


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=512)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    # a prompt that repeats itself, so that the repetition penalty has prompt tokens to hit
    loop = [rng.randrange(3, vocab) for _ in range(6)] * 4
    return [loop, [rng.randrange(3, vocab) for _ in range(40)], [7, 7, 7, 9]]


def hf_adjusted_greedy(model: torch.nn.Module, prompt: list[int], n: int, rep: float = 1.0,
                       presence: float = 0.0, frequency: float = 0.0,
                       bias: dict[int, float] | None = None) -> list[int]:
    """A full forward per token; the last logits adjusted by hand as vLLM defines it."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].clone()
            for t, b in (bias or {}).items():
                logits[t] += b
            for t in set(seq):  # prompt and output
                logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
            for t, c in Counter(out).items():  # output only
                logits[t] -= frequency * c + presence
            nxt = int(logits.argmax())
            seq.append(nxt)
            out.append(nxt)
    return out


CASES = {
    "repetition": {"repetition_penalty": 1.8},
    "repetition-below-1": {"repetition_penalty": 0.6},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.7},
    "all-three": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4},
}


@pytest.mark.parametrize("name", list(CASES))
def test_penalties_match_transformers(llm, hf, name: str) -> None:
    kw = CASES[name]
    ps = prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, **kw)
    got = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    ref = [hf_adjusted_greedy(hf, p, N, rep=kw.get("repetition_penalty", 1.0),
                              presence=kw.get("presence_penalty", 0.0),
                              frequency=kw.get("frequency_penalty", 0.0)) for p in ps]
    plain = [hf_adjusted_greedy(hf, p, N) for p in ps]
    assert ref != plain, "the penalty must change what greedy picks, or this proves nothing"
    assert got == ref


def test_logit_bias_matches_transformers(llm, hf) -> None:
    ps = prompts(hf.config.vocab_size)
    plain = [hf_adjusted_greedy(hf, p, N) for p in ps]
    # ban every token plain greedy picked, and favour a few others mildly
    bias = {t: -100.0 for out in plain for t in set(out)} | {11: 3.0, 12: 2.5, 300: 4.0}
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logit_bias=bias)
    got = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    ref = [hf_adjusted_greedy(hf, p, N, bias=bias) for p in ps]
    assert all(not set(r) & set(p) for r, p in zip(ref, plain, strict=True))
    assert got == ref


def test_penalties_leave_logprobs_raw(llm, hf) -> None:
    """Logprobs are the model's raw distribution, whatever the adjustments (vLLM's default)."""
    p = prompts(hf.config.vocab_size)[0]
    kw = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}
    plain = llm.generate([p], SamplingParams(**kw), use_tqdm=False)[0]
    first_top = plain.logprobs[0].top
    biased = llm.generate([p], SamplingParams(**kw, logit_bias={first_top[0][0]: -100.0}),
                          use_tqdm=False)[0]
    assert biased.token_ids[0] != plain.token_ids[0]
    assert [t for t, _ in biased.logprobs[0].top] == [t for t, _ in first_top]
    assert [v for _, v in biased.logprobs[0].top] == pytest.approx([v for _, v in first_top])


def test_mixed_batch_leaves_plain_requests_alone(llm, hf) -> None:
    ps = prompts(hf.config.vocab_size)
    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    pen = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    got = [o.token_ids for o in llm.generate(ps + ps, [plain] * 3 + [pen] * 3, use_tqdm=False)]
    assert got[:3] == [hf_adjusted_greedy(hf, p, N) for p in ps]
    assert got[3:] == [hf_adjusted_greedy(hf, p, N, rep=1.8) for p in ps]


@pytest.mark.parametrize("kw", [{"repetition_penalty": 0}, {"repetition_penalty": -1.0},
                                {"presence_penalty": 2.5}, {"frequency_penalty": -3},
                                {"logit_bias": {5: 101.0}}, {"logit_bias": {-1: 1.0}},
                                {"logit_bias": {"5": 1.0}}, {"n": 0}, {"n": 2, "best_of": 1}])
def test_bad_values_are_invalid(kw) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_logit_bias_out_of_vocab_is_refused_and_engine_lives(llm) -> None:
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate([[5, 6]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids


# ---- n > 1 and best_of: forked sequences ------------------------------------------------------


def test_greedy_n_gives_identical_choices_sharing_the_prompt_pages(tiny_llama: Path, hf) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=512, page_size=16,
              check_invariants=True)
    prompt = prompts(hf.config.vocab_size)[1]  # 40 tokens: two full pages and a partial one
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, n=4,
                            repetition_penalty=1.3)
    before = llm.engine.stats.computed_tokens
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ref = hf_adjusted_greedy(hf, prompt, N, rep=1.3)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == ref for c in out.outputs)
    # siblings wait for the first's prefill and find its two full pages cached: each computes
    # only the last partial page of the prompt
    reqs_cached = (len(prompt) - 1) // 16 * 16
    assert out.num_cached_tokens == 0
    computed = llm.engine.stats.computed_tokens - before
    assert computed == len(prompt) + 3 * (len(prompt) - reqs_cached) + 4 * (N - 1)
    kv = llm.engine.kv
    kv.check_invariants()  # used + free + cached == pool
    assert kv.num_used == 0


def test_seeded_siblings_differ_and_reproduce(llm, hf) -> None:
    prompt = prompts(hf.config.vocab_size)[1]
    params = SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True, n=3, seed=42)
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    b = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = [c.token_ids for c in a.outputs]
    assert ids == [c.token_ids for c in b.outputs]
    assert len({tuple(x) for x in ids}) == 3
    # sibling i is the single request with seed 42 + i
    for i in range(3):
        one = SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True, seed=42 + i)
        assert llm.generate([prompt], one, use_tqdm=False)[0].token_ids == ids[i]


def test_best_of_returns_the_highest_cumulative_logprob(llm, hf) -> None:
    prompt = prompts(hf.config.vocab_size)[2]
    best = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, n=2, best_of=5,
                          seed=7)
    out = llm.generate([prompt], best, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(c.logprobs is None for c in out.outputs)
    every = [llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0,
                                                   ignore_eos=True, seed=7 + i, logprobs=0),
                          use_tqdm=False)[0] for i in range(5)]
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)
    assert [c.token_ids for c in out.outputs] == [o.token_ids for o in ranked[:2]]
    assert out.outputs[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob)
