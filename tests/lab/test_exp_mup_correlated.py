import json

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import mup_correlated as exp


def synthetic(exponent=1.0, sqrt_rise=0.8, shared_rise=0.0, d_ks=(8, 64, 512)) -> dict:
    exponents = {case: {"rms_qk": exponent, "row_std": exponent} for case in exp.CASES}
    exponents["independent"] = {"rms_qk": 0.5, "row_std": 0.5}
    rows = []
    for case in exp.CASES:
        rise = shared_rise if case == "shared" else sqrt_rise
        for i, d_k in enumerate(d_ks):
            t = i / (len(d_ks) - 1)
            rows.append({"case": case, "d_k": d_k, "max_prob 1/sqrt(d_k)": 0.1 + rise * t, "max_prob 1/d_k": 0.05})
    return {"exponents": exponents, "rows": rows}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(shared_rise=0.5), Verdict.HOLDS),
        (synthetic(), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(exponent=0.6), Verdict.DOES_NOT_HOLD),
        (synthetic(sqrt_rise=0.02), Verdict.DOES_NOT_HOLD),
        (synthetic(d_ks=(8, 16)), Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_growth_exponent_recovers_a_power_law():
    assert exp.growth_exponent([4, 16, 64], [2.0 * d**0.75 for d in (4, 16, 64)]) == pytest.approx(0.75)


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured):
    json.dumps(measured, allow_nan=False)
    exps = measured["exponents"]
    assert exps["independent"]["rms_qk"] == pytest.approx(0.5, abs=0.05)
    assert exps["q=k"]["rms_qk"] == pytest.approx(1.0, abs=0.05)
    # a shared correlation grows q.k like d_k but the spread within a row like sqrt(d_k)
    assert exps["shared"]["rms_qk"] > 0.85 and exps["shared"]["row_std"] == pytest.approx(0.5, abs=0.1)
    for r in measured["rows"]:
        if r["case"] == "independent":
            assert r["row_std 1/sqrt(d_k)"] == pytest.approx(1.0, abs=0.15)
        assert 0.0 < r["max_prob 1/d_k"] <= 1.0
    assert exp.drift(measured, "q=k", "1/sqrt(d_k)") > 0.3
    assert exp.judge(measured).verdict is Verdict.HOLDS_APPROXIMATELY


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["mup_correlated"]
    assert (tmp_path / "mup_correlated.png").stat().st_size > 0
    assert (tmp_path / "mup_correlated.svg").stat().st_size > 0
