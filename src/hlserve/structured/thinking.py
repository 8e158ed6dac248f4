"""The thinking budget (vLLM's ``thinking_token_budget``): at most N tokens inside a
reasoning section, then the section's end is forced.

A reasoning section opens with ``start_ids`` (``<think>``) and closes with ``end_ids``
(``</think>``), in the prompt (templates that open it there) or in the output. Once a
section holds ``budget`` tokens, the next tokens are forced to ``end_ids``, one per step
(the rest of it, when the output already ends with its first tokens); then the model
answers. Each section has its own budget, as in vLLM (its
``ThinkingBudgetStateHolder``): a section that the prompt opened counts the prompt's tokens
after its start, and a budget of 0 closes a section as soon as it opens.

:class:`ThinkingState` follows one request's tokens incrementally (``sync`` reads only the
tokens appended since its last call) and names the token the sampler must pick next, if any
(:meth:`ThinkingState.forced`). Pure Python, no torch: the runner applies the forcing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from hlserve.errors import InvalidRequestError


@dataclass(frozen=True)
class ThinkingBudget:
    """At most ``budget`` tokens per section between ``start_ids`` and ``end_ids``.
    ``natural_end_ids``: how the model itself closes a section, when the forced end differs
    (vLLM's ``reasoning_end_str`` may put a transition phrase before ``</think>``); empty:
    ``end_ids``."""

    budget: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    natural_end_ids: tuple[int, ...] = ()

    @property
    def closing_ids(self) -> tuple[int, ...]:
        return self.natural_end_ids or self.end_ids

    def validate(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0:
            raise InvalidRequestError("thinking budget must be a non-negative integer")
        if not self.start_ids or not self.end_ids:
            raise InvalidRequestError("thinking budget needs the start and end token ids of a "
                                      "reasoning section")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               for t in (*self.start_ids, *self.end_ids, *self.natural_end_ids)):
            raise InvalidRequestError("thinking budget token ids must be non-negative ints")


class ThinkingState:
    """One request's place in its reasoning: inside a section or not, its tokens so far, and
    how much of the forced end has been written."""

    def __init__(self, spec: ThinkingBudget, prompt_ids: Sequence[int]) -> None:
        self.spec = spec
        start = _last_index(prompt_ids, spec.start_ids)
        end = _last_index(prompt_ids, spec.closing_ids)
        # the prompt opened a section it did not close (e.g. a template ending in <think>)
        self.inside = start > end
        self.count = len(prompt_ids) - start - len(spec.start_ids) if self.inside else 0
        self.forcing: int | None = None  # index into end_ids of the next forced token
        self._tail: deque[int] = deque(prompt_ids[-self._window():], maxlen=self._window())
        self._seen = 0  # output tokens read
        self._check_budget()

    def _window(self) -> int:
        return max(len(self.spec.start_ids), len(self.spec.end_ids),
                   len(self.spec.closing_ids))

    def _ends_with(self, ids: tuple[int, ...]) -> bool:
        n = len(ids)
        return len(self._tail) >= n and tuple(self._tail)[-n:] == ids

    def _check_budget(self) -> None:
        if self.inside and self.forcing is None and self.count >= self.spec.budget:
            # an end the model had begun (``</`` of ``</think>``) is finished, not restarted
            self.forcing = self._begun_end()

    def _begun_end(self) -> int:
        """How many of ``end_ids`` the output ends with already (a proper prefix)."""
        end, tail = self.spec.end_ids, tuple(self._tail)
        for k in range(min(len(end) - 1, len(tail)), 0, -1):
            if tail[-k:] == end[:k]:
                return k
        return 0

    def _step(self, token: int) -> None:
        self._tail.append(token)
        if self.forcing is not None:  # a forced end token was written
            self.forcing += 1
            if self.forcing == len(self.spec.end_ids):
                self.inside, self.count, self.forcing = False, 0, None
            return
        if self.inside:
            if self._ends_with(self.spec.closing_ids):  # the model closed it itself
                self.inside, self.count = False, 0
            else:
                self.count += 1
        elif self._ends_with(self.spec.start_ids):
            self.inside, self.count = True, 0
        self._check_budget()

    def sync(self, output_ids: Sequence[int]) -> None:
        """Read the output tokens appended since the last call."""
        for token in output_ids[self._seen:]:
            self._step(token)
        self._seen = len(output_ids)

    def forced(self) -> int | None:
        """The token the next step must emit, or None when the model chooses."""
        return None if self.forcing is None else self.spec.end_ids[self.forcing]


def _last_index(ids: Sequence[int], sub: tuple[int, ...]) -> int:
    """Where the last occurrence of ``sub`` starts in ``ids``; -1 if none."""
    n = len(sub)
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == sub[0] and tuple(ids[i : i + n]) == sub:
            return i
    return -1
