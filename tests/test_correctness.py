"""Greedy outputs equal Hugging Face transformers' own forward of the same weights (fp32).

Across architectures, chunk sizes from 16 to unlimited, both mixing policies, prefix-cache
hits and a pool small enough to force retraction.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hlserve import LLM, SamplingParams

MAX_NEW = 20


def make_prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 7, 16, 33, 70, 129, 200]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(3, vocab) for _ in range(48)]  # a system prompt, say
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (5, 21, 40)]
    return prompts


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The plainest reference: a full forward per token, argmax of the last position."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def case(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path]):
    path = tiny_model_dirs[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(7, hf.config.vocab_size)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return path, prompts, refs


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

CONFIGS = {
    "unchunked": {},
    "chunk16": {"chunk_size": 16},
    "chunk64-budget96": {"chunk_size": 64, "token_budget": 96},
    "prefill_first-chunk32": {"chunk_size": 32, "mixing": "prefill_first"},
    "no-prefix-cache": {"enable_prefix_caching": False, "chunk_size": 128},
    "page1": {"page_size": 1, "chunk_size": 50},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(case, name: str) -> None:
    path, prompts, refs = case
    llm = LLM(str(path), dtype="float32", check_invariants=True, **CONFIGS[name])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverged under {name}"
    # the same prompts again are served from the prefix cache, with the same tokens
    if llm.engine.config.enable_prefix_caching:
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in again] == refs
        assert sum(o.num_cached_tokens for o in again) > 0
    assert llm.engine.kv.num_used == 0


@pytest.mark.parametrize("decode_path", ["cpu_kernel", "padded", "per_sequence"])
def test_the_last_layer_runs_only_the_sampled_rows(case, decode_path: str, monkeypatch) -> None:
    """The last layer attends, projects and runs its MLP on the rows a step samples from
    only (of a prompt chunk's other rows it needs just K and V): those rows attend as
    decodes over the rest, on every decode path, and the tokens stay transformers'."""
    from hlserve.models.cpu_kernels import decode_op
    from hlserve.runner.torch_runner import TorchRunner

    if decode_path == "cpu_kernel" and decode_op() is None:
        pytest.skip("the CPU decode kernel did not build")
    monkeypatch.setattr(TorchRunner, "_decode_path", lambda self, head_dim: decode_path)
    monkeypatch.setattr(TorchRunner, "_prefill_path", lambda self, head_dim: "sdpa")
    path, prompts, refs = case
    llm = LLM(str(path), dtype="float32", chunk_size=32, enable_prefix_caching=False,
              check_invariants=True)
    assert llm.engine.runner.decode_path == decode_path
    layers = llm.engine.runner.model.model.layers
    rows: dict[str, list[int]] = {"first": [], "last": []}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        layer.mlp.register_forward_pre_hook(lambda _m, a, name=name: rows[name].append(len(a[0])))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    # every token came from one sampled row; every prompt token and fed-back token ran the
    # first layer (a step of chunks that sample nothing ran the last one on no rows)
    assert sum(rows["last"]) == len(prompts) * MAX_NEW
    assert sum(rows["first"]) == sum(len(p) + MAX_NEW - 1 for p in prompts)
    assert llm.engine.kv.num_used == 0


def test_retraction_keeps_tokens_identical(case) -> None:
    path, prompts, refs = case
    # 24 pages of 16 tokens: the long prompts and their outputs cannot all be resident
    llm = LLM(str(path), dtype="float32", num_pages=24, page_size=16, chunk_size=64,
              check_invariants=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > 0, "the pool was meant to force retraction"
    assert [o.token_ids for o in outs] == refs
    assert llm.engine.kv.num_used == 0


PRESET_CONFIGS = {
    "mode=throughput": {"mode": "throughput"},
    "mode=slo": {"mode": "slo", "token_budget": 64},
    "sglang": {"preset": "sglang", "chunk_size": 32},
    "vllm": {"preset": "vllm"},
    "sarathi": {"preset": "sarathi", "chunk_size": 48, "token_budget": 48},
    "sarathi-relaxed": {"preset": "sarathi-relaxed"},
    "throughput+priority": {"mode": "throughput", "order": "priority", "retraction": "priority"},
}


@pytest.fixture(scope="module")
def llama_case(tiny_model_dirs: dict[str, Path]):
    path = tiny_model_dirs["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(11, hf.config.vocab_size)
    return path, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("name", list(PRESET_CONFIGS))
def test_every_preset_and_mode_matches_transformers(llama_case, name: str) -> None:
    path, prompts, refs = llama_case
    llm = LLM(str(path), dtype="float32", check_invariants=True, **PRESET_CONFIGS[name])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs, name


@pytest.mark.parametrize("opts", [
    {"mode": "throughput", "admission": "chunk"},
    {"preset": "sglang", "chunk_size": 32, "admission": "chunk"},
    {"preset": "vllm", "token_budget": 64},
], ids=["throughput", "sglang", "vllm"])
def test_retraction_storm_under_presets_keeps_tokens(llama_case, opts) -> None:
    path, prompts, refs = llama_case
    llm = LLM(str(path), dtype="float32", num_pages=20, page_size=16, check_invariants=True,
              **opts)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > 0
    assert [o.token_ids for o in outs] == refs
