"""Seed-to-seed uncertainty for the verdict rules: every quantity a rule compares with a threshold
is measured over seeds and carries its spread, and the comparison says whether the quantity is
clearly on one side of the threshold or within noise of it.

The spread is the standard error of the median over seeds, ``1.2533 s / sqrt(n)`` (``s`` the
seeds' sample standard deviation; 1.2533 = sqrt(pi / 2), the median's standard error relative to
the mean's for normal data), with ``s`` floored at the measurement's own resolution where it has
one (a step count logged every ``k`` steps is known to ``k / sqrt(12)``: a uniform quantisation).
A quantity is clearly below a bound when ``centre + m * spread <= bound``, clearly above when
``centre - m * spread > bound``, and within noise otherwise, where ``m = margin(n)`` is Student's t
two-sided 95% quantile with ``n - 1`` degrees of freedom: the seeds' standard deviation is itself
estimated from the ``n`` seeds, so 2 seeds need 12.7 standard errors, 3 need 4.30, 8 need 2.36,
and many (a bootstrap, many independent draws) about 1.96. Floating-point rounding on another
CPU, thread count or kernel perturbs a training run much as another seed does, so a verdict that
needs every comparison to be clear is, but for a 5% chance per comparison, the same verdict on
any of them.

    >>> e = estimate([1.0, 2.0, 3.0])
    >>> (e.centre, round(e.spread, 3), e.n, margin(e.n))
    (2.0, 0.724, 3, 4.303)
    >>> side(e, 6.0), side(e, 4.0), side(e, -2.0)
    (<Side.BELOW: 'below'>, <Side.WITHIN: 'within noise'>, <Side.ABOVE: 'above'>)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "MEDIAN_SE",
    "Estimate",
    "Side",
    "bootstrap_se",
    "clear",
    "difference",
    "estimate",
    "margin",
    "quantisation",
    "ratio",
    "ratio_of_means",
    "side",
]

_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
)  # Student's t, two-sided 95% (the 0.975 quantile), 1..29 degrees of freedom
_Z975 = 1.959964


def margin(n: int) -> float:
    """Standard errors between a quantity measured over ``n`` seeds (or groups) and a threshold for
    the comparison to count as clear: Student's t 0.975 quantile with ``n - 1`` degrees of freedom
    (Cornish-Fisher expansion from 30 on; inf below 2 seeds).

    >>> margin(2), margin(4), round(margin(31), 3), round(margin(10**6), 3)
    (12.706, 3.182, 2.042, 1.96)
    """
    df = n - 1
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)

MEDIAN_SE = math.sqrt(math.pi / 2)
"""The median's standard error over the mean's, for normal data."""


@dataclass(frozen=True)
class Estimate:
    """A quantity measured over seeds: its median, the median's standard error, the seed count."""

    centre: float
    spread: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"centre": self.centre, "spread": self.spread, "n": self.n}

    def text(self, digits: int = 3) -> str:
        """``centre +- spread``, to ``digits`` significant digits."""
        return f"{self.centre:.{digits}g} +- {self.spread:.2g}"


class Side(StrEnum):
    BELOW = "below"
    ABOVE = "above"
    WITHIN = "within noise"


def quantisation(step: float) -> float:
    """The standard deviation of a value known only to within ``step`` (uniform): ``step / sqrt(12)``."""
    return step / math.sqrt(12)


def estimate(values: Sequence[float], resolution: float = 0.0) -> Estimate:
    """Median and its standard error over ``values`` (one per seed); ``resolution`` floors the
    seeds' standard deviation (:func:`quantisation` of a logging interval, say). One value: spread inf."""
    n = len(values)
    if n == 0:
        raise ValueError("estimate: expected at least one value (one per seed), got none")
    centre = float(statistics.median(values))
    if n < 2:
        return Estimate(centre, math.inf, n)
    s = max(statistics.stdev(values), resolution)
    return Estimate(centre, MEDIAN_SE * s / math.sqrt(n), n)


def difference(a: Estimate, b: Estimate) -> Estimate:
    """``a - b`` of two independent estimates: spreads add in quadrature."""
    return Estimate(a.centre - b.centre, math.hypot(a.spread, b.spread), min(a.n, b.n))


def ratio(a: Estimate, b: Estimate) -> Estimate:
    """``a / b`` of two independent estimates (b's centre non-zero): relative spreads add in quadrature."""
    if b.centre == 0:
        raise ValueError("ratio: the denominator's centre is 0")
    # first order: d(a/b) = da / b - a db / b^2
    spread = math.hypot(a.spread / b.centre, a.centre * b.spread / b.centre**2)
    return Estimate(a.centre / b.centre, spread, min(a.n, b.n))


def side(value: Estimate, bound: float) -> Side:
    """Whether ``value`` is clearly below ``bound``, clearly above it, or within ``margin(value.n)``
    standard errors of it (a NaN centre or spread, or a single seed: within noise)."""
    m = margin(value.n)
    if not math.isfinite(m):
        return Side.WITHIN
    if value.centre + m * value.spread <= bound:
        return Side.BELOW
    if value.centre - m * value.spread > bound:
        return Side.ABOVE
    return Side.WITHIN


def ratio_of_means(numerators: Sequence[float], denominators: Sequence[float]) -> Estimate:
    """``mean(numerators) / mean(denominators)`` over independent groups (one pair per group: rows
    that share a draw are one group), with the ratio estimator's standard error
    ``sd(n_g - r d_g) / (sqrt(G) mean(d))``. One group: spread inf.

    >>> e = ratio_of_means([1.0, 2.0, 3.0], [10.0, 20.0, 30.0])
    >>> (e.centre, e.spread, e.n)
    (0.1, 0.0, 3)
    """
    G = len(numerators)
    if G == 0 or G != len(denominators):
        raise ValueError(f"ratio_of_means: expected equal, non-zero counts; got {G} and {len(denominators)}")
    mean_d = statistics.fmean(denominators)
    if mean_d == 0:
        raise ValueError("ratio_of_means: the denominators' mean is 0")
    r = statistics.fmean(numerators) / mean_d
    if G < 2:
        return Estimate(r, math.inf, G)
    residual = [n - r * d for n, d in zip(numerators, denominators, strict=True)]
    return Estimate(r, statistics.stdev(residual) / (math.sqrt(G) * abs(mean_d)), G)


def bootstrap_se(statistic: Callable[[int], float], draws: int) -> float:
    """Standard deviation of ``statistic(b)`` over ``draws`` bootstrap resamples ``b = 0..draws-1``
    (the caller resamples its own data for each ``b``): the statistic's standard error."""
    if draws < 2:
        raise ValueError(f"bootstrap_se: expected at least 2 draws, got {draws}")
    return statistics.stdev(statistic(b) for b in range(draws))


def clear(value: Estimate, low: float | None = None, high: float | None = None) -> bool | None:
    """Whether ``value`` lies inside ``(low, high]`` (None: unbounded on that side): True when it is
    clearly inside, False when clearly outside, None when within noise of a bound.

    >>> clear(Estimate(1.0, 0.01, 4), 0.85, 1.15), clear(Estimate(0.86, 0.01, 4), 0.85), clear(Estimate(2.0, 0.1, 4), high=1.0)
    (True, None, False)
    """
    sides = []
    if low is not None:
        sides.append(side(value, low) is Side.ABOVE if side(value, low) is not Side.WITHIN else None)
    if high is not None:
        sides.append(side(value, high) is Side.BELOW if side(value, high) is not Side.WITHIN else None)
    if False in sides:
        return False
    return None if None in sides else True
