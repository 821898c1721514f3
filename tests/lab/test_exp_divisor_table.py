import json
import math

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import divisor_table as exp

D_KS = (8, 32, 128)


def synthetic(sqrt_var: float = 1.0, rival: str | None = None, d_ks=D_KS) -> dict:
    """Variances as the iid law predicts, with sqrt(d_k)'s variance overridden."""
    rows = []
    for d_k in d_ks:
        for name in exp.DIVISORS:
            value = math.sqrt(d_k) if name == exp.LEARNED else exp.divisor_value(name, d_k, 8)
            var = d_k / value**2
            if name == "sqrt(d_k)":
                var = sqrt_var
            if name == rival:
                var = 1.0
            rows.append({"divisor": name, "d_k": d_k, "value": value, "score_var": var})
    return {"rows": rows}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(1.0), Verdict.HOLDS),
        (synthetic(1.6), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(3.0), Verdict.DOES_NOT_HOLD),
        (synthetic(1.0, rival="log(d_k)"), Verdict.DOES_NOT_HOLD),
        (synthetic(1.0, d_ks=(8, 16)), Verdict.INCONCLUSIVE),
        ({"rows": []}, Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_judge_flags_a_non_finite_variance():
    measured = synthetic(1.0)
    measured["rows"][0]["score_var"] = None
    assert exp.judge(measured).verdict is Verdict.INCONCLUSIVE


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny_measures_the_variance_law(measured):
    json.dumps(measured, allow_nan=False)
    rows = {(r["divisor"], r["d_k"]): r for r in measured["rows"]}
    assert set(rows) == {(n, d) for n in exp.DIVISORS for d in D_KS}
    for d_k in D_KS:
        assert 0.8 < rows["sqrt(d_k)", d_k]["score_var"] < 1.25
        assert 0.8 * d_k < rows["1", d_k]["score_var"] < 1.25 * d_k
        assert 0.9 < rows["learned", d_k]["value"] / math.sqrt(d_k) < 1.1
        for r in (rows[n, d_k] for n in exp.DIVISORS):
            assert 0.0 < r["max_prob"] <= 1.0
            assert 0.0 < r["entropy_ratio"] <= 1.0
            assert 0.0 <= r["offpeak_jacobian"] < 2.0
    # no division saturates softmax more as d_k grows; d_k flattens it
    assert rows["1", 128]["max_prob"] > rows["1", 8]["max_prob"] > rows["sqrt(d_k)", 8]["max_prob"]
    assert rows["d_k", 128]["entropy_ratio"] > 0.99
    assert exp.judge(measured).verdict is Verdict.HOLDS


def test_off_peak_mass_at_uniform_matches_closed_form():
    import torch

    n = 16
    mass = exp.off_peak_jacobian_mass(torch.full((n,), 1.0 / n, dtype=torch.float64))
    assert float(mass) == pytest.approx((n - 1) * (2 * n - 3) / n**2, rel=1e-12)


def test_plot_writes_files(measured, tmp_path):
    names = exp.plot(measured, tmp_path)
    assert names == ["divisor_table"]
    assert (tmp_path / "divisor_table.png").stat().st_size > 0
    assert (tmp_path / "divisor_table.svg").stat().st_size > 0
