"""Tool-call formats beyond JSON-in-tags, by vLLM's ``--tool-call-parser`` names:

- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): XML, ``<tool_call><function=NAME><parameter=KEY>
  VALUE</parameter>...</function></tool_call>``; each value is text, converted by the tool's
  parameter schema (a string stays a string; integers, numbers, booleans, objects and
  arrays are parsed as JSON, and text that does not parse stays text), as vLLM converts them.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (older
  tokenizers) or ``NAME[ARGS]{...}`` per call (v11 and later).
- ``pythonic`` (Llama 3.2 / 4, ToolACE): the reply is a Python list of calls,
  ``[get_weather(city="Paris", days=3), now()]``, optionally in ``<|python_start|>`` /
  ``<|python_end|>``; arguments are Python literals.

Each parser gives ``extract(text) -> (content, [(name, arguments as JSON text)])`` and
``segments(text)`` (the calls so far, for streaming: server/tools/streamed_calls.py).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from hlserve.server.tools.streamed_calls import WHOLE, CallSegment, partial_json

Calls = list[tuple[str, str]]


def _dump(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False)


# ---- qwen3_coder ----------------------------------------------------------------------------------


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _convert(value: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as its schema's type says (vLLM's rule: strings verbatim, the
    rest parsed when it parses)."""
    kind = (schema or {}).get("type")
    if kind == "string" or (kind is None and schema and "enum" in schema
                            and all(isinstance(e, str) for e in schema["enum"])):
        return value
    try:
        return json.loads(value)
    except ValueError:
        if value in ("True", "False"):
            return value == "True"
        return value


class Qwen3CoderFormat:
    start = "<tool_call>"

    def __init__(self, functions: dict[str, dict[str, Any]] | None = None) -> None:
        self.functions = functions or {}

    def _args(self, name: str, body: str) -> dict[str, Any]:
        props = self.functions.get(name, {}).get("properties") or {}
        out = {}
        for m in _PARAM.finditer(body):
            key = m.group(1).strip()
            # the value sits between newlines: the first and last are format, not value
            value = m.group(2).removeprefix("\n").removesuffix("\n")
            out[key] = _convert(value, props.get(key))
        return out

    def _functions(self, text: str) -> list[tuple[str, str, bool]]:
        at = text.find(self.start)
        if at < 0:
            return []
        found = []
        for block in text[at:].split(self.start)[1:]:
            m = _FUNCTION.search(block)
            if m is None:
                continue
            found.append((m.group(1).strip(), m.group(2), "</function>" in block))
        return found

    def extract(self, text: str) -> tuple[str | None, Calls]:
        found = self._functions(text)
        if not found:
            return text, []
        calls = [(name, _dump(self._args(name, body))) for name, body, _ in found]
        content = text[:text.find(self.start)].rstrip()
        return content or None, calls

    def segments(self, text: str) -> list[CallSegment]:
        out = []
        for name, body, _ in self._functions(text):
            obj = {"name": name, "arguments": self._args(name, body)}
            out.append(CallSegment(obj, obj, ("arguments",)))
        return out


# ---- mistral ----------------------------------------------------------------------------------


class MistralFormat:
    start = "[TOOL_CALLS]"
    _args_tag = "[ARGS]"

    def _pieces(self, text: str) -> list[str]:
        at = text.find(self.start)
        return [] if at < 0 else [p.strip() for p in text[at:].split(self.start)[1:]]

    def extract(self, text: str) -> tuple[str | None, Calls]:
        pieces = self._pieces(text)
        if not pieces:
            return text, []
        calls: Calls = []
        for piece in pieces:
            got = self._parse(piece)
            if got is None:
                return text, []  # not calls after all: the text stays content, as vLLM
            calls += got
        content = text[:text.find(self.start)].rstrip()
        return content or None, calls

    def _parse(self, piece: str) -> Calls | None:
        try:
            if piece.startswith("["):  # [{"name", "arguments"}, ...]
                items = json.loads(piece)
                if not isinstance(items, list) or not all(
                        isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
                    return None
                return [(i["name"], i["arguments"] if isinstance(i.get("arguments"), str)
                         else _dump(i.get("arguments", {}))) for i in items]
            name, sep, args = piece.partition(self._args_tag)
            if not sep or not name.strip():
                return None
            return [(name.strip(), _dump(json.loads(args)))]
        except ValueError:
            return None

    def segments(self, text: str) -> list[CallSegment]:
        out = []
        for piece in self._pieces(text):
            if piece.startswith("["):
                partial, whole = partial_json(piece), partial_json(piece, WHOLE)
                whole = whole if isinstance(whole, list) else []
                if isinstance(partial, list):
                    out += [CallSegment(p, whole[i] if i < len(whole) else None, ("arguments",))
                            for i, p in enumerate(partial)]
                continue
            name, sep, args = piece.partition(self._args_tag)
            if sep:  # the name is complete once [ARGS] follows it
                obj = {"name": name.strip(), "arguments": partial_json(args)}
                out.append(CallSegment(obj, obj, ("arguments",)))
        return out


# ---- pythonic ----------------------------------------------------------------------------------


class PythonicFormat:
    start = "["

    def extract(self, text: str) -> tuple[str | None, Calls]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        body = body.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls: Calls = []
        for node in tree.elts:
            call = _pythonic_call(node)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls

    def segments(self, text: str) -> list[CallSegment]:
        return []  # sent whole at the end: a prefix of Python is not parseable as such


def _pythonic_call(node: ast.expr) -> tuple[str, str] | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:
        return None
    try:
        return node.func.id, _dump(args)
    except TypeError:  # a literal JSON has no form for (a set, bytes)
        return None
