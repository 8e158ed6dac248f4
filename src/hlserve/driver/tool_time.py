"""Tool time: the pause between an agent session's rounds while its tool runs.

A distribution is named by a spec string: ``fixed:S`` (always S seconds; a bare number means
the same), ``exp:MEAN``, ``lognormal:MEDIAN:SIGMA`` (the log's standard deviation), or
``empirical:PATH`` (seconds, one a line, sampled uniformly), or ``recorded``: a trace's own
gaps, for the closed-loop replay of a Mooncake trace's chains only
(:class:`hlserve.driver.workloads.TraceSession`: the pause before a chain's next round is the
recorded time between the two requests, divided by the replay's time scale, less what the
replayed round itself took, at least 0). ``0`` is no pause: the source study's zero-gap
workload. Samples come from the caller's ``random.Random``, so a workload
seed fixes them: an agent workload's ``tool_time`` (:class:`hlserve.driver.workloads.AgentWorkload`)
is drawn per round from each session's own tool-time generator, and every closed-loop driver
(in-process, simulated, HTTP) waits it out before the session's next round.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

TOOL_TIME_KINDS = ("fixed", "exp", "lognormal", "empirical", "recorded")


@dataclass(frozen=True)
class ToolTime:
    kind: str = "fixed"
    a: float = 0.0  # fixed: seconds; exp: mean; lognormal: median
    b: float = 0.0  # lognormal: sigma
    values: tuple[float, ...] = ()  # empirical samples

    @property
    def is_zero(self) -> bool:
        return self.kind == "fixed" and self.a == 0.0

    @property
    def spec(self) -> str:
        """The spec string that parses back to this (an empirical one names its sample
        count, not its file): for results and labels."""
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        if self.kind == "exp":
            return f"exp:{self.a:g}"
        if self.kind == "lognormal":
            return f"lognormal:{self.a:g}:{self.b:g}"
        if self.kind == "recorded":
            return "recorded"
        return f"empirical:{len(self.values)} values"

    def sample(self, rng: random.Random) -> float:
        """One tool call's seconds (>= 0)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a)
        if self.kind == "lognormal":
            return rng.lognormvariate(math.log(self.a), self.b)
        check_drawn(self)
        return rng.choice(self.values)


NO_TOOL_TIME = ToolTime()  # the zero-gap default (a shared constant: it is frozen)


def tool_rng(seed: int, index: int) -> random.Random:
    """Session ``index``'s generator of tool times: its own stream, seeded from a string (not
    ``hash()``, which differs per process), so drawing tool times never moves the draws of
    the session's lengths and ids (or a coding session's tasks)."""
    return random.Random(f"tool:{seed}:{index}")


def draw_pause(tool_time: ToolTime, rng: random.Random) -> float:
    """One tool call's seconds; a zero tool time draws nothing."""
    return 0.0 if tool_time.is_zero else tool_time.sample(rng)


def check_drawn(tool_time: ToolTime) -> None:
    """A generated workload draws its tool times: ``recorded`` (a trace's gaps) is refused
    when the workload is made, not at its first tool call."""
    if tool_time.kind == "recorded":
        raise ValueError("--tool-time recorded replays a trace's own gaps: it needs a trace's "
                         "chains (--trace FILE with the agent workload)")


def parse_tool_time(spec: str | float) -> ToolTime:
    """A spec (module docstring) as a :class:`ToolTime`; ValueError says what is wrong."""
    if isinstance(spec, int | float):
        return _checked(ToolTime("fixed", float(spec)))
    kind, _, rest = spec.strip().partition(":")
    if kind == "recorded" and not rest:
        return ToolTime("recorded")
    try:
        if not rest:
            return _checked(ToolTime("fixed", float(kind)))
        if kind == "fixed":
            return _checked(ToolTime("fixed", float(rest)))
        if kind == "exp":
            return _checked(ToolTime("exp", float(rest)))
        if kind == "lognormal":
            median, _, sigma = rest.partition(":")
            return _checked(ToolTime("lognormal", float(median), float(sigma or 1.0)))
    except ValueError:
        raise ValueError(f"bad tool time {spec!r}: numbers expected") from None
    if kind == "empirical":
        lines = Path(rest).read_text().split()
        return _checked(ToolTime("empirical", values=tuple(float(x) for x in lines)))
    raise ValueError(f"tool time {spec!r}: kind must be one of {TOOL_TIME_KINDS}")


def _checked(t: ToolTime) -> ToolTime:
    if t.kind == "empirical":
        if not t.values or min(t.values) < 0 or not all(map(math.isfinite, t.values)):
            raise ValueError("an empirical tool time needs finite seconds >= 0, one a line")
        return t
    if not (math.isfinite(t.a) and t.a >= 0 and math.isfinite(t.b) and t.b >= 0):
        raise ValueError(f"tool time parameters must be finite and >= 0, got {t.a}, {t.b}")
    if t.kind != "fixed" and t.a == 0:
        raise ValueError(f"a {t.kind} tool time needs a positive mean/median")
    return t
