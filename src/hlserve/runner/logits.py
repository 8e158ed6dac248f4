"""Per-request logits adjustments before sampling: ``logit_bias`` and the repetition,
presence and frequency penalties, with vLLM's semantics and order (bias, then penalties);
and the sampling filters after temperature (min-p, top-k / top-p), which the sampler and
speculative verification share."""

from __future__ import annotations

import torch

from hlserve.request import Request


class LogitsAdjuster:
    """Applies each request's bias and penalties to its row of the logits, in place.

    Only rows whose request asks for an adjustment are touched, so a batch without any does
    no tensor work at all. A request's distinct context tokens (for the repetition penalty)
    are kept between steps and grow by its new tokens, until :meth:`release`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seen: dict[str, _SeenTokens] = {}

    def apply(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        for i, r in enumerate(reqs):
            if r.params.adjusts_logits:
                self._adjust_row(logits, i, r)

    def _adjust_row(self, logits: torch.Tensor, i: int, req: Request) -> None:
        """Each adjustment gathers and scatters only the tokens it concerns (the bias's, the
        context's distinct ones): O(context), not O(vocabulary) per row."""
        p = req.params
        row = logits[i]  # a view: the updates below land in ``logits``
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=self.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=self.device)
            row.index_add_(0, ids, bias)
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=self.device)
        if p.repetition_penalty != 1.0:
            seen = self._seen_tokens(req)
            vals = row[seen]
            rep = p.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / rep, vals * rep)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and len(out):
            ids, counts = out.unique(return_counts=True)
            c = counts.to(row.dtype)
            row.index_add_(0, ids, -(c * p.frequency_penalty + p.presence_penalty))

    def _seen_tokens(self, req: Request) -> torch.Tensor:
        seen = self._seen.get(req.request_id)
        if seen is None:
            seen = self._seen[req.request_id] = _SeenTokens(req.prompt_token_ids, self.device)
        return seen.update(req.output_token_ids)

    def release(self, request_id: str) -> None:
        self._seen.pop(request_id, None)


class _SeenTokens:
    """The distinct tokens of a request's context, as a set and as an index tensor, grown by
    each step's new output tokens (usually one, usually already seen: no copy then)."""

    def __init__(self, prompt: list[int], device: torch.device) -> None:
        self.ids = set(prompt)
        self.device = device
        self.tensor = torch.tensor(sorted(self.ids), dtype=torch.long, device=device)
        self.num_output = 0

    def update(self, output: list[int]) -> torch.Tensor:
        new = [t for t in dict.fromkeys(output[self.num_output:]) if t not in self.ids]
        self.num_output = len(output)
        if new:
            self.ids.update(new)
            self.tensor = torch.cat([self.tensor, torch.tensor(new, dtype=torch.long,
                                                               device=self.device)])
        return self.tensor


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely one (row by row); the
    most likely token always survives."""
    # p < min_p * p_max  <=>  logit < logit_max + log(min_p): no softmax needed
    log_min_p = torch.tensor(min_p, device=logits.device, dtype=logits.dtype).log().unsqueeze(1)
    floor = logits.amax(dim=-1, keepdim=True) + log_min_p
    return logits.masked_fill(logits < floor, -float("inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, -float("inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    p = torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((before >= p) & (rank > 0), -float("inf"))
    return torch.full_like(logits, -float("inf")).scatter(1, order, sorted_logits)
