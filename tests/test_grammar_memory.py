"""The compiled-grammar cache is bounded by bytes, not only by entries: distinct large specs,
one request each, must not grow the process without bound (hardening, issue row 2)."""

from __future__ import annotations

import random
import string

from hlserve.models.tiny_tokenizer import TOKENIZER_VOCAB_SIZE, trained_tokenizer_json
from hlserve.structured import grammar
from hlserve.structured.grammar import GrammarCompiler
from hlserve.structured.params import StructuredOutputsParams


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _big_regex(rng: random.Random) -> StructuredOutputsParams:
    words = ("".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(55_000))
    return StructuredOutputsParams(regex="(" + "|".join(words) + ")")  # ~495K characters


def test_distinct_large_specs_do_not_grow_memory_without_bound() -> None:
    g = GrammarCompiler(trained_tokenizer_json(), TOKENIZER_VOCAB_SIZE, [1])
    rng = random.Random(0)
    g.compile(_big_regex(rng))  # the allocator's first growth is not the cache's
    start = _rss_mb()
    for _ in range(30):  # unbounded: ~33 MB each stays cached, ~1 GB in all
        g.compile(_big_regex(rng))
        assert g.cached_bytes <= grammar.CACHE_BYTES
    grown = _rss_mb() - start
    assert g.cached <= grammar.CACHE_BYTES // grammar.spec_charge(("regex", "x" * 495_001))
    assert grown < 400, f"the process grew {grown:.0f} MB over 30 distinct specs"


def test_a_spec_too_large_to_keep_is_compiled_and_not_cached(monkeypatch) -> None:
    monkeypatch.setattr(grammar, "CACHE_BYTES", 4 * grammar.BYTES_PER_SPEC_CHAR * 1000)
    g = GrammarCompiler(trained_tokenizer_json(), TOKENIZER_VOCAB_SIZE, [1])
    small = StructuredOutputsParams(regex="a{1,3}")
    large = StructuredOutputsParams(regex="(" + "|".join(["ab"] * 2000) + ")")
    g.compile(small)
    assert g.cached == 1
    state = g.state(large)  # still a working matcher
    assert not state.matcher.is_error()
    assert g.cached == 1 and g.cached_bytes == grammar.spec_charge(small.key())
