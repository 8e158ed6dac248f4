"""Speculative decoding end to end (issue 24): the real engine on the tiny Llama, with
``speculative_config`` as vLLM takes it.

Greedy outputs with speculation equal those without it and transformers' own forward, for
both methods, in the default and throughput modes and with a small chunk; a prompt that
repeats makes the speculators propose, and accepted drafts make fewer steps than tokens; the
KV pool balances after every step and ends empty; stop strings and max_tokens cut exactly;
sampling with a seed runs; the counters reach /metrics of a real ``hlserve serve``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from hlserve import LLM, SamplingParams
from hlserve.config import SpeculativeConfig
from hlserve.engine.args import make_config, parse_engine_args
from hlserve.server.runtime.launch import ExternalServer, free_port
from servers import BASE_ARGS, metric
from support import hf_greedy

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SPEC = {m: {"method": m, "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2} for m in ("ngram", "suffix")}
SPEC["suffix"] = {"method": "suffix", "num_speculative_tokens": 3}
CONFIGS = {"default": {}, "throughput": {"mode": "throughput"},
           "chunk8": {"chunk_size": 8, "page_size": 4}}


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(3, vocab) for _ in range(10)]
    return [phrase * 5,  # repeats: n-gram proposals happen
            [rng.randrange(3, vocab) for _ in range(37)],
            phrase * 2 + [rng.randrange(3, vocab) for _ in range(9)]]


@pytest.fixture(scope="module")
def case(tiny_llama: Path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)
    return tiny_llama, ps, [hf_greedy(hf, p, MAX_NEW) for p in ps]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("method", list(SPEC))
def test_greedy_with_speculation_is_identical(case, method: str, config: str) -> None:
    path, ps, refs = case
    plain = LLM(str(path), dtype="float32", check_invariants=True, **CONFIGS[config])
    outs = [o.token_ids for o in plain.generate(ps, GREEDY, use_tqdm=False)]
    assert outs == refs
    llm = LLM(str(path), dtype="float32", check_invariants=True,  # KV checked every step
              speculative_config=SPEC[method], **CONFIGS[config])
    spec = [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert spec == refs, f"{method} under {config} diverged"
    stats = llm.engine.spec_stats
    assert stats is not None and stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    # accepted drafts: fewer decode steps than tokens decoded
    assert llm.engine.stats.steps < plain.engine.stats.steps
    assert llm.engine.kv.num_used == 0  # no page leaked, rejected drafts' included
    llm.engine.check_invariants()


def test_repeating_prompt_steps_fewer_than_tokens(case) -> None:
    path, ps, refs = case
    llm = LLM(str(path), dtype="float32", check_invariants=True,
              speculative_config=SPEC["ngram"])
    out = llm.generate([ps[0]], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == refs[0]
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens >= stats.num_accepted_tokens > 0
    # one step prefills the prompt and samples the first token; the rest decode
    assert llm.engine.stats.steps - 1 < MAX_NEW - 1


def test_max_tokens_and_stop_cut_speculated_runs_exactly(case) -> None:
    path, ps, refs = case
    llm = LLM(str(path), dtype="float32", check_invariants=True,
              speculative_config=SPEC["ngram"])
    for n in (1, 2, 5, 7):
        out = llm.generate([ps[0]], SamplingParams(max_tokens=n, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == refs[0][:n]
    # a stop token inside an accepted run: the request ends at it, nothing after it
    stop_at = 6
    tok = refs[0][stop_at]
    first = refs[0].index(tok)
    out = llm.generate([ps[0]], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                               stop_token_ids=(tok,)), use_tqdm=False)[0]
    assert out.token_ids == refs[0][: first + 1] and out.finish_reason == "stop"
    # a stop string: the text is cut before it and no token after the one completing it
    text = llm.tokenizer.decode(refs[0])
    plain = LLM(str(path), dtype="float32")
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop=(stop,))
    want = plain.generate([ps[0]], sp, use_tqdm=False)[0]
    got = llm.generate([ps[0]], sp, use_tqdm=False)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (
        want.token_ids, want.text, want.finish_reason)
    assert want.finish_reason == "stop"
    # min_tokens masks EOS per row, as without speculation
    sp = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=8,
                        stop_token_ids=(refs[0][0],))
    assert [o.token_ids for o in llm.generate([ps[0]], sp, use_tqdm=False)] == \
        [o.token_ids for o in plain.generate([ps[0]], sp, use_tqdm=False)]
    assert llm.engine.kv.num_used == 0


def test_sampling_with_a_seed_speculates_and_repeats(case) -> None:
    path, ps, _ = case
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=50, seed=11,
                        ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(path), dtype="float32", check_invariants=True,
                  speculative_config=SPEC["suffix"])
        outs = llm.generate(ps, sp, use_tqdm=False)
        runs.append([o.token_ids for o in outs])
        vocab = llm.engine.runner.model_config.vocab_size
        assert all(len(o.token_ids) == MAX_NEW and all(0 <= t < vocab for t in o.token_ids)
                   for o in outs)
        assert llm.engine.spec_stats.num_drafts > 0
        assert llm.engine.kv.num_used == 0
    assert runs[0] == runs[1]  # the request's seed drives verification too


def test_requests_that_cannot_speculate_do_not(case) -> None:
    path, ps, _ = case
    llm = LLM(str(path), dtype="float32", speculative_config=SPEC["ngram"])
    for sp in (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=2),
               SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.3),
               SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias={5: 1.0})):
        out = llm.generate([ps[0]], sp, use_tqdm=False)[0]
        assert len(out.token_ids) == MAX_NEW
    assert llm.engine.spec_stats.num_drafts == 0


def test_the_flag_is_vllms_and_bad_configs_fail_at_start(tiny_llama: Path) -> None:
    text = json.dumps(SPEC["ngram"])
    opts = parse_engine_args(["--speculative-config", text])
    # parsed once, where the flag is read: the config holds the typed value itself
    assert opts["speculative_config"] == SpeculativeConfig.parse(text)
    assert opts["speculative_config"].prompt_lookup_max == 4
    assert make_config(str(tiny_llama), **opts).speculative_config is opts["speculative_config"]
    assert make_config(str(tiny_llama), speculative_config=text).speculative_config == \
        opts["speculative_config"]
    for bad, says in (("{not json", "not valid JSON"), ('{"method": "eagle", '
                      '"num_speculative_tokens": 2}', "not supported"),
                      ('{"method": "ngram"}', "num_speculative_tokens")):
        with pytest.raises(SystemExit):
            parse_engine_args(["--speculative-config", bad])
        with pytest.raises(ValueError, match=says):
            make_config(str(tiny_llama), speculative_config=bad)


def test_metrics_on_a_real_server(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "hlserve.cli", "serve", str(tiny_llama), "--host",
           "127.0.0.1", "--port", str(port), *BASE_ARGS,
           "--speculative-config", json.dumps(SPEC["ngram"])]
    vocab = 4096  # the tiny model's
    with ExternalServer(cmd, "127.0.0.1", port, tmp_path / "server.log",
                        health_timeout=180) as srv, httpx.Client(base_url=srv.url,
                                                                 timeout=120) as c:
        prompt = prompts(vocab)[0]
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_NEW,
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = c.get("/metrics").text
    drafts = metric(text, "vllm:spec_decode_num_drafts_total")
    proposed = metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(3)]
    assert drafts > 0 and proposed >= accepted > 0, text
    assert sum(per_pos) == accepted and per_pos[0] > 0
    assert metric(text, "hlserve:spec_decode_num_drafts_total") == drafts
