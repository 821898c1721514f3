import copy
import math

import pytest

from attnscale.lab.base import Verdict
from attnscale.lab.experiments import qknorm_double_shrink as exp


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=lambda done, total: None)


def test_best_case_matches_the_closed_form(measured):
    n = measured["keys"]
    for D, row in measured["variants"]["l2 + 1/sqrt(d)"].items():
        g = 2 / math.sqrt(int(D))  # the largest logit gap left by the double shrink
        assert row["best_case_max_prob"] == pytest.approx(math.exp(g) / (math.exp(g) + n - 1), rel=1e-9)
    assert measured["variants"]["rms + 1/sqrt(d)"]["128"]["best_case_max_prob"] > 0.9


def test_verdicts(measured, tmp_path):
    assert exp.judge(measured).verdict is Verdict.HOLDS
    partial = copy.deepcopy(measured)
    partial["variants"]["l2 + 1/sqrt(d)"]["16"]["best_case_max_prob"] = 0.7
    assert exp.judge(partial).verdict is Verdict.HOLDS_APPROXIMATELY
    none = copy.deepcopy(measured)
    for row in none["variants"]["l2 + 1/sqrt(d)"].values():
        row["best_case_max_prob"] = 0.7
    assert exp.judge(none).verdict is Verdict.DOES_NOT_HOLD
    broken = copy.deepcopy(measured)
    broken["variants"]["l2 + learned (init)"]["16"]["best_case_max_prob"] = 0.1
    assert exp.judge(broken).verdict is Verdict.INCONCLUSIVE
    assert exp.plot(measured, tmp_path) == ["qknorm_double_shrink"]
