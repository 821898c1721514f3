import copy

import pytest

from attnscale.lab.base import Verdict
from attnscale.lab.experiments import linear_attention, quant_folding


def _noop(done, total):
    pass


@pytest.fixture(scope="module")
def linear_measured():
    return linear_attention.run(linear_attention.Config.for_profile("tiny"), seed=0, progress=_noop)


@pytest.fixture(scope="module")
def quant_measured():
    return quant_folding.run(quant_folding.Config.for_profile("tiny"), seed=0, progress=_noop)


def test_linear_attention_measurements(linear_measured, tmp_path):
    sat = linear_measured["saturation"]
    assert sat["softmax"]["max_weight"][-1] > 0.99  # unscaled-like logits saturate softmax
    assert sat["relu"]["max_weight"][0] == pytest.approx(sat["relu"]["max_weight"][-1], rel=1e-9)  # scale-free
    assert max(linear_measured["scale_sensitivity"]["relu"].values()) < 1e-12
    assert min(linear_measured["scale_sensitivity"]["elu"].values()) > 1e-2
    assert linear_attention.plot(linear_measured, tmp_path) == ["linear_attention"]
    assert (tmp_path / "linear_attention.png").exists()


def test_linear_attention_verdicts(linear_measured):
    m = copy.deepcopy(linear_measured)
    m["favor_relative_error"] = {"1": 0.9, "1/sqrt(D)": 0.1, "1/D": 0.05}
    assert linear_attention.judge(m).verdict is Verdict.HOLDS
    m["favor_relative_error"] = {"1": 0.9, "1/sqrt(D)": 0.8, "1/D": 0.05}
    assert linear_attention.judge(m).verdict is Verdict.HOLDS_APPROXIMATELY
    saturating = copy.deepcopy(m)
    saturating["saturation"]["elu"]["max_weight"][-1] = 0.95
    assert linear_attention.judge(saturating).verdict is Verdict.DOES_NOT_HOLD
    broken = copy.deepcopy(m)
    broken["favor_relative_error"]["1"] = float("nan")
    assert linear_attention.judge(broken).verdict is Verdict.INCONCLUSIVE


def test_quant_folding_measurements(quant_measured, tmp_path):
    assert quant_measured["folding"]["64"]["int8_values_changed"] == 0.0
    assert quant_measured["smoothing"]["10"]["float_change"] < 1e-12
    assert quant_measured["smoothing_error_ratio_at_largest_offset"] < 0.5
    assert quant_folding.judge(quant_measured).verdict is Verdict.HOLDS
    assert quant_folding.plot(quant_measured, tmp_path) == ["quant_folding"]


def test_quant_folding_verdicts(quant_measured):
    m = copy.deepcopy(quant_measured)
    m["folding"]["128"]["relative_change"] = 0.5
    assert quant_folding.judge(m).verdict is Verdict.HOLDS_APPROXIMATELY
    m = copy.deepcopy(quant_measured)
    m["folding"]["64"]["int8_values_changed"] = 0.01
    assert quant_folding.judge(m).verdict is Verdict.DOES_NOT_HOLD
    m = copy.deepcopy(quant_measured)
    m["smoothing_error_ratio_at_largest_offset"] = 1.2
    assert quant_folding.judge(m).verdict is Verdict.DOES_NOT_HOLD
    m = copy.deepcopy(quant_measured)
    for row in m["folding"].values():
        row["mean_abs_error_folded"] = 1e-7
    assert quant_folding.judge(m).verdict is Verdict.INCONCLUSIVE
