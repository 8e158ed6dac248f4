"""Token budget controllers: tokens per iteration, read each pass and fed each step's time;
``make_budget_controller`` builds one from the config for either host."""

from __future__ import annotations

import abc
import math

from hlserve.config import EngineConfig


class BudgetController(abc.ABC):
    """Tokens per iteration. ``budget`` is read each pass, ``observe`` fed each step."""

    budget: float

    @abc.abstractmethod
    def observe(self, elapsed: float, has_prefill: bool) -> None: ...


class FixedBudget(BudgetController):
    def __init__(self, budget: int | None) -> None:
        self.budget = budget if budget is not None else math.inf

    def observe(self, elapsed: float, has_prefill: bool) -> None:
        pass


class RatchetBudget(BudgetController):
    """The baseline: a target iteration time calibrated from the first ``warmup``
    iterations (near-empty batches, so unrealistically low), the budget cut by 5% on every
    iteration slower than it, and never raised above its initial value. Under real load it
    ratchets to zero and prefill stops."""

    def __init__(self, initial: int, warmup: int) -> None:
        self.initial = initial
        self.budget = float(initial)
        self.warmup = warmup
        self._calib: list[float] = []
        self.target: float | None = None

    def observe(self, elapsed: float, has_prefill: bool) -> None:
        if self.target is None:
            self._calib.append(elapsed)
            if len(self._calib) >= self.warmup:
                self.target = sum(self._calib) / len(self._calib)
            return
        if elapsed > self.target:
            self.budget = math.floor(self.budget * 0.95)
        self.budget = min(self.budget, self.initial)


class EMABudget(BudgetController):
    """Ours: the target follows the real iteration time, τ ← (1−α)·τ + α·t, updated only on
    iterations that contain prefill (decode-only ones say nothing about prefill cost) and
    only after ``warmup`` iterations. An iteration much slower than τ (a spike) cuts the
    budget by 5%; any other grows it by 5%, up to a ceiling that does not depend on the
    initial value, and never below a floor: the budget can grow as well as shrink."""

    def __init__(self, initial: int, alpha: float, warmup: int, floor: int, ceiling: int,
                 spike: float = 1.5) -> None:
        self.budget = float(min(max(initial, floor), ceiling))
        self.alpha, self.warmup, self.floor, self.ceiling = alpha, warmup, floor, ceiling
        self.spike = spike
        self.tau: float | None = None
        self._seen = 0

    def observe(self, elapsed: float, has_prefill: bool) -> None:
        self._seen += 1
        if self._seen <= self.warmup or not has_prefill:
            return
        if self.tau is None:
            self.tau = elapsed
            return
        if elapsed > self.spike * self.tau:
            self.budget = max(self.floor, self.budget * 0.95)
        else:
            self.budget = min(self.ceiling, self.budget * 1.05)
        self.tau = (1 - self.alpha) * self.tau + self.alpha * elapsed



def make_budget_controller(config: EngineConfig, pool_tokens: int) -> BudgetController:
    ceiling = config.budget_max or pool_tokens
    initial = config.token_budget or ceiling
    if config.budget_controller == "ratchet":
        return RatchetBudget(initial, config.budget_warmup)
    if config.budget_controller == "ema":
        return EMABudget(initial, config.ema_alpha, config.budget_warmup,
                         min(config.budget_min, ceiling), ceiling)
    return FixedBudget(config.token_budget)
