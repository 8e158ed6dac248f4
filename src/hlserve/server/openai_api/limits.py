"""Documented size limits the API checks up front, before any work is done for a request
(each a 400 in OpenAI's error format naming the field that went over); docs/server.md lists
them with their defaults."""

from __future__ import annotations

import re
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


# JSON nodes (objects, arrays, object members) one body may hold: validating a body into its
# request model holds the GIL throughout, ~1-6 us a node (a chat of 1M empty messages, 29 MB,
# held it for 3.5-6 s, and the event loop with it, even from a worker thread), so a body is
# counted before it is validated: at 2^17 nodes that is ~0.1-0.3 s. A message is 3 nodes (an
# object, its role and content), a content part 3 more; token ids and strings in a list are
# not nodes (cheap to validate), so prompts of token ids are unaffected.
MAX_BODY_NODES = 1 << 17
_NODES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{\[:]')


def check_body_nodes(body: bytes) -> None:
    """400 if ``body`` holds more than MAX_BODY_NODES JSON nodes (objects, arrays, members).
    The count of ``{``, ``[`` and ``:`` bytes bounds it from above in a few ms; only a body
    over the limit by that bound is scanned exactly (strings skipped), stopping at the limit.
    Run it in a worker thread: the exact scan is Python-level, so it yields the GIL."""
    if body.count(b"{") + body.count(b"[") + body.count(b":") <= MAX_BODY_NODES:
        return
    nodes = 0
    for m in _NODES.finditer(body):
        if m.end() - m.start() == 1:  # a structural byte, not a string
            nodes += 1
            if nodes > MAX_BODY_NODES:
                raise ApiError(400, f"The request body holds more than {MAX_BODY_NODES} JSON "
                               "objects, arrays and object members (messages, content parts, "
                               "tools, schema nodes, logit_bias entries); this server accepts "
                               f"at most {MAX_BODY_NODES}", code="invalid_value")
