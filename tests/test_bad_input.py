"""Bad input gets a clear error that names the problem, and the engine keeps serving.

Bad prompts and parameters (offline API and engine API, before and mid-flight), aborts,
requests that could never fit the KV pool, and directories that are not models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hlserve import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from hlserve.tokenizer import Tokenizer

MAX_LEN = 64
VOCAB = 4096
GOOD = [[5, 6, 7, 8, 9], list(range(100, 112)), list(range(1000, 1020)), "Hello there"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_pages=32, max_model_len=MAX_LEN,
               chunk_size=8, check_invariants=True)


@pytest.fixture(scope="module")
def refs(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(GOOD, GREEDY, use_tqdm=False)]


def assert_serves(llm: LLM, refs: list[list[int]]) -> None:
    """The engine is idle, holds no pages, and generates exactly what it did before."""
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_used == 0
    assert [o.token_ids for o in llm.generate(GOOD, GREEDY, use_tqdm=False)] == refs
    assert llm.engine.kv.num_used == 0


# ---- bad prompts --------------------------------------------------------------------------

BAD_PROMPTS = {
    "empty-string": ("", "empty"),
    "empty-ids": ([], "empty"),
    "as-long-as-the-model": (list(range(3, 3 + MAX_LEN)), "maximum context length is 64"),
    "longer-than-the-model": (list(range(3, 3 + 100)), "maximum context length is 64"),
    "long-text": ("word " * 200, "maximum context length is 64"),
    "id-too-large": ([5, 6, VOCAB], f"token id {VOCAB} is not in the vocabulary"),
    "id-negative": ([-1, 5], "token id -1 is not in the vocabulary"),
    "id-not-int": ([5, "6"], "list of int token ids"),
    "id-bool": ([5, True], "list of int token ids"),
    "id-float": ([5.0, 6], "list of int token ids"),
}


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompt(llm, refs, name: str) -> None:
    prompt, message = BAD_PROMPTS[name]
    # alone, and as the second of a batch: nothing of the batch is submitted
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=f"prompt 1: .*{message}"):
        llm.generate([GOOD[0], prompt, GOOD[1]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request(prompt, GREEDY)
    assert_serves(llm, refs)


def test_single_empty_string_prompt(llm, refs) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    assert_serves(llm, refs)


def test_longest_prompt_that_fits(llm) -> None:
    prompt = list(range(3, 3 + MAX_LEN - 1))
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


# ---- bad sampling parameters ------------------------------------------------------------------

BAD_PARAMS = {
    "max_tokens-0": (dict(max_tokens=0), "max_tokens"),
    "max_tokens-negative": (dict(max_tokens=-3), "max_tokens"),
    "max_tokens-float": (dict(max_tokens=2.5), "max_tokens"),
    "temperature-negative": (dict(temperature=-0.5), "temperature"),
    "temperature-nan": (dict(temperature=float("nan")), "temperature"),
    "temperature-inf": (dict(temperature=float("inf")), "temperature"),
    "temperature-str": (dict(temperature="1"), "temperature"),
    "top_p-0": (dict(top_p=0.0), "top_p"),
    "top_p-above-1": (dict(top_p=1.5), "top_p"),
    "top_p-negative": (dict(top_p=-0.1), "top_p"),
    "top_p-nan": (dict(top_p=float("nan")), "top_p"),
    "min_p-negative": (dict(min_p=-0.1), "min_p"),
    "min_p-above-1": (dict(min_p=1.5), "min_p"),
    "min_p-nan": (dict(min_p=float("nan")), "min_p"),
    "logprobs-negative": (dict(logprobs=-1), "logprobs"),
    "logprobs-above-20": (dict(logprobs=21), "logprobs"),
    "logprobs-float": (dict(logprobs=1.5), "logprobs"),
    "top_k-negative": (dict(top_k=-2), "top_k"),
    "top_k-float": (dict(top_k=2.5), "top_k"),
    # the crash: beyond int64, torch.tensor() fails the whole batch's step
    "top_k-beyond-int64": (dict(top_k=1180591620717411303424), "top_k"),
    "top_k-beyond-int32": (dict(top_k=2**31), "top_k"),
    "max_tokens-beyond-int32": (dict(max_tokens=2**31), "max_tokens"),
    "temperature-beyond-float32": (dict(temperature=1e39), "temperature"),
    "stop_token_ids-beyond-int32": (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    "stop_token_ids-beyond-int64": (dict(stop_token_ids=[2**70]), "stop_token_ids"),
    "min_tokens-above-max": (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    "min_tokens-negative": (dict(min_tokens=-1), "min_tokens"),
    "seed-too-large": (dict(seed=2**64), "seed"),
    "seed-str": (dict(seed="42"), "seed"),
    "stop-empty": (dict(stop=[""]), "stop"),
    "stop-not-str": (dict(stop=[1]), "stop"),
    "stop_token_ids-negative": (dict(stop_token_ids=[-1]), "stop_token_ids"),
    "stop_token_ids-str": (dict(stop_token_ids=["a"]), "stop_token_ids"),
    "stop_token_ids-not-a-list": (dict(stop_token_ids=object()), "stop_token_ids"),
}


@pytest.mark.parametrize("name", list(BAD_PARAMS))
def test_bad_sampling_params(llm, refs, name: str) -> None:
    kwargs, message = BAD_PARAMS[name]
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)
    if name.endswith("not-a-list"):
        return
    # the engine checks again: a value slipped past the constructor must not reach a batch,
    # where it would fail the step of every request in it
    params = SamplingParams(max_tokens=8)
    for key, value in kwargs.items():
        object.__setattr__(params, key, value)
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(GOOD, [GREEDY, params, GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request(GOOD[0], params)
    assert_serves(llm, refs)


def test_params_of_the_wrong_type(llm, refs) -> None:
    with pytest.raises(InvalidRequestError, match="must be SamplingParams, got dict"):
        llm.generate(GOOD[0], [{"max_tokens": 4}], use_tqdm=False)
    assert_serves(llm, refs)


def test_lenient_params_are_normalised() -> None:
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == () and p.stop_token_ids == ()
    p = SamplingParams(stop="x", stop_token_ids=7, seed=-1)
    assert p.stop == ("x",) and p.stop_token_ids == (7,)
    assert SamplingParams(temperature=1e-9).greedy and not SamplingParams(temperature=0.1).greedy


def test_mismatched_params_list(llm, refs) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(GOOD[:3], [GREEDY, GREEDY], use_tqdm=False)
    assert_serves(llm, refs)


def test_duplicate_request_id(llm, refs) -> None:
    eng = llm.engine
    eng.add_request(GOOD[0], GREEDY, request_id="dup")
    with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
        eng.add_request(GOOD[1], GREEDY, request_id="dup")
    outs = _drain(eng)
    assert outs["dup"].token_ids == refs[0]
    assert_serves(llm, refs)


@pytest.mark.parametrize("messages", [[{"content": "no role"}], "a string", None, [1, 2]])
def test_bad_chat_messages(llm, refs, messages) -> None:
    with pytest.raises(InvalidRequestError, match="chat template failed on these messages"):
        llm.chat(messages, GREEDY)
    assert_serves(llm, refs)


@pytest.mark.parametrize("template, kwargs", [
    ("{% for i in range(n) %}{% endfor %}", {"n": 10**9}),  # the sandbox: OverflowError
    ("{{ 1 // d }}", {"d": 0}),  # ZeroDivisionError
    ("{{ '%d' % n }}", {"n": "x"}),  # TypeError
])
def test_a_template_that_raises_on_the_clients_values_is_the_clients_error(
        tiny_llama: Path, template: str, kwargs: dict[str, Any]) -> None:
    """Whatever a template's operation raises on a value the client sent (here through
    ``chat_template_kwargs``) is an InvalidRequestError, which the server answers with a
    400 (vLLM answers any error from rendering so); an OverflowError or ZeroDivisionError
    was a 500."""
    tok = Tokenizer.from_dir(tiny_llama)
    assert tok is not None
    tok.chat_template = template
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        tok.encode_chat(messages, **kwargs)


# ---- mid-flight ---------------------------------------------------------------------------


def _drain(eng, seen: dict | None = None) -> dict:
    """Step until idle; every request must end exactly once."""
    seen = {} if seen is None else seen
    while eng.has_unfinished():
        _collect(eng.step(), seen)
    return seen


def _collect(outs, seen: dict) -> None:
    for out in outs:
        assert out.request_id not in seen, f"{out.request_id} reported after it ended"
        if out.finished:
            seen[out.request_id] = out


def test_bad_request_mid_flight(llm, refs) -> None:
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in GOOD]
    seen: dict = {}
    for _ in range(3):
        _collect(eng.step(), seen)
    assert eng.kv.num_used > 0
    for prompt, message in (([], "empty"), (list(range(3, 200)), "maximum context length"),
                            ([VOCAB + 5], "not in the vocabulary")):
        with pytest.raises(InvalidRequestError, match=message):
            eng.add_request(prompt, GREEDY)
        _collect(eng.step(), seen)
    with pytest.raises(InvalidRequestError, match="top_p"):
        eng.add_request(GOOD[0], SamplingParams(top_p=2.0))
    _drain(eng, seen)
    assert [seen[r.request_id].token_ids for r in reqs] == refs
    assert all(seen[r.request_id].finish_reason == "length" for r in reqs)
    assert eng.kv.num_used == 0
    assert_serves(llm, refs)


def test_abort_mid_flight(llm, refs) -> None:
    eng = llm.engine
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(p, GREEDY) for p in GOOD]
    victim = eng.add_request(GOOD[1], long)
    seen: dict = {}
    for _ in range(4):
        _collect(eng.step(), seen)
    assert victim.request_id not in seen and len(victim.output_token_ids) > 0
    assert eng.abort(victim.request_id) is True
    assert eng.abort(victim.request_id) is False, "a request ends once"
    assert eng.abort("no-such-request") is False
    # a request aborted before it ever ran
    queued = eng.add_request(GOOD[2], GREEDY)
    assert eng.abort(queued.request_id) is True
    _drain(eng, seen)
    for r in (victim, queued):
        out = seen[r.request_id]
        assert out.finished and out.finish_reason == "abort"
    assert seen[queued.request_id].token_ids == []
    v = seen[victim.request_id].token_ids
    assert 0 < len(v) < 40 and v == refs[1][: len(v)]
    assert [seen[r.request_id].token_ids for r in reqs] == refs
    assert eng.kv.num_used == 0
    assert_serves(llm, refs)


# ---- the KV pool ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pool(tiny_llama: Path) -> LLM:
    # 4 pages of 16 tokens: 64 tokens of KV in all; the model itself allows 32768
    return LLM(str(tiny_llama), dtype="float32", num_pages=4, page_size=16, check_invariants=True)


def test_request_that_never_fits_the_pool(small_pool) -> None:
    prompt = list(range(10, 50))  # 40 tokens
    with pytest.raises(InvalidRequestError, match="needs up to 140 tokens of KV cache; the pool holds 64"):
        small_pool.generate([prompt], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="pool holds 64"):
        small_pool.engine.add_request(prompt, SamplingParams(max_tokens=100))
    assert not small_pool.engine.has_unfinished()
    # what fits alone is served, even when two such requests cannot be resident together
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = small_pool.generate([prompt], params, use_tqdm=False)[0].token_ids
    outs = small_pool.generate([prompt, list(range(60, 100))], params, use_tqdm=False)
    assert outs[0].token_ids == alone and all(len(o.token_ids) == 20 for o in outs)
    assert small_pool.engine.kv.num_used == 0


# ---- model directories and engine options ---------------------------------------------------

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")


def _copy(src: Path, dst: Path, files=MODEL_FILES) -> Path:
    dst.mkdir()
    for f in files:
        (dst / f).symlink_to(src / f)
    return dst


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    _copy(src, dst, [f for f in MODEL_FILES if f != "config.json"])
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _write(dst: Path, src: Path, name: str, content: str | bytes, keep=MODEL_FILES) -> Path:
    _copy(src, dst, [f for f in keep if f != name])
    if isinstance(content, bytes):
        (dst / name).write_bytes(content)
    else:
        (dst / name).write_text(content)
    return dst


def _load(path: Path) -> LLM:
    return LLM(str(path), dtype="float32", num_pages=8)


def test_unknown_model_directory(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        _load(tmp_path / "no-such-model")


def test_file_instead_of_directory(tiny_llama) -> None:
    with pytest.raises(ModelLoadError, match="is not a directory"):
        _load(tiny_llama / "config.json")


def test_empty_directory(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match=r"not a model directory: config\.json not found"):
        _load(tmp_path)


def test_unsupported_architecture(tiny_llama, tmp_path) -> None:
    path = _edit_config(tiny_llama, tmp_path / "bert", architectures=["BertForMaskedLM"])
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['BertForMaskedLM'\]"):
        _load(path)


def test_config_without_weights(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path / "m", ["config.json", "tokenizer.json"])
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        _load(path)


def test_corrupted_config(tiny_llama, tmp_path) -> None:
    path = _write(tmp_path / "m", tiny_llama, "config.json", '{"architectures": ["LlamaFor')
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        _load(path)


def test_config_missing_a_field(tiny_llama, tmp_path) -> None:
    path = _edit_config(tiny_llama, tmp_path / "m", hidden_size=None)
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        _load(path)


def test_config_disagrees_with_weights(tiny_llama, tmp_path) -> None:
    path = _edit_config(tiny_llama, tmp_path / "m", intermediate_size=512)
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight has shape"):
        _load(path)


def test_config_not_an_object(tiny_llama, tmp_path) -> None:
    path = _write(tmp_path / "m", tiny_llama, "config.json", "[1, 2, 3]")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        _load(path)


def test_corrupted_weights(tiny_llama, tmp_path) -> None:
    path = _write(tmp_path / "m", tiny_llama, "model.safetensors", b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        _load(path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_corrupted_tokenizer_files(tiny_llama, tmp_path, name: str) -> None:
    path = _write(tmp_path / "m", tiny_llama, name, "{oops")
    with pytest.raises(ModelLoadError, match=name):
        _load(path)


def test_model_without_tokenizer(tiny_llama, tmp_path) -> None:
    llm = _load(_copy(tiny_llama, tmp_path / "m", ["config.json", "model.safetensors"]))
    assert llm.tokenizer is None
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate("some text", GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    out = llm.generate([[5, 6, 7, 8, 9]], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 10 and out.text == ""


def test_unknown_engine_option(tiny_llama) -> None:
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['max_model_length'\]"):
        LLM(str(tiny_llama), max_model_length=64)


@pytest.mark.parametrize("options,message", [
    (dict(num_pages=0), "num_pages"),
    (dict(page_size=0), "page_size"),
    (dict(mixing="sometimes"), "mixing"),
    (dict(dtype="float64"), "dtype"),
])
def test_bad_engine_option_value(tiny_llama, options, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), **options)

