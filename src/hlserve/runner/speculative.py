"""Speculative decoding in the runner: a speculating request's rows of the forward turned
into the tokens it emits this step.

A request scheduled with k draft tokens ran k + 1 query rows over its cached context (its
last known token, then the drafts: a chunk, as a prefill over a cached context is). Row i's
logits are the target's distribution after draft i - 1. Each row is processed as the sampler
would process it when the request has ``len(output) + i`` tokens (``min_tokens`` masks EOS and
stop ids per row), then verified (``spec_verify``): greedy requests exactly, sampled ones by
rejection sampling from their temperature / min-p / top-k / top-p distribution, with the
request's own generator when it has a seed. Requests with penalties, ``logit_bias``, a
grammar or logprobs never carry drafts (engine/spec_decode.py).
"""

from __future__ import annotations

import torch

from hlserve.engine.batch import ScheduledSeq
from hlserve.request import Request, SamplingParams
from hlserve.runner.logits import apply_min_p, apply_top_k_top_p
from hlserve.runner.spec_verify import greedy_verify, rejection_verify


def mask_min_tokens(logits: torch.Tensor, req: Request) -> None:
    """Row i generates output token ``len(output) + i``: EOS and stop ids are masked on the
    rows before ``min_tokens`` is reached, as the sampler masks its one row."""
    p = req.params
    rows = p.min_tokens - len(req.output_token_ids)
    if rows <= 0:
        return
    banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
    cols = [b for b in banned if b < logits.shape[1]]
    if cols:
        logits[:rows, cols] = -float("inf")


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, per row: temperature, min-p, top-k, top-p."""
    rows = logits.shape[0]
    sub = logits / p.temperature
    if p.min_p > 0:
        sub = apply_min_p(sub, [p.min_p] * rows)
    vocab = sub.shape[1]
    top_k = p.top_k if p.top_k > 0 else vocab
    if top_k < vocab or p.top_p < 1.0:
        sub = apply_top_k_top_p(sub, [top_k] * rows, [p.top_p] * rows)
    return torch.softmax(sub.float(), dim=-1)


def verify(seq: ScheduledSeq, logits: torch.Tensor,
           generator: torch.Generator | None) -> list[int]:
    """The tokens ``seq`` emits from its ``[1 + len(draft), vocab]`` logits: the accepted
    drafts, then the target's correction or bonus token (1 to k + 1 tokens)."""
    req = seq.request
    mask_min_tokens(logits, req)
    if req.params.greedy:
        return greedy_verify(seq.draft, logits)
    return rejection_verify(seq.draft, sampling_probs(logits, req.params), generator)


def draft_rows(batch_seqs: list[ScheduledSeq]) -> tuple[list[int], list[int],
                                                        list[tuple[ScheduledSeq, int]]]:
    """Row indices of the flattened batch whose logits are needed: the last row of each
    plain sampling sequence (with its index in the batch), and each speculating sequence's
    first row (its rows follow). Returns (plain rows, plain seq indices, speculating)."""
    rows: list[int] = []
    which: list[int] = []
    spec: list[tuple[ScheduledSeq, int]] = []
    end = 0
    for i, seq in enumerate(batch_seqs):
        end += seq.num_tokens
        if not (keep := seq.logit_rows):
            continue
        if seq.draft:
            spec.append((seq, end - keep))
        else:
            rows.append(end - keep)
            which.append(i)
    return rows, which, spec
