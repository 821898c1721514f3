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
    assert max(x for xs in linear_measured["scale_sensitivity"]["relu"].values() for x in xs) < 1e-12
    assert min(x for xs in linear_measured["scale_sensitivity"]["elu"].values() for x in xs) > 1e-2
    assert linear_attention.plot(linear_measured, tmp_path) == ["linear_attention"]
    assert (tmp_path / "linear_attention.png").exists()


def _favor(m, unscaled, scaled):
    """FAVOR+ errors per seed: ``unscaled`` and ``scaled`` lists."""
    m["favor_errors_per_seed"] = {"1": unscaled, "1/sqrt(D)": scaled, "1/D": [0.05] * len(scaled)}
    return m


def test_linear_attention_verdicts(linear_measured):
    m = copy.deepcopy(linear_measured)
    m["scale_sensitivity"]["elu"] = {"16": [0.05, 0.06, 0.05], "64": [0.03, 0.031, 0.032]}
    assert linear_attention.judge(_favor(m, [0.9, 0.91, 0.92], [0.1, 0.1, 0.1])).verdict is Verdict.HOLDS
    assert linear_attention.judge(_favor(m, [0.9, 0.9, 0.9], [0.8, 0.8, 0.8])).verdict is Verdict.HOLDS_APPROXIMATELY
    # a ratio of 2.2 +- 0.5 is within noise of the bound 2: neither holds nor clearly not
    within = _favor(copy.deepcopy(m), [1.6, 2.2, 2.8], [1.0, 1.0, 1.0])
    assert linear_attention.judge(within).verdict is Verdict.INCONCLUSIVE
    assert linear_attention.judge(_favor(copy.deepcopy(m), [0.9], [0.1])).verdict is Verdict.INCONCLUSIVE  # one seed
    noisy_elu = _favor(copy.deepcopy(m), [0.9, 0.91, 0.92], [0.1, 0.1, 0.1])
    noisy_elu["scale_sensitivity"]["elu"]["64"] = [0.005, 0.012, 0.02]
    assert linear_attention.judge(noisy_elu).verdict is Verdict.INCONCLUSIVE
    saturating = copy.deepcopy(m)
    saturating["saturation"]["elu"]["max_weight"][-1] = 0.95
    assert linear_attention.judge(saturating).verdict is Verdict.DOES_NOT_HOLD
    broken = copy.deepcopy(m)
    broken["favor_errors_per_seed"]["1"][0] = float("nan")
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


def test_quant_folding_is_judged_through_attnscales_int8_attention_too(quant_measured):
    """Rule v3: smoothing that does not reduce quantized_attention's error at the largest offset
    fails the claim; folding that moves its error by 25% or more makes it holds-approximately."""
    assert quant_measured["kernel_smoothing_error_ratio_at_largest_offset"] < 0.5
    assert quant_measured["smoothing"]["10"]["kernel_backend"] in ("fused", "torch", "math", "tiled")
    m = copy.deepcopy(quant_measured)
    m["kernel_smoothing_error_ratio_at_largest_offset"] = 1.05
    assert quant_folding.judge(m).verdict is Verdict.DOES_NOT_HOLD
    m = copy.deepcopy(quant_measured)
    m["kernel_folding_relative_change"] = 0.3
    assert quant_folding.judge(m).verdict is Verdict.HOLDS_APPROXIMATELY
