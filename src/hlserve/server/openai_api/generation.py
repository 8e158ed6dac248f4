"""From a checked, tokenized request to the engine and back, for both generation endpoints.

The sampling parameters (``max_tokens`` bounded by the context and the KV pool), the output
constraint compiled before the engine sees it (a bad schema is a 400), the chat's tool plan
and reasoning parser, the submission of every prompt and sequence to the bridge, and the
collection of the final outputs of a request that is not streamed.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from fastapi import Request

from hlserve.errors import InvalidRequestError
from hlserve.request import RequestOutput, SamplingParams
from hlserve.server.openai_api.error_replies import engine_error, output_error
from hlserve.server.openai_api.intake import Inbound
from hlserve.server.openai_api.limits import check_logprob_volume
from hlserve.server.openai_api.state import ServerState
from hlserve.server.protocol import ApiError, ChatCompletionRequest, context_length_error
from hlserve.server.runtime.events import EventSink, RequestGroup, Submission
from hlserve.server.tools.agent_checks import check_constrained
from hlserve.server.tools.constraints import named_constraint, request_constraint
from hlserve.server.tools.parsers import ToolPlan, tool_plan
from hlserve.server.tools.reasoning import ReasoningParser, reasoning_for
from hlserve.structured import StructuredOutputsParams
from hlserve.structured.grammar import GrammarState


def sampling(st: ServerState, req: Any, n_prompt: int) -> SamplingParams:
    requested = req.requested_max_tokens
    if requested is None:
        if n_prompt >= st.max_model_len:
            raise context_length_error(st.max_model_len, n_prompt, None)
        # the rest of the context, but no more than the KV pool could ever hold (nor the
        # model's max_new_tokens)
        max_tokens = st.sampling_defaults.max_tokens(
            max(1, min(st.max_model_len, st.pool_tokens) - n_prompt))
    else:
        if n_prompt + requested > st.max_model_len:
            raise context_length_error(st.max_model_len, n_prompt, requested)
        max_tokens = requested
    check_logprob_volume(req, max_tokens)
    return with_thinking_budget(st, req, req.sampling_params(max_tokens))


def with_thinking_budget(st: ServerState, req: Any, params: SamplingParams) -> SamplingParams:
    """vLLM's ``thinking_token_budget`` (-1: unlimited): the end of a reasoning section is
    forced after that many tokens in it. As vLLM, only with a reasoning parser, whose
    ``<think>`` / ``</think>`` mark the section (or ``--reasoning-config``'s strings)."""
    budget = getattr(req, "thinking_token_budget", None)
    if budget is None or budget == -1:
        return params
    if st.thinking_markers is None:
        raise ApiError(400, "thinking_token_budget is set but reasoning_config is not "
                       "configured. Please set --reasoning-parser and/or --reasoning-config "
                       "to use thinking_token_budget.", param="thinking_token_budget",
                       code="invalid_value")
    return replace(params, thinking=replace(st.thinking_markers, budget=budget))


def chat_reasoning(st: ServerState, req: Any) -> ReasoningParser | None:
    if not isinstance(req, ChatCompletionRequest):
        return None
    constrained = request_constraint(req) is not None or \
        chat_tool_plan(st, req)[0].mode in ("named", "required")
    return reasoning_for(st.settings.reasoning_parser, constrained)


def chat_tool_plan(st: ServerState, req: Any) -> tuple[ToolPlan, dict[str, Any]]:
    if not isinstance(req, ChatCompletionRequest):
        return ToolPlan(), {}
    return tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                     st.settings.tool_call_parser, st.settings.enable_auto_tool_choice)


async def constrain(st: ServerState, req: Any, params: list[SamplingParams], client: str
                    ) -> list[SamplingParams]:
    """``params`` with the request's output constraint (response_format, structured_outputs,
    guided_*, or tool_choice required / named), compiled here so that a bad schema is a 400
    before the engine sees it (in the ``grammar`` pool under the client's limit: a compile
    may take seconds, and the first one indexes the vocabulary)."""
    named = named_constraint(req)
    param, spec = named if named else (None, None)
    plan, functions = chat_tool_plan(st, req)
    if plan.mode is not None:  # a tokenizer may mark a tool-call tag as special (vLLM's rule)
        params = [replace(p, skip_special_tokens=False) for p in params]
    check_constrained(req, spec, "an output constraint")
    if (tool_spec := plan.constraint(functions)) is not None:
        # a forced call outranks response_format / structured_outputs, as in vLLM (its tool
        # parser's adjust_request): the answer is a call, whose shape the tools fix. Agents
        # send both: the OpenAI Agents SDK sends its output_type's format on every turn,
        # tool_choice "required" included
        check_constrained(req, tool_spec, f"tool_choice {plan.mode}")
        spec, param = tool_spec, "tools"
    if spec is None:
        return params
    await st.offload.run("grammar", client, compile_spec, st, spec, param)
    return [replace(p, structured_outputs=spec) for p in params]


def compile_spec(st: ServerState, spec: StructuredOutputsParams, param: str | None) -> None:
    try:
        st.engine.grammars.compile(spec)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=param or "response_format",
                       code="invalid_value") from None


def prepare_grammars(st: ServerState, subs: list[Submission]) -> None:
    """Each constrained submission's own matcher, compiled here (in the ``grammar`` pool)
    rather than by the engine thread when it adds the request: a spec too large for the
    cache is compiled anew each time, up to a second, which held every request's steps."""
    first: dict[tuple, GrammarState] = {}  # a spec's first matcher; the others copy it
    for sub in subs:
        if (spec := sub.params.structured_outputs) is None:
            continue
        if (done := first.get(spec.key())) is not None:
            sub.grammar = GrammarState(done.matcher.deep_copy())
            continue
        try:
            sub.grammar = first[spec.key()] = st.engine.grammars.state(spec)
        except InvalidRequestError as e:  # compiled once already: only if it changed
            raise ApiError(400, str(e), param="response_format", code="invalid_value") from None


async def submit(st: ServerState, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], inbound: Inbound) -> RequestGroup:
    # the bridge refuses (draining, engine dead, queue caps: ServiceUnavailableError,
    # EngineDeadError, InvalidRequestError) and coalesces what a slow reader has not read
    sink = EventSink()
    who = inbound.caller
    subs = []
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        # n / best_of: sequence j of prompt i is index i * k + j (vLLM's choice order); the
        # siblings follow the first, so they share its prompt pages
        k = p.num_sequences
        for j in range(k):
            index = i * k + j
            subs.append(Submission(f"{request_id}-{index}", ids, p.for_sibling(j) if k > 1 else p,
                                   who.request_class, who.priority, inbound.arrival, index, sink,
                                   cache_salt=who.cache_salt, session=who.session,
                                   follows=subs[i * k].request_id if j else None))
    if any(s.params.structured_outputs is not None for s in subs):
        await st.offload.run("grammar", inbound.client, prepare_grammars, st, subs)
    group = RequestGroup(subs, sink, st.bridge.abort)
    try:
        st.bridge.submit(subs)
        await group.wait_added()
    except BaseException as e:
        group.abort_unfinished()
        if isinstance(e, Exception):
            raise engine_error(e) from None
        raise
    return group


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, group: RequestGroup) -> list[RequestOutput] | None:
    """Every final output, in prompt order; None if the client went away first."""

    async def gather() -> list[RequestOutput]:
        latest: dict[int, RequestOutput] = {}
        async for batch in group.events():
            for index, item in batch:
                if isinstance(item, BaseException):
                    raise engine_error(item)
                if (err := output_error(item)) is not None:
                    raise err
                latest[index] = item
        return [latest[i] for i in sorted(latest)]

    task = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else None
    finally:
        watch.cancel()
        task.cancel()
        group.abort_unfinished()
