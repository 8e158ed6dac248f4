"""The OpenAI wire format: request bodies, their validation, errors and response objects.

Request bodies are parsed strictly (no "5" for 5, no 1 for true) and unknown fields are
rejected, as OpenAI does ("Unrecognized request argument supplied"): a typo in a sampling
parameter should not silently change what is generated. Fields of the OpenAI API that this
server cannot honour are accepted only at their neutral value (``n=1``, no logprobs, no
penalties), so a client that asks for them learns that it did not get them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hlserve.errors import InvalidRequestError
from hlserve.request import MAX_LOGPROBS, SamplingParams

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
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ("server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(e: ValidationError) -> ApiError:
    """The first problem pydantic found, as an OpenAI 400."""
    err = e.errors(include_url=False)[0]
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        return ApiError(400, f"The request body is not valid JSON: {err['msg']}", code="invalid_json")
    if not loc:
        return ApiError(400, "The request body must be a JSON object", code="invalid_json")
    # union members show up as loc parts ('stop', 'list[str]', 0): keep the real path only
    parts = [str(p) for p in loc if isinstance(p, int) or not _looks_like_type(p)]
    param = ".".join(parts) if parts else str(loc[0])
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'", param=param,
                        code="missing_required_parameter")
    same_field = [x for x in e.errors(include_url=False) if x["loc"][:1] == loc[:1]]
    if len(same_field) > 1 and len(loc) > 1 and _looks_like_type(loc[1]):
        # a union: every alternative failed; name them rather than the first one's complaint
        kinds = sorted({str(x["loc"][1]) for x in same_field if len(x["loc"]) > 1})
        return ApiError(400, f"Invalid type for '{loc[0]}': expected one of {', '.join(kinds)}",
                        param=str(loc[0]), code="invalid_type")
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    code = "invalid_value" if kind.startswith("literal") else "invalid_type"
    return ApiError(400, f"Invalid value for '{param}': {err['msg']} (got {shown})", param=param,
                    code=code)


def _looks_like_type(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool",
                                                              "function-after", "list"})


# ---- requests -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # accepted and ignored: they do not change what is generated here
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    session_id: str | None = None
    return_token_ids: bool = False
    # hlserve: who waits on this request
    request_class: Literal["interactive", "agent"] | None = None

    def check_supported(self) -> None:
        """Reject OpenAI features this server does not implement, at non-neutral values."""
        if self.n != 1:
            raise ApiError(400, f"n must be 1 (one choice per prompt); got {self.n}", param="n",
                           code="invalid_value")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and value != 0:
                raise ApiError(400, f"{name} is not supported by this server; got {value}",
                               param=name, code="unsupported_parameter")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias",
                           code="unsupported_parameter")
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
            )
        except InvalidRequestError as e:
            raise invalid_request(str(e)) from None


class CompletionRequest(_Common):
    prompt: Any = None
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of must be 1; got {self.best_of}", param="best_of",
                           code="invalid_value")
        if self.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo",
                           code="unsupported_parameter")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix",
                           code="unsupported_parameter")

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

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
            msg["content"] = "".join(texts)
        elif self.content is None:
            msg["content"] = None
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # accepted and ignored
    metadata: dict[str, Any] | None = None
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
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                           f"{self.top_logprobs}", param="top_logprobs", code="invalid_value")
        if self.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice other than 'none' or 'auto' is not supported by "
                           "this server", param="tool_choice", code="unsupported_parameter")
        if self.modalities and self.modalities != ["text"]:
            raise ApiError(400, "this model only produces text", param="modalities",
                           code="unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format other than text is not supported by this "
                           "server", param="response_format", code="unsupported_parameter")
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


SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens",
                   "logprobs",
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
