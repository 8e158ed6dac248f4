"""Token budget controllers: tokens per iteration, read each pass and fed each step's time;
``make_budget_controller`` builds one from the config for either host. :class:`StepTimeCap`
is the safety cap beside them: tokens per iteration bounded by the time a step may take."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable

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



def _fixed(config: EngineConfig, initial: int, ceiling: int) -> BudgetController:
    return FixedBudget(config.token_budget)


def _ratchet(config: EngineConfig, initial: int, ceiling: int) -> BudgetController:
    return RatchetBudget(initial, config.budget_warmup)


def _ema(config: EngineConfig, initial: int, ceiling: int) -> BudgetController:
    return EMABudget(initial, config.ema_alpha, config.budget_warmup,
                     min(config.budget_min, ceiling), ceiling)


# the knob's names, each with its constructor from (config, start budget, ceiling): what
# ``--budget-controller`` lists, what a config is checked against (engine/policies/names.py)
# and what ``make_budget_controller`` builds
BUDGET_CONTROLLERS: dict[str, Callable[[EngineConfig, int, int], BudgetController]] = {
    "fixed": _fixed, "ratchet": _ratchet, "ema": _ema,
}


def make_budget_controller(config: EngineConfig, pool_tokens: int) -> BudgetController:
    ceiling = config.budget_max or pool_tokens
    initial = config.token_budget or ceiling
    return BUDGET_CONTROLLERS[config.budget_controller](config, initial, ceiling)


class StepTimeCap:
    """A safety cap, not a latency one: the tokens of one step bounded so that the step takes
    about ``seconds``, from the measured time per token. Without it an uncapped mode (the
    default, throughput mode) puts a request of 256 prompts x 2,000 tokens into one forward
    of a minute or more, and everything else (a plain request, /health) waits behind it.

    The time per token is an EMA of ``elapsed / tokens`` over steps of at least
    ``MIN_SAMPLE`` tokens (smaller ones measure the step's fixed cost, not its tokens); a step
    that overran ``seconds`` by half resets it at once. Fixed per-step cost makes a small step
    overestimate the time per token, so the cap errs low and then grows as larger steps
    measure it. Before the first measurement the cap is ``initial`` tokens. ``seconds=None``:
    off (the limit is infinite and nothing is measured), so a config without it behaves, and
    simulates, exactly as before."""

    MIN_SAMPLE = 128

    def __init__(self, seconds: float | None, initial: int = 2048, floor: int = 256,
                 alpha: float = 0.5) -> None:
        self.seconds = seconds
        self.initial, self.floor, self.alpha = initial, floor, alpha
        self.per_token: float | None = None  # seconds per token, measured
        self.limit: float = math.inf if seconds is None else float(initial)

    def observe(self, elapsed: float, tokens: int) -> None:
        if self.seconds is None or tokens < self.MIN_SAMPLE or not elapsed > 0:
            return
        sample = elapsed / tokens
        if self.per_token is None or elapsed > 1.5 * self.seconds:
            self.per_token = sample
        else:
            self.per_token = (1 - self.alpha) * self.per_token + self.alpha * sample
        self.limit = max(float(self.floor), self.seconds / self.per_token)
