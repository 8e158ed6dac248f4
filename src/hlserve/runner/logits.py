"""Per-request logits adjustments before sampling: ``logit_bias`` and the repetition,
presence and frequency penalties, with vLLM's semantics and order (bias, then penalties)."""

from __future__ import annotations

import torch

from hlserve.request import Request


class LogitsAdjuster:
    """Applies each request's bias and penalties to its row of the logits, in place.

    Only rows whose request asks for an adjustment are touched, so a batch without any does
    no tensor work at all. A request's prompt tokens (for the repetition penalty) are turned
    into a tensor once and kept until :meth:`release`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._prompt_ids: dict[str, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        for i, r in enumerate(reqs):
            if r.params.adjusts_logits:
                self._adjust_row(logits, i, r)

    def _adjust_row(self, logits: torch.Tensor, i: int, req: Request) -> None:
        p = req.params
        row = logits[i]  # a view: the updates below land in ``logits``
        vocab = row.shape[0]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=self.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=self.device)
            row.index_add_(0, ids, bias)
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=self.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            seen[self._prompt_tensor(req)] = True
            seen[out] = True
            rep = p.repetition_penalty
            penalized = torch.where(row > 0, row / rep, row * rep)
            row.copy_(torch.where(seen, penalized, row))
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and len(out):
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row.sub_(counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty)

    def _prompt_tensor(self, req: Request) -> torch.Tensor:
        t = self._prompt_ids.get(req.request_id)
        if t is None:
            t = torch.tensor(sorted(set(req.prompt_token_ids)), dtype=torch.long,
                             device=self.device)
            self._prompt_ids[req.request_id] = t
        return t

    def release(self, request_id: str) -> None:
        self._prompt_ids.pop(request_id, None)
