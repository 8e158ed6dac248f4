"""Penalties, logit_bias, n / best_of, echo, /tokenize and /detokenize over HTTP: a real
``hlserve serve`` process, the official ``openai`` client, and transformers' logits of the
same weights (adjusted by hand) as the reference. Also: the request bodies that vLLM's and
SGLang's benchmark clients send, as they build them, are accepted."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from hlserve.server.runtime.launch import ServerProcess
from hlserve.tokenizer import Tokenizer
from servers import BASE_ARGS, sse_events
from test_penalties import hf_adjusted_greedy

MODEL = "tiny"
MAX_LEN = 512
N = 10
GREEDY = {"temperature": 0.0, "max_tokens": N}
IDS = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("sampling") / "server.log"
    args = [*BASE_ARGS, "--served-model-name", MODEL, "--max-model-len", str(MAX_LEN),
            "--page-size", "16"]
    with ServerProcess(tiny_llama, args, log_path=log) as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Tokenizer:
    t = Tokenizer.from_dir(tiny_llama)
    assert t is not None
    return t


def metric(http: httpx.Client, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(http.get("/metrics").text)
               for s in f.samples if s.name == name)


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---- penalties and logit_bias ---------------------------------------------------------------


@pytest.mark.parametrize("kw", [{"repetition_penalty": 1.7}, {"presence_penalty": 1.2},
                                {"frequency_penalty": 0.8},
                                {"repetition_penalty": 1.2, "frequency_penalty": 0.5}])
def test_penalties_match_transformers(client, hf, kw) -> None:
    prompt = [40, 41, 42, 43] * 5
    extra = {**IDS, **{k: v for k, v in kw.items() if k == "repetition_penalty"}}
    std = {k: v for k, v in kw.items() if k != "repetition_penalty"}
    out = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, **std, extra_body=extra)
    ref = hf_adjusted_greedy(hf, prompt, N, rep=kw.get("repetition_penalty", 1.0),
                             presence=kw.get("presence_penalty", 0.0),
                             frequency=kw.get("frequency_penalty", 0.0))
    assert ref != hf_adjusted_greedy(hf, prompt, N)
    assert ids_of(out.choices[0]) == ref


def test_chat_penalty_and_logit_bias_match_transformers(client, hf) -> None:
    msgs = [{"role": "user", "content": "Say something, then say it again."}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY, extra_body=IDS)
    prompt = plain.choices[0].model_extra["prompt_token_ids"]
    assert ids_of(plain.choices[0]) == hf_adjusted_greedy(hf, prompt, N)
    bias = {t: -100.0 for t in set(ids_of(plain.choices[0]))} | {77: 2.0}
    out = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY, presence_penalty=0.9,
                                         logit_bias={str(t): b for t, b in bias.items()},
                                         extra_body=IDS)
    ref = hf_adjusted_greedy(hf, prompt, N, presence=0.9, bias=bias)
    assert not set(ref) & set(ids_of(plain.choices[0]))
    assert ids_of(out.choices[0]) == ref


# ---- n and best_of ----------------------------------------------------------------------------


def test_greedy_n_identical_choices_share_prompt_pages(client, http, hf) -> None:
    prompt = list(range(600, 640))  # 40 tokens: two full pages of 16
    hits0 = metric(http, "hlserve:prefix_cache_hits_total")
    out = client.completions.create(model=MODEL, prompt=prompt, n=3, **GREEDY, extra_body=IDS)
    ref = hf_adjusted_greedy(hf, prompt, N)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(ids_of(c) == ref for c in out.choices)
    assert out.usage.prompt_tokens == 40 and out.usage.completion_tokens == 3 * N
    # the two siblings found the first one's two full prompt pages in the prefix cache
    assert metric(http, "hlserve:prefix_cache_hits_total") - hits0 == 2 * 32
    deadline = time.monotonic() + 10  # the gauge is published after the engine's step
    while metric(http, "hlserve:kv_cache_usage_perc") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(http, "hlserve:kv_cache_usage_perc") == 0  # every page handed back


def test_choices_of_several_prompts_in_vllm_order(client, hf) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY, extra_body=IDS)
    refs = [hf_adjusted_greedy(hf, p, N) for p in prompts]
    assert [ids_of(c) for c in out.choices] == [refs[0], refs[0], refs[1], refs[1]]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


def test_seeded_siblings_differ_and_are_seed_plus_i(client) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": N, "temperature": 1.0,
          "extra_body": IDS}
    out = client.completions.create(n=3, seed=11, **kw)
    ids = [ids_of(c) for c in out.choices]
    assert len({tuple(x) for x in ids}) == 3
    singles = [ids_of(client.completions.create(seed=11 + i, **kw).choices[0]) for i in range(3)]
    assert ids == singles


def test_streamed_n_matches_unstreamed(client) -> None:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": N,
          "temperature": 1.0, "seed": 5, "n": 2, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kw)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 2 * N


def test_best_of_returns_highest_cumulative_logprob(client) -> None:
    kw = {"model": MODEL, "prompt": "The answer is", "max_tokens": 6, "temperature": 1.0,
          "extra_body": IDS}
    out = client.completions.create(n=1, best_of=4, seed=21, **kw)
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    singles = [client.completions.create(seed=21 + i, logprobs=0, **kw).choices[0]
               for i in range(4)]
    best = max(singles, key=lambda c: sum(c.logprobs.token_logprobs))
    assert ids_of(out.choices[0]) == ids_of(best)


# ---- echo -------------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(client, tok) -> None:
    plain = client.completions.create(model=MODEL, prompt="Hello there", **GREEDY)
    echo = client.completions.create(model=MODEL, prompt="Hello there", echo=True, **GREEDY)
    assert echo.choices[0].text == "Hello there" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello there", echo=True, stream=True, **GREEDY) if c.choices)
    assert streamed == echo.choices[0].text
    ids = [300, 301, 302]
    out = client.completions.create(model=MODEL, prompt=ids, echo=True, n=2, **GREEDY)
    gen = client.completions.create(model=MODEL, prompt=ids, **GREEDY).choices[0].text
    head = tok.decode(ids, skip_special_tokens=False)
    assert [c.text for c in out.choices] == [head + gen] * 2


def test_a_stream_keeps_unicode_line_breaks_inside_its_events(http) -> None:
    """U+0085, U+2028 and U+2029 are line breaks to str.splitlines, and so to httpx's
    iter_lines and many agents' SSE readers: sent raw, one cut an event in two in the soak
    test. Escaped in the JSON, each event stays one line and decodes to the same text."""
    prompt = "one\u2028two\u2029three\x85four"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    text = "".join(c["text"] for ev in events[:-1] for c in ev["choices"])
    assert text.startswith(prompt)


# ---- /tokenize and /detokenize ------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize(http, client, tok, prefix: str) -> None:
    text = "Hello world, hello tokens"
    r = http.post(f"{prefix}/tokenize", json={"model": MODEL, "prompt": text,
                                              "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tok.encode(text, True) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_LEN
    assert body["token_strs"] == [tok.token_str(t) for t in body["tokens"]]
    raw = http.post(f"{prefix}/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert raw.json()["tokens"] == tok.encode(text, False) and raw.json()["token_strs"] is None
    back = http.post(f"{prefix}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {
        "prompt": tok.decode(body["tokens"], skip_special_tokens=False)}
    msgs = [{"role": "user", "content": "hi"}]
    chat = http.post(f"{prefix}/tokenize", json={"model": MODEL, "messages": msgs}).json()
    served = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                            extra_body={"return_token_ids": True})
    assert chat["tokens"] == served.choices[0].model_extra["prompt_token_ids"]
    assert chat["count"] == served.usage.prompt_tokens


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "add_special_token": True}, "add_special_token"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
])
def test_tokenize_bad_input_is_400(http, client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices


# ---- what benchmark clients send ------------------------------------------------------------------


def bench_bodies(prompt: str, n: int) -> dict[str, tuple[str, dict]]:
    """Request bodies as the benchmark clients build them (the values their defaults give)."""
    return {
        # vllm bench serve --backend openai: the payload of async_request_openai_completions,
        # with serve's default sampling extras (temperature 0.0) and --ignore-eos
        "vllm-openai": ("/v1/completions", {
            "model": MODEL, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": n,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}),
        # the same with every sampling flag of vllm bench serve set
        "vllm-openai-sampling-flags": ("/v1/completions", {
            "model": MODEL, "prompt": prompt, "repetition_penalty": 1.1, "max_tokens": n,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "top_p": 0.9, "top_k": 20, "min_p": 0.05, "temperature": 0.7,
            "frequency_penalty": 0.1, "presence_penalty": 0.1, "ignore_eos": True}),
        # vllm bench serve --backend openai-chat: content as a list of text parts
        "vllm-openai-chat": ("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "text", "text": prompt}]}],
            "max_completion_tokens": n, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.0}),
        # sglang.bench_serving --backend vllm / openai (completions) and openai-chat
        "sglang-completions": ("/v1/completions", {
            "model": MODEL, "prompt": prompt, "temperature": 0.0, "best_of": 1,
            "max_tokens": n, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}),
        "sglang-chat": ("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0, "max_tokens": n, "stream": True, "ignore_eos": True}),
    }


@pytest.mark.parametrize("name", list(bench_bodies("", 1)))
def test_benchmark_clients_bodies_are_accepted(http, name: str) -> None:
    path, body = bench_bodies("A benchmark prompt of a few words", 6)[name]
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), chunks
    text_key = "text" if path.endswith("/completions") and "chat" not in path else None
    pieces = [(c["choices"][0].get(text_key) if text_key else c["choices"][0]["delta"].get(
        "content")) for c in chunks if c.get("choices")]
    assert "".join(p or "" for p in pieces)
    if body.get("stream_options"):
        assert chunks[-1]["usage"]["completion_tokens"] == 6  # ignore_eos: all of them
