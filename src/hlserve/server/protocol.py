"""The OpenAI wire format: request bodies, their validation, errors and response objects.

Request bodies are parsed strictly (no "5" for 5, no 1 for true) and unknown fields are
rejected, as OpenAI does ("Unrecognized request argument supplied"): a typo in a sampling
parameter should not silently change what is generated. (vLLM and SGLang ignore unknown
fields; every field their benchmark clients send is known here, with its meaning.) Fields
of the OpenAI API that this server cannot honour are accepted only at their neutral value
(``suffix``, ``echo`` with ``logprobs``), so a client that asks for them learns that it did
not get them.

Every number is range-checked here, against what the engine can represent as well as what
it means: integers that reach a tensor or a C call fit int32 (seeds: 64 bits), floats are
finite and fit float32, lists and strings that cost work per token are capped. The bounds
are part of the models, so ``/openapi.json`` documents them. A 400 names the field in
``param`` and quotes at most a short prefix of what was sent.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from hlserve.errors import InvalidRequestError
from hlserve.request import (
    FLOAT32_MAX,
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    SamplingParams,
)

# ---- limits -----------------------------------------------------------------------------------

INT32_MIN = -(2**31)
MAX_STOP_STRINGS = 32  # each is checked against the text after every token
MAX_STOP_CHARS = 512  # a stop string's length is also how much text is held back
MAX_STOP_TOKEN_IDS = 128
MAX_CACHE_SALT_CHARS = 256
# identifiers a client names things by. OpenAI refuses longer ones (its 400
# "string_above_max_length") for prompt_cache_key, user, call ids and function names, and
# documents 64 for a function name; safety_identifier, which supersedes user, is held to the
# same. vLLM has no limit on any of them
MAX_IDENTIFIER_CHARS = 64
# hlserve's and vLLM's own names, which OpenAI does not have (vLLM: no limit): room for a
# composite of a few UUIDs
MAX_SESSION_ID_CHARS = 256
# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at
# most 512 (vLLM's Responses API takes OpenAI's type: string keys and values, no bounds)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_QUOTED_CHARS = 200  # of an input quoted in an error message
MAX_ERROR_CHARS = 2000  # of an error message, whatever it quotes

Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
Identifier = Annotated[str, StringConstraints(max_length=MAX_IDENTIFIER_CHARS)]
SessionId = Annotated[str, StringConstraints(max_length=MAX_SESSION_ID_CHARS)]
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_CHARS)],
                          Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_CHARS)]],
                     Field(max_length=MAX_METADATA_PAIRS)]


def clip(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how long it was: an error about a
    multi-megabyte input must not send it back."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"

# ---- errors ---------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered to the client in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = clip(message, MAX_ERROR_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ("server_error" if status >= 500 else "invalid_request_error")
        self.param = None if param is None else clip(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(e: ValidationError) -> ApiError:
    """The first problem pydantic found, as an OpenAI 400."""
    errors = e.errors(include_url=False)
    err = errors[0]
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        return ApiError(400, f"The request body is not valid JSON: {err['msg']}", code="invalid_json")
    if not loc:
        return ApiError(400, "The request body must be a JSON object", code="invalid_json")
    if kind == "extra_forbidden":
        param = _param(loc)
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if kind == "missing":
        param = _param(loc)
        return ApiError(400, f"Missing required parameter: '{param}'", param=param,
                        code="missing_required_parameter")
    same_field = [x for x in errors if x["loc"][:1] == loc[:1]]
    if len(same_field) > 1 and len(loc) > 1 and _looks_like_type(loc[1]):
        # a union: every alternative failed. One of the right type that only disliked the
        # value says what is wrong; else name the types that would do
        by_value = [x for x in same_field if x["type"] in _VALUE_MESSAGES]
        if not by_value:
            kinds = sorted({str(x["loc"][1]) for x in same_field if len(x["loc"]) > 1})
            return ApiError(400, f"Invalid type for '{loc[0]}': expected one of "
                            f"{', '.join(kinds)}", param=str(loc[0]), code="invalid_type")
        err, kind = by_value[0], by_value[0]["type"]
    param = _param(err["loc"])
    got = err.get("input")
    shown = _shown(got)
    if kind in _VALUE_MESSAGES:
        ctx = dict(err.get("ctx") or {})
        ctx.setdefault("length", len(got) if isinstance(got, (str, list)) else None)
        if ctx.get("actual_length") is None and isinstance(got, (str, list, dict)):
            ctx["actual_length"] = len(got)  # pydantic leaves it unset for a dict
        return ApiError(400, f"{param} {_VALUE_MESSAGES[kind].format(**ctx)}, got {shown}",
                        param=param, code="invalid_value")
    code = "invalid_value" if kind.startswith("literal") else "invalid_type"
    return ApiError(400, f"Invalid value for '{param}': {err['msg']} (got {shown})", param=param,
                    code=code)


# pydantic's range and size errors, worded as "<param> must ..., got <value>"
_VALUE_MESSAGES = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "finite_number": "must be a finite number",
    "too_long": "may have at most {max_length} items (it has {actual_length})",
    "too_short": "must have at least {min_length} items",
    "string_too_long": "may be at most {max_length} characters long (it has {length})",
    "string_too_short": "must be at least {min_length} characters long",
}


def _shown(value: object) -> str:
    """A received value as quoted in a message: short, whatever was sent."""
    if isinstance(value, (dict, list)):
        return type(value).__name__
    return repr(clip(value)) if isinstance(value, str) else clip(repr(value))


def _param(loc: tuple) -> str:
    """The field's path, without union members ('stop', 'list[str]', 0 -> 'stop.0'); a
    dict key at fault is named by its dict ('metadata', 'k...', '[key]' -> 'metadata': the
    key is the bad input, not a field)."""
    if "[key]" in loc:
        loc = loc[:max(1, loc.index("[key]") - 1)]
    parts = [str(p) for p in loc if isinstance(p, int) or not _looks_like_type(p)]
    return clip(".".join(parts) if parts else str(loc[0]))  # a field name is input too


def _looks_like_type(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part.startswith(("constrained-", "function-"))
                                      or part in {"str", "int", "float", "bool", "list"})


# ---- requests -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # token id (a JSON key: a string) -> bias in [-100, 100], as OpenAI bounds it
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)
    # an agent session's name when session_id is unset (engine/sessions.py's precedence)
    user: Identifier | None = None
    prompt_cache_key: Identifier | None = None
    # accepted and ignored: it does not change what is generated here
    safety_identifier: Identifier | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    repetition_penalty: float | None = Field(None, gt=0, le=FLOAT32_MAX)  # 1: off
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int32 = 0  # lower is served first; the server may bound it further
    session_id: SessionId | None = None
    return_token_ids: bool = False
    # vLLM's prefix-cache namespace: requests hit only pages cached under the same salt (and,
    # with API keys, the same key)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # hlserve: who waits on this request
    request_class: Literal["interactive", "agent"] | None = None
    # vLLM's: at most this many tokens per <think> section, then </think> is forced; -1:
    # unlimited. Needs --reasoning-parser (generation.py: with_thinking_budget)
    thinking_token_budget: int | None = Field(None, ge=-1, le=INT32_MAX)
    # output constraints (server/tools/constraints.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* extras; at most one per request
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """Reject OpenAI features this server does not implement, at non-neutral values."""
        self.logit_bias_ids()
        if not self.skip_special_tokens:
            raise ApiError(400, "skip_special_tokens=false is not supported by this server",
                           param="skip_special_tokens", code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' "
                           "is enabled.", param="stream_options", code="invalid_value")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return None

    @property
    def requested_best_of(self) -> int | None:
        return None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys as token ids; a key that is not one is a 400."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
                raise ApiError(400, f"logit_bias keys must be token ids, got {clip(key)!r}",
                               param="logit_bias", code="invalid_value")
            out[int(key)] = bias
        return out

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                stop=self.stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=self.requested_logprobs,
                repetition_penalty=1.0 if self.repetition_penalty is None
                else self.repetition_penalty,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias=self.logit_bias_ids(),
                n=self.n,
                best_of=self.requested_best_of,
            )
        except InvalidRequestError as e:
            raise invalid_request(str(e)) from None


# what /openapi.json says ``prompt`` is; the handler checks it (prompts()), for messages that
# say which shapes are allowed rather than four failed alternatives
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "string"}},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}


class CompletionRequest(_Common):
    prompt: Any = Field(None, json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)  # OpenAI's and vLLM's default
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # sequences per prompt, as n
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise ApiError(400, f"best_of must be at least n={self.n}; got {self.best_of}",
                           param="best_of", code="invalid_value")
        if self.stream and (self.best_of or self.n) > self.n:
            raise ApiError(400, "best_of > n cannot be streamed: the best sequences are known "
                           "only at the end", param="best_of", code="invalid_value")
        if self.echo and self.logprobs is not None:
            # prompt logprobs would need the logits of every prompt position: not computed
            raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported by this "
                           "server", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix",
                           code="unsupported_parameter")

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_best_of(self) -> int | None:
        return self.best_of

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item text or token ids."""
        p = self.prompt
        message = ("prompt must be a string, a list of strings, a list of token ids, or a list "
                   "of lists of token ids")
        if p is None:
            raise ApiError(400, "Missing required parameter: 'prompt'", param="prompt",
                           code="missing_required_parameter")
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise ApiError(400, message if p != [] else "prompt must not be empty", param="prompt",
                           code="invalid_value")
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(_is_int(x) for x in p):
            return [list(p)]
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            return [list(x) for x in p]
        raise ApiError(400, message, param="prompt", code="invalid_type")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # extra keys pass through to the chat template (some templates read them)
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as vLLM hands it to a chat template in its "string" content format (the
        one hlserve renders): text parts joined with newlines, no content as "" (an assistant
        message that only calls tools: templates that concatenate content would fail on
        None)."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for i, part in enumerate(self.content):
                if part.type != "text":
                    raise ApiError(400, f"content part {i} has type {part.type!r}; this model "
                                   "accepts only text parts", param="messages",
                                   code="invalid_value")
                if part.text is None:
                    raise ApiError(400, f"content part {i} of type 'text' has no 'text'",
                                   param="messages", code="missing_required_parameter")
                texts.append(part.text)
            msg["content"] = "\n".join(texts)
        elif self.content is None:
            msg["content"] = ""
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    # accepted and ignored
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true",
                           param="top_logprobs", code="invalid_value")
        if self.modalities and self.modalities != ["text"]:
            raise ApiError(400, "this model only produces text", param="modalities",
                           code="unsupported_parameter")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree",
                           param="max_completion_tokens", code="invalid_value")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------------


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template places the special tokens
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def check_supported(self) -> None:
        for name in ("continue_final_message", "add_special_tokens"):
            if getattr(self, name):
                raise ApiError(400, f"{name}=true is not supported by this server's /tokenize",
                               param=name, code="unsupported_parameter")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens",
                   "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "logit_bias", "n", "best_of",
                   "stop", "stop_token_ids", "prompt"}


def invalid_request(message: str) -> ApiError:
    """An engine :class:`InvalidRequestError` as a 400; its first word names the field when
    the message starts with one."""
    first = message.split(" ", 1)[0]
    param = first if first in SAMPLING_FIELDS else None
    if "token id" in message or "the prompt" in message:
        param = param or "prompt"
    return ApiError(400, message, param=param, code="invalid_value")


def context_length_error(max_model_len: int, n_prompt: int, max_tokens: int | None) -> ApiError:
    """vLLM's wording for a request that does not fit the model's context."""
    if max_tokens is None:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {n_prompt} tokens in the messages, Please reduce the length of the "
                   "messages.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
                   f"{max_tokens} in the completion). Please reduce the length of the messages "
                   "or completion.")
    return ApiError(400, message, param="messages" if max_tokens is None else "max_tokens",
                    code="context_length_exceeded")


# ---- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u
