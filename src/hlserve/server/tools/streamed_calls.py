"""Tool calls streamed as vLLM streams them (``tool_choice`` auto and required): each call's
first delta carries its ``index``, ``id``, ``type`` and ``function.name`` (once the name is
complete), then ``function.arguments`` deltas as the arguments are generated.

The text of each call is parsed as partial JSON (``partial-json-parser``, vLLM's choice),
with partial strings, objects and arrays allowed but not partial numbers or literals (``12``
may yet become ``123``). The arguments so far are dumped as the final call will be dumped
(``json.dumps``, ``ensure_ascii=False``) with their trailing closers (``"``, ``}``, ``]``)
dropped: what is left is a prefix of the final arguments text, and only what extends the
text already sent goes out. At the end the rest of each call, as the non-streamed parse
gives it, is sent, so the concatenated deltas equal the non-streamed call.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

log = logging.getLogger("hlserve.server")

PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR  # what may be incomplete in a parsed prefix
WHOLE = Allow.OBJ | Allow.ARR  # strings complete: a name is known only once closed
CLOSERS = '"}]'


def partial_json(text: str, allow: Allow = PARTIAL) -> Any:
    """``text`` (a JSON prefix) parsed, or None while nothing is parseable yet."""
    if not text.strip():
        return None
    try:
        return partial_json_parser.loads(text, allow)
    except Exception:  # the library raises several kinds on malformed input
        return None


@dataclass
class CallSegment:
    """One call as generated so far: its JSON parsed with partial strings allowed
    (``partial``) and without (``whole``: a name is known once its string closed), and the
    keys its arguments may come under (``parameters`` first for Llama and required)."""

    partial: Any
    whole: Any
    args_keys: tuple[str, ...]

    @classmethod
    def of(cls, text: str, args_keys: tuple[str, ...]) -> CallSegment:
        return cls(partial_json(text), partial_json(text, WHOLE), args_keys)


def hermes_segments(full: str) -> list[CallSegment]:
    """The JSON inside each ``<tool_call>`` block (the last may be open)."""
    return [CallSegment.of(m.group(1), ("arguments", "parameters"))
            for m in re.finditer(r"<tool_call>\s*(.*?)(?:</tool_call>|$)", full, re.DOTALL)]


def required_segments(full: str) -> list[CallSegment]:
    """The elements of ``tool_choice: required``'s JSON array ``[{"name", "parameters"}]``."""
    partial, whole = partial_json(full), partial_json(full, WHOLE)
    if not isinstance(partial, list):
        return []
    whole = whole if isinstance(whole, list) else []
    return [CallSegment(p, whole[i] if i < len(whole) else None, ("parameters",))
            for i, p in enumerate(partial)]


def llama3_segments(full: str) -> list[CallSegment]:
    """The ``;``-separated JSON objects of a Llama 3 reply (the last may be open)."""
    body = full.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    decoder, out, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            out.append(CallSegment.of(body[pos:], ("parameters", "arguments")))
            break
        out.append(CallSegment.of(body[pos:end], ("parameters", "arguments")))
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return out


@dataclass
class _Sent:
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    name: str | None = None  # sent once complete
    args: str = ""  # the arguments text sent so far


def _stable_args(segment: CallSegment) -> str | None:
    """The arguments dumped so far, minus trailing closers; None while unknown (or when the
    model writes them as a JSON string, which is sent whole at the end)."""
    obj = segment.partial
    if not isinstance(obj, dict):
        return None
    key = next((k for k in segment.args_keys if k in obj), None)
    if key is None:
        return None
    args = obj[key]
    if not isinstance(args, (dict, list)):
        return None
    return json.dumps(args, ensure_ascii=False).rstrip(CLOSERS)


def _complete_name(segment: CallSegment) -> str | None:
    obj = segment.whole
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) else None


class CallStreamer:
    """One streamed choice's tool calls: :meth:`update` with the call segments parsed from
    the text so far gives the new deltas; :meth:`finish` with the final calls the rest."""

    def __init__(self) -> None:
        self.sent: list[_Sent] = []

    @property
    def started(self) -> bool:
        return bool(self.sent)

    def update(self, segments: list[CallSegment]) -> list[dict[str, Any]]:
        deltas = []
        for i, seg in enumerate(segments):
            if i == len(self.sent):
                name = _complete_name(seg)
                if name is None:
                    break  # calls are announced in order
                self.sent.append(_Sent(name=name))
                deltas.append({"index": i, "id": self.sent[i].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            sent = self.sent[i]
            stable = _stable_args(seg)
            if stable and stable.startswith(sent.args) and len(stable) > len(sent.args):
                piece, sent.args = stable[len(sent.args):], stable
                deltas.append({"index": i, "function": {"arguments": piece}})
        return _merge(deltas)

    def finish(self, calls: list[Any]) -> list[dict[str, Any]]:
        """The rest of each final call (``ToolCall``s, as the unstreamed reply has them)."""
        deltas = []
        for i, call in enumerate(calls):
            if i >= len(self.sent):
                self.sent.append(_Sent(name=call.name, args=call.arguments))
                deltas.append({"index": i, "id": self.sent[i].id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.sent[i]
            if call.arguments.startswith(sent.args):
                rest = call.arguments[len(sent.args):]
                if rest:
                    deltas.append({"index": i, "function": {"arguments": rest}})
            else:  # should not happen: the prefix rule above; say so rather than hide it
                log.warning("streamed tool-call arguments diverged from the final parse: "
                            "%r vs %r", sent.args[:80], call.arguments[:80])
            sent.args = call.arguments
        return _merge(deltas)


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas of the same call in one step folded into one entry."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append(d)
    return out
