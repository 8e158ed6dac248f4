"""Verification of draft tokens against the target model's rows of one forward.

A request that carries k draft tokens runs k + 1 query rows (its last known token and the k
drafts); row i's distribution is the target's for the token after draft i - 1. These functions
turn those rows into the tokens emitted this step: the accepted prefix of the draft and one
token from the target (the correction at the first rejection, or the bonus token after a fully
accepted draft), so a step emits between 1 and k + 1 tokens.

- ``greedy_verify``: accept while the draft equals the row's argmax. The emitted tokens are
  exactly the ones non-speculative greedy decoding would give, by construction.
- ``rejection_verify``: the drafts are deterministic (a point-mass proposal q), so the standard
  speculative-sampling rule min(1, p/q) becomes: accept draft x with probability p(x); on
  rejection sample from p with x removed and renormalised (the residual max(0, p - q)
  normalised). Each emitted token is then distributed exactly as sampling from p would be.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy_verify(draft: Sequence[int], logits: torch.Tensor) -> list[int]:
    """Tokens emitted for ``draft`` given its ``[len(draft) + 1, vocab]`` processed logits."""
    target = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, tok in enumerate(draft):
        out.append(target[i])
        if target[i] != tok:
            return out
    out.append(target[len(draft)])
    return out


def rejection_verify(draft: Sequence[int], probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Tokens emitted for ``draft`` given its ``[len(draft) + 1, vocab]`` target probabilities.

    ``probs`` are after every logits processor, temperature and top-k/top-p filter, so
    acceptance is measured against the distribution the request would sample from."""
    k = len(draft)
    uniforms = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype) \
        if k else None
    out: list[int] = []
    for i, tok in enumerate(draft):
        row = probs[i]
        if uniforms is not None and float(uniforms[i]) < float(row[tok]):
            out.append(tok)
            continue
        residual = row.clone()
        residual[tok] = 0.0
        total = residual.sum()
        if float(total) <= 0.0:
            # p(x) == 1 cannot reject; kept for rounding: emit the draft.
            out.append(tok)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
