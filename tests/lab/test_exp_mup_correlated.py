import json
import statistics

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import mup_correlated as exp


def synthetic(exponent=1.0, sqrt_rise=0.8, shared_rise=0.0, d_ks=(8, 64, 512), se=0.01) -> dict:
    exponents = {case: {"rms_qk": exponent, "row_std": exponent} for case in exp.CASES}
    exponents["independent"] = {"rms_qk": 0.5, "row_std": 0.5}
    rows = []
    for case in exp.CASES:
        rise = shared_rise if case == "shared" else sqrt_rise
        for i, d_k in enumerate(d_ks):
            t = i / (len(d_ks) - 1)
            rows.append({"case": case, "d_k": d_k, "max_prob 1/sqrt(d_k)": 0.1 + rise * t, "max_prob 1/d_k": 0.05})
    boot = {
        "draws": 200,
        "exponent_se": dict.fromkeys(exp.CASES, se),
        "drift_se": {c: dict.fromkeys(exp.SCALINGS, se) for c in exp.CASES},
        "margin_se": dict.fromkeys(exp.CASES, se),
    }
    return {"exponents": exponents, "rows": rows, "bootstrap": boot}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(shared_rise=0.5), Verdict.HOLDS),
        (synthetic(), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(exponent=0.6), Verdict.DOES_NOT_HOLD),
        (synthetic(sqrt_rise=0.02), Verdict.DOES_NOT_HOLD),
        (synthetic(d_ks=(8, 16)), Verdict.INCONCLUSIVE),
        # within 2 standard errors of a bound: the growth bound 0.85, the rise bound 0.1, the shared case
        (synthetic(exponent=0.86), Verdict.INCONCLUSIVE),
        (synthetic(exponent=0.86, se=0.001), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(sqrt_rise=0.11), Verdict.INCONCLUSIVE),
        (synthetic(shared_rise=0.11), Verdict.INCONCLUSIVE),
        (synthetic(shared_rise=0.13), Verdict.HOLDS),
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


def test_bootstrap_error_matches_the_spread_over_seeds():
    """The bootstrap standard error of an exponent from one run is the seed-to-seed spread of that
    exponent over independent runs, within the sampling error of 8 seeds' standard deviation."""
    config = exp.Config.for_profile("tiny")
    runs = [exp.run(config, seed=s, progress=no_progress) for s in range(8)]
    for case in ("q=k", "spread", "independent"):
        observed = statistics.stdev(r["exponents"][case]["rms_qk"] for r in runs)
        predicted = statistics.median(r["bootstrap"]["exponent_se"][case] for r in runs)
        assert 0.5 < predicted / observed < 2.0, (case, predicted, observed)


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["mup_correlated"]
    assert (tmp_path / "mup_correlated.png").stat().st_size > 0
    assert (tmp_path / "mup_correlated.svg").stat().st_size > 0
