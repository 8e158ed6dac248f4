"""Throughput mode's per-step choice of how many draft tokens to verify (issue 24).

A draft token costs a query row of the step's forward whether or not it is accepted, and
pays only when it is. Each step :class:`AdaptiveK` picks the k (0..k_max) that every
speculating request may draft, from three measurements:

- reach: ``q_j``, the EMA of P(a lookup allowed j or more tokens drafts at least j), per
  position, over every lookup (one that found no match drafts 0). An n-gram proposer
  drafts only as far as its match goes, so allowing k tokens drafts ``R(k) = sum_{j<=k}
  q_j`` rows on average, not k: on repetitive agent output most drafts are one token;
- acceptance: ``a_i``, the EMA of P(draft token i accepted | the tokens before it were),
  per position, over every verified draft. ``g_j = prod_{i<=j} a_i`` is the chance that the
  j-th draft token, once drafted, is accepted, so allowing k tokens gains
  ``E(k) = sum_{j<=k} q_j g_j`` tokens;
- cost: the step's time as ``t0 + t_row x rows``, a least-squares fit over the recent steps
  with exponential forgetting (:class:`StepCostFit`; ``t0``: what a step costs whatever its
  size, the weights read, launches and the scheduler; ``t_row``: what each query row adds).

With D decodes, k gives ``D (1 + E(k))`` tokens in ``t0 + t_row D (1 + R(k))`` seconds.
The step takes the k with the most expected tokens per second among those whose last draft
token is accepted with probability at least ``min_gain`` (below it a draft costs the
proposal and the verification's bookkeeping for almost nothing). Where ``t0`` dominates (a
memory-bound GPU at a small batch) every draft that may be accepted pays; where the rows
dominate (a large batch, a compute-bound device) k falls, to 0 once ``1 + E(k)`` grows more
slowly than ``1 + k``: at high concurrency the answer may be none. The scheduler also never
gives drafts more than the token budget leaves after the step's decodes, so a step whose
decodes fill the budget speculates none.

While k is 0 nothing is measured, so every ``probe_every`` such steps one request drafts
k_max tokens (a probe), and the estimate follows a workload that turns repetitive. The prior
is ``a_i = q_j = 1``: a fresh engine speculates fully until its drafts are measured (the warm-up;
with acceptance ~0, ``a_1`` falls below ``min_gain`` after about 22 drafts at ``alpha`` 0.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# a draft token accepted with a lower probability than this is not worth its row
MIN_GAIN = 0.1
ALPHA = 0.1  # EMA weight of one verified draft's outcome
PROBE_EVERY = 16  # steps at k = 0 between probes
FORGET = 0.95  # the cost fit's weight of a step, per step after it (~20 steps remembered)
MIN_FIT_STEPS = 8


@dataclass
class StepCostFit:
    """Step time = t0 + t_row x rows, by weighted least squares (recent steps weigh most)."""

    forget: float = FORGET
    min_steps: int = MIN_FIT_STEPS
    steps: int = 0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        f, x, y = self.forget, float(rows), seconds
        self._w = f * self._w + 1.0
        self._x = f * self._x + x
        self._y = f * self._y + y
        self._xx = f * self._xx + x * x
        self._xy = f * self._xy + x * y
        self.steps += 1

    def estimate(self) -> tuple[float, float] | None:
        """(t0, t_row), both >= 0; None before ``min_steps`` steps or while the steps' sizes
        spread too little for a slope (a standard deviation under one row or under a tenth
        of their mean: timing noise would be all the fit saw)."""
        if self.steps < self.min_steps:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 1.0 or var < 0.01 * mx * mx:
            return None
        t_row = max(0.0, (self._xy / self._w - mx * my) / var)
        return max(0.0, my - t_row * mx), t_row


@dataclass
class AdaptiveK:
    """The per-step k (module docstring); its counters are what the stats and /metrics show."""

    k_max: int
    alpha: float = ALPHA
    min_gain: float = MIN_GAIN
    probe_every: int = PROBE_EVERY
    accept: list[float] = field(default_factory=list)  # a_i, conditional, per position
    reach: list[float] = field(default_factory=list)  # q_j, per position, over lookups
    cost: StepCostFit = field(default_factory=StepCostFit)
    steps_by_k: list[int] = field(default_factory=list)  # steps with decodes, by the k chosen
    probes: int = 0
    _idle: int = 0  # steps at k = 0 since the last probe

    def __post_init__(self) -> None:
        self.accept = self.accept or [1.0] * self.k_max
        self.reach = self.reach or [1.0] * self.k_max
        self.steps_by_k = self.steps_by_k or [0] * (self.k_max + 1)

    def observe_draft(self, num_draft: int, num_accepted: int) -> None:
        """One verified draft: position i is seen when every token before it was accepted."""
        for i in range(min(num_draft, num_accepted + 1)):
            hit = 1.0 if i < num_accepted else 0.0
            self.accept[i] += self.alpha * (hit - self.accept[i])

    def observe_lookup(self, allowed: int, drafted: int) -> None:
        """One lookup that could draft ``allowed`` tokens drafted ``drafted`` (0: no match);
        positions past ``allowed`` learn nothing."""
        for j in range(min(allowed, self.k_max)):
            self.reach[j] += self.alpha * ((1.0 if j < drafted else 0.0) - self.reach[j])

    def observe_step(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def gains(self) -> list[float]:
        """g_j: the probability that draft token j (1-based) is accepted."""
        out, p = [], 1.0
        for a in self.accept:
            p *= a
            out.append(p)
        return out

    def best_k(self, decodes: int) -> int:
        """The k with the most expected tokens per second (ties to the larger k) among those
        whose last draft token clears ``min_gain``."""
        gains = self.gains()
        cap = next((j for j, g in enumerate(gains) if g < self.min_gain), self.k_max)
        fit = self.cost.estimate()
        if fit is None:
            return cap
        t0, t_row = fit
        best_k, best, expected, rows = 0, -1.0, 0.0, 0.0
        for k in range(cap + 1):
            if k:
                expected += self.reach[k - 1] * gains[k - 1]
                rows += self.reach[k - 1]
            rate = (1.0 + expected) / max(1e-12, t0 + t_row * decodes * (1 + rows))
            if rate >= best * (1 - 1e-9):
                best_k, best = k, rate
        return best_k

    def choose(self, decodes: int, spare: float) -> tuple[int, bool]:
        """This step's k for ``decodes`` decoding requests with ``spare`` budget left after
        them, and whether one request probes (drafts k_max though k is 0)."""
        if decodes <= 0:
            return 0, False
        k = self.best_k(decodes) if spare >= 1 else 0
        self.steps_by_k[k] += 1
        if k > 0 or spare < 1:
            self._idle = 0
            return k, False
        self._idle += 1
        if self._idle < self.probe_every:
            return 0, False
        self._idle = 0
        return 0, True
