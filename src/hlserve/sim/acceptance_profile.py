"""Speculative decoding on a simulated machine: an acceptance profile instead of a speculator
that reads tokens.

The simulated runner's tokens are a hash of the request and the position (sim/sim_runner.py), so a
real speculator (n-gram, suffix) finds nothing to copy in them. What the simulation needs is
how often a real one proposes and how much of a draft the target accepts: an
:class:`AcceptanceProfile`, measured on the real engine (``benchmarks/speculation.py`` writes
one per workload). :class:`ProfileSpeculator` proposes drafts whose first ``m`` tokens are the
tokens the simulated runner will produce and the rest wrong, ``m`` drawn from the profile
deterministically per (request, position); the runner then verifies them exactly as the real
runner verifies greedy drafts (equal prefix, then the target's token), and the scheduler, the
KV cache and the cost of the extra query rows are the real engine's. A profile may also say
how far drafts reach (``reach``: a real n-gram proposal stops where the context does, so on
repetitive text many are shorter than k): a draft is then that long, and only its rows cost.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hlserve.engine.speculation import Speculator

TokenAt = Callable[[int, int], int]  # (the prompt's last token, position) -> the runner's token


@dataclass(frozen=True)
class AcceptanceProfile:
    """``propose_rate``: the share of a request's decode steps that carry a draft (a lookup
    that found a match); ``accept[i]``: the share of drafts whose token at position ``i + 1``
    was accepted (vLLM's ``num_accepted_tokens_per_pos`` over ``num_drafts``), non-increasing
    because a draft is accepted as a prefix."""

    accept: tuple[float, ...]
    propose_rate: float = 1.0
    name: str = ""
    # reach[i]: the share of drafts with a token at position i + 1 (empty: every draft is k
    # long); accept[i] is then among the drafts that reach it
    reach: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.propose_rate <= 1.0:
            raise ValueError(f"propose_rate {self.propose_rate} is not a share")
        for name, shares in (("acceptance", self.accept), ("reach", self.reach)):
            prev = 1.0
            for a in shares:
                if not 0.0 <= a <= prev + 1e-9:
                    raise ValueError(f"{name} by position {shares} must be shares that do not "
                                     "increase with the position")
                prev = a
        if self.reach and len(self.reach) != len(self.accept):
            raise ValueError("reach and accept need one share per position each")

    def draft_length(self, u: float, k: int) -> int:
        """A draft's length (at most ``k``) for a uniform draw ``u``: P(length >= i) =
        reach[i - 1]; at least one token (a proposal is a draft only if it has one)."""
        if not self.reach:
            return k
        return max(1, sum(1 for r in self.reach[:k] if u < r))

    @property
    def k(self) -> int:
        return len(self.accept)

    def expected_accepted(self) -> float:
        """Tokens accepted per draft on average (the sum of the by-position shares)."""
        return sum(self.accept)

    def accepted_length(self, u: float, k: int) -> int:
        """The accepted prefix of a ``k``-token draft for a uniform draw ``u``:
        P(length >= i) = accept[i - 1]."""
        return sum(1 for a in self.accept[:k] if u < a)

    @classmethod
    def from_counts(cls, num_drafts: int, accepted_per_pos: Sequence[int], decode_steps: int,
                    name: str = "") -> AcceptanceProfile:
        """From the engine's spec_decode counters and the number of decode steps (steps in
        which a speculation-eligible request decoded, with or without a draft)."""
        if num_drafts <= 0:
            return cls(tuple(0.0 for _ in accepted_per_pos), 0.0, name)
        return cls(tuple(a / num_drafts for a in accepted_per_pos),
                   min(1.0, num_drafts / max(decode_steps, 1)), name)

    @classmethod
    def load(cls, path: str | Path, workload: str | None = None) -> AcceptanceProfile:
        """A profile from JSON: ``{"accept": [...], "propose_rate": p}``, or a file of several
        under ``"profiles": {name: {...}}`` (pick one with ``workload``)."""
        data = json.loads(Path(path).read_text())
        if "profiles" in data:
            if workload is None or workload not in data["profiles"]:
                raise ValueError(f"{path}: choose a workload of {sorted(data['profiles'])}")
            data, name = data["profiles"][workload], workload
        else:
            name = data.get("name", workload or "")
        return cls(tuple(float(a) for a in data["accept"]),
                   float(data.get("propose_rate", 1.0)), name,
                   tuple(float(r) for r in data.get("reach", ())))


def _unit(request_id: str, position: int, salt: int) -> float:
    """A uniform number in [0, 1) fixed by (request, position): runs are reproducible and
    two configurations see the same draws for the same request."""
    # not crc32: it is affine in its input, so the draws for salts 0 and 1 would be correlated
    h = hashlib.blake2b(f"{request_id}:{position}:{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


class ProfileSpeculator(Speculator):
    """Drafts that the simulated runner accepts as the profile says (module docstring)."""

    def __init__(self, profile: AcceptanceProfile, token_at: TokenAt, vocab: int) -> None:
        self.profile = profile
        self.token_at = token_at
        self.vocab = vocab
        self._last_prompt: dict[str, int] = {}

    def observe(self, request_id: str, context: Sequence[int],
                prompt_len: int | None = None) -> None:
        if prompt_len:
            self._last_prompt[request_id] = context[prompt_len - 1]

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        pos = len(context)  # the draft's first token would be context[pos]
        k = min(k, self.profile.k)
        if k <= 0 or _unit(request_id, pos, 0) >= self.profile.propose_rate:
            return []
        last = self._last_prompt.get(request_id, context[-1])
        k = self.profile.draft_length(_unit(request_id, pos, 2), k)
        m = self.profile.accepted_length(_unit(request_id, pos, 1), k)
        draft = [self.token_at(last, pos + i) for i in range(m)]
        if m < k:  # the first rejected token: anything but the runner's
            draft.append((self.token_at(last, pos + m) + 1) % self.vocab)
            draft += [draft[-1]] * (k - m - 1)
        return draft

    def finish(self, request_id: str) -> None:
        self._last_prompt.pop(request_id, None)
