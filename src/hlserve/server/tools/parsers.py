"""Tool calling: the model's tool-call text parsed into OpenAI ``tool_calls`` (vLLM's
``hermes`` and ``llama3_json`` parsers), and the JSON schemas that enforce ``tool_choice``
``required`` and a named function by constrained decoding (vLLM's approach: the output is a
JSON list of ``{"name", "parameters"}`` for required, the arguments object for named).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hlserve.server.protocol import ApiError
from hlserve.server.tools.formats import MistralFormat, PythonicFormat, Qwen3CoderFormat
from hlserve.server.tools.streamed_calls import (
    CallSegment,
    CallStreamer,
    hermes_segments,
    llama3_segments,
    required_segments,
)
from hlserve.structured import StructuredOutputsParams


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def wire(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # a streamed delta names its call's position
            out["index"] = index
        return out


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args,
                                                                               ensure_ascii=False))


class ToolParser:
    """Splits generated text into content and tool calls. ``start`` is the text from which
    on a streamed reply is held back (it may be a tool call) until the end."""

    start = ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def segments(self, text: str) -> list[CallSegment]:
        """The calls in ``text`` so far, as partial JSON (server/tools/streamed_calls.py)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """Qwen2.5 / Qwen3 (and Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
    </tool_call>``, any number of them, after optional content."""

    start = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for m in self._call.finditer(text, at):
            try:
                call = _call_of(json.loads(m.group(1)), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: the text stays content, as vLLM
                return text, []
            calls.append(call)
        content = text[:at].rstrip()
        return content or None, calls

    def segments(self, text: str) -> list[CallSegment]:
        return hermes_segments(text)


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}`` (or
    several joined by ``;``), optionally after ``<|python_tag|>``."""

    start = "{"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def segments(self, text: str) -> list[CallSegment]:
        return llama3_segments(text)


class FormatParser(ToolParser):
    """A parser of server/tools/formats.py (which knows nothing of ToolCall)."""

    format: Any = None

    def __init__(self, functions: dict[str, dict[str, Any]] | None = None) -> None:
        self.fmt = self.format(functions) if self.format is Qwen3CoderFormat else self.format()
        self.start = self.fmt.start

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.fmt.extract(text)
        return content, [ToolCall(name, args) for name, args in calls]

    def segments(self, text: str) -> list[CallSegment]:
        return self.fmt.segments(text)


class Qwen3CoderParser(FormatParser):
    format = Qwen3CoderFormat


class MistralParser(FormatParser):
    format = MistralFormat


class PythonicParser(FormatParser):
    format = PythonicFormat


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser,
    "mistral": MistralParser, "pythonic": PythonicParser}


# ---- tool_choice ------------------------------------------------------------------------------


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, with each tool's shape checked."""
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': "
                           "{'name': ..., 'parameters': {...}}}", param=f"tools.{i}",
                           code="invalid_value")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema",
                           param=f"tools.{i}", code="invalid_value")
        out[fn["name"]] = params
    return out


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tool calls come out: ``mode`` is "auto" (parsed from free
    text), "required" or "named" (constrained), or None (no tool calls)."""

    mode: str | None = None
    parser: ToolParser | None = None
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: False keeps at most one call

    def constraint(self, tools: dict[str, dict[str, Any]]) -> StructuredOutputsParams | None:
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutputsParams(json=tools[self.name])
        if self.mode == "required":
            defs, calls = {}, []
            for name, params in tools.items():
                # a function's "#/$defs/..." refs point at the root of the combined schema,
                # so its $defs move there (as vLLM does); clashing names are refused
                params = dict(params)
                hoisted = params.pop("$defs", None) or {}
                if not isinstance(hoisted, dict):
                    raise ApiError(400, f"tool {name!r}: $defs must be an object",
                                   param="tools", code="invalid_value")
                for key, value in hoisted.items():
                    if defs.setdefault(key, value) != value:
                        raise ApiError(400, f"tools define $defs/{key} differently; required "
                                       "tool choice needs them to agree", param="tools",
                                       code="invalid_value")
                calls.append({"type": "object", "properties": {
                    "name": {"const": name}, "parameters": params},
                    "required": ["name", "parameters"], "additionalProperties": False})
            schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls},
                                      "minItems": 1}
            if defs:
                schema["$defs"] = defs
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def final(self, text: str, finish_reason: str | None
              ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a finished reply."""
        if self.mode == "named":
            # always a call, as vLLM answers it and as it streams: cut by length, its
            # arguments are the partial JSON generated (finish_reason "length" says so)
            assert self.name is not None
            return None, [ToolCall(self.name, text)], finish_reason  # named keeps "stop"
        if self.mode == "required" and finish_reason == "stop":
            try:
                calls = [_call_of(c, ("parameters",)) for c in json.loads(text)]
            except (json.JSONDecodeError, TypeError):
                return text, [], finish_reason
            return None, [c for c in calls if c is not None], "tool_calls"
        if self.mode == "auto" and self.parser is not None:
            content, calls = self.parser.extract(text)
            if calls:
                calls = calls if self.parallel else calls[:1]
                return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
        return text, [], finish_reason


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
              parser: str | None, auto_enabled: bool) -> tuple[ToolPlan, dict[str, Any]]:
    """The plan for a request's ``tools`` / ``tool_choice`` and its functions' schemas;
    400 for what vLLM refuses."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice requires tools", param="tool_choice",
                           code="invalid_value")
        return ToolPlan(), {}
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    par = parallel is not False
    if choice == "none":
        return ToolPlan(), functions
    if choice == "auto":
        if not (auto_enabled and parser):
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", param="tool_choice",
                           code="invalid_value")
        made = PARSERS[parser]
        # qwen3_coder converts each parameter's text by the tool's schema
        instance = made(functions) if issubclass(made, FormatParser) else made()
        return ToolPlan("auto", instance, parallel=par), functions
    if choice == "required":
        return ToolPlan("required", parallel=par), functions
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}",
                           param="tool_choice", code="invalid_value")
        if name not in functions:
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools",
                           param="tool_choice", code="invalid_value")
        return ToolPlan("named", name=name), functions
    raise ApiError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function; "
                   f"got {choice!r}", param="tool_choice", code="invalid_value")


def apply_tool_calls(plan: ToolPlan, choices: list[dict[str, Any]],
                     outs: list[Any]) -> None:
    """A whole chat reply's choices with their tool calls parsed out (in place)."""
    if plan.mode is None:
        return
    for c, o in zip(choices, outs, strict=True):
        # the content: the text, less any reasoning split out before (server/tools/reasoning.py)
        content, calls, reason = plan.final(c["message"]["content"] or "", o.finish_reason)
        c["message"]["content"] = content
        if calls:
            c["message"]["tool_calls"] = [call.wire() for call in calls]
        c["finish_reason"] = reason


class ToolStream:
    """One streamed choice's tool calls, as vLLM streams them. Named: the arguments stream
    as they are generated. Required and auto: each call's name once complete, then its
    arguments as generated (server/tools/streamed_calls.py); text that may start a call is held
    back from ``content``. Concatenated by index, the deltas are the unstreamed calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.named_call: ToolCall | None = None
        self.sent_content = 0
        self.calls = CallStreamer()

    def delta(self, text: str, full: str, finished: bool, finish_reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        """The chunk's delta and finish reason for ``text`` newly generated (``full``: all)."""
        plan = self.plan
        if plan.mode == "named":
            first = self.named_call is None
            if first:
                assert plan.name is not None
                self.named_call = ToolCall(plan.name, "")
            call = {"index": 0, "function": {"arguments": text}}
            if first:
                call.update(id=self.named_call.id, type="function")
                call["function"]["name"] = plan.name
            return ({"tool_calls": [call]} if text or first else {}), finish_reason
        if plan.mode == "required":
            if not finished:
                deltas = self.calls.update(required_segments(full))
                return ({"tool_calls": deltas} if deltas else {}), None
            _, calls, reason = plan.final(full, finish_reason)
            if calls or self.calls.started:
                deltas = self.calls.finish(calls)
                return ({"tool_calls": deltas} if deltas else {}), reason
            return {"content": full}, reason
        return self._auto(full, finished, finish_reason)

    def _auto(self, full: str, finished: bool, finish_reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        assert self.plan.parser is not None
        start = self.plan.parser.start
        at = full.find(start) if start else -1
        if not finished:
            # content up to where a call may begin (or a partial marker at the end) goes out
            safe = at if at >= 0 else len(full) - _partial_suffix(full, start)
            if isinstance(self.plan.parser, Llama3JsonParser):
                safe = 0 if full.lstrip()[:1] in ("", "{", "<") else len(full)
            # trailing whitespace waits: content before a call is sent stripped
            safe = len(full[:safe].rstrip())
            piece = full[self.sent_content:max(safe, self.sent_content)]
            self.sent_content += len(piece)
            out: dict[str, Any] = {"content": piece} if piece else {}
            if at >= 0 or safe == 0:
                calls = self.plan.parser.segments(full)
                if not self.plan.parallel:
                    calls = calls[:1]
                if deltas := self.calls.update(calls):
                    out["tool_calls"] = deltas
            return out, None
        content, calls, reason = self.plan.final(full, finish_reason)
        out = {}
        rest = (content or "")[self.sent_content:] if calls else full[self.sent_content:]
        if rest:
            out["content"] = rest
        if (calls or self.calls.started) and (deltas := self.calls.finish(calls)):
            out["tool_calls"] = deltas
        return out, reason


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` are a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
