"""The OpenAI Agents SDK's tool loop against a real ``hlserve serve`` of the tiny model and of
the real one (SmolLM2-135M-Instruct, its own chat template), through both of its model classes: ``OpenAIResponsesModel`` (``/v1/responses``, chained by
``previous_response_id`` from the server's store) and ``OpenAIChatCompletionsModel``
(``/v1/chat/completions``). The random model would not pick a tool by itself, so the first
turn forces one (``tool_choice="required"``: the call's arguments are grammar-constrained to
the tool's schema; the agent's ``output_type`` format, which the SDK sends on every turn,
gives way to the forced call as in vLLM); the SDK then resets the choice to auto, as it does
after any tool call, and the model answers in the output type's JSON, which the grammar
ends. Each run asserts the whole loop: the tool called once with arguments the SDK parsed,
its output fed back (the second prompt is exactly the chat with the call and its output),
and a final answer that the SDK parsed into the output type."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from pydantic import BaseModel

from hlserve.models.resolve import resolve_model
from hlserve.server.runtime.launch import ServerProcess

MODEL = "tiny"
ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--uvicorn-log-level", "warning", "--cpu-threads", "1",
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
INSTRUCTIONS = "You answer questions about the weather."
QUESTION = "How warm is it in Rome?"


class Forecast(BaseModel):
    """The agent's final answer: the SDK asks for it as a JSON schema and parses it."""

    feel: Literal["warm", "mild", "cold"]


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def server(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory):
    set_tracing_disabled(True)  # the SDK would send its traces to OpenAI
    tmp = tmp_path_factory.mktemp("agents_sdk")
    path = (tiny_model_dirs["qwen2"] if request.param == "tiny"
            else resolve_model(request.param, quiet=True))
    with ServerProcess(path, ARGS, log_path=tmp / "server.log") as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


def weather_agent(model: Any, calls: list[str]) -> Agent:
    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The temperature in a city."""
        calls.append(city)
        return f"It is 21 degrees in {city}."

    # one call: parallel calls are an array the random model would extend to max_tokens
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False,
                             temperature=0.0, max_tokens=60)
    return Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                 model_settings=settings, output_type=Forecast)  # reset_tool_choice: auto
    # after a call (the SDK's default)


def chat_tools(agent: Agent) -> list[dict[str, Any]]:
    """The agent's tool as the SDK sends it, in chat's shape."""
    tool = agent.tools[0]
    return [{"type": "function", "function": {
        "name": tool.name, "description": tool.description,
        "parameters": tool.params_json_schema, "strict": tool.strict_json_schema}}]


def prompt_tokens(server, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    r = httpx.post(server.url + "/tokenize", timeout=60,
                   json={"model": MODEL, "messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def check_loop(server, agent: Agent, result: Any, calls: list[str]) -> None:
    """One forced call, executed once with the parsed city, its output fed back as the second
    prompt, then a final text answer."""
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem], kinds
    assert kinds[2:] == [MessageOutputItem], kinds
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome", "Oslo")
    call, output = result.new_items[0].raw_item, result.new_items[1]
    assert output.output == f"It is 21 degrees in {calls[0]}."
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": call.call_id, "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": output.output}]
    assert result.raw_responses[1].usage.input_tokens == \
        prompt_tokens(server, history, chat_tools(agent))


def test_responses_model_tool_loop(server) -> None:
    """Through ``/v1/responses``: the SDK's second request sends only the tool output with
    ``previous_response_id``; the server's store supplies the rest."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                timeout=120)
    calls: list[str] = []
    agent = weather_agent(OpenAIResponsesModel(model=MODEL, openai_client=client), calls)
    result = Runner.run_sync(agent, QUESTION, max_turns=3, auto_previous_response_id=True,
                             run_config=RunConfig(tracing_disabled=True))
    check_loop(server, agent, result, calls)
    first, second = (r.response_id for r in result.raw_responses)
    stored = openai.OpenAI(base_url=server.url + "/v1", api_key="x").responses.retrieve(second)
    assert stored.previous_response_id == first


def test_chat_completions_model_tool_loop(server) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                timeout=120)
    calls: list[str] = []
    agent = weather_agent(OpenAIChatCompletionsModel(model=MODEL, openai_client=client), calls)
    result = Runner.run_sync(agent, QUESTION, max_turns=3,
                             run_config=RunConfig(tracing_disabled=True))
    check_loop(server, agent, result, calls)
