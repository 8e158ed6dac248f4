"""Intervals over repeated measurements: the mean and 95% interval of a metric, the interval of a
ratio between two configurations, and how to print them (``mean ± half-width``, "within noise").

Pure and torch-free (bottom layer). Choices, and why:

- **Mean interval: Student t.** Repeats are few (2-10), so a bootstrap of so few values is
  too narrow (it cannot see beyond the sample's own range); the t interval is exact for normal
  errors and robust enough for throughputs and percentiles averaged over a run. The t quantile
  is scipy's where scipy is installed (the ``bench`` extra has it); the core install has no
  scipy, yet its ``hlserve demo`` and repeats print intervals, so a fallback computes the
  quantile here (regularized incomplete beta, inverted by bisection); the tests check the two
  against each other.
- **Ratio interval: Fieller's theorem on paired repeats.** Repeats are interleaved (A B B A),
  so A_i and B_i share the machine's state of that moment and are a pair. For the ratio of means
  R = mean(B) / mean(A), the interval is every R for which the paired differences
  ``B_i - R A_i`` have a mean that a t test at 5% cannot tell from zero. It is exact for normal
  errors, uses the pairing (the correlation of A_i and B_i), is consistent with the printed
  ratio of means, and has a property the delta method lacks: the ratio interval contains 1
  exactly when the paired-difference interval of B - A contains 0, so "within noise" means the
  same thing for a ratio and for a difference. When mean(A) itself is not distinguishable from
  0 the set is unbounded and no interval is given.
- **n = 1**: no interval at all (None), printed as "n=1, no interval"; never a fake one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

LEVEL = 0.95


# ---- Student t -----------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.cache
def _scipy_t() -> Any | None:
    """scipy's Student t distribution, or None without scipy (imported on first use: it is
    heavy, and most commands never print an interval)."""
    try:
        from scipy.stats import t
    except ImportError:
        return None
    return t


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t: scipy's where it is installed, else
    :func:`t_ppf_fallback`."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile needs 0 < p < 1, got {p}")
    t = _scipy_t()
    return t_ppf_fallback(p, df) if t is None else float(t.ppf(p, df))


def t_ppf_fallback(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t without scipy (bisection on :func:`t_cdf`, to
    ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_ppf_fallback(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def t_critical(n: int, level: float = LEVEL) -> float:
    """Two-sided critical value of a ``level`` interval from ``n`` values (df = n - 1)."""
    return t_ppf(0.5 + level / 2.0, n - 1)


# ---- intervals ---------------------------------------------------------------------------------


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    m = math.fsum(xs) / n
    return m, (math.fsum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0)


def clean(xs: Sequence[object]) -> list[float]:
    """The finite numbers of ``xs`` (a failed repeat's None or NaN does not count)."""
    return [float(x) for x in xs if isinstance(x, int | float) and not isinstance(x, bool)
            and math.isfinite(float(x))]


def mean_ci(xs: Sequence[float], level: float = LEVEL) -> tuple[float, tuple[float, float] | None]:
    """(mean, t interval of the mean); the interval is None for fewer than 2 values."""
    if not xs:
        return math.nan, None
    m, var = _mean_var(xs)
    if len(xs) < 2:
        return m, None
    hw = t_critical(len(xs), level) * math.sqrt(var / len(xs))
    return m, (m - hw, m + hw)


def ratio_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
             ) -> tuple[float, tuple[float, float] | None]:
    """Ratio of means mean(B) / mean(A) and its paired Fieller interval (module docstring).

    The interval is None for fewer than 2 pairs, or when it is unbounded (mean(A) not
    distinguishable from zero)."""
    if len(a) != len(b):
        raise ValueError(f"paired repeats need as many A as B values ({len(a)} vs {len(b)})")
    n = len(a)
    if n == 0:
        return math.nan, None
    ma, saa = _mean_var(a)
    mb, sbb = _mean_var(b)
    r = mb / ma if ma != 0 else math.nan
    if n < 2 or ma == 0:
        return r, None
    sab = math.fsum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / (n - 1)
    k = t_critical(n, level) ** 2 / n
    # (mb - R ma)^2 <= k (sbb - 2 R sab + R^2 saa), a quadratic qa R^2 + qb R + qc <= 0
    qa, qb, qc = ma * ma - k * saa, -2.0 * (ma * mb - k * sab), mb * mb - k * sbb
    disc = qb * qb - 4.0 * qa * qc
    if qa <= 0 or disc < 0:
        return r, None
    root = math.sqrt(disc)
    return r, ((-qb - root) / (2.0 * qa), (-qb + root) / (2.0 * qa))


# ---- printing ----------------------------------------------------------------------------------


def half_width(ci: Sequence[float] | None, mean: float) -> float | None:
    """Half the interval's width (a t interval is symmetric about the mean)."""
    if ci is None:
        return None
    return max(mean - ci[0], ci[1] - mean)


def fmt_ci(mean: float | None, ci: Sequence[float] | None, fmt: str = "{:.0f}") -> str:
    """``mean ± half-width``; only the mean where there is no interval (n = 1)."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "—"
    hw = half_width(ci, mean)
    return fmt.format(mean) if hw is None else f"{fmt.format(mean)} ± {fmt.format(hw)}"


def ci_table(configs: dict[str, dict[str, Any]], label: tuple[str, int],
             columns: Sequence[tuple[str, str, str, int]]) -> list[str]:
    """Rows of a fixed-width table of summaries with ``*_ci95`` intervals: ``label`` is the
    first column's (header, width), each column ``(header, key, fmt, width)``."""
    head, lw = label
    rows = [f"{head:<{lw}}" + "".join(f"{h:>{w}}" for h, _, _, w in columns)]
    for name, s in configs.items():
        rows.append(f"{name:<{lw}}" + "".join(
            f"{fmt_ci(s.get(k), s.get(f'{k}_ci95'), fmt):>{w}}" for _, k, fmt, w in columns))
    return rows


@dataclass(frozen=True)
class RatioVerdict:
    """A ratio B / A with its interval, and what may be said of it."""

    ratio: float
    ci: tuple[float, float] | None
    n: int

    @property
    def within_noise(self) -> bool | None:
        """True when the interval contains 1 (no difference shown); None with no interval."""
        return None if self.ci is None else self.ci[0] <= 1.0 <= self.ci[1]

    def text(self, pct: bool = True) -> str:
        """E.g. ``+12% [+5%, +19%]``, ``-3% [-9%, +4%]: within noise``, or ``+8% (n=1, no
        interval)``."""
        def f(x: float) -> str:
            return f"{100 * (x - 1):+.1f}%" if pct else f"{x:.3f}"

        if self.ci is None:
            why = "n=1, no interval" if self.n < 2 else "interval unbounded"
            return f"{f(self.ratio)} ({why})"
        out = f"{f(self.ratio)} [{f(self.ci[0])}, {f(self.ci[1])}]"
        return out + (": within noise" if self.within_noise else "")


def ratio_verdict(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> RatioVerdict:
    r, ci = ratio_ci(a, b, level)
    return RatioVerdict(r, ci, len(a))
