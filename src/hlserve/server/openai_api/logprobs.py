"""Logprobs in the OpenAI wire formats.

The engine gives one :class:`~hlserve.request.TokenLogprobs` per generated token. The
completions API (legacy) wants parallel lists (``tokens``, ``token_logprobs``,
``top_logprobs`` as dicts, ``text_offset``); the chat API wants one entry per token with its
UTF-8 ``bytes`` and a list of alternatives. A token's text is its own decode, special tokens
included; a model without a tokenizer names tokens ``token_id:N`` (vLLM's convention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hlserve.request import TokenLogprobs
from hlserve.tokenizer import Tokenizer

# a token the grammar forbids has logprob -inf, which JSON cannot carry: vLLM's floor
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer | None, ids: Sequence[int],
                        entries: Sequence[TokenLogprobs], text_offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs`` object; ``text_offset`` is where the first token's
    text starts in the completion (non-zero for a later streamed chunk)."""
    tokens, offsets, tops = [], [], []
    offset = text_offset
    for tid, entry in zip(ids, entries, strict=True):
        text = token_text(tokenizer, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for alt, lp in entry.top:
            top.setdefault(token_text(tokenizer, alt), _finite(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(tokenizer: Tokenizer | None, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer | None, ids: Sequence[int],
                  entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """The chat API's ``logprobs`` object."""
    content = []
    for tid, entry in zip(ids, entries, strict=True):
        item = _chat_entry(tokenizer, tid, entry.logprob)
        item["top_logprobs"] = [_chat_entry(tokenizer, alt, lp) for alt, lp in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}
