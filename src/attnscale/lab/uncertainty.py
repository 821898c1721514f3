"""Seed-to-seed uncertainty for the verdict rules: every quantity a rule compares with a threshold
is measured over seeds and carries its spread, and the comparison says whether the quantity is
clearly on one side of the threshold or within noise of it.

The spread is the standard error of the median over seeds, ``1.2533 s / sqrt(n)`` (``s`` the
seeds' sample standard deviation; 1.2533 = sqrt(pi / 2), the median's standard error relative to
the mean's for normal data), with ``s`` floored at the measurement's own resolution where it has
one (a step count logged every ``k`` steps is known to ``k / sqrt(12)``: a uniform quantisation).
A quantity is clearly below a bound when ``centre + MARGIN * spread <= bound``, clearly above when
``centre - MARGIN * spread > bound``, and within noise otherwise. Floating-point rounding on
another CPU, thread count or kernel perturbs a training run much as another seed does, so a
verdict that needs every comparison to be clear is the same verdict on any of them.

    >>> e = estimate([1.0, 2.0, 3.0])
    >>> (e.centre, round(e.spread, 3), e.n)
    (2.0, 0.724, 3)
    >>> side(e, 4.0), side(e, 2.5), side(e, 0.0)
    (<Side.BELOW: 'below'>, <Side.WITHIN: 'within noise'>, <Side.ABOVE: 'above'>)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "MARGIN",
    "MEDIAN_SE",
    "Estimate",
    "Side",
    "bootstrap_se",
    "clear",
    "difference",
    "estimate",
    "quantisation",
    "ratio",
    "ratio_of_means",
    "side",
]

MARGIN = 2.0
"""Standard errors between a quantity and a threshold for the comparison to count as clear."""

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


def side(value: Estimate, bound: float, margin: float = MARGIN) -> Side:
    """Whether ``value`` is clearly below ``bound``, clearly above it, or within ``margin``
    standard errors of it (a NaN centre or spread: within noise)."""
    if value.centre + margin * value.spread <= bound:
        return Side.BELOW
    if value.centre - margin * value.spread > bound:
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
