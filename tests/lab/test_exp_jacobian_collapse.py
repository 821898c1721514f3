import json
import math
import statistics

import pytest
import torch

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import jacobian_collapse as exp


def synthetic(ratio_by_dk: dict[int, float], check: float | None = 0.0, se: float = 0.001) -> dict:
    """Ratios with standard error ``se`` over 4 draws of keys."""
    curves = []
    a = se * math.sqrt(3)  # 4 draws of +-a: standard error a / sqrt(3)
    for d_k, ratio in ratio_by_dk.items():
        scaled = 1.0 / math.sqrt(d_k)
        points = [
            {"alpha": scaled, "logit_std": 1.0, "offpeak_mass": 1.6, "spectral_norm": 0.1},
            {"alpha": 1.0, "logit_std": math.sqrt(d_k), "offpeak_mass": 1.6 * ratio, "spectral_norm": 0.1},
        ]
        groups = {"scaled": [1.6] * 4, "unscaled": [1.6 * (ratio + a * (-1) ** g) for g in range(4)]}
        curves.append({"d_k": d_k, "points": points, "offpeak_mass_per_draw": groups})
    return {"curves": curves, "autograd_max_abs_diff": check}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic({16: 0.3, 64: 0.08, 128: 0.05}), Verdict.HOLDS),
        (synthetic({64: 0.12, 128: 0.08}), Verdict.HOLDS_APPROXIMATELY),
        (synthetic({64: 0.25, 128: 0.2}), Verdict.HOLDS_APPROXIMATELY),
        (synthetic({64: 0.5, 128: 0.4}), Verdict.DOES_NOT_HOLD),
        (synthetic({16: 0.05, 32: 0.05}), Verdict.INCONCLUSIVE),
        (synthetic({64: 0.05}, check=0.1), Verdict.INCONCLUSIVE),
        # within 3.18 standard errors (t, 4 draws) of 0.1 at d_k = 64: holds or holds approximately
        (synthetic({64: 0.095, 128: 0.05}, se=0.005), Verdict.INCONCLUSIVE),
        (synthetic({64: 0.08, 128: 0.05}, se=0.005), Verdict.HOLDS),
        (synthetic({64: 0.29, 128: 0.2}, se=0.01), Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_closed_forms_match_the_explicit_jacobian():
    gen = torch.Generator().manual_seed(1)
    temps = torch.logspace(-2, 2, 200, dtype=torch.float64)[:, None]
    p = torch.softmax(torch.randn(200, 33, generator=gen, dtype=torch.float64) * temps, dim=-1)
    tie = torch.zeros(1, 33, dtype=torch.float64)
    tie[0, :2] = 0.5
    p = torch.cat([p, tie, torch.full((1, 33), 1 / 33, dtype=torch.float64)])
    jac = exp.softmax_jacobian(p)
    off = torch.ones_like(p, dtype=torch.bool).scatter(-1, p.argmax(-1, keepdim=True), False)
    off_peak = jac.abs() * (off.unsqueeze(-1) & off.unsqueeze(-2))
    got = exp.jacobian_metrics(p)
    torch.testing.assert_close(got["offpeak_mass"], off_peak.sum((-1, -2)), rtol=0, atol=1e-12)
    torch.testing.assert_close(got["offpeak_max"], off_peak.amax((-1, -2)), rtol=0, atol=1e-12)
    torch.testing.assert_close(got["spectral_norm"], torch.linalg.eigvalsh(jac)[..., -1], rtol=0, atol=1e-12)
    torch.testing.assert_close(got["frobenius_norm"], jac.norm(dim=(-1, -2)), rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured):
    json.dumps(measured, allow_nan=False)
    assert measured["autograd_max_abs_diff"] < 1e-12
    closed, smallest = measured["uniform_closed_form"], measured["smallest_alpha_measured"]
    for name in exp.METRICS:
        assert smallest[name] == pytest.approx(closed[name], rel=0.05)
    r = exp.ratios(measured)
    assert r[128] < r[64] < r[16] < 1.0
    # the spectral norm rises from the uniform value, then falls: an interior maximum
    assert all(1.0 < v < 10.0 for v in measured["peak_logit_std"]["spectral_norm"].values())
    assert exp.judge(measured).verdict in (Verdict.HOLDS, Verdict.HOLDS_APPROXIMATELY)


def test_ratio_error_matches_the_spread_over_seeds():
    """The standard error of r(d_k) from one run's draws of keys is the seed-to-seed spread of r
    over independent runs, within the sampling error of 8 seeds' standard deviation."""
    config = exp.Config.for_profile("tiny")
    runs = [exp.run(config, seed=s, progress=no_progress) for s in range(8)]
    for d_k in config.d_ks:
        observed = statistics.stdev(exp.ratios(r)[d_k] for r in runs)
        predicted = statistics.median(r["offpeak_ratio_se"][str(d_k)] for r in runs)
        assert 0.5 < predicted / observed < 2.0, (d_k, predicted, observed)


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["jacobian_collapse"]
    assert (tmp_path / "jacobian_collapse.svg").stat().st_size > 0
    assert (tmp_path / "jacobian_collapse.png").stat().st_size > 0
