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
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["MARGIN", "MEDIAN_SE", "Estimate", "Side", "difference", "estimate", "quantisation", "ratio", "side"]

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
