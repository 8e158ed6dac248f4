"""The suffix speculator's array indexes (engine/suffix_index.py): the proposals of the count
trie they replace, on small alphabets (many repeats) with outputs finishing, evicted by count
and by bytes; and the shared index's bytes held to its budget under thousands of distinct
500-token outputs (the trie held ~3.4 MB per such output)."""

from __future__ import annotations

import sys
import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hlserve.config import SpeculativeConfig
from hlserve.engine.speculation import SuffixSpeculator
from hlserve.engine.suffix_index import SharedIndex
from suffix_trie_reference import TrieSuffixSpeculator


def _config(data: st.DataObject, cached: int) -> SpeculativeConfig:
    return SpeculativeConfig(
        "suffix", 8, suffix_decoding_max_tree_depth=data.draw(st.integers(1, 7)),
        suffix_decoding_max_cached_requests=cached,
        suffix_decoding_max_spec_factor=data.draw(st.sampled_from([0.5, 1.0, 2.0, 4.0])),
        suffix_decoding_min_token_prob=data.draw(st.sampled_from([0.0, 0.1, 0.4, 0.7])))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_arrays_propose_what_the_trie_does(data: st.DataObject) -> None:
    cached = data.draw(st.integers(0, 3))
    config = _config(data, cached)
    new, old = SuffixSpeculator(config), TrieSuffixSpeculator(config)
    toks = st.lists(st.integers(0, 3), max_size=25)
    for r in range(data.draw(st.integers(1, 6))):
        prompt, output = data.draw(toks), data.draw(toks)
        rid = f"r{r}"
        # the engine's order: observe on first sight with the prompt length, then grow
        for end in sorted({0, *data.draw(st.lists(st.integers(0, len(output)), max_size=3)),
                           len(output)}):
            ctx = prompt + output[:end]
            new.observe(rid, ctx, len(prompt))
            old.observe(rid, ctx, len(prompt))
            k = data.draw(st.integers(0, 6))
            assert new.propose(rid, ctx, k) == old.propose(rid, ctx, k), (ctx, k)
        new.finish(rid)
        old.finish(rid)
        probe = data.draw(toks)  # a fresh request reads only the finished outputs
        assert new.propose("q", probe, 5) == old.propose("q", probe, 5), probe
        new.finish("q")
        old.finish("q")


def test_engine_calls_read_the_lists_without_joining_them() -> None:
    """``draft`` (the engine's per-step call, a view of prompt + output) proposes as
    ``propose`` over the joined list, and a request's state goes when it finishes."""
    spec = SuffixSpeculator(SpeculativeConfig("suffix", 4))
    prompt, output = [5, 6, 7, 8, 5, 6], []
    for tok in [7, 8, 5, 6, 7]:
        assert spec.draft("a", prompt, output, 4) == \
            TrieSuffixSpeculator(SpeculativeConfig("suffix", 4)).propose("a", prompt + output, 4)
        output.append(tok)
    spec.finish("a")
    assert spec._requests == {}
    # the output as last observed (4 tokens: the fifth came after the last draft) is cached
    assert spec.shared is not None and list(spec.shared.spans) == [4 + 1]


def _outputs(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 150_000, length).tolist() for _ in range(n)]


def test_shared_index_bytes_stay_within_the_budget() -> None:
    """2,000 distinct 500-token outputs (1M tokens, ~16 MB of arrays uncapped) into a 2 MiB
    budget: the arrays never pass it after an add, and Python's heap (tracemalloc, numpy's
    buffers included) holds the arrays plus a constant. The count cap (vLLM's 1,000) alone
    held ~3.4 GB in the trie."""
    budget = 2 << 20
    index = SharedIndex(max_requests=10_000, max_bytes=budget)
    outputs = _outputs(2000, 500, seed=1)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    peak_charge = 0
    for out in outputs:
        index.add(out)
        peak_charge = max(peak_charge, index.nbytes())
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert peak_charge <= budget
    assert held <= index.nbytes() + (256 << 10), (held, index.nbytes())
    # the newest outputs stay findable, the oldest are gone
    # 16 bytes a token: 262 outputs fill 2 MiB; a shrink evicts down to 3/4 of it
    assert 150 < len(index.spans) <= 262
    newest, oldest = outputs[-1], outputs[0]
    assert any(p.size for _, _, p in index.candidates(newest[:3]))
    assert not any(p.size for _, p, _ in index.candidates(oldest[:2]))


def test_speculator_memory_is_bounded_by_the_config_budget() -> None:
    """Through the speculator as the engine drives it: 400 requests of 500 distinct output
    tokens under ``suffix_decoding_max_cached_bytes`` 512 KiB (64 outputs); the speculator's whole heap
    stays within the budget plus a constant, and nothing of a finished request's own index is
    kept."""
    budget = 512 << 10
    spec = SuffixSpeculator(SpeculativeConfig("suffix", 4, suffix_decoding_max_cached_bytes=budget))
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i, out in enumerate(_outputs(400, 500, seed=2)):
        prompt = out[:8]
        spec.observe(str(i), prompt, len(prompt))
        spec.observe(str(i), prompt + out, len(prompt))
        spec.finish(str(i))
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert spec._requests == {}
    assert held <= budget + (256 << 10), held
    assert spec.shared is not None and spec.shared.nbytes() <= budget


def test_context_index_is_a_few_bytes_a_token() -> None:
    """A request's own index: 8K distinct tokens (its worst case) in under 100 bytes a token
    (the trie: ~24 nodes of ~200 bytes a token); repeated tokens ~4 bytes more a token."""
    spec = SuffixSpeculator(SpeculativeConfig("suffix", 4))
    ctx = _outputs(1, 8192, seed=3)[0]
    spec.observe("a", ctx, 16)
    index = spec._requests["a"][0]
    assert index.nbytes() < 100 * 8192
    before = index.nbytes()
    spec.observe("a", ctx * 3, 16)  # every token again, twice
    assert index.nbytes() - before < 8 * 16384 + 100 * 8192
    assert sys.getsizeof(index) < 200
