"""The count trie that suffix speculation ran on before its flat arrays
(hlserve/engine/suffix_index.py): one Python node per suffix occurrence. Kept here, out of
the package, as the reference the arrays' proposals are checked against
(tests/test_suffix_index.py, tests/test_speculation.py)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hlserve.config import SpeculativeConfig
from hlserve.engine.speculation import Speculator


@dataclass
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class CountTrie:
    """Counts of every substring of length <= depth of the sequences added (a suffix trie)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Add (or with sign -1 remove) every substring of ``tokens`` up to the depth."""
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start:start + self.depth]:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[tok]
                    break
                node = child

    def extend(self, tokens: Sequence[int]) -> None:
        """Count the substrings that end in ``tokens`` (the one sequence this trie follows grew).

        ``_active`` holds the nodes of the suffixes (length < depth) ending at the last token
        counted, so each new token costs O(depth), not O(depth^2)."""
        active: list[_Node] = getattr(self, "_active", [])
        for tok in tokens:
            parents = [self.root, *active[:self.depth - 1]]
            active = [p.children.setdefault(tok, _Node()) for p in parents]
            for node in active:
                node.count += 1
        self._active = active

    def match(self, context: Sequence[int]) -> tuple[int, _Node | None]:
        """The longest suffix of ``context`` (< depth) present, and its node."""
        for m in range(min(self.depth - 1, len(context)), 0, -1):
            node: _Node | None = self.root
            for tok in context[len(context) - m:]:
                node = node.children.get(tok) if node else None
                if node is None:
                    break
            if node is not None and node.children:
                return m, node
        return 0, None


def walk(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """Most frequent continuation from ``node`` while its cumulative probability >= min_prob."""
    out: list[int] = []
    prob = 1.0
    while len(out) < limit and node.children:
        tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
        total = sum(c.count for c in node.children.values())
        prob *= child.count / total
        if prob < min_prob:
            break
        out.append(tok)
        node = child
    return out, prob


@dataclass
class _RequestTrie:
    trie: CountTrie
    prompt_len: int
    seen: int = 0


class TrieSuffixSpeculator(Speculator):
    """The definition :class:`SuffixSpeculator` is tested against: the same proposals from
    count tries of Python nodes (~depth nodes per token, ~200 B each; not for serving)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.shared = CountTrie(self.depth)
        self._outputs: OrderedDict[str, list[int]] = OrderedDict()
        self._requests: dict[str, _RequestTrie] = {}
        self._contexts: dict[str, list[int]] = {}

    def observe(self, request_id: str, context: Sequence[int], prompt_len: int | None = None
                ) -> None:
        state = self._requests.get(request_id)
        if state is None:
            plen = len(context) if prompt_len is None else prompt_len
            state = self._requests[request_id] = _RequestTrie(CountTrie(self.depth), plen)
        if len(context) > state.seen:
            new = context[state.seen:]
            state.trie.extend(new)
            state.seen = len(context)
            # Only the new tokens are copied: a long context costs nothing per step.
            self._contexts.setdefault(request_id, []).extend(new)

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        self.observe(request_id, context)
        best: tuple[int, float, list[int]] = (0, 0.0, [])
        for trie in (self._requests[request_id].trie, self.shared):
            m, node = trie.match(context)
            if node is None:
                continue
            limit = min(k, max(1, math.floor(self.spec_factor * m)))
            draft, prob = walk(node, limit, self.min_prob)
            # Score as SuffixDecoding does: expected accepted tokens ~ sum of path probabilities;
            # here the draft length weighted by its probability, ties to the longer match.
            score = (len(draft) * prob, m)
            if draft and score > (len(best[2]) * best[1], best[0]):
                best = (m, prob, draft)
        return best[2]

    def finish(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        context = self._contexts.pop(request_id, None)
        if state is None or context is None or self.max_cached <= 0:
            return
        output = context[state.prompt_len:]
        if not output:
            return
        self._outputs[request_id] = output
        self.shared.add(output)
        while len(self._outputs) > self.max_cached:
            _, old = self._outputs.popitem(last=False)
            self.shared.add(old, sign=-1)
