import json
import math

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import fp16_secondary as exp


def synthetic(vanish_median, vanish_mean, overflow_std=2e4, finite=True) -> dict:
    overflow = None if overflow_std is None else {"logit_std": overflow_std, "attnscale_fp16_finite": finite}

    def gap(v):
        return overflow_std / v if overflow_std and v else None

    return {
        "threshold": 1e-3,
        "vanish_logit_std": {"median": vanish_median, "mean": vanish_mean},
        "fp16_product_overflow": overflow,
        "naive_exp_overflow": {"fp16": {"first_logit_std": 3.0}},
        "gap": {"median": gap(vanish_median), "mean": gap(vanish_mean)},
    }


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(30.0, 300.0), Verdict.HOLDS),
        (synthetic(30.0, 5000.0), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(30.0, None), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(5000.0, 8000.0), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(15000.0, None), Verdict.DOES_NOT_HOLD),
        (synthetic(None, None), Verdict.INCONCLUSIVE),
        (synthetic(30.0, 300.0, overflow_std=None), Verdict.INCONCLUSIVE),
        (synthetic(30.0, 300.0, finite=False), Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_crossing_interpolates_in_log_log():
    assert exp.crossing([1.0, 100.0], [1.0, 1e-4], 1e-2) == pytest.approx(10.0)
    assert exp.crossing([1.0, 10.0], [1.0, 0.5], 1e-2) is None


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured):
    json.dumps(measured, allow_nan=False)
    naive = measured["naive_exp_overflow"]
    assert naive["fp16"]["exp_overflow_at"] == pytest.approx(math.log(65504.0), abs=0.01)
    assert naive["fp32"]["exp_overflow_at"] == pytest.approx(88.72, abs=0.01)
    overflow = measured["fp16_product_overflow"]
    assert overflow["attnscale_fp16_finite"] is True
    assert overflow["max_abs_logit"] > 65504.0
    vanish = measured["vanish_logit_std"]
    # the typical row loses its off-peak gradient long before fp16 overflows
    assert 5.0 < vanish["median"] < 100.0 < overflow["logit_std"]
    assert vanish["mean"] is None or vanish["mean"] > vanish["median"]
    unit = next(r for r in measured["gradients"] if r["logit_std"] == 1.0)
    assert unit["median_rel"] == 1.0 and unit["mean_rel"] == 1.0


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["fp16_secondary"]
    assert (tmp_path / "fp16_secondary.png").stat().st_size > 0
    assert (tmp_path / "fp16_secondary.svg").stat().st_size > 0
