"""Sampling and stopping: what a caller asks for in SamplingParams is what it gets.

Greedy determinism, per-request seeds (reproducible across engines and batch compositions),
top-k / top-p / temperature (against crafted distributions and transformers' logits),
max_tokens, EOS, min_tokens, stop token ids, stop strings, text versus token ids, chat.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hlserve import LLM, SamplingParams
from hlserve.request import Request

PROMPTS = [
    "Hello world, this is a test",
    "def foo(x):",
    "The warehouse shipped",
    '{"name": "agent", "tools": [',
]
N = 24  # generated tokens per request in most tests
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def sampled(seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=kw.pop("temperature", 1.0), seed=seed,
                          ignore_eos=True, **kw)


def gen(llm: LLM, prompts, params) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_pages=256, check_invariants=True)


@pytest.fixture(scope="module")
def llm_other(tiny_llama: Path) -> LLM:
    """A second engine on the same weights, with another engine seed and chunked prefill."""
    return LLM(str(tiny_llama), dtype="float32", num_pages=256, seed=99, chunk_size=4,
               check_invariants=True)


@pytest.fixture(scope="module")
def greedy_refs(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in gen(llm, PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


# ---- greedy and seeds ---------------------------------------------------------------------


def test_greedy_is_deterministic(llm, llm_other, greedy_refs, hf) -> None:
    assert all(len(r) == N for r in greedy_refs)
    assert [o.token_ids for o in gen(llm, PROMPTS, GREEDY)] == greedy_refs
    assert [o.token_ids for o in gen(llm, PROMPTS[::-1], GREEDY)] == greedy_refs[::-1]
    assert [o.token_ids for o in gen(llm_other, PROMPTS, GREEDY)] == greedy_refs
    # the first greedy token is transformers' argmax
    for prompt, ref in zip(PROMPTS, greedy_refs, strict=True):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        assert int(logits.argmax()) == ref[0]


def test_tiny_temperature_is_greedy(llm, greedy_refs) -> None:
    # dividing logits by 1e-30 overflows to inf / NaN; such temperatures must act as greedy
    for t in (1e-6, 1e-30, 1e-45):
        outs = gen(llm, PROMPTS, sampled(temperature=t))
        assert [o.token_ids for o in outs] == greedy_refs, f"temperature {t}"


def test_seed_reproducible_across_engines(llm, llm_other, greedy_refs) -> None:
    params = [sampled(seed=1234 + i) for i in range(len(PROMPTS))]
    a = [o.token_ids for o in gen(llm, PROMPTS, params)]
    b = [o.token_ids for o in gen(llm_other, PROMPTS, params)]
    assert a == b
    assert a != greedy_refs, "temperature 1.0 should not be greedy"
    # and again on the same engine, whose unseeded generator has moved on
    gen(llm, PROMPTS, sampled())
    assert [o.token_ids for o in gen(llm, PROMPTS, params)] == a


def test_seed_independent_of_batch(llm) -> None:
    target = sampled(seed=7, top_k=50, top_p=0.9)
    alone = gen(llm, [PROMPTS[1]], target)[0].token_ids
    # in a batch with greedy, unseeded and other-seeded requests, at any position
    others = [GREEDY, sampled(), sampled(seed=8), sampled(temperature=0.7)]
    batch = [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[1]]
    params = [others[0], others[1], target, others[2], others[3]]
    assert gen(llm, batch, params)[2].token_ids == alone
    # arriving mid-flight, while others decode
    eng = llm.engine
    for p, sp in zip(PROMPTS, others, strict=True):
        eng.add_request(p, sp)
    for _ in range(3):
        eng.step()
    req = eng.add_request(PROMPTS[1], target)
    final = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == req.request_id and out.finished:
                final = out
    assert final is not None and final.token_ids == alone
    assert eng.kv.num_used == 0


def test_different_seeds_differ(llm) -> None:
    outs = gen(llm, [PROMPTS[0]] * 5, [sampled(seed=s) for s in range(5)])
    seqs = {tuple(o.token_ids) for o in outs}
    assert len(seqs) == 5
    # unseeded requests in one batch draw independent noise too
    outs = gen(llm, [PROMPTS[0]] * 4, sampled())
    assert len({tuple(o.token_ids) for o in outs}) == 4


# ---- top-k, top-p, temperature --------------------------------------------------------------


def test_top_k_1_and_tiny_top_p_are_greedy(llm, greedy_refs) -> None:
    for params in (sampled(temperature=5.0, top_k=1), sampled(seed=3, temperature=2.0, top_k=1),
                   sampled(temperature=1.5, top_p=1e-6), sampled(seed=4, top_p=1e-6),
                   sampled(seed=5, temperature=3.0, min_p=1.0)):
        assert [o.token_ids for o in gen(llm, PROMPTS, params)] == greedy_refs, params


def _reqs(n: int, **kw) -> list[Request]:
    return [Request(prompt_token_ids=[1], params=SamplingParams(**kw)) for _ in range(n)]


def test_top_k_samples_only_the_k_highest(llm) -> None:
    runner = llm.engine.runner
    g = torch.Generator().manual_seed(0)
    rows, vocab = 2000, 64
    logits = torch.randn(rows, vocab, generator=g) * 3
    for k, top_p in ((5, 1.0), (3, 0.95), (20, 1.0)):
        out = runner.sample(logits.clone(), _reqs(rows, temperature=2.0, top_k=k, top_p=top_p))
        top = logits.topk(k, dim=-1).indices
        assert (top == out.unsqueeze(1)).any(dim=1).all(), f"top_k={k}: a token outside the top {k}"
        ranks = (logits.argsort(dim=-1, descending=True) == out.unsqueeze(1)).float().argmax(dim=1)
        assert len(set(ranks.tolist())) == k, "every one of the top k should be drawn sometimes"


def test_top_k_against_transformers_logits(llm, hf) -> None:
    ids = llm.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    top3 = set(logits.topk(3).indices.tolist())
    params = [SamplingParams(max_tokens=1, temperature=3.0, top_k=3, seed=s) for s in range(60)]
    firsts = [o.token_ids[0] for o in gen(llm, [ids] * 60, params)]
    assert set(firsts) <= top3
    assert len(set(firsts)) >= 2


PROBS = torch.tensor([0.5, 0.3, 0.2])


def _expected(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    p = PROBS ** (1 / temperature)
    p = p / p.sum()
    # vLLM's order: min-p on the tempered distribution, then top-k and top-p over what is left
    p = torch.where(p >= min_p * p.max(), p, torch.zeros(3))
    p = p / p.sum()
    keep = torch.zeros(3, dtype=torch.bool)
    mass = 0.0
    for i in range(3):  # PROBS is sorted, and tempering keeps the order
        if p[i] == 0 or (top_k > 0 and i >= top_k) or (i > 0 and mass >= top_p):
            break
        keep[i] = True
        mass += float(p[i])
    p = torch.where(keep, p, torch.zeros(3))
    return p / p.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, -1, 1.0, 0.0), (2.0, -1, 1.0, 0.0), (0.5, -1, 1.0, 0.0), (1.0, -1, 0.75, 0.0),
     (1.0, 2, 1.0, 0.0), (2.0, 2, 0.6, 0.0),
     (1.0, -1, 1.0, 0.5), (2.0, -1, 1.0, 0.7), (0.5, -1, 1.0, 0.3), (1.0, -1, 0.9, 0.5)],
)
def test_sampling_frequencies(llm, temperature: float, top_k: int, top_p: float,
                              min_p: float) -> None:
    runner = llm.engine.runner
    draws = 4000
    logits = PROBS.log().repeat(draws, 1)
    # a seed per row: independent draws, and the same ones whatever ran before
    reqs = [Request(prompt_token_ids=[1], params=SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=i))
        for i in range(draws)]
    out = runner.sample(logits, reqs)
    for r in reqs:
        runner.release(r.request_id)
    freq = torch.bincount(out, minlength=3).float() / draws
    want = _expected(temperature, top_k, top_p, min_p)
    # 4000 draws: one standard deviation is at most 0.008
    assert torch.allclose(freq, want, atol=0.03), f"drew {freq.tolist()}, expected {want.tolist()}"


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_match_transformers(llm, hf, greedy_refs) -> None:
    """Each generated token's logprob and the top alternatives are the model's raw
    distribution at that position: transformers' log-softmax of the same weights."""
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = gen(llm, PROMPTS[:2], params)
    for prompt, out, ref in zip(PROMPTS[:2], outs, greedy_refs, strict=False):
        assert out.token_ids == ref  # asking for logprobs changes nothing generated
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        ids = llm.tokenizer.encode(prompt) + out.token_ids
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        n = len(out.prompt_token_ids)
        for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = lp[n - 1 + i]
            assert entry.logprob == pytest.approx(float(row[tok]), abs=1e-3)
            want = row.topk(5)
            assert [t for t, _ in entry.top] == want.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=1e-3)
            assert entry.top[0][0] == tok  # greedy: the sampled token is the most likely


def test_logprobs_of_sampled_tokens_and_off_by_default(llm) -> None:
    # sampled at a high temperature, the token is often not the top one: its own logprob is
    # reported, from the raw (untempered) distribution
    out = gen(llm, PROMPTS[:1], sampled(seed=7, temperature=3.0, logprobs=1))[0]
    assert out.logprobs is not None and all(len(e.top) == 1 for e in out.logprobs)
    assert all(e.logprob <= e.top[0][1] + 1e-6 for e in out.logprobs)
    off_top = [e for tok, e in zip(out.token_ids, out.logprobs, strict=True) if tok != e.top[0][0]]
    assert off_top and all(e.logprob < e.top[0][1] for e in off_top)
    zero = gen(llm, PROMPTS[:1], sampled(seed=7, temperature=3.0, logprobs=0))[0]
    assert zero.token_ids == out.token_ids and all(e.top == () for e in zero.logprobs)
    assert [e.logprob for e in zero.logprobs] == pytest.approx([e.logprob for e in out.logprobs])
    assert gen(llm, PROMPTS[:1], sampled(seed=7))[0].logprobs is None
    with pytest.raises(Exception, match="logprobs"):
        SamplingParams(logprobs=21)


# ---- stopping -------------------------------------------------------------------------------


def test_max_tokens_gives_length(llm) -> None:
    for n in (1, 5, 17):
        params = SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True)
        for out in gen(llm, PROMPTS, params):
            assert len(out.token_ids) == n
            assert out.finished and out.finish_reason == "length" and out.stop_reason is None


def test_max_model_len_gives_length(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_pages=16, max_model_len=64)
    prompt = list(range(3, 63))  # 60 tokens: room for 4 more
    out = gen(llm, [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert llm.engine.kv.num_used == 0


@pytest.fixture(scope="module")
def eos_case(tiny_llama: Path, tmp_path_factory, greedy_refs):
    """A copy of the model whose generation_config names the 6th greedy token as an EOS."""
    ref = greedy_refs[0]
    pos = next(i for i in range(5, N) if ref[i] not in ref[:i])
    d = tmp_path_factory.mktemp("eos_model")
    for f in tiny_llama.iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f)
    gen_cfg = json.loads((tiny_llama / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [gen_cfg["eos_token_id"], ref[pos]]
    (d / "generation_config.json").write_text(json.dumps(gen_cfg))
    return LLM(str(d), dtype="float32", num_pages=64, check_invariants=True), ref, pos


def test_eos_stops_unless_ignored(eos_case) -> None:
    llm, ref, pos = eos_case
    eos = ref[pos]
    assert eos in llm.engine.default_eos
    out = gen(llm, PROMPTS[0], SamplingParams(max_tokens=N, temperature=0.0))[0]
    assert out.token_ids == ref[: pos + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = gen(llm, PROMPTS[0], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_min_tokens_holds_back_eos(eos_case) -> None:
    llm, ref, pos = eos_case
    eos = ref[pos]
    m = pos + 3
    out = gen(llm, PROMPTS[0], SamplingParams(max_tokens=N, temperature=0.0, min_tokens=m))[0]
    assert eos not in out.token_ids[:m]
    assert out.token_ids[:pos] == ref[:pos]
    assert len(out.token_ids) > m or out.finish_reason == "length"
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in llm.engine.default_eos


def test_stop_token_ids(llm, greedy_refs) -> None:
    ref = greedy_refs[1]
    k = next(i for i in range(2, N) if ref[i] not in ref[:i])
    out = gen(llm, PROMPTS[1], SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=[ref[k]]))[0]
    assert out.token_ids == ref[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[k]
    # a stop id is honoured even with ignore_eos, and with sampling
    out = gen(llm, PROMPTS[1], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                             stop_token_ids=[ref[0]]))[0]
    assert out.token_ids == ref[:1] and out.stop_reason == ref[0]


def test_min_tokens_holds_back_stop_token_ids(llm, greedy_refs) -> None:
    for ref, prompt in zip(greedy_refs, PROMPTS, strict=True):
        stop_ids = sorted(set(ref[:8]))  # the greedy continuation wants to stop at once
        params = SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=stop_ids,
                                ignore_eos=True)
        assert gen(llm, prompt, params)[0].token_ids == ref[:1]
        m = 6
        out = gen(llm, prompt, SamplingParams(max_tokens=N, temperature=0.0, min_tokens=m,
                                              stop_token_ids=stop_ids, ignore_eos=True))[0]
        assert not set(out.token_ids[:m]) & set(stop_ids), "a stop id came before min_tokens"
        if out.finish_reason == "stop":
            assert len(out.token_ids) > m and out.stop_reason == out.token_ids[-1] in stop_ids
        else:
            assert len(out.token_ids) == N
        # sampled too: min_tokens masks the stop ids whatever the temperature
        out = gen(llm, prompt, SamplingParams(max_tokens=N, temperature=1.0, seed=5, min_tokens=m,
                                              stop_token_ids=stop_ids, ignore_eos=True))[0]
        assert not set(out.token_ids[:m]) & set(stop_ids)


def _offsets(llm: LLM, ids: list[int]) -> list[int]:
    """offsets[k]: characters of text that the first k tokens decode to."""
    return [len(llm.tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]


def _clean(text: str) -> bool:
    return all(c.isascii() and c.isprintable() for c in text)


def _stop_string_case(llm: LLM, greedy_refs, spanning: bool):
    """A prompt, its greedy ids and text, a stop string whose first occurrence is where we
    want it (inside one token, or across a token boundary), and the token index ending it."""
    for prompt, ref in zip(PROMPTS, greedy_refs, strict=True):
        text = llm.tokenizer.decode(ref)
        offs = _offsets(llm, ref)
        if not all(text.startswith(llm.tokenizer.decode(ref[:k])) for k in range(len(ref))):
            continue
        for j in range(2, N - 1):
            a, b, c = offs[j - 1], offs[j], offs[j + 1]
            if spanning and b - a >= 2 and c - b >= 2:
                s, start = text[b - 2 : b + 2], b - 2
            elif not spanning and c - b >= 3:
                s, start = text[b : b + 3], b
            else:
                continue
            if _clean(s) and s.strip() and text.find(s) == start:
                return prompt, ref, text, s, start, j
    pytest.fail("no usable stop string in the greedy outputs")


@pytest.mark.parametrize("spanning", [False, True], ids=["in-one-token", "across-tokens"])
def test_stop_string(llm, greedy_refs, spanning: bool) -> None:
    prompt, ref, text, s, start, j = _stop_string_case(llm, greedy_refs, spanning)
    out = gen(llm, prompt, SamplingParams(max_tokens=N, temperature=0.0, stop=[s]))[0]
    assert out.text == text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == ref[: j + 1], "generation should stop at the token completing it"
    out = gen(llm, prompt, SamplingParams(max_tokens=N, temperature=0.0, stop=s,
                                          include_stop_str_in_output=True))[0]
    assert out.text == text[: start + len(s)]
    assert out.stop_reason == s
    # with another stop string that never occurs, and one that occurs later
    later = text[-3:] if text.find(text[-3:]) > start else "\x00never"
    out = gen(llm, prompt, SamplingParams(max_tokens=N, temperature=0.0,
                                          stop=["\x00never", later, s]))[0]
    assert out.text == text[:start] and out.stop_reason == s


def test_stop_string_absent_keeps_full_text(llm, greedy_refs) -> None:
    out = gen(llm, PROMPTS[0], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                              stop=["\x00never"]))[0]
    assert out.token_ids == greedy_refs[0] and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(greedy_refs[0]) and out.stop_reason is None


# ---- text, prompts, chat ----------------------------------------------------------------


def test_text_is_decode_of_token_ids(llm) -> None:
    rng = random.Random(3)
    prompts = PROMPTS + [[rng.randrange(3, 4096) for _ in range(rng.randrange(1, 20))]
                         for _ in range(12)]
    for params in (GREEDY, sampled(seed=11, temperature=1.3)):
        for out in gen(llm, prompts, params):
            assert out.text == llm.tokenizer.decode(out.token_ids)


def test_text_and_token_id_prompts_agree(llm, greedy_refs) -> None:
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    by_ids = gen(llm, ids, GREEDY)
    assert [o.token_ids for o in by_ids] == greedy_refs
    assert [o.prompt_token_ids for o in by_ids] == ids
    one = gen(llm, ids[0], GREEDY)  # a single token-id prompt, not a batch of ints
    assert len(one) == 1 and one[0].token_ids == greedy_refs[0]
    text = gen(llm, PROMPTS[0], GREEDY)[0]
    assert text.prompt_token_ids == ids[0] and text.text == one[0].text
    seeded = sampled(seed=21)
    assert gen(llm, PROMPTS[3], seeded)[0].token_ids == gen(llm, [ids[3]], seeded)[0].token_ids


def test_chat(llm) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "List three colours."}]
    out = llm.chat(messages, GREEDY)
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.finished and len(out.token_ids) == N
    assert out.token_ids == gen(llm, [ids], GREEDY)[0].token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert not math.isnan(out.metrics["finish_time"])


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_never_shrinks(llm, greedy_refs, include: bool) -> None:
    """Cumulative text in each step's output only grows: the start of a stop string is held
    back until it is known not to be one, so a streaming client never sees text withdrawn."""
    prompt, _, text, s, start, _ = _stop_string_case(llm, greedy_refs, spanning=True)
    eng = llm.engine
    req = eng.add_request(prompt, SamplingParams(max_tokens=N, temperature=0.0, stop=[s, "\x00x"],
                                                 include_stop_str_in_output=include))
    texts = []
    while eng.has_unfinished():
        texts += [o.text for o in eng.step() if o.request_id == req.request_id]
    assert texts[-1] == text[: start + (len(s) if include else 0)]
    for a, b in itertools.pairwise(texts):
        assert b.startswith(a), f"streamed text went from {a!r} to {b!r}"
