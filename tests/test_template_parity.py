"""An agent's history rendered by hlserve exactly as transformers renders it: ``/tokenize``
of a history with a system prompt, tools, an assistant turn whose tool-call ``arguments``
are the OpenAI JSON string, and the tool's result, against transformers'
``apply_chat_template(tokenize=True)`` of the same history with the arguments as dicts (what
vLLM hands the template). Two templates that render arguments with ``| tojson``: the tiny
model's template made Qwen2.5's in how it renders arguments and a Llama-3.1-style one
(tool calls as ``{"name": ..., "parameters": ...}``, results under the ``ipython`` role)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from hlserve.server.runtime.launch import ServerProcess

transformers = pytest.importorskip("transformers")

ARGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048",
        "--uvicorn-log-level", "warning", "--cpu-threads", "1"]

# the parts of Llama 3.1's template that an agent's history goes through
LLAMA31 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- system }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' and loop.first and tools is not none %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions:\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- message['content'] + '<|eot_id|>' }}"
    "{%- elif message['role'] in ('user', 'system') or (message['role'] == 'assistant' "
    "and message.tool_calls is not defined) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif message.tool_calls is defined %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' + '<|eot_id|>' }}"
    "{%- elif message['role'] in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}"
    "{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}]
ARGUMENTS = {"city": "Zürich", "unit": "c", "days": [1, 2]}
HISTORY = [
    {"role": "system", "content": "You are a weather agent. Use the tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
]


def with_template(src: Path, dst: Path, style: str) -> Path:
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if style == "llama3.1":
        cfg["chat_template"] = LLAMA31
    else:  # the tiny template passes string arguments through; Qwen2.5's always | tojson
        literal = "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}" \
                  "{{- fn['arguments'] | tojson }}{%- endif %}"
        assert literal in cfg["chat_template"]
        cfg["chat_template"] = cfg["chat_template"].replace(
            literal, "{{- fn['arguments'] | tojson }}")
    path.write_text(json.dumps(cfg))
    return dst


def transformers_ids(model: Path) -> list[int]:
    messages = copy.deepcopy(HISTORY)
    messages[2]["tool_calls"][0]["function"]["arguments"] = dict(ARGUMENTS)
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    out: Any = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                       tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.mark.parametrize("style", ["qwen2.5", "llama3.1"])
def test_tokenize_equals_apply_chat_template(style: str, tiny_model_dirs: dict[str, Path],
                                             tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HLSERVE_CPU_KERNELS", "0")  # nothing is generated: no kernel build
    model = with_template(tiny_model_dirs["qwen2"], tmp_path / "m", style)
    expected = transformers_ids(model)
    with ServerProcess(model, ARGS, log_path=tmp_path / "server.log") as srv:
        r = httpx.post(srv.url + "/tokenize", timeout=60,
                       json={"model": "tiny", "messages": HISTORY, "tools": TOOLS})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == expected
        text = httpx.post(srv.url + "/detokenize", timeout=60,
                          json={"model": "tiny", "tokens": expected}).json()["prompt"]
    # the arguments appear once, as the object, not as a JSON-encoded string
    assert json.dumps(ARGUMENTS, ensure_ascii=False) in text and '\\"city\\"' not in text
