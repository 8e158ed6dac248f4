"""The compiled-grammar cache is bounded by bytes, not only by entries, and each entry is
charged what it really holds: distinct large specs, one request each, of any shape, must not
grow the process past the budget."""

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
    assert g.cached < 30
    assert grown < 400, f"the process grew {grown:.0f} MB over 30 distinct specs"


def test_literal_runs_are_charged_what_they_hold(monkeypatch) -> None:
    """A compiled literal run holds ~4x what an alternation of the same length does: charged
    by its spec's length at the alternations' rate, hundreds of distinct ones grew the
    process ~4x past the budget (here 32 MiB: ~130 MB); charged what the heap grew by, the
    cache stays within it."""
    budget_mb = 32
    monkeypatch.setattr(grammar, "CACHE_BYTES", budget_mb << 20)
    g = GrammarCompiler(trained_tokenizer_json(), TOKENIZER_VOCAB_SIZE, [1])
    rng = random.Random(1)
    g.compile(StructuredOutputsParams(regex="abc"))
    start = _rss_mb()
    for _ in range(100):  # 400K characters in all
        g.compile(StructuredOutputsParams(regex="".join(rng.choices(string.ascii_lowercase,
                                                                    k=4000))))
        assert g.cached_bytes <= grammar.CACHE_BYTES
    grown = _rss_mb() - start
    assert grown < budget_mb + 24, f"grew {grown:.0f} MB for a {budget_mb} MiB budget"


def test_an_unmeasured_compile_is_charged_the_worst_case() -> None:
    assert grammar.entry_charge("x" * 100, None) == 100 * grammar.WORST_BYTES_PER_SPEC_CHAR + 100
    assert grammar.entry_charge("x" * 100, 0) == 100 * grammar.MIN_BYTES_PER_SPEC_CHAR + 100
    assert grammar.entry_charge("x" * 100, 1 << 20) == (1 << 20) + 100
    assert grammar.heap_in_use() is not None  # glibc here: compiles are measured


def test_a_spec_too_large_to_keep_is_compiled_and_not_cached(monkeypatch) -> None:
    monkeypatch.setattr(grammar, "CACHE_BYTES", 8 << 20)  # a quarter: 2 MiB
    g = GrammarCompiler(trained_tokenizer_json(), TOKENIZER_VOCAB_SIZE, [1])
    small = StructuredOutputsParams(regex="a{1,3}")  # tens of KB
    large = StructuredOutputsParams(regex="ab" * 10_000)  # a literal run: ~12 MB
    g.compile(small)
    assert g.cached == 1
    charged = g.cached_bytes
    state = g.state(large)  # still a working matcher
    assert not state.matcher.is_error()
    assert g.cached == 1 and g.cached_bytes == charged
