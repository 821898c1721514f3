import json

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import length_scaling as exp


def synthetic(curves, *, err=0.0, n_max=65536) -> dict:
    """curves: (gap, s*gap, fixed at n_min, fixed at n_max, log-n scaled at n_max)."""
    return {
        "n_min": 2,
        "n_max": n_max,
        "max_abs_closed_form_error": err,
        "curves": [
            {"gap": g, "s_times_gap": sg, "points": [{"fixed": f0, "log_n": f0}, {"fixed": f1, "log_n": l1}]}
            for g, sg, f0, f1, l1 in curves
        ],
    }


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic([(2.0, 2.0, 0.9, 0.01, 0.99), (4.0, 4.0, 0.98, 0.02, 1.0)]), Verdict.HOLDS),
        (synthetic([(0.5, 0.5, 0.6, 0.001, 0.01), (2.0, 2.0, 0.9, 0.01, 0.99)]), Verdict.HOLDS_APPROXIMATELY),
        (synthetic([(2.0, 2.0, 0.9, 0.01, 0.3)]), Verdict.DOES_NOT_HOLD),
        (synthetic([(2.0, 2.0, 0.9, 0.5, 0.99)]), Verdict.DOES_NOT_HOLD),
        (synthetic([(2.0, 2.0, 0.9, 0.01, 0.99)], err=1e-3), Verdict.INCONCLUSIVE),
        (synthetic([(2.0, 2.0, 0.9, 0.01, 0.99)], n_max=64), Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured):
    json.dumps(measured, allow_nan=False)
    assert measured["max_abs_closed_form_error"] < 1e-12
    by_gap = {c["gap"]: c["points"] for c in measured["curves"]}
    for points in by_gap.values():
        fixed = [p["fixed"] for p in points]
        assert all(a > b for a, b in zip(fixed, fixed[1:]))
    assert by_gap[1.0][-1]["log_n"] == pytest.approx(0.5, abs=1e-3)  # s g = 1: the boundary
    assert by_gap[4.0][-1]["log_n"] > 0.99
    assert by_gap[0.5][-1]["log_n"] < 0.1
    assert exp.judge(measured).verdict is Verdict.HOLDS_APPROXIMATELY
    # random distractors: the largest of them overtakes a fixed gap, with or without log n
    noisy = by_gap[2.0][-1]
    assert noisy["log_n_noisy"] < 0.5 < by_gap[2.0][-1]["log_n"]
    assert 0.0 < noisy["fixed_noisy"] < 0.1


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["length_scaling"]
    assert (tmp_path / "length_scaling.png").stat().st_size > 0
    assert (tmp_path / "length_scaling.svg").stat().st_size > 0
