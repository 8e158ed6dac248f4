"""``--reasoning-parser``: ``<think>`` text into ``reasoning_content``, whole and streamed
(deltas that concatenate to the unstreamed split), on strings of the shape Qwen3 and
DeepSeek-R1 write and on a real ``hlserve serve`` process."""

from __future__ import annotations

import random
from pathlib import Path

import openai
import pytest

from hlserve.server.runtime.launch import ServerProcess
from hlserve.server.tools.reasoning import REASONING_PARSERS, ReasoningStream

QWEN3 = "<think>\nThe user wants 1 + 2. That is 3.\n</think>\n\nThe answer is 3."
R1 = "Okay, 1 + 2 = 3; no </thin trick here.\n</think>\n\nIt is **3**."
CASES = [("qwen3", QWEN3, "\nThe user wants 1 + 2. That is 3.\n", "\n\nThe answer is 3."),
         ("qwen3", "Just 3.", None, "Just 3."),  # enable_thinking=false: no tags
         ("deepseek_r1", R1, "Okay, 1 + 2 = 3; no </thin trick here.\n", "\n\nIt is **3**."),
         ("deepseek_r1", "<think>cut before it ended", "cut before it ended", ""),
         ("qwen3", "<think>cut before it ended", "cut before it ended", "")]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_split_whole_and_streamed(name: str, text: str, reasoning: str | None,
                                  content: str) -> None:
    parser = REASONING_PARSERS[name]
    assert parser.split(text) == (reasoning, content)
    for seed in range(4):
        rng, rs, at, thought, shown = random.Random(seed), ReasoningStream(parser), 0, "", ""
        while at < len(text):
            at = min(len(text), at + rng.randint(1, 4))
            delta, so_far = rs.step(text[:at], at == len(text))
            assert so_far.startswith(shown)  # content never taken back
            thought, shown = thought + delta, so_far
        assert (thought or None, shown) == (reasoning, content)


@pytest.fixture(scope="module")
def client(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("reasoning")
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "1024",
            "--uvicorn-log-level", "warning", "--cpu-threads", "1",
            "--reasoning-parser", "deepseek_r1"]
    with ServerProcess(tiny_model_dirs["qwen2"], args, log_path=tmp / "server.log") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert "Traceback" not in srv.log_text()


def test_server_reasoning_content(client: openai.OpenAI) -> None:
    """DeepSeek-R1's template opens <think> in the prompt: a reply without </think> is all
    reasoning; streamed deltas say the same."""
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
          "temperature": 0}
    msg = client.chat.completions.create(**kw).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and msg.content is None
    streamed, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (streamed, content) == (reasoning, "")
    # a constrained reply is not split: the grammar leaves no room to think
    r = client.chat.completions.create(extra_body={"guided_choice": ["yes", "no"]}, **kw)
    assert r.choices[0].message.content in ("yes", "no")
