"""Prompts into token ids, with the work bounded by the context.

Text prompts and chats are tokenized (chats rendered with the model's chat template first),
when large in the server's ``prep`` pool under the client's limit
(:mod:`hlserve.server.runtime.offload`): the chat's messages are prepared for the template
there too, never on the event loop. A text far longer than the context is tokenized in part
first and refused if that part alone is over the context (``HEAD_CHARS_PER_TOKEN``), so
what a prompt costs is bounded by the context, not by the size of the body.
"""

from __future__ import annotations

from typing import Any

from hlserve.errors import InvalidRequestError
from hlserve.server.openai_api.intake import OFFLOAD_CHARS
from hlserve.server.openai_api.state import ServerState
from hlserve.server.protocol import ApiError, ChatCompletionRequest
from hlserve.server.tools.agent_checks import parse_tool_call_arguments, reasoning_kwargs
from hlserve.tokenizer import Tokenizer

HEAD_CHARS_PER_TOKEN = 32  # prompts longer than this x the context are tokenized in part first
HEAD_MARGIN = 16  # tokens a cut can add at its end: a part over context + this is over for sure


def no_tokenizer(what: str) -> ApiError:
    return ApiError(400, f"This model has no tokenizer: {what}", param="prompt",
                    code="invalid_value")


def need_tokenizer(st: ServerState) -> Tokenizer:
    if st.tokenizer is None:
        raise ApiError(400, "This model has no tokenizer", code="invalid_value")
    return st.tokenizer


async def encode_prompts(st: ServerState, prompts: list[str | list[int]],
                         offload: bool, client: str) -> list[list[int]]:
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return prompts  # type: ignore[return-value]
    tok = st.tokenizer
    if tok is None:
        raise no_tokenizer("send the prompt as token ids")

    def run() -> list[list[int]]:
        return [p if isinstance(p, list) else encode_bounded(tok, p, st.max_model_len)
                for p in prompts]

    if offload or sum(map(len, texts)) > OFFLOAD_CHARS:
        return await st.offload.run("prep", client, run)
    return run()


def encode_bounded(tok: Tokenizer, text: str, max_model_len: int,
                   add_special_tokens: bool = True) -> list[int]:
    """``text``'s ids; a text far longer than the context is tokenized in part first, and
    refused if that part alone is over the context: the work a prompt costs is bounded by
    the context, not by the body size. (Tokenizing holds the GIL for long stretches, so a
    worker thread alone does not keep a multi-megabyte prompt from stalling the event loop.)
    """
    check_head(tok, text, max_model_len, add_special_tokens, "prompt", "the prompt")
    return tok.encode(text, add_special_tokens)


def check_head(tok: Tokenizer, text: str, max_model_len: int, add_special_tokens: bool,
               param: str, what: str) -> None:
    """A 400 context_length_exceeded when ``text`` is longer than HEAD_CHARS_PER_TOKEN x the
    context and its first that many characters alone are over the context (a cut can add
    HEAD_MARGIN tokens at its end). A text that passes is still tokenized whole."""
    limit = HEAD_CHARS_PER_TOKEN * max_model_len
    if len(text) <= limit:
        return
    head = tok.encode(text[:limit], add_special_tokens)
    if len(head) > max_model_len + HEAD_MARGIN:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, {what} has more than {len(head) - HEAD_MARGIN} tokens in its "
                       f"first {limit} characters alone ({len(text)} in all). Please reduce "
                       f"the length of {what}.", param=param, code="context_length_exceeded")


def text_chars(obj: Any) -> int:
    """Characters in every string of a JSON-like value (keys included): what rendering it
    into a chat template puts into the text, give or take the template's own."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(len(k) + text_chars(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(map(text_chars, obj))
    return 0


async def encode_chat(st: ServerState, req: ChatCompletionRequest, offload: bool,
                      client: str) -> list[int]:
    tok = st.tokenizer
    if tok is None:
        raise ApiError(400, "This model has no tokenizer, so no chat template: use "
                       "/v1/completions with token ids", code="invalid_value")
    kwargs = dict(req.chat_template_kwargs or {})
    if clash := tok.template_args & kwargs.keys():
        raise ApiError(400, f"chat_template_kwargs cannot set {sorted(clash)}: the server "
                       "passes them to the template itself", param="chat_template_kwargs",
                       code="invalid_value")
    kwargs = {**reasoning_kwargs(req), **kwargs}
    if req.tools:
        kwargs["tools"] = req.tools

    def run() -> list[int]:  # every step in proportion to the chat's size, off the loop
        messages = parse_tool_call_arguments(req.template_messages())
        return bounded_chat(tok, messages, req.add_generation_prompt, kwargs, st.max_model_len)

    try:
        return await st.offload.run("prep", client, run) if offload else run()
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None


def bounded_chat(tok: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 kwargs: dict[str, Any], max_model_len: int) -> list[int]:
    """The chat's ids, its work bounded by the context as :func:`encode_bounded` bounds a
    prompt's: a chat whose strings are far longer than the context is rendered and only a
    head of the rendered text tokenized first (rendering is cheap; tokenizing holds the GIL).
    The head keeps special-token text as control tokens, so it counts no more tokens than
    the full encoding does (within the cut's margin)."""
    if text_chars(messages) + text_chars(kwargs) > HEAD_CHARS_PER_TOKEN * max_model_len:
        text = tok.apply_chat_template(messages, add_generation_prompt, **kwargs)
        check_head(tok, text, max_model_len, False, "messages", "the rendered chat")
    return tok.encode_chat(messages, add_generation_prompt, **kwargs)
