"""Speculation: the vLLM config fields, the n-gram and suffix speculators, and verification
(greedy exact against a real multi-row forward; rejection sampling keeps the distribution)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from hlserve.config import SpeculativeConfig
from hlserve.engine.speculation import (
    ContextView,
    NgramIndex,
    NgramSpeculator,
    SuffixSpeculator,
    make_speculator,
    ngram_propose,
)
from hlserve.errors import InvalidRequestError
from hlserve.runner.spec_verify import greedy_verify, rejection_verify
from suffix_trie_reference import CountTrie, _Node


def test_config_reads_vllm_fields_and_refuses_the_rest() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                  '"prompt_lookup_max": 6, "prompt_lookup_min": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 3, 6)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert isinstance(make_speculator(cfg), NgramSpeculator)
    suffix = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8})
    assert isinstance(make_speculator(suffix), SuffixSpeculator)
    for bad in ('{"method": "eagle", "num_speculative_tokens": 2}',
                '{"method": "ngram", "num_speculative_tokens": 0}',
                '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}',
                '{"method": "ngram"}',
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
                '"prompt_lookup_max": 3}'):
        with pytest.raises(InvalidRequestError):
            SpeculativeConfig.parse(bad)


def test_ngram_takes_the_longest_match_and_its_earliest_occurrence() -> None:
    """vLLM's rule (``_find_longest_matched_ngram_and_propose_tokens``): the longest match,
    then its earliest occurrence."""
    ctx = [1, 2, 3, 4, 9, 8, 2, 3, 5, 6, 1, 2, 3]
    # "1 2 3" (n=3) occurred at 0 followed by 4 9 8; "2 3" alone would also match at 6 (-> 5).
    assert ngram_propose(ctx, 3, 2, 5) == [4, 9, 8]
    assert ngram_propose(ctx, 3, 2, 2) == [4, 9, 8]  # n=2 only: the earliest "2 3", at 1
    ctx = [5, 6, 7, 5, 6, 8, 5, 6]
    assert ngram_propose(ctx, 3, 2, 4) == [7, 5, 6]
    assert ngram_propose(ctx, 3, 4, 5) == []  # no 4-gram repeats
    assert ngram_propose([7, 7, 7], 5, 1, 3) == [7]  # the follow is cut at the context's end
    assert ngram_propose(ctx, 0, 1, 3) == []


def test_ngram_drafts_k_tokens_on_repetitive_output() -> None:
    """A run of one token (or a short loop): the most recent occurrence of the suffix ends
    right before the context and leaves one token to draft, as hlserve did; the earliest
    (vLLM's) leaves k. The engine's index as the engine calls it, token by token."""
    spec = NgramSpeculator(2, 4)
    prompt, output = [3] + [9] * 8, []  # "9 9 9 9" ends at 4..7 before the suffix's own
    for _ in range(6):
        assert spec.draft("r", prompt, output, 3) == [9, 9, 9]
        output.append(9)
    loop = [4, 5, 6] * 4
    assert NgramSpeculator(2, 4).draft("s", loop, [], 3) == [4, 5, 6]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.data())
def test_the_index_proposes_what_the_scan_does(ctx: list[int], data: st.DataObject) -> None:
    """The engine's incremental index against the definition, on small alphabets (many
    repeats), the context grown in pieces with proposals asked in between."""
    nmin = data.draw(st.integers(1, 3))
    nmax = data.draw(st.integers(nmin, 6))
    k = data.draw(st.integers(0, 4))
    index = NgramIndex(nmin)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ctx)), max_size=4)))
    for end in [*cuts, len(ctx)]:
        index.extend(ctx[:end])
        assert index.propose(k, nmax) == ngram_propose(ctx[:end], k, nmin, nmax)
    spec = NgramSpeculator(nmin, nmax)
    assert spec.propose("r", ctx, k) == ngram_propose(ctx, k, nmin, nmax)
    spec.finish("r")
    assert spec._index == {}  # nothing kept after a request ends
    # the engine's call: prompt and output apart, the output growing (a few tokens a step,
    # one token a plain decode step: the inlined path)
    split = data.draw(st.integers(0, len(ctx)))
    prompt, output = ctx[:split], []
    for end in [*(c for c in cuts if c >= split), *range(max(split, len(ctx) - 3), len(ctx) + 1)]:
        output[:] = ctx[split:end]
        assert spec.draft("r", prompt, output, k) == ngram_propose(ctx[:end], k, nmin, nmax)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=30), st.data())
def test_context_view_reads_as_the_joined_list(tokens: list[int], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(tokens)))
    view, joined = ContextView(tokens[:cut], tokens[cut:]), tokens
    assert len(view) == len(joined) and list(view) == joined
    a = data.draw(st.integers(-35, 35) | st.none())
    b = data.draw(st.integers(-35, 35) | st.none())
    step = data.draw(st.sampled_from([None, 1, 2, -1]))
    assert view[a:b:step] == joined[a:b:step]
    if joined:
        i = data.draw(st.integers(-len(joined), len(joined) - 1))
        assert view[i] == joined[i]


def _counts(node: _Node, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], int]:
    out = {}
    for tok, child in node.children.items():
        if child.count:
            out[(*prefix, tok)] = child.count
        out.update(_counts(child, (*prefix, tok)))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6), st.integers(0, 40))
def test_incremental_trie_counts_every_substring(tokens: list[int], depth: int,
                                                 cut: int) -> None:
    whole, grown = CountTrie(depth), CountTrie(depth)
    whole.add(tokens)
    grown.extend(tokens[:cut])
    grown.extend(tokens[cut:])
    expect: dict[tuple[int, ...], int] = {}
    for i in range(len(tokens)):
        for j in range(i + 1, min(len(tokens), i + depth) + 1):
            expect[tuple(tokens[i:j])] = expect.get(tuple(tokens[i:j]), 0) + 1
    assert _counts(whole.root) == expect == _counts(grown.root)
    whole.add(tokens, sign=-1)
    assert whole.root.children == {}


def test_suffix_speculator_uses_own_context_then_finished_outputs() -> None:
    spec = SuffixSpeculator(SpeculativeConfig("suffix", 8, suffix_decoding_max_cached_requests=1))
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    # Own context: "12 13 14" repeats, so its continuation is proposed; the length is adaptive:
    # at most spec_factor (1.0) x match length.
    ctx = [*prompt, 12, 13, 14]
    assert spec.propose("a", ctx, 8) == [15, 16, 17]
    spec.observe("a", [*ctx, 15, 16, 17, 40, 41, 42, 43], prompt_len=len(prompt))
    spec.finish("a")
    # Another request whose context ends in a piece of a's output gets its continuation.
    assert spec.propose("b", [1, 2, 40, 41], 8) == [42, 43]
    assert spec.propose("b", [1, 2, 40, 41], 1) == [42]
    spec.observe("c", [50, 51, 52, 53], prompt_len=2)
    spec.finish("c")  # evicts a's output (max_cached_requests=1)
    assert spec.propose("d", [1, 2, 40, 41], 8) == []
    assert spec.propose("d", [9, 50, 51, 52], 8) == [53]


def test_suffix_draft_stops_when_the_continuation_is_ambiguous() -> None:
    def speculator(min_prob: float) -> SuffixSpeculator:
        spec = SuffixSpeculator(SpeculativeConfig(
            "suffix", 8, suffix_decoding_min_token_prob=min_prob,
            suffix_decoding_max_spec_factor=4.0))
        for i, branch in enumerate(([5, 6, 7, 8], [5, 6, 9, 9])):
            spec.observe(str(i), [1, 2, 3, 4, *branch], prompt_len=4)
            spec.finish(str(i))
        return spec
    # After "5 6" the outputs went on with 7 or 9, probability 1/2 each.
    assert speculator(0.6).propose("q", [0, 5], 8) == [6]
    assert speculator(0.4).propose("q", [0, 5], 8) == [6, 7, 8]
    # Adaptive length: a match of one token speculates at most spec_factor x 1 tokens.
    spec = SuffixSpeculator(SpeculativeConfig("suffix", 8))
    spec.observe("a", [1, 2, 3, 4, 5, 6, 7, 8], prompt_len=0)
    spec.finish("a")
    assert spec.propose("b", [0, 5], 8) == [6]
    assert spec.propose("b", [0, 4, 5], 8) == [6, 7]


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dirs: dict[str, Path]) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"],
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("drafts", ["ngram", "random"])
def test_greedy_verify_gives_plain_greedy_tokens(hf_llama: torch.nn.Module, drafts: str) -> None:
    """Drafts run as extra query rows of one real forward; the emitted tokens equal one
    forward per token, whether the drafts are mostly right (n-gram on a repetitive prompt)
    or mostly wrong (random)."""
    rng = random.Random(3)
    vocab = hf_llama.config.vocab_size
    motif = [rng.randrange(3, vocab) for _ in range(12)]
    prompt = motif * 4
    n_new, k = 24, 4
    with torch.no_grad():
        plain = list(prompt)
        for _ in range(n_new):
            plain.append(int(hf_llama(torch.tensor([plain])).logits[0, -1].argmax()))
        seq, steps, accepted = list(prompt), 0, 0
        while len(seq) < len(plain):
            draft = ngram_propose(seq, k, 1, 4) if drafts == "ngram" else \
                [rng.randrange(3, vocab) for _ in range(k)]
            logits = hf_llama(torch.tensor([seq + draft])).logits[0, len(seq) - 1:]
            emitted = greedy_verify(draft, logits)
            accepted += len(emitted) - 1
            seq += emitted
            steps += 1
    assert seq[:len(plain)] == plain
    if drafts == "ngram":
        assert steps < n_new  # the repetitive prompt lets drafts through
    else:
        assert accepted <= 2 and steps >= n_new - 2


def test_rejection_sampling_keeps_the_distribution() -> None:
    """Chi-square over 20000 trials on a 5-token vocabulary: the first emitted token follows
    p0, and after an accepted first draft the second follows p1, for any deterministic draft
    (here one the target likes and one it rarely picks)."""
    p = torch.tensor([[0.10, 0.40, 0.20, 0.25, 0.05],
                      [0.30, 0.05, 0.15, 0.10, 0.40],
                      [0.20, 0.20, 0.20, 0.20, 0.20]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    trials = 20000
    for draft in ([1, 4], [4, 1]):
        first = [0] * 5
        second = [0] * 5
        for _ in range(trials):
            out = rejection_verify(draft, p, gen)
            first[out[0]] += 1
            if out[0] == draft[0]:
                second[out[1]] += 1
        n2 = sum(second)
        assert chisquare(first, [trials * float(x) for x in p[0]]).pvalue > 1e-3
        assert chisquare(second, [n2 * float(x) for x in p[1]]).pvalue > 1e-3
        assert abs(n2 / trials - float(p[0, draft[0]])) < 0.02  # accepted with prob p(x)


def test_rejection_sampling_never_emits_a_rejected_draft_at_once() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        out = rejection_verify([0], p, gen)
        assert out in ([0, 2], [1])


def test_logit_rows_is_the_rule_sampling_and_the_last_layer_share() -> None:
    """A prompt chunk short of the prompt's end reads no logits, the chunk that reaches it
    reads its last row, a decode its one row, a speculating decode every row; draft_rows
    picks exactly those rows."""
    from hlserve.engine.batch import ScheduledSeq
    from hlserve.request import Request, SamplingParams
    from hlserve.runner.speculative import draft_rows

    def request(computed: int, outputs: int) -> Request:
        req = Request(list(range(3, 23)), SamplingParams(max_tokens=4))  # 20 prompt tokens
        req.num_computed = computed
        req.output_token_ids.extend([5] * outputs)
        return req
    prompt = request(0, 0)
    mid, last = ScheduledSeq(prompt, 0, 8, [0]), ScheduledSeq(prompt, 8, 12, [0])
    assert (mid.logit_rows, last.logit_rows) == (0, 1)
    decode = ScheduledSeq(request(20, 1), 20, 1, [0, 1])
    spec = ScheduledSeq(request(20, 1), 20, 4, [0, 1], draft=[7, 8, 9])
    assert (decode.logit_rows, spec.logit_rows) == (1, 4)
    rows, which, specs = draft_rows([mid, last, decode, spec])
    assert (rows, which) == ([19, 20], [1, 2])
    assert [(s.logit_rows, first) for s, first in specs] == [(4, 21)]
