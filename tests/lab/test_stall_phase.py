"""The stall's phase diagram (attnscale.lab.stall_phase): the crossing read on synthetic ladders,
and a tiny ladder trained end to end."""

import dataclasses
import json
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


def test_the_crossing_is_interpolated_in_log_log_not_linearly():
    """Between (1, 1.0) and (27, 6.0) the 2x crossing lies at 27 ** (ln 2 / ln 6) = 3.58 on the
    log-log line (linearly it would be 6.2); the clean ladder above sits on a line through the
    origin, where both agree."""
    c = crossing([_point(1, 1.0), _point(27, 6.0)], 2.0)
    assert c.at == pytest.approx(27 ** (math.log(2) / math.log(6)), rel=1e-3)
    assert c.at == pytest.approx(3.58, abs=0.01)


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


def test_the_stall_starts_where_every_larger_rung_of_a_d_k_stalls():
    assert (crossing(LADDER, 2.0).stall, crossing(LADDER, 2.0).stall_dk) == (32, 64)
    assert crossing([_point(1, 1.2), _point(2, None), _point(4, 3.0), _point(8, None), _point(16, None)], 2.0).stall == 8
    assert crossing([_point(1, 1.2), _point(2, None), _point(4, 3.0)], 2.0).stall is None  # the largest rung learns
    assert "a stall from an init logit std of 32 (d_k 64)" in stall_phase.judge_ladder(LADDER).reason

    def at(dk, sigma, slowdown):
        return dataclasses.replace(_point(sigma, slowdown), dk=dk)

    # rungs calibrated to one target differ by rounding: d_k 16's stalling rung a hair above d_k 64's learning one
    c = crossing([at(64, 27.0, 1.9), at(64, 54.0, 2.3), at(16, 27.0, 1.8), at(16, 54.001, None)], 2.0)
    assert (c.stall, c.stall_dk) == (54.001, 16)
    # each d_k read on its own: d_k 64 stalls from 10, though d_k 128's rung at 15 learns
    c = crossing([at(64, 5.0, 1.5), at(64, 10.0, None), at(64, 20.0, None), at(128, 15.0, 1.5)], 2.0)
    assert (c.stall, c.stall_dk) == (10.0, 64)
    assert crossing([at(64, 5.0, 1.5), at(128, 15.0, 1.5)], 2.0).stall_dk is None


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


def _realistic(point, name):
    return Point(point.dk, point.gain, point.logit_std, point.unscaled, point.scaled, point.budget, point.log_every, name)


@pytest.mark.parametrize(
    "realistic, verdict",
    [
        ({"default": (2, 1.1), "unit": (4, 1.5)}, "does-not-hold"),
        ({"default": (8, 3.0), "unit": (16, None)}, "holds"),  # a stall counts as clearly over 2x
        ({"default": (2, 1.1), "unit": (16, 6.0)}, "holds-approximately"),
        ({"default": (2, 1.1), "unit": (6, 2.05)}, "inconclusive"),
    ],
    ids=["clear below", "clear above", "one each side", "within noise"],
)
def test_the_ladder_rule_judges_the_realistic_inits_by_their_own_slowdowns(realistic, verdict):
    from attnscale.lab.stall_phase import judge_ladder

    rungs = [_realistic(_point(*sr), name) for name, sr in realistic.items()]
    judgement = judge_ladder([*LADDER, *rungs])
    assert judgement.verdict.value == verdict, judgement.reason
    assert "2x crossed at an init logit std of" in judgement.reason
    assert judge_ladder(LADDER).verdict.value == "inconclusive"  # no realistic rung


def test_the_ladder_rule_is_inconclusive_where_the_scaled_model_misses_or_one_seed_ran():
    from attnscale.lab.stall_phase import judge_ladder

    missed = Point(64, 1.0, 3.0, (100, 110), (None, None), 1000, 10, "default")
    judgement = judge_ladder([*LADDER, missed, _realistic(_point(8, 3.0), "unit")])
    assert judgement.verdict.value == "inconclusive" and "missed 90% at default/64" in judgement.reason
    assert crossing([*LADDER, missed], 2.0) == crossing(LADDER, 2.0)  # such a rung says nothing of the slowdown
    one = Point(64, 1.0, 3.0, (300,), (100,), 1000, 10, "default")
    assert "only 1 seed" in judge_ladder([one]).reason


def test_sgd_counts_a_collapse_as_a_miss_and_picks_the_best_learning_rate():
    from attnscale.lab.training import RunLog

    def log(accuracy):
        return RunLog(steps=[10 * i for i in range(len(accuracy))], accuracy=accuracy)

    assert stall_phase.kept(log([0.1, 0.95, 0.99])) == 10
    assert stall_phase.kept(log([0.1, 0.95, 0.05])) is None  # passed 90%, then collapsed
    assert stall_phase.kept(log([0.1, 0.5, 0.6])) is None
    assert stall_phase.best_lr({0.03: [300, 310], 0.1: [200, 190], 0.3: [None, None]}) == 0.1
    assert stall_phase.best_lr({0.03: [200, 200], 0.1: [200, 200]}) == 0.03
    assert stall_phase.best_lr({0.1: [None, None], 0.3: [None, None]}) == 0.1
    # the fastest median at the edge of stability loses to a rate whose every seed keeps 90%
    assert stall_phase.best_lr({0.1: [200, 210, 220], 0.3: [90, 100, None]}) == 0.1
    assert stall_phase.best_lr({0.1: [200, None, 220], 0.3: [90, 100, None]}) == 0.3


LRS = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


@pytest.mark.parametrize(
    ("profile", "best", "tried"),
    [
        ({0.01: 500, 0.03: 300, 0.1: 200, 0.3: 250, 1.0: None}, 0.1, {0.03, 0.1, 0.3}),
        ({0.003: 90, 0.01: 100, 0.03: 150, 0.1: 300, 0.3: None}, 0.003, {0.003, 0.01, 0.03, 0.1, 0.3}),
        ({0.03: 400, 0.1: 300, 0.3: 200, 1.0: 100, 3.0: 120}, 1.0, {0.03, 0.1, 0.3, 1.0, 3.0}),
        ({0.003: 80, 0.01: None, 0.03: None, 0.1: None, 0.3: None}, 0.003, set(LRS)),
        ({}, 0.003, set(LRS)),
    ],
    ids=["best at the start", "walks down to the end", "walks up and stops", "widens both ways", "never: all tried"],
)
def test_learning_rate_search_never_stops_at_an_untried_edge(profile, best, tried):
    seen = []

    def evaluate(lr):
        seen.append(lr)
        return [profile.get(lr)] * 3  # three seeds alike

    result = stall_phase.search_lr(LRS, 0.1, evaluate)
    assert stall_phase.best_lr(result) == best and set(result) == tried and len(seen) == len(set(seen))
    with pytest.raises(ValueError, match="start must be one of"):
        stall_phase.search_lr(LRS, 0.2, evaluate)


def test_a_learning_rate_search_start_without_a_ladder_is_refused():
    task = stall_phase.task_named("copy", context=4, queries=2, vocab=8)
    tc = TrainConfig(steps=10, batch=8, log_every=5, eval_batch=16, stop_at=0.9)
    with pytest.raises(ValueError, match="lr_start=0.1 starts a learning-rate search, which needs lrs"):
        stall_phase.measure_point(task, ModelConfig(d_model=16, head_dim=16), tc, 1.0, (0,), lr_start=0.1)


def test_a_rung_is_a_realistic_init_or_a_target_std():
    from attnscale.lab.stall_phase import Rung

    assert Rung("unit").sigma is None and Rung(sigma=3.0).name == ""
    for bad in ({}, {"name": "unit", "sigma": 3.0}, {"name": "large"}):
        with pytest.raises(ValueError, match="a rung is"):
            Rung(**bad)


@pytest.mark.parametrize(
    "argv",
    [["--optimizer", "adamw", "--lrs", "0.1"], ["--optimizer", "adamw", "--lr-start", "0.1"], ["--optimizer", "sgd", "--lr", "0.1"],
     ["--optimizer", "sgd", "--lr-start", "0.2"]],
    ids=["adamw given sgd's ladder", "adamw given sgd's start", "sgd given adamw's rate", "a start off the ladder"],
)
def test_the_command_refuses_an_option_it_would_ignore(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        stall_phase.main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_searched_rung_keeps_every_rates_runs_through_its_dict():
    p = Point(
        dk=64, gain=1.0, logit_std=2.5, unscaled=(90, None), scaled=(30, 40), budget=400, log_every=10, name="default",
        saturated=0.1, lrs=(0.03, 0.3),
        by_lr=(("1", 0.03, (90, None)), ("1", 0.1, (None, None)), ("sqrt", 0.1, (60, 40)), ("sqrt", 0.3, (30, None))),
    )  # fmt: skip
    d = p.as_dict()
    assert d["by_lr"] == {"unscaled": {"0.03": [90, None], "0.1": [None, None]}, "scaled": {"0.1": [60, 40], "0.3": [30, None]}}
    assert Point.from_dict(json.loads(json.dumps(d))) == p
    assert stall_phase.fastest_per_seed({0.1: [60, 40], 0.3: [30, None]}) == p.scaled
