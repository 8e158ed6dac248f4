"""Speculators: propose up to k draft tokens per running decode request from what the engine
already holds (no draft model), behind one interface.

- ``NgramSpeculator``: vLLM's ``ngram`` method (prompt lookup). The longest suffix of the
  request's context of length ``prompt_lookup_min..prompt_lookup_max`` that occurred earlier in
  that context proposes the tokens that followed its earliest occurrence (vLLM's choice: on
  repetitive text the most recent one ends right before the context does, and so drafts one
  token; the earliest has the most tokens after it).
- ``SuffixSpeculator``: SuffixDecoding's idea. Count tries of every substring (up to a depth)
  over the request's own context and over the outputs of recent requests; the longest suffix of
  the context found in a trie is walked on by its most frequent continuation while the
  continuation's empirical probability stays above ``min_token_prob``, for at most
  ``max_spec_factor`` x the match length tokens: a long, frequent match speculates far, a short
  or ambiguous one little (the adaptive length).

Their config is :class:`hlserve.config.SpeculativeConfig` (vLLM's ``--speculative-config``
fields, a typed field of ``EngineConfig``). This module is pure Python: the engine layer, no
torch.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

from hlserve.config import SpeculativeConfig
from hlserve.engine.suffix_index import ContextIndex, SharedIndex, longest_match, walk_counts


class ContextView(Sequence[int]):
    """A request's prompt and output read as one sequence without joining them: a draft is
    asked for every decode step, and ``all_token_ids`` copies the whole context each time
    (the speculators read only what was appended, or the last few tokens)."""

    __slots__ = ("n", "output", "prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output
        self.n = len(prompt) + len(output)  # read while the request cannot grow

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return (self.prompt + self.output)[i]
            if stop <= start:
                return []
            if stop <= n:
                return self.prompt[start:stop]
            if start >= n:
                return self.output[start - n:stop - n]
            return self.prompt[start:] + self.output[:stop - n]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.prompt[i] if i < n else self.output[i - n]


class Speculator(abc.ABC):
    """Proposes draft tokens for a request from its context (prompt + output so far)."""

    @abc.abstractmethod
    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``context``; may be empty."""

    # Optional hooks (stateless speculators keep nothing), hence not abstract.
    def observe(self, request_id: str, context: Sequence[int],  # noqa: B027
                prompt_len: int | None = None) -> None:
        """The request's context grew (tokens appended); ``prompt_len`` on first sight."""

    def finish(self, request_id: str) -> None:  # noqa: B027
        """The request ended."""

    def draft(self, request_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        """``observe`` then ``propose`` over the context ``prompt + output``, not joined: the
        engine's call, once per decoding request per step (a speculator may do both at
        once, as :class:`NgramSpeculator` does)."""
        context = ContextView(prompt, output)
        self.observe(request_id, context, len(prompt))
        return self.propose(request_id, context, k)


@dataclass
class NgramSpeculator(Speculator):
    """Prompt lookup: vLLM's ``ngram`` method over the request's own context, each request's
    context indexed as it grows (:class:`NgramIndex`): a proposal costs the occurrences of
    the last ``prompt_lookup_min`` tokens, not a scan of the context (a scan is ~0.7 ms per
    1K tokens of context per request per step in Python: 64 requests at 4K, 180 ms a step)."""

    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    _index: dict[str, NgramIndex] = field(default_factory=dict, repr=False)

    def observe(self, request_id: str, context: Sequence[int],
                prompt_len: int | None = None) -> None:
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = NgramIndex(self.prompt_lookup_min)
        index.extend(context)

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        index = self._index.get(request_id)
        if index is None or len(index.tokens) != len(context):  # not observed since it grew
            self.observe(request_id, context)
            index = self._index[request_id]
        return index.propose(k, self.prompt_lookup_max)

    def draft(self, request_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        # the engine's per-step call: no view, the index reads the two lists' new tail itself
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = NgramIndex(self.prompt_lookup_min)
        return index.draft(prompt, output, k, self.prompt_lookup_max)

    def finish(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class NgramIndex:
    """One context's ``nmin``-grams, each with the positions where it ends, in order; only
    the tokens appended since the last call are read. :meth:`propose` gives what
    :func:`ngram_propose` gives (the longest match in ``nmin..nmax``, its earliest
    occurrence), from the occurrences of the context's last ``nmin`` tokens: a match of n
    tokens ends with them, so each occurrence is extended backwards and the longest (then the
    earliest) wins."""

    def __init__(self, nmin: int) -> None:
        self.nmin = nmin
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int | list[int]] = {}
        self.indexed = nmin - 2  # the last end position indexed

    def extend(self, context: Sequence[int]) -> None:
        """Read what was appended to the context since the last call (a context only grows;
        one that shrank is indexed afresh)."""
        self.extend_parts(context, ())

    def extend_parts(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """:meth:`extend` for the context ``prompt + output`` without joining them."""
        t = self.tokens
        have, p = len(t), len(prompt)
        if have > p + len(output):
            self.__init__(self.nmin)  # type: ignore[misc]
            t, have = self.tokens, 0
        if have < p:
            t.extend(prompt[have:])
            have = p
        if have - p < len(output):
            t.extend(output[have - p:])

    def _index_to(self, last: int) -> None:
        """Index the n-grams ending at positions up to ``last``: ~1 us a token, once (a
        position seen once is an int, a list only from its second occurrence: 4 MB per 32K
        tokens, not 6)."""
        t, n, ends = self.tokens, self.nmin, self.ends
        first = self.indexed + 1
        if last < first:
            return
        if last - first < 8:  # a decode step's few tokens: zip's set-up would cost more
            grams = (tuple(t[e - n + 1:e + 1]) for e in range(first, last + 1))
        else:
            grams = zip(*(t[first - n + 1 + j:last + 2 - n + j] for j in range(n)), strict=True)
        for e, key in enumerate(grams, first):
            at = ends.get(key)
            if at is None:
                ends[key] = e
            elif type(at) is int:
                ends[key] = [at, e]
            else:
                at.append(e)
        self.indexed = last

    def draft(self, prompt: list[int], output: list[int], k: int, nmax: int) -> list[int]:
        """:meth:`extend_parts` then :meth:`propose`: the engine's per-step call."""
        if len(self.tokens) != len(prompt) + len(output):
            self.extend_parts(prompt, output)
        return self.propose(k, nmax)

    def propose(self, k: int, nmax: int) -> list[int]:
        t, n = self.tokens, self.nmin
        size = len(t)
        if k <= 0 or size < n + 1:
            return []
        # the suffix's own occurrence (ending at the last token) has nothing after it
        last = size - 2
        if last == self.indexed + 1:  # a plain decode step's one new n-gram, inlined: this
            key = tuple(t[last - n + 1:size - 1])  # runs per decoding request per step
            at = self.ends.get(key)
            if at is None:
                self.ends[key] = last
            elif type(at) is int:
                self.ends[key] = [at, last]
            else:
                at.append(last)
            self.indexed = last
        else:
            self._index_to(last)
        at = self.ends.get(tuple(t[size - n:]))
        if at is None:
            return []
        occurrences = [at] if type(at) is int else at
        cap = min(nmax, size - 1)
        best, best_end = 0, -1
        for e in occurrences:  # earliest first: the first to reach a length keeps it
            m = n  # tokens e-m+1..e equal the last m tokens
            while m < cap and m <= e and t[e - m] == t[size - 1 - m]:
                m += 1
            if m > best:
                best, best_end = m, e
                if m == cap:
                    break
        return t[best_end + 1:best_end + 1 + k]


def ngram_propose(context: Sequence[int], k: int, nmin: int, nmax: int) -> list[int]:
    """The tokens after the earliest occurrence of the longest matching suffix (vLLM's
    ``_find_longest_matched_ngram_and_propose_tokens``): the definition, by a scan of the
    context (the reference :class:`NgramIndex` is tested against)."""
    tokens = list(context)
    size = len(tokens)
    if k <= 0:
        return []
    for n in range(min(nmax, size - 1), nmin - 1, -1):
        suffix = tokens[size - n:]
        # Earliest occurrence first, as vLLM: the most recent of a repeating run ends just
        # before the context and leaves one token to draft.
        for start in range(size - n):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


class SuffixSpeculator(Speculator):
    """SuffixDecoding over the request's own context and recently finished requests' outputs,
    indexed in arrays (engine/suffix_index.py): the proposals of :class:`TrieSuffixSpeculator`
    at 12-16 bytes per token, the shared index held to ``suffix_decoding_max_cached_bytes``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.shared: SharedIndex | None = None
        if config.suffix_decoding_max_cached_requests > 0 \
                and config.suffix_decoding_max_cached_bytes > 0:
            self.shared = SharedIndex(config.suffix_decoding_max_cached_requests,
                                      config.suffix_decoding_max_cached_bytes)
        self._requests: dict[str, tuple[ContextIndex, int]] = {}  # index, prompt length

    def observe(self, request_id: str, context: Sequence[int], prompt_len: int | None = None
                ) -> None:
        state = self._requests.get(request_id)
        if state is None:
            plen = len(context) if prompt_len is None else prompt_len
            state = self._requests[request_id] = (ContextIndex(), plen)
        index = state[0]
        if len(context) > index.size - 1:
            index.extend(context[index.size - 1:])  # only what was appended

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        self.observe(request_id, context)
        cap = min(self.depth - 1, len(context))
        if cap < 1:
            return []
        tail = context[len(context) - cap:]
        own = self._requests[request_id][0]
        best: tuple[int, float, list[int]] = (0, 0.0, [])
        for sources in ([own.candidates(tail)],
                        self.shared.candidates(tail) if self.shared is not None else []):
            m, found = longest_match(sources, tail, cap)
            if not m:
                continue
            limit = min(k, max(1, math.floor(self.spec_factor * m)))
            draft, prob = walk_counts(found, self.depth - m, limit, self.min_prob)
            # Scored as TrieSuffixSpeculator does: the draft length weighted by its
            # probability, ties to the longer match.
            if draft and (len(draft) * prob, m) > (len(best[2]) * best[1], best[0]):
                best = (m, prob, draft)
        return best[2]

    def finish(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None or self.shared is None:
            return
        output = state[0].tokens(state[1])
        if output:
            self.shared.add(output)


def make_speculator(config: SpeculativeConfig) -> Speculator:
    """The speculator of a config's method."""
    if config.method == "ngram":
        return NgramSpeculator(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixSpeculator(config)
