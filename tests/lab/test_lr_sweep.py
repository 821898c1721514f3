"""The real-text rule (attnscale.lab.lr_sweep, version 3) on synthetic curves, both ways: a clear
stall, a clear cost, a narrower range of usable rates, no effect, and results within noise, with
too few seeds, unpaired seeds or with an optimum at the edge of the grid, which it must not judge;
and the arms compared seed by seed."""

from __future__ import annotations

import math

import pytest

from attnscale.lab.base import Verdict
from attnscale.lab.lr_sweep import GRID, Curve, Effect, compare, judge_effects, summarise

L0 = 4.3  # the loss at initialisation of a 75-character vocabulary: ln 75
RATES = GRID[:6]  # 1e-4 .. 3.16e-2


def _curve(best, *, noise=0.004, seeds=5, valley=2, steep=0.3, diverge_from=None):
    """A V-shaped curve in log rate, lowest (``best``) at RATES[valley], each seed offset by a
    fixed amount (seed spread ``noise``); rates from ``diverge_from`` on diverge (NaN)."""
    offsets = [noise * (i - (seeds - 1) / 2) for i in range(seeds)]
    losses = {}
    for i, lr in enumerate(RATES):
        if diverge_from is not None and i >= diverge_from:
            losses[lr] = [math.nan] * seeds
        else:
            losses[lr] = [best + steep * abs(i - valley) + d for d in offsets]
    return Curve(losses, L0)


@pytest.mark.parametrize(
    ("unscaled", "effect"),
    [
        (_curve(1.90), Effect.STALLS),  # 0.4 nats worse at its best rate
        (_curve(1.60), Effect.COSTS),  # 0.1 nats worse
        (_curve(1.50, diverge_from=3), Effect.NARROWS),  # the same best, but every faster rate diverges
        (_curve(1.50), Effect.NONE),  # the same curve
        (_curve(1.44), Effect.NONE),  # better without the scale: no support for the claim either
        (_curve(1.55, noise=0.2), Effect.INCONCLUSIVE),  # 0.05 nats worse, seeds 0.2 apart
        (_curve(1.90, seeds=1), Effect.INCONCLUSIVE),  # one seed: no spread to judge by
        (_curve(1.90, valley=0), Effect.INCONCLUSIVE),  # the optimum at the grid's edge
    ],
    ids=["stall", "cost", "narrower", "none", "better", "within-noise", "one-seed", "edge"],
)
def test_the_rule_tells_each_case_apart(unscaled, effect):
    scaled = summarise(_curve(1.50))
    got, why = compare(scaled, summarise(unscaled))
    assert got is effect, why


def test_a_diverged_run_counts_at_the_loss_at_initialisation():
    curve = _curve(1.5, diverge_from=4)
    s = summarise(curve)
    assert s.loss[RATES[4]] == s.loss[RATES[5]] == L0
    assert s.best_lr == RATES[2] and s.best.centre == pytest.approx(1.5)
    # Wortsman's sensitivity: the mean over the grid of min(loss, L0) less the best
    expected = sum(min(v, L0) for v in s.loss.values()) / len(RATES) - 1.5
    assert s.sensitivity.centre == pytest.approx(expected, abs=1e-9)
    assert s.width == 0.5  # only the best rate within 0.05 nats of it: half a decade


def test_the_claims_verdict_is_the_least_supportive_conclusive_condition():
    assert judge_effects({"a": Effect.STALLS, "b": Effect.STALLS}) is Verdict.HOLDS
    assert judge_effects({"a": Effect.STALLS, "b": Effect.NARROWS}) is Verdict.HOLDS  # v8: each states the claim
    assert judge_effects({"a": Effect.COSTS, "b": Effect.NONE}) is Verdict.DOES_NOT_HOLD
    assert judge_effects({"a": Effect.INCONCLUSIVE, "b": Effect.STALLS}) is Verdict.HOLDS
    assert judge_effects({"a": Effect.INCONCLUSIVE}) is Verdict.INCONCLUSIVE


def _shifted(curve: Curve, by: list[float]) -> Curve:
    """``curve`` with seed i's loss at every rate moved by ``by[i]`` (what seed i's init and batches do to both arms)."""
    return Curve({lr: [x + d for x, d in zip(v, by, strict=True)] for lr, v in curve.losses.items()}, curve.init_loss)


def test_the_arms_are_compared_seed_by_seed():
    """Seeds that move both arms alike (the same init and batches) do not hide a cost every seed
    shows: 0.1 nats worse at each of 5 seeds whose losses lie 0.3 nats apart is a clear cost, where
    the arms' own spreads, added as independent, would put it within noise."""
    seeds = [0.0, 0.3, -0.3, 0.15, -0.15]
    scaled, unscaled = (summarise(_shifted(_curve(best, noise=0.0), seeds)) for best in (1.50, 1.60))
    assert compare(scaled, unscaled)[0] is Effect.COSTS
    scattered = summarise(_shifted(_curve(1.60, noise=0.0), [0.3, -0.3, 0.0, -0.15, 0.15]))  # the seeds' shifts shuffled: no pairs agree
    assert compare(scaled, scattered)[0] is Effect.INCONCLUSIVE


def test_arms_of_different_seed_counts_are_not_compared():
    got, why = compare(summarise(_curve(1.50, seeds=5)), summarise(_curve(1.90, seeds=4)))
    assert got is Effect.INCONCLUSIVE and "pairs" in why
