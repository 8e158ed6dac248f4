"""What agents send that used to get a quiet wrong answer: each request either means what it
means in vLLM, or is a 400 saying why. A real ``hlserve serve`` of the tiny model through the
official ``openai`` client, on a copy of the model dressed as agents' models are: a chat
template that renders tool-call arguments with ``| tojson`` and reads ``enable_thinking``
(as Qwen2.5 / Qwen3 do), ``<tool_call>`` a special token, and sampling defaults in
``generation_config.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hlserve.server.runtime.launch import ServerProcess

MODEL = "tiny"
ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--uvicorn-log-level", "warning", "--cpu-threads", "1",
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
TOOL_TAG_ID = 4095  # the id the copy's tokenizer gives <tool_call>, as a special token
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
USER = [{"role": "user", "content": "What is 1 + 2?"}]


def dressed(src: Path, dst: Path) -> Path:
    """A copy of the tiny model with the template, special token and defaults above."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    t = cfg["chat_template"]
    literal = "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}" \
              "{{- fn['arguments'] | tojson }}{%- endif %}"
    assert literal in t and "{{- '<|im_start|>assistant\\n' }}" in t
    t = t.replace(literal, "{{- fn['arguments'] | tojson }}")  # Qwen2.5's, Llama 3.1's
    t = t.replace("{{- '<|im_start|>assistant\\n' }}",
                  "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not "
                  "enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    cfg["chat_template"] = t
    cfg_path.write_text(json.dumps(cfg))
    tok_path = dst / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    # the vocabulary's last entry (a merge result) becomes the tag, so its id stays in range
    vocab = tok["model"]["vocab"]
    old = next(k for k, v in vocab.items() if v == TOOL_TAG_ID)
    del vocab[old]
    vocab["<tool_call>"] = TOOL_TAG_ID
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if "".join(m) != old]
    tok["added_tokens"].append({"id": TOOL_TAG_ID, "content": "<tool_call>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    tok_path.write_text(json.dumps(tok))
    gen_path = dst / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update(top_k=1, do_sample=True)  # a model that ships greedy defaults
    gen_path.write_text(json.dumps(gen))
    return dst


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("agent_api")
    model = dressed(tiny_model_dirs["qwen2"], tmp / "model")
    with ServerProcess(model, ARGS, log_path=tmp / "server.log") as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **kw: Any):
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, **kw)


def refused(client: openai.OpenAI, param: str, **kw: Any) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    body = e.value.body
    assert body["param"] == param, body
    return body["message"]


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, str, str | None]:
    """(content, concatenated tool-call arguments, finish reason) of a streamed reply."""
    content, args, reason = "", "", None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                args += tc.function.arguments or ""
            reason = c.finish_reason or reason
    return content, args, reason


# ---- 1. string arguments in the history -----------------------------------------------------


def history(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": arguments}}
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]


def test_string_arguments_render_once(server) -> None:
    """OpenAI sends arguments as a JSON string; rendered through ``| tojson`` they must
    appear as the object, exactly as the dict form renders (vLLM parses them first)."""
    def ids(arguments: Any) -> list[int]:
        r = httpx.post(server.url + "/tokenize", json={
            "model": MODEL, "messages": history(arguments), "tools": [ADD]}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    as_dict = ids({"a": 1, "b": 2})
    assert ids('{"a": 1, "b": 2}') == as_dict
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": as_dict})
    assert r.status_code == 200, r.text
    text = r.json()["prompt"]
    assert '"arguments": {"a": 1, "b": 2}' in text
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": history("{bad")})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# ---- 2, 6. what would end a constrained output elsewhere ----------------------------------------


SCHEMA_RF = {"type": "json_schema", "json_schema": {"name": "o", "schema": {
    "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}


def test_stop_under_a_grammar_is_refused(client: openai.OpenAI) -> None:
    message = refused(client, "stop", response_format=SCHEMA_RF, stop=[","])
    assert "constrained output" in message
    refused(client, "stop", tools=[ADD], tool_choice="required", stop=["}"])
    # the grammar alone: a "stop" reply parses
    r = chat(client, response_format=SCHEMA_RF, max_tokens=64, temperature=0)
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].message.content)


def test_min_tokens_and_ignore_eos_under_a_grammar_are_refused(client: openai.OpenAI) -> None:
    refused(client, "min_tokens", extra_body={"guided_choice": ["yes", "no"], "min_tokens": 10})
    refused(client, "ignore_eos", extra_body={"guided_choice": ["yes", "no"], "ignore_eos": True})
    refused(client, "min_tokens", tools=[ADD], tool_choice={"type": "function", "function": {
        "name": "add"}}, extra_body={"min_tokens": 5})


# ---- 3. logprobs after the grammar's mask --------------------------------------------------------


def test_logprobs_under_a_grammar_are_after_the_mask(client: openai.OpenAI) -> None:
    choices = ["yes", "no"]
    r = chat(client, extra_body={"guided_choice": choices}, logprobs=True, top_logprobs=5,
             temperature=0)
    text = r.choices[0].message.content
    assert text in choices
    first = r.choices[0].logprobs.content[0]
    live = [alt for alt in first.top_logprobs if alt.logprob > -9999.0]
    assert live, first
    for alt in live:  # every alternative shown is one the grammar allows here
        assert any(c.startswith(alt.token) for c in choices), (alt.token, first.top_logprobs)
    # renormalized over what the grammar allows
    assert abs(sum(2.718281828 ** a.logprob for a in live) - 1) < 1e-3 or len(live) == 5


# ---- 4, 5. shapes nothing reads -------------------------------------------------------------


def test_extra_keys_are_refused(client: openai.OpenAI) -> None:
    refused(client, "response_format", response_format={
        "type": "json_object", "schema": {"type": "object"}})
    refused(client, "tool_choice", tools=[ADD], tool_choice={
        "type": "function", "function": {"name": "add"}, "force": True})
    refused(client, "tool_choice.function", tools=[ADD], tool_choice={
        "type": "function", "function": {"name": "add", "arguments": "{}"}})
    bad_tool = {**ADD, "function": {**ADD["function"], "strict": "yes"}}
    refused(client, "tools.0.function.strict", tools=[bad_tool], tool_choice="none")
    extra_tool = {**ADD, "function": {**ADD["function"], "returns": {"type": "integer"}}}
    refused(client, "tools.0.function", tools=[extra_tool], tool_choice="none")
    # the known keys still pass: strict (a bool), description
    strict = {**ADD, "function": {**ADD["function"], "strict": True}}
    assert chat(client, tools=[strict], tool_choice="none").choices[0].finish_reason


def test_empty_tools_are_refused(client: openai.OpenAI) -> None:
    assert "empty" in refused(client, "tools", tools=[])
    assert "empty" in refused(client, "tools", tools=[], tool_choice="none")


# ---- 7. reasoning_effort ----------------------------------------------------------------------


def prompt_ids(client: openai.OpenAI, **kw: Any) -> list[int]:
    r = chat(client, max_tokens=1, extra_body={"return_token_ids": True, **kw.pop("extra", {})},
             **kw)
    return r.choices[0].model_extra["prompt_token_ids"]


def test_reasoning_effort_none_turns_thinking_off(client: openai.OpenAI) -> None:
    off = prompt_ids(client, extra={"chat_template_kwargs": {"enable_thinking": False}})
    default = prompt_ids(client)
    assert off != default
    assert prompt_ids(client, reasoning_effort="none") == off
    assert prompt_ids(client, reasoning_effort="high") == default
    # chat_template_kwargs wins over the shortcut
    assert prompt_ids(client, reasoning_effort="none",
                      extra={"chat_template_kwargs": {"enable_thinking": True}}) == default
    refused(client, "reasoning_effort", reasoning_effort="extreme")


# ---- 8. generation_config.json sampling defaults ---------------------------------------------------


def test_generation_config_defaults_apply(client: openai.OpenAI) -> None:
    """The copy's generation_config.json says top_k=1: a request that names no sampling
    fields is greedy, seeds or not; one that names top_k overrides it."""
    greedy = chat(client, max_tokens=24, temperature=0).choices[0].message.content
    for seed in (1, 2, 3):
        assert chat(client, max_tokens=24, seed=seed).choices[0].message.content == greedy
    sampled = {chat(client, max_tokens=24, seed=s, extra_body={"top_k": -1}).choices[0]
               .message.content for s in (1, 2, 3)}
    assert sampled != {greedy}


# ---- 9. a named call cut by length --------------------------------------------------------------


def test_named_call_cut_by_length_is_one_shape(client: openai.OpenAI) -> None:
    kw = {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}},
          "max_tokens": 3, "temperature": 0}
    r = chat(client, **kw)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert c.message.content is None
    assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "add"
    content, args, reason = streamed(client, **kw)
    assert (content, args, reason) == ("", c.message.tool_calls[0].function.arguments, "length")


# ---- streamed tool calls ----------------------------------------------------------------------


def stream_calls(client: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], int, str]:
    """The streamed calls by index (name, arguments), the number of argument deltas, and
    the finish reason."""
    calls: dict[int, list[str]] = {}
    n_args, reason = 0, None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                acc = calls.setdefault(tc.index, ["", ""])
                acc[0] += tc.function.name or ""
                acc[1] += tc.function.arguments or ""
                n_args += bool(tc.function.arguments)
            reason = c.finish_reason or reason
    return [tuple(calls[i]) for i in sorted(calls)], n_args, reason


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("kw", [
    {"tool_choice": "required", "max_tokens": 120, "parallel_tool_calls": False,
     "tools": [WEATHER, ADD]}], ids=["required"])
def test_streamed_calls_equal_unstreamed(client: openai.OpenAI, kw: dict) -> None:
    r = chat(client, temperature=0, **kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    whole = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    calls, n_args, reason = stream_calls(client, temperature=0, **kw)
    assert (calls, reason) == (whole, "tool_calls")
    assert n_args > 2  # the arguments stream as they are generated, not in one piece
    # (auto, streamed as it is parsed: test_structured_server.py, whose tokenizer keeps
    # <tool_call> plain text that a regex can force)


# ---- 10. a special tool-call tag -------------------------------------------------------------------


def test_special_tool_tag_reaches_the_parser(client: openai.OpenAI) -> None:
    """``<tool_call>`` is a special token of this tokenizer: with tools it must stay in the
    text (vLLM sets skip_special_tokens=False), else the parser never sees the tag."""
    kw = {"tools": [ADD], "max_tokens": 1, "logit_bias": {str(TOOL_TAG_ID): 100}}
    assert chat(client, **kw).choices[0].message.content == "<tool_call>"
    assert streamed(client, **kw)[0] == "<tool_call>"
    # without tools, special tokens are skipped as before
    assert chat(client, max_tokens=1, logit_bias={str(TOOL_TAG_ID): 100}
                ).choices[0].message.content == ""


# ---- vLLM's metric names ------------------------------------------------------------------------


def test_metrics_under_vllm_names(server, client: openai.OpenAI) -> None:
    """vLLM's dashboards query vllm:...: every family with vLLM's name and meaning is there
    too, with the same samples; hlserve's own families are not aliased."""
    from prometheus_client.parser import text_string_to_metric_families

    chat(client, max_tokens=2)
    fams = {f.name: f for f in text_string_to_metric_families(
        httpx.get(server.url + "/metrics").text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions", "prompt_tokens", "generation_tokens",
                 "prefix_cache_queries", "prefix_cache_hits", "request_success",
                 "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        ours, theirs = fams[f"hlserve:{name}"], fams[f"vllm:{name}"]
        assert [(s.name.replace("hlserve:", "vllm:"), s.labels, s.value)
                for s in ours.samples] == [(s.name, s.labels, s.value) for s in theirs.samples]
    assert "vllm:requests_rejected" not in fams and "hlserve:requests_rejected" in fams


# ---- a multi-turn tool loop through chat completions -----------------------------------------------


def test_multi_turn_tool_loop_renders_as_vllm(server, client: openai.OpenAI) -> None:
    """Calls parsed, executed, fed back as the SDK sends them (arguments as strings), twice;
    the prompt of the next turn is the history with the arguments as objects, which is what
    vLLM renders (/tokenize of the dict form)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in two cities?"}]
    for _ in range(2):
        r = chat(client, messages=messages, tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False, max_tokens=120, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        result = f"{args['city']}: 21 degrees {args['unit']}"  # the tool, executed
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    assert isinstance(messages[1]["tool_calls"][0]["function"]["arguments"], str)
    r = chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=1,
             extra_body={"return_token_ids": True})
    as_dicts = json.loads(json.dumps(messages))
    for m in as_dicts:
        for tc in m.get("tool_calls") or ():
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    t = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": as_dicts,
                                                   "tools": [WEATHER]}, timeout=60)
    assert r.choices[0].model_extra["prompt_token_ids"] == t.json()["tokens"]


def test_messages_reach_the_template_as_vllm_hands_them() -> None:
    """vLLM's "string" content format: text parts joined by newlines, and no content (an
    assistant turn that only calls tools) as "" (SmolLM2's template concatenates content
    and failed on None)."""
    from hlserve.server.protocol import ChatMessage

    parts = ChatMessage(role="user", content=[{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}])
    assert parts.for_template()["content"] == "a\nb"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool_only = ChatMessage(role="assistant", content=None, tool_calls=[call])
    assert tool_only.for_template() == {"role": "assistant", "content": "", "tool_calls": [call]}
