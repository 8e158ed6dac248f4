"""A request of several prompts handed to the engine prompt by prompt (the bridge's side).

A completion request may carry hundreds of long prompts. Added to the engine at once they
would all queue ahead of every request that arrives after them (a plain request behind 256
prompts of 2,000 tokens waits for all of their prefill), so the bridge hands a request's
prompts over in units (a prompt with its n > 1 siblings) while those of its prompts already
in the engine that have not prefilled hold fewer than a window of prompt tokens
(``--request-prefill-window``); the rest are :class:`Held`, accepted but not yet added.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from hlserve.errors import InvalidRequestError, ServiceUnavailableError
from hlserve.server.runtime.events import EventSink, Submission


@dataclass(eq=False)
class Held:
    """A request's prompts not yet handed to the engine: units of a prompt and its n > 1
    siblings, released as the request's earlier prompts prefill (prompt by prompt)."""

    sink: EventSink
    units: deque[list[Submission]]


def units_of(batch: Sequence[Submission]) -> list[list[Submission]]:
    """A request's submissions as units: each sequence that follows another (n > 1) rides
    with the one it follows, which must reach the engine first."""
    units: list[list[Submission]] = []
    for sub in batch:
        if sub.follows is not None and units:
            units[-1].append(sub)
        else:
            units.append([sub])
    return units


def sibling_rejected() -> InvalidRequestError:
    return InvalidRequestError("another prompt of this request was rejected")


def timeout_error(timeout: float | None) -> ServiceUnavailableError:
    return ServiceUnavailableError(f"The request did not finish within the server's request "
                                   f"timeout ({timeout:g}s, --request-timeout)",
                                   code="request_timeout")


def fit_window(units: Sequence[list[Submission]], window: int, unprefilled: int) -> int:
    """How many of ``units`` to hand over now: while what waits for prefill holds fewer than
    ``window`` prompt tokens (so always one when nothing does)."""
    n = 0
    while n < len(units) and unprefilled < window:
        unprefilled += prompt_tokens(units[n][0])
        n += 1
    return n


def prompt_tokens(sub: Submission) -> int:
    # a text prompt counts its characters: never fewer than its tokens
    return len(sub.prompt)
