"""The first three experiments: each runs at profile tiny, and each verdict rule can return every verdict."""

import copy
import json
import math

import pytest

from attnscale.lab import schema
from attnscale.lab.base import PROFILES, Judgement, Verdict, no_progress
from attnscale.lab.experiments import saturation_example, softmax_peak_example, variance_law

EXPERIMENTS = [softmax_peak_example, saturation_example, variance_law]


@pytest.fixture(scope="module")
def tiny():
    """Each experiment's tiny measurement, computed once for the whole module."""
    return {m.CLAIM.id: m.run(m.Config.for_profile("tiny"), 0, no_progress) for m in EXPERIMENTS}


@pytest.mark.parametrize("module", EXPERIMENTS, ids=lambda m: m.CLAIM.id)
def test_runs_at_tiny_and_plots(module, tiny, tmp_path):
    measured = tiny[module.CLAIM.id]
    json.dumps(schema.to_jsonable(measured), allow_nan=False)
    judgement = module.judge(measured)
    assert isinstance(judgement, Judgement) and judgement.reason
    names = module.plot(measured, tmp_path)
    assert names
    for name in names:
        assert (tmp_path / f"{name}.svg").stat().st_size > 1000
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    if module.HEADLINE:
        assert isinstance(measured[module.HEADLINE.key], float)


@pytest.mark.parametrize("module", EXPERIMENTS, ids=lambda m: m.CLAIM.id)
def test_protocol(module):
    assert module.CLAIM.statement and module.CLAIM.method and module.CLAIM.rule and module.CLAIM.sources
    for profile in PROFILES:
        assert isinstance(module.Config.for_profile(profile), module.Config)


@pytest.mark.parametrize("module", EXPERIMENTS, ids=lambda m: m.CLAIM.id)
def test_deterministic_for_a_seed(module, tiny):
    again = module.run(module.Config.for_profile("tiny"), 0, no_progress)
    assert again == tiny[module.CLAIM.id]


# softmax-peak-example


def test_softmax_peak_values_are_exact(tiny):
    m = tiny["softmax-peak-example"]
    small = math.exp(-11) / (3 * math.exp(-11) + 1)
    assert m["probs"] == pytest.approx([small, small, 1 / (3 * math.exp(-11) + 1), small], rel=1e-14)
    assert small == pytest.approx(1.6700864e-5, rel=1e-7)
    assert m["quoted"]["exact_peak_rounded"] == 0.99995  # the claim's 0.99994 is truncated, not rounded


def test_softmax_peak_every_verdict(tiny):
    m = tiny["softmax-peak-example"]
    assert softmax_peak_example.judge(m).verdict is Verdict.HOLDS

    off = copy.deepcopy(m)
    off["quoted"]["peak"] = 0.9990
    assert softmax_peak_example.judge(off).verdict is Verdict.HOLDS_APPROXIMATELY

    flat = copy.deepcopy(m)
    flat["probs"] = flat["exact_probs"] = [0.03, 0.03, 0.91, 0.03]
    assert softmax_peak_example.judge(flat).verdict is Verdict.DOES_NOT_HOLD

    broken = copy.deepcopy(m)
    broken["probs"] = [0.25, 0.25, 0.25, 0.25]
    assert softmax_peak_example.judge(broken).verdict is Verdict.INCONCLUSIVE


# saturation-example


def _saturation(unscaled_median, scaled_median, spread=0.05, draws=10_000):
    out = {"draws": draws, "quoted": {"unscaled": 0.99, "scaled": 0.05}}
    for case, median in (("unscaled", unscaled_median), ("scaled", scaled_median)):
        out[f"{case}_max_prob_median"] = median
        out[f"{case}_max_prob_quantiles"] = {
            "q05": median - 2 * spread, "q25": median - spread, "q50": median, "q75": median + spread, "q95": median + 2 * spread
        }
    return out


def test_saturation_every_verdict():
    judge = saturation_example.judge
    assert judge(_saturation(0.97, 0.06)).verdict is Verdict.HOLDS
    assert judge(_saturation(0.95, 0.0955, spread=0.02)).verdict is Verdict.HOLDS_APPROXIMATELY
    assert judge(_saturation(0.60, 0.06)).verdict is Verdict.DOES_NOT_HOLD
    assert judge(_saturation(0.97, 0.40)).verdict is Verdict.DOES_NOT_HOLD
    assert judge(_saturation(0.97, 0.06, draws=50)).verdict is Verdict.INCONCLUSIVE
    assert judge(_saturation(float("nan"), 0.06)).verdict is Verdict.INCONCLUSIVE


def test_saturation_measures_the_example(tiny):
    m = tiny["saturation-example"]
    assert m["unscaled_score_std"] == pytest.approx(math.sqrt(128), rel=0.1)
    assert m["unscaled_max_prob_median"] > 0.8
    assert m["scaled_max_prob_median"] < 0.2
    lo, hi = m["scaled_max_prob_median_ci95"]
    assert lo <= m["scaled_max_prob_median"] <= hi
    assert sum(m["histogram"]["scaled"]) == m["draws"]


# variance-law


def _variance(ratio_by_kind, se=0.02, samples=10_000):
    dks = ("2", "64", "1024")
    return {
        "samples": samples,
        "var_over_dk_by_component": {kind: {d: r for d in dks} for kind, r in ratio_by_kind.items()},
        "var_over_dk_se": {kind: {d: se for d in dks} for kind in ratio_by_kind},
    }


def test_variance_every_verdict():
    judge = variance_law.judge
    assert judge(_variance({"gaussian": 1.01, "uniform": 0.99})).verdict is Verdict.HOLDS
    assert judge(_variance({"gaussian": 1.15, "uniform": 1.0})).verdict is Verdict.HOLDS_APPROXIMATELY
    assert judge(_variance({"gaussian": 2.0, "uniform": 1.0})).verdict is Verdict.DOES_NOT_HOLD
    assert judge(_variance({"gaussian": 1.0}, samples=100)).verdict is Verdict.INCONCLUSIVE
    assert judge(_variance({"gaussian": 1.0}, se=0.5)).verdict is Verdict.INCONCLUSIVE
    assert judge(_variance({"gaussian": float("nan")})).verdict is Verdict.INCONCLUSIVE


def test_variance_law_measurements(tiny):
    m = tiny["variance-law"]
    assert set(m["var_over_dk"]) == {"2", "16", "128"}
    for kind, row in m["var_over_dk_by_component"].items():
        for d, ratio in row.items():
            assert abs(ratio - 1) < 5 * m["var_over_dk_se"][kind][d], (kind, d)
    # default nn.Linear init: weights U(-1/sqrt(fan_in), 1/sqrt(fan_in)), so outputs have variance ~1/3
    for value in m["linear_layer"]["q component mean square"].values():
        assert value == pytest.approx(1 / 3, rel=0.1)
    rho = m["correlated"]["rho=0.9"]
    assert rho["mean(q.k)/d_k"]["128"] == pytest.approx(0.9, abs=0.05)
    assert rho["var(q.k)/d_k"]["128"] == pytest.approx(1 + 0.9**2, rel=0.2)
