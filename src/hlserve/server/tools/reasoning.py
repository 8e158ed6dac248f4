"""Reasoning text split from the answer (``--reasoning-parser``, vLLM's names): what the model
writes inside ``<think>...</think>`` goes to the message's ``reasoning_content``, the rest to
``content`` (where the tool-call parser, if any, then looks for calls).

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the reply starts
  inside the reasoning: everything up to ``</think>`` (a leading ``<think>`` dropped) is
  reasoning; a reply with no ``</think>`` is all reasoning (cut before it ended), as vLLM.
- ``qwen3``: reasoning only when the reply opens with ``<think>`` (or ``</think>`` closes it:
  templates that open it in the prompt); without (``enable_thinking=false``) all content.

Streamed, the split is recomputed on the text so far, holding back a partial tag at the end,
so ``reasoning_content`` and ``content`` deltas concatenate to the unstreamed split.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """``open_by_default``: the reply starts inside the reasoning (deepseek_r1)."""

    open_by_default: bool

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of the text so far; unfinished text keeps a partial tag at its
        end out of both."""
        body = text.lstrip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START):]
        elif not finished and START.startswith(body) and body:
            return None, ""  # may yet be "<think>"
        at = body.find(END)
        if at >= 0:
            return body[:at], body[at + len(END):]  # both verbatim, as vLLM
        if not (opened or self.open_by_default):
            return None, text
        # inside the reasoning: all of it is reasoning, less a partial "</think>"
        hold = 0 if finished else _partial_suffix(body, END)
        return body[:len(body) - hold], ""


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {"qwen3": ReasoningParser(False), "deepseek_r1": ReasoningParser(True)}


class ReasoningStream:
    """One streamed choice's split: each step gives the new reasoning and the content so
    far (to be streamed as content or handed to the tool-call stream)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent = 0

    def step(self, full: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content so far)."""
        reasoning, content = self.parser.split(full, finished)
        reasoning = reasoning or ""
        delta = reasoning[self.sent:] if len(reasoning) > self.sent else ""
        self.sent += len(delta)
        return delta, content


def reasoning_for(name: str | None, constrained: bool) -> ReasoningParser | None:
    """The request's parser: none without ``--reasoning-parser``, and none for a constrained
    reply (a grammar from the first token leaves no room to think)."""
    return None if name is None or constrained else REASONING_PARSERS[name]


def apply_reasoning(parser: ReasoningParser | None, choices: list[dict]) -> None:
    """Whole chat choices with their reasoning split out of ``content`` (in place)."""
    if parser is None:
        return
    for c in choices:
        msg = c["message"]
        reasoning, content = parser.split(msg["content"] or "")
        msg["reasoning_content"] = reasoning
        msg["content"] = content if reasoning is None else (content or None)
