"""Greedy tokens with n-gram speculation equal transformers' forward in every configuration
tests/test_correctness.py covers (issue 24, point 1): chunk sizes from 16 to unlimited, both
mixing policies, page sizes 1, 4 and 16, no prefix cache, every preset and mode, and a pool
small enough to force retraction while drafts are in flight.

The prompts repeat phrases so the speculator proposes and some drafts are accepted (the tiny
model's random weights then tend to repeat too); each case asserts that speculation really
ran, so a configuration that silently turned it off fails instead of passing trivially.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hlserve import LLM, SamplingParams
from support import hf_greedy

MAX_NEW = 20
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4}



def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    phrase, shared = ids(8), ids(48)
    return [phrase * 4, ids(7), phrase * 2 + ids(30) + phrase, ids(129),
            shared + phrase * 3, shared + ids(21), (phrase + ids(3)) * 6, ids(2) * 20]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path]):
    path = tiny_model_dirs[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size)
    return path, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


CONFIGS = {
    "unchunked": {},
    "chunk16": {"chunk_size": 16},
    "chunk64-budget96": {"chunk_size": 64, "token_budget": 96},
    "prefill_first-chunk32": {"chunk_size": 32, "mixing": "prefill_first"},
    "no-prefix-cache": {"enable_prefix_caching": False, "chunk_size": 128},
    "page1": {"page_size": 1, "chunk_size": 50},
    "page4-chunk8": {"page_size": 4, "chunk_size": 8},
    "mode=throughput": {"mode": "throughput"},
    "mode=slo": {"mode": "slo", "token_budget": 64},
    "sglang": {"preset": "sglang", "chunk_size": 32},
    "vllm": {"preset": "vllm"},
    "sarathi": {"preset": "sarathi", "chunk_size": 48, "token_budget": 48},
}


def run(path: Path, prompts: list[list[int]], **opts) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", check_invariants=True, speculative_config=NGRAM,
              **opts)
    return llm, [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_speculated(llm: LLM) -> None:
    stats = llm.engine.spec_stats
    assert stats is not None and stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert llm.engine.kv.num_used == 0  # rejected drafts' pages included


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_greedy_matches_transformers(case, name: str) -> None:
    path, prompts, refs = case
    llm, outs = run(path, prompts, **CONFIGS[name])
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out == ref, f"prompt {i} diverged under {name} with speculation"
    assert_speculated(llm)


@pytest.mark.parametrize("opts", [
    {"page_size": 16, "chunk_size": 64},
    {"mode": "throughput", "admission": "chunk", "page_size": 16},
    {"page_size": 4, "chunk_size": 16},
], ids=["default", "throughput", "page4"])
def test_retraction_with_drafts_in_flight_keeps_tokens(case, opts) -> None:
    path, prompts, refs = case
    num_pages = 24 if opts["page_size"] == 16 else 96  # too small for all at once
    llm, outs = run(path, prompts, num_pages=num_pages, **opts)
    assert llm.engine.scheduler.num_retractions > 0, "the pool was meant to force retraction"
    assert outs == refs
    assert_speculated(llm)


@pytest.mark.parametrize(("decode_path", "page_size"), [
    ("cpu_kernel", 1), ("cpu_kernel", 16), ("padded", 1), ("per_sequence", 16)])
def test_verify_rows_on_every_decode_path(case, decode_path: str, page_size: int,
                                          monkeypatch) -> None:
    """A speculating decode's 1 + k rows run as decodes of lengths start+1..start+1+k on the
    batched paths (the CPU kernel; the padded call CUDA uses, run here on the CPU), and as a
    prefill over its context where decodes go one by one: the same tokens on each."""
    from hlserve.models.cpu_kernels import decode_op
    from hlserve.runner.torch_runner import TorchRunner

    if decode_path == "cpu_kernel" and decode_op() is None:
        pytest.skip("the CPU decode kernel did not build")
    monkeypatch.setattr(TorchRunner, "_decode_path", lambda self, head_dim: decode_path)
    monkeypatch.setattr(TorchRunner, "_prefill_path", lambda self, head_dim: "sdpa")
    path, prompts, refs = case
    llm, outs = run(path, prompts, page_size=page_size, chunk_size=32)
    assert llm.engine.runner.decode_path == decode_path
    assert outs == refs
    assert_speculated(llm)
