"""What agents send, checked or normalized at the API edge so that no request gets a quiet
wrong answer: each either means what it means in vLLM, or is a 400 saying why.

- Assistant history: ``tool_calls[].function.arguments`` is a JSON *string* on the wire
  (OpenAI's shape), while chat templates render it with ``| tojson``; like vLLM it is parsed
  to a dict first, so the model sees the arguments once, not JSON-encoded twice.
- Shapes with keys nothing here reads (``response_format.schema`` on ``json_object``, extra
  keys in ``tool_choice`` or in a tool) and ``tools: []`` are refused, not dropped.
- An output constraint decides where the output ends: ``stop`` strings, ``min_tokens`` and
  ``ignore_eos`` would cut it short or push past its end, so together they are a 400.
- ``reasoning_effort`` reaches the chat template (``"none"``: ``enable_thinking=false``).
"""

from __future__ import annotations

import json
from typing import Any

from hlserve.server.protocol import MAX_IDENTIFIER_CHARS, ApiError
from hlserve.structured import StructuredOutputsParams

TOOL_KEYS = frozenset({"type", "function"})
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
NAMED_CHOICE_KEYS = frozenset({"type", "function"})
RESPONSE_FORMAT_KEYS = {"text": frozenset({"type"}), "json_object": frozenset({"type"}),
                        "json_schema": frozenset({"type", "json_schema"})}
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _refuse(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _extra(obj: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    if unknown := sorted(set(obj) - allowed):
        raise _refuse(f"{where} has unknown key(s) {unknown}; it takes {sorted(allowed)}",
                      where, "unknown_parameter")


# ---- history ------------------------------------------------------------------------------------


def parse_tool_call_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every assistant tool call's string ``arguments`` parsed to a dict
    (vLLM does the same before rendering); arguments that are not a JSON object are a 400."""
    for m, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if not calls:
            continue
        parsed = []
        for c, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise _refuse(f"messages[{m}].tool_calls[{c}] must have a 'function' object",
                              f"messages.{m}.tool_calls.{c}")
            if call.get("type", "function") != "function":
                raise _refuse(f"messages[{m}].tool_calls[{c}].type must be 'function'",
                              f"messages.{m}.tool_calls.{c}.type")
            _check_types(call, f"messages.{m}.tool_calls.{c}", id=str)
            _check_types(fn, f"messages.{m}.tool_calls.{c}.function", name=str)
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise _refuse(f"messages[{m}].tool_calls[{c}].function.arguments is not "
                                  f"valid JSON: {e}", f"messages.{m}.tool_calls.{c}") from None
            if args is not None and not isinstance(args, dict):
                raise _refuse(f"messages[{m}].tool_calls[{c}].function.arguments must be a "
                              "JSON object", f"messages.{m}.tool_calls.{c}")
            parsed.append({**call, "function": {**fn, "arguments": args or {}}})
        messages[m] = {**msg, "tool_calls": parsed}
    return messages


# ---- shapes -------------------------------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """``tools`` and a named ``tool_choice``: each tool's shape and types (vLLM's pydantic
    model refuses the same), no empty list, no keys nothing reads, names of at most OpenAI's
    64 characters, no two functions of one name (which schema a call of that name keeps to
    would be a guess; OpenAI refuses them, vLLM takes the first)."""
    if tools is not None and not tools:
        raise _refuse("tools must not be an empty list (omit it for no tools)", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str):
            raise _refuse(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                          "'parameters': {...}}}}", f"tools.{i}", "invalid_type")
        _extra(tool, TOOL_KEYS, f"tools.{i}")
        _extra(fn, FUNCTION_KEYS, f"tools.{i}.function")
        _check_name(fn["name"], i, seen)
        _check_types(fn, f"tools.{i}.function", parameters=dict, strict=bool, description=str)
    if isinstance(tool_choice, dict):
        _extra(tool_choice, NAMED_CHOICE_KEYS, "tool_choice")
        if isinstance(fn := tool_choice.get("function"), dict):
            _extra(fn, frozenset({"name"}), "tool_choice.function")


def _check_types(obj: dict[str, Any], where: str, **types: type) -> None:
    """Each named key of ``obj``: absent, null, or of its type (a 400 naming it otherwise)."""
    for key, kind in types.items():
        value = obj.get(key)
        if value is not None and (not isinstance(value, kind) or
                                  (kind is not bool and isinstance(value, bool))):
            raise _refuse(f"{where}.{key} must be {_TYPE_NAMES[kind]}, got "
                          f"{type(value).__name__}", f"{where}.{key}", "invalid_type")


_TYPE_NAMES = {dict: "an object", str: "a string", bool: "a boolean", list: "a list"}


def _check_name(name: str, i: int, seen: set[str]) -> None:
    if len(name) > MAX_IDENTIFIER_CHARS:
        raise _refuse(f"tools[{i}].function.name may be at most {MAX_IDENTIFIER_CHARS} "
                      f"characters long (it has {len(name)})", f"tools.{i}.function.name")
    if name in seen:
        raise _refuse(f"tools[{i}] repeats the function name {name!r}: names must be unique",
                      "tools")
    seen.add(name)


def check_response_format(rf: dict[str, Any] | None) -> None:
    if not rf:
        return
    kind = rf.get("type", "text")
    if not isinstance(kind, str):  # a list or object is unhashable: the lookup below raises
        raise _refuse(f"response_format.type must be a string, got {type(kind).__name__}",
                      "response_format.type", "invalid_type")
    if kind not in RESPONSE_FORMAT_KEYS:
        return  # constraints.py names the types
    if kind == "json_object" and "schema" in rf:
        raise _refuse("response_format json_object takes no schema; use {'type': "
                      "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                      "response_format", "unknown_parameter")
    _extra(rf, RESPONSE_FORMAT_KEYS[kind], "response_format")
    if kind == "json_schema" and isinstance(rf.get("json_schema"), dict):
        _extra(rf["json_schema"], JSON_SCHEMA_KEYS, "response_format.json_schema")
        _check_types(rf["json_schema"], "response_format.json_schema", name=str,
                     description=str, strict=bool)


def check_prediction(prediction: dict[str, Any] | None) -> None:
    """OpenAI's predicted output: ``{"type": "content", "content": str | [text parts]}``.
    Accepted and not used (no draft comes from it), but typed as OpenAI types it."""
    if prediction is None:
        return
    if prediction.get("type") != "content":
        raise _refuse("prediction.type must be 'content'", "prediction.type", "invalid_value")
    content = prediction.get("content")
    parts_ok = isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content)
    if not isinstance(content, str) and not parts_ok:
        raise _refuse("prediction.content must be a string or a list of text parts",
                      "prediction.content", "invalid_type")


def check_constrained(req: Any, spec: StructuredOutputsParams | None, what: str) -> None:
    """A constrained request's grammar decides where it ends: what would end it elsewhere
    (``stop``) or hold it open (``min_tokens``, ``ignore_eos``) is refused, not silently
    outranked. ``what`` names the constraint in the message."""
    if spec is None:
        return
    if req.stop:
        raise _refuse(f"stop cannot be combined with {what}: a stop string inside the "
                      "constrained output would cut it into text that does not parse", "stop")
    if req.min_tokens:
        raise _refuse(f"min_tokens cannot be combined with {what}: the grammar ends the output "
                      "where it is complete", "min_tokens")
    if req.ignore_eos:
        raise _refuse(f"ignore_eos cannot be combined with {what}: the grammar ends the output "
                      "where it is complete", "ignore_eos")


# ---- the chat template --------------------------------------------------------------------------


def reasoning_kwargs(req: Any) -> dict[str, Any]:
    """What ``reasoning_effort`` passes to the chat template: itself (templates such as
    gpt-oss's read it) and, for ``"none"``, ``enable_thinking=False`` (Qwen3's switch)
    unless ``chat_template_kwargs`` sets that itself."""
    effort = getattr(req, "reasoning_effort", None)
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise _refuse(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got "
                      f"{effort!r}", "reasoning_effort")
    out: dict[str, Any] = {"reasoning_effort": effort}
    if effort == "none" and "enable_thinking" not in (req.chat_template_kwargs or {}):
        out["enable_thinking"] = False
    return out
