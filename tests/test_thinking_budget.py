"""vLLM's ``thinking_token_budget``: at most N tokens per reasoning section, then its end is
forced. The state machine on its own (sections opened by the prompt or the output, closed by
the model or by force, a fresh budget per section, budget 0); the engine's greedy tokens
against transformers' (the model's own choices up to the budget, the forced end, then the
model's greedy continuation after it, and a request without a budget in the same batch
untouched); and a real ``hlserve serve`` with ``--reasoning-parser`` (completions and chat),
the 400 without one, and the field's bounds."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from hlserve import LLM, SamplingParams
from hlserve.errors import InvalidRequestError
from hlserve.server.runtime.launch import ServerProcess
from hlserve.structured.thinking import ThinkingBudget, ThinkingState
from support import hf_greedy

START, END = (7, 8), (9, 10)


def run(spec: ThinkingBudget, prompt: list[int], choices: list[int]) -> list[int]:
    """The tokens a model that would write ``choices`` emits under ``spec``."""
    state, out = ThinkingState(spec, prompt), []
    for choice in choices:
        state.sync(out)
        forced = state.forced()
        out.append(choice if forced is None else forced)
    return out


def test_budget_forces_the_end_once_per_section() -> None:
    spec = ThinkingBudget(3, START, END)
    # the prompt opened the section: three tokens, then </think> forced, then free
    assert run(spec, [1, 2, *START], [5] * 8) == [5, 5, 5, *END, 5, 5, 5]
    # two of the section's tokens were already in the prompt
    assert run(spec, [*START, 4, 4], [5] * 4) == [5, *END, 5]
    # opened in the output: counted from after its start; a second section has its own budget
    model = [5, *START, 5, 5, 5, 5, 5, 5, *START, 6, 6, 6, 6, 6]
    assert run(spec, [1], model) == [5, *START, 5, 5, 5, *END, 5, *START, 6, 6, 6, *END]
    # closed by the model within its budget: nothing forced
    assert run(spec, [*START], [5, 5, *END, 5, 5, 5, 5]) == [5, 5, *END, 5, 5, 5, 5]
    # a prompt whose section is closed, and a partial end that is not one
    assert run(spec, [*START, 5, *END], [5] * 5) == [5] * 5
    assert run(spec, [*START], [9, 5, 5, 5, 5]) == [9, 5, 5, *END]
    # the budget runs out on an end the model has begun: it is finished, not restarted
    assert run(spec, [*START], [5, 5, 9, 5, 5, 5]) == [5, 5, 9, 10, 5, 5]
    # budget 0: the section ends as soon as it opens
    assert run(ThinkingBudget(0, START, END), [*START], [5, 5, 5]) == [*END, 5]
    assert run(ThinkingBudget(0, START, END), [1], [*START, 5, 5, 5]) == [*START, *END, 5]


def test_budget_is_validated() -> None:
    for bad in (ThinkingBudget(-1, START, END), ThinkingBudget(True, START, END),
                ThinkingBudget(2, (), END), ThinkingBudget(2, START, (-3,))):
        with pytest.raises(InvalidRequestError):
            SamplingParams(thinking=bad)



def test_engine_forces_the_end_and_matches_transformers(tiny_model_dirs: dict[str, Path]) -> None:
    """Greedy with a budget of 5 on a prompt that opens a section: transformers' 5 tokens,
    the end ids, then transformers' greedy continuation of the whole context; the other
    request of the batch is plain greedy."""
    path = tiny_model_dirs["qwen2"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    start, end = (100, 101), (200, 201, 202)
    opened = [rng.randrange(3, 4000) for _ in range(20)] + list(start)
    plain = [rng.randrange(3, 4000) for _ in range(30)]
    budget, n = 5, 16
    first = hf_greedy(hf, opened, budget)
    rest = hf_greedy(hf, opened + first + list(end), n - budget - len(end))
    assert not any(rest[i:i + 2] == list(start) for i in range(len(rest)))  # one section
    greedy = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    llm = LLM(str(path), dtype="float32", check_invariants=True, chunk_size=16)
    outs = llm.generate([opened, plain], [
        SamplingParams(**greedy, thinking=ThinkingBudget(budget, start, end)),
        SamplingParams(**greedy)], use_tqdm=False)
    assert outs[0].token_ids == first + list(end) + rest
    assert outs[1].token_ids == hf_greedy(hf, plain, n)
    assert llm.engine.kv.num_used == 0


# ---- the server ------------------------------------------------------------------------------

MODEL = "tiny"
ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--uvicorn-log-level", "warning", "--cpu-threads", "1"]


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("thinking_budget")
    args = [*ARGS, "--reasoning-parser", "qwen3"]
    with ServerProcess(tiny_model_dirs["qwen2"], args, log_path=tmp / "server.log") as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


def ids_of(srv, text: str) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                "add_special_tokens": False}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def completion_ids(client: openai.OpenAI, prompt: list[int], **extra: object) -> list[int]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=14, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True,
                                              **extra})
    return r.choices[0].model_extra["token_ids"]


def test_server_budget(server) -> None:
    """A completion whose prompt opens <think>: with a budget of 4, the model's own first 4
    tokens, then </think>'s ids; -1 is no budget; chat takes the field too."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    start, end = ids_of(server, "<think>"), ids_of(server, "</think>")
    prompt = ids_of(server, "Is it warm?\n") + start
    free = completion_ids(client, prompt)
    assert free[4:4 + len(end)] != end
    budgeted = completion_ids(client, prompt, thinking_token_budget=4)
    assert budgeted[:4] == free[:4] and budgeted[4:4 + len(end)] == end
    assert completion_ids(client, prompt, thinking_token_budget=-1) == free
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, extra_body={"thinking_token_budget": 2})
    assert r.choices[0].finish_reason == "length"
    for bad in (True, -2, 1.5):
        with pytest.raises(openai.BadRequestError) as e:
            completion_ids(client, prompt, thinking_token_budget=bad)
        assert e.value.body["param"] == "thinking_token_budget"


def test_budget_needs_a_reasoning_config(tiny_model_dirs: dict[str, Path], tmp_path: Path
                                         ) -> None:
    """As vLLM: without a reasoning parser or config there is no section to budget, so a
    400; ``--reasoning-config`` alone names the section, its end string is what is forced."""
    model = tiny_model_dirs["qwen2"]
    with ServerProcess(model, ARGS, log_path=tmp_path / "s.log") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_body={"thinking_token_budget": 8})
        assert e.value.body["param"] == "thinking_token_budget"
        assert "--reasoning-parser" in e.value.body["message"]
    config = '{"reasoning_start_str": "<think>", "reasoning_end_str": "Enough.</think>"}'
    with ServerProcess(model, [*ARGS, "--reasoning-config", config],
                       log_path=tmp_path / "s2.log") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=60)
        end = ids_of(srv, "Enough.</think>")
        prompt = ids_of(srv, "Is it warm?\n") + ids_of(srv, "<think>")
        free = completion_ids(client, prompt)
        budgeted = completion_ids(client, prompt, thinking_token_budget=3)
        assert budgeted[:3] == free[:3] and budgeted[3:3 + len(end)] == end


def test_natural_end_differs_from_the_forced_one() -> None:
    """With a closing phrase forced (vLLM's reasoning_end_str), the model's own </think>
    still closes a section."""
    spec = ThinkingBudget(3, START, (42, *END), END)
    assert run(spec, [*START], [5, *END, 5, 5, 5, 5]) == [5, *END, 5, 5, 5, 5]
    assert run(spec, [*START], [5] * 7) == [5, 5, 5, 42, *END, 5]
