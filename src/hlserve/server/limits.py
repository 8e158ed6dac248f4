"""Documented size limits the API checks up front, before any work is done for a request
(each a 400 in OpenAI's error format naming the field that went over); docs/server.md lists
them with their defaults."""

from __future__ import annotations

from typing import Any

from hlserve.server.protocol import ApiError

# Logprob entries one response may carry: sequences (n, or best_of) x max_tokens x
# (top_logprobs + 1). vLLM caps top_logprobs at 20 but not the product, so n=128,
# max_tokens=1000, top_logprobs=20 asks for a ~200 MB response built in one piece. 2^18
# entries (~20 MB of JSON) still allows top_logprobs=20 over 12,000 tokens of one sequence.
MAX_LOGPROB_ENTRIES = 1 << 18


def check_logprob_volume(req: Any, max_tokens: int) -> None:
    """400 if the response's logprobs would exceed MAX_LOGPROB_ENTRIES."""
    top = req.requested_logprobs
    if top is None:
        return
    sequences = getattr(req, "best_of", None) or req.n
    entries = sequences * max_tokens * (top + 1)
    if entries > MAX_LOGPROB_ENTRIES:
        raise ApiError(400, f"the response would carry {entries} logprob entries ({sequences} "
                       f"sequences x {max_tokens} tokens x {top + 1}); the limit is "
                       f"{MAX_LOGPROB_ENTRIES}: lower n, max_tokens or top_logprobs",
                       param="top_logprobs" if hasattr(req, "top_logprobs") else "logprobs",
                       code="invalid_value")
