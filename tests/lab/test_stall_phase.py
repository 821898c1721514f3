"""The stall's phase diagram (attnscale.lab.stall_phase): the crossing read on synthetic ladders,
and a tiny ladder trained end to end."""

import math

import pytest
import torch

from attnscale.lab import stall_phase
from attnscale.lab.stall_phase import Point, crossing, point_slowdown
from attnscale.lab.training import ModelConfig, TrainConfig


def _point(sigma, slowdown, *, spread=0.02, seeds=4, scaled=1000, budget=100_000):
    """A rung whose unscaled runs take ``slowdown`` times the scaled runs' steps (None: never),
    the seeds' ratios spread by ``spread`` relative; the seeds' own speeds differ by 30%."""
    offsets = [(-1.5 + i) * spread for i in range(seeds)]
    speeds = [1.0 + 0.1 * i for i in range(seeds)]
    unscaled = tuple(None if slowdown is None else round(scaled * v * slowdown * (1 + o)) for o, v in zip(offsets, speeds))
    return Point(64, 1.0, sigma, unscaled, tuple(round(scaled * v) for v in speeds), budget, 1)


def test_a_clean_ladder_crosses_between_its_last_rung_below_and_first_above():
    ladder = [_point(s, r) for s, r in ((1, 1.0), (2, 1.1), (4, 1.5), (8, 3.0), (16, 6.0), (32, None))]
    c = crossing(ladder, 2.0)
    assert (c.low, c.high, c.monotone) == (4, 8, True)
    # log-log between (4, 1.5) and (8, 3.0): log2(2 / 1.5) / log2(3.0 / 1.5) of the way from 4 to 8
    t = math.log(2 / 1.5) / math.log(2.0)
    assert c.at == pytest.approx(4 * 2**t, rel=1e-3)


def test_the_slowdown_pairs_each_seeds_runs():
    """Seeds whose own speeds differ by 30% with one ratio 1.5 between the divisors: the paired
    slowdown is 1.5 to rounding, clearly below 2; unpaired medians would spread it by the speeds."""
    e = point_slowdown(_point(1, 1.5, spread=0.0))
    assert e.centre == pytest.approx(1.5, abs=1e-3) and e.spread < 1e-3 and e.n == 4


def test_a_rung_within_noise_of_the_bound_brackets_nothing():
    ladder = [_point(1, 1.0), _point(2, 2.0, spread=0.3), _point(4, 4.0)]
    c = crossing(ladder, 2.0)
    assert point_slowdown(ladder[1]) is not None
    assert (c.low, c.high) == (1, 4)  # the rung at 2 is neither clearly below nor clearly above


def test_a_ladder_that_never_passes_the_bound_has_no_crossing():
    c = crossing([_point(s, 1.1) for s in (1, 2, 4, 8)], 2.0)
    assert (c.low, c.high, c.at) == (8, None, None)


def test_a_stall_counts_above_any_bound_and_the_crossing_is_reached_by_it():
    c = crossing([_point(1, 1.2), _point(2, None)], 2.0)
    assert (c.low, c.high, c.at) == (1, 2, 2)
    assert point_slowdown(_point(2, None)) is None


def test_a_rung_clearly_above_below_one_clearly_below_is_not_monotone():
    c = crossing([_point(1, 3.0), _point(2, 1.0)], 2.0)
    assert c.monotone is False


def test_a_tiny_ladder_hits_its_target_logit_stds():
    torch.manual_seed(0)
    task = stall_phase.task_named("copy", context=4, queries=2, vocab=8)
    tc = TrainConfig(steps=10, batch=8, log_every=5, eval_batch=16, stop_at=0.9)
    points = stall_phase.measure_ladder(task, ModelConfig(d_model=16, head_dim=16), tc, (1.0, 4.0), seeds=(0, 1, 2))
    assert [p.dk for p in points] == [16, 16] and 1.5 < points[1].gain / points[0].gain < 2.5
    for p, sigma in zip(points, (1.0, 4.0)):
        assert p.logit_std == pytest.approx(sigma, rel=1e-3)  # measured in training as in the calibration
        assert len(p.unscaled) == len(p.scaled) == 3
        assert Point.from_dict(p.as_dict()) == p


LADDER = [_point(s, r) for s, r in ((1, 1.0), (2, 1.1), (4, 1.5), (8, 3.0), (16, 6.0), (32, None))]


@pytest.mark.parametrize(
    "realistic, verdict",
    [
        ({"default/64": 1.5, "unit/64": 3.5}, "does-not-hold"),  # both before the last rung clearly under 2x
        ({"default/64": 8.0, "unit/64": 20.0}, "holds"),  # both at or past the first rung clearly over it
        ({"default/64": 2.0, "unit/64": 12.0}, "holds-approximately"),  # the crossing lies between them
        ({"default/64": 2.0, "unit/64": 6.0}, "inconclusive"),  # 6 lies within the bracket 4 .. 8
    ],
    ids=["clear below", "clear above", "crossing", "within noise"],
)
def test_the_ladder_rule_reads_where_the_realistic_inits_lie(realistic, verdict):
    from attnscale.lab.stall_phase import judge_ladder

    judgement = judge_ladder(LADDER, realistic)
    assert judgement.verdict.value == verdict, judgement.reason
    assert "2x crossed at an init logit std of 5.33" in judgement.reason  # 4 * 2 ** log2(2 / 1.5), log-log between (4, 1.5) and (8, 3)


def test_the_ladder_rule_is_inconclusive_where_the_scaled_model_misses_or_the_rungs_disagree():
    from attnscale.lab.stall_phase import judge_ladder

    missed = Point(64, 1.0, 3.0, (100, 110), (None, None), 1000, 10)
    assert judge_ladder([*LADDER, missed], {"default/64": 3.5}).verdict.value == "inconclusive"
    out_of_order = [_point(1, 3.0), _point(2, 1.0)]
    judgement = judge_ladder(out_of_order, {"default/64": 1.5})
    assert judgement.verdict.value == "inconclusive" and "does not grow" in judgement.reason
