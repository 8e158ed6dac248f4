"""Grammars compiled once per spec (llguidance) and matched token by token; the token mask
of a batch's constrained rows applied to their logits."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import torch

from hlserve.errors import InvalidRequestError
from hlserve.structured.params import StructuredOutputsParams
from hlserve.structured.strict import closed_schema_text

CACHE_SIZE = 512  # compiled grammars kept (LRU), keyed by the spec's text
# ... and the bytes they may hold. llguidance does not report a matcher's size, and a spec's
# length is a poor proxy (per character, a compiled and probed literal run holds ~620 B, an
# alternation ~70 B, a JSON schema ~20 B), so an entry is charged what the heap grew by while
# it was compiled and probed (:func:`heap_in_use`, glibc's allocator statistics, which see
# llguidance's Rust allocations). One compile is measured at a time; one compiled while
# another is measured, or where the statistics are missing, is charged the worst case found
# per character (WORST_BYTES_PER_SPEC_CHAR), and no entry less than MIN_BYTES_PER_SPEC_CHAR
# (another thread's frees during a compile can hide its growth). A grammar charged over a
# quarter of the budget is compiled per request and freed with it instead of being kept.
CACHE_BYTES = 256 << 20
WORST_BYTES_PER_SPEC_CHAR = 1024
MIN_BYTES_PER_SPEC_CHAR = 16
PROBE_STEPS = 2  # matcher steps taken at compile time, where llguidance's lazy errors surface
_SHIFTS = torch.arange(32, dtype=torch.int32)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2() -> object | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out (glibc: in-use chunks of every arena plus mmapped
    ones), or None where the allocator does not say."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()  # type: ignore[operator]
    return int(info.uordblks + info.hblkhd)


def entry_charge(text: str, grown: int | None) -> int:
    """The bytes a cached grammar is charged: what the heap grew by while it was compiled
    and probed (None: not measured, the worst case per character), never less than the
    floor per character, plus its spec's text, which the cache key holds."""
    chars = max(1, len(text))
    if grown is None:
        return chars * WORST_BYTES_PER_SPEC_CHAR + len(text)
    return max(grown, chars * MIN_BYTES_PER_SPEC_CHAR) + len(text)


class GrammarError(RuntimeError):
    """A grammar that compiled but failed while matching (a lazy llguidance error): the
    request's fault, not the engine's, so it fails that request alone and quietly."""


def short_error(text: str) -> str:
    """llguidance's message without its grammar dump or stats: the first line, clipped."""
    first = text.strip().splitlines()[0] if text and text.strip() else "unknown error"
    if "NoExtensionBias" in first:  # llguidance's word for a language with no finite word
        return "the grammar matches no output (it is empty, or every derivation is infinite)"
    return first[:200]


class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed. The output
    is the truth: a retracted request keeps its tokens (recompute) so its matcher stays
    valid, and a matcher that ever disagrees with the output is rebuilt from it (:meth:`sync`)."""

    __slots__ = ("accepted", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.accepted = 0

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True once the grammar is complete and can take nothing
        more (the request ends with finish_reason "stop")."""
        self.matcher.consume_token(token)
        self.accepted += 1
        if self.matcher.is_error():
            raise GrammarError(f"the grammar refused token {token}: "
                               f"{short_error(self.matcher.get_error())}")
        return self.matcher.is_stopped()

    def sync(self, output_ids: Sequence[int]) -> None:
        if self.accepted == len(output_ids):
            return
        self.matcher.reset()
        self.accepted = 0
        for t in output_ids:
            self.advance(t)


class GrammarCompiler:
    """Compiles specs against one tokenizer and vocabulary. Thread-safe: the server compiles
    in its handlers (a bad schema is a 400 before the engine sees it), the engine thread
    hits the cache. ``close_objects``: a JSON schema's omitted ``additionalProperties`` means
    false (vLLM's default reading, :mod:`hlserve.structured.strict`); False, JSON Schema's."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int],
                 close_objects: bool = True) -> None:
        self.vocab_size = vocab_size
        self.close_objects = close_objects
        self._tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                           eos_token=sorted(eos_ids))
        # key -> (matcher, its charge)
        self._cache: OrderedDict[tuple, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self._bytes = 0  # the charge of what _cache holds (see CACHE_BYTES)
        self._lock = threading.Lock()
        self._measuring = threading.Lock()  # held by the one compile being measured

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher of the spec's grammar; raises InvalidRequestError if it is invalid."""
        kind, text, compact, closed = spec.key()
        key = (kind, text, compact, closed or self.close_objects)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0].deep_copy()
        measured = self._measuring.acquire(blocking=False)
        try:
            before = heap_in_use() if measured else None
            matcher = self._build(key)
            after = heap_in_use() if before is not None else None
        finally:
            if measured:
                self._measuring.release()
        grown = None if before is None or after is None else after - before
        self._keep(key, matcher, entry_charge(key[1], grown))
        return matcher.deep_copy()

    def _build(self, key: tuple) -> llguidance.LLMatcher:
        """The compiled and probed matcher of a cache key; InvalidRequestError if invalid."""
        try:
            matcher = llguidance.LLMatcher(self._tok, grammar_text(key), log_level=0)
        except InvalidRequestError:
            raise
        except Exception as e:  # whatever the engine raises on a spec is the spec's fault
            raise InvalidRequestError(f"invalid {key[0]} for structured output: {e}") from None
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {key[0]} for structured output: "
                                      f"{short_error(matcher.get_error())}")
        if (why := self._probe(matcher.deep_copy())) is not None:
            raise InvalidRequestError(f"invalid {key[0]} for structured output: {why}")
        return matcher

    def _keep(self, key: tuple, matcher: llguidance.LLMatcher, charge: int) -> None:
        """Cache a compiled matcher within CACHE_SIZE entries and CACHE_BYTES, evicting the
        least recently used; one too large for a quarter of the budget is not kept."""
        if charge > CACHE_BYTES // 4:
            return
        with self._lock:
            if key in self._cache:  # compiled twice at once: keep one
                return
            self._cache[key] = (matcher, charge)
            self._bytes += charge
            while len(self._cache) > CACHE_SIZE or self._bytes > CACHE_BYTES:
                _, (_, old_charge) = self._cache.popitem(last=False)
                self._bytes -= old_charge

    def _probe(self, matcher: llguidance.LLMatcher) -> str | None:
        """Why the grammar cannot be matched, or None: its first PROBE_STEPS steps (mask, then
        one allowed token) taken here, in the handler's thread, because llguidance reports
        empty languages, runaway lexers and oversized rows only once matching starts, which
        would otherwise be on the engine thread."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(words, dtype=torch.int32)
        for _ in range(PROBE_STEPS):
            if matcher.is_stopped():
                return None
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
            if matcher.is_error():
                return short_error(matcher.get_error())
            allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).flatten()[:self.vocab_size]
            ids = allowed.nonzero().flatten()
            if ids.numel() == 0:
                return "the grammar allows no output"
            matcher.consume_token(int(ids[0]))
            if matcher.is_error():
                return short_error(matcher.get_error())
        return None

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile(spec))

    @property
    def cached(self) -> int:
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        """What the cache is charged with now (<= CACHE_BYTES)."""
        return self._bytes


def grammar_text(key: tuple[str, str, bool, bool]) -> str:
    """llguidance's grammar of a cache key: (kind, text, compact, objects closed)."""
    kind, text, compact, closed = key
    try:
        if kind == "json":
            if closed:  # llguidance has no option for it: the schema is rewritten
                text = closed_schema_text(text)
            options = {"whitespace_flexible": not compact}
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.grammar_from("choice", text)
        return llguidance.grammar_from("grammar", text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise InvalidRequestError(f"invalid {kind} for structured output: {e}") from None


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Any]) -> None:
    """Set to -inf, in place, every logit the row's grammar does not allow now; rows of
    requests without a grammar are untouched. The caller checks that there is one."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    base, row_bytes = bitmask.data_ptr(), words * 4
    for j, i in enumerate(rows):
        state: GrammarState = reqs[i].grammar
        state.sync(reqs[i].output_token_ids)
        # row by row in this thread: tens of microseconds each. (llguidance's parallel
        # executor cost ~40 ms a call here, its threads contending with torch's.)
        state.matcher.unsafe_compute_mask_ptr(base + j * row_bytes, row_bytes)
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).flatten(1)[:, :vocab].bool()
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), -float("inf"))
