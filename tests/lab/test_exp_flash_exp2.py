import json

import pytest
import torch

import attnscale
from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import flash_exp2 as exp


def synthetic(exp2: float, plain: float = 10.0) -> dict:
    case = {"d_k": 64, "keys": 1000, "scale": "1"}
    for dtype in ("fp32", "fp64"):
        case[f"exp2_{dtype}_eps"] = exp2
        case[f"attnscale_{dtype}_eps"] = plain
    return {"block": 128, "cases": [case]}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(20.0), Verdict.HOLDS),
        (synthetic(200.0, plain=110.0), Verdict.HOLDS),
        (synthetic(500.0), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(1e5), Verdict.DOES_NOT_HOLD),
        (synthetic(None), Verdict.INCONCLUSIVE),
        ({"cases": []}, Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


@pytest.mark.parametrize("S", [1, 59, 130])
def test_exp2_loop_matches_attnscale_in_float64(S):
    gen = torch.Generator().manual_seed(S)
    q = torch.randn(2, 3, 5, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 3, S, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    got = exp.exp2_attention(q, k, v, scale=0.3, block=32)
    torch.testing.assert_close(got, attnscale.scaled_dot_product_attention(q, k, v, scale=0.3), rtol=0, atol=1e-13)


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured):
    json.dumps(measured, allow_nan=False)
    assert {c["scale"] for c in measured["cases"]} == {"1/sqrt(d_k)", "1"}
    for c in measured["cases"]:
        for key in ("exp2_fp32_eps", "exp2_fp64_eps", "attnscale_fp32_eps", "attnscale_fp64_eps"):
            assert 0.0 <= c[key] < 1000.0
        assert c["exp2_fp32_eps"] * torch.finfo(torch.float32).eps > c["exp2_fp64_eps"] * torch.finfo(torch.float64).eps
    assert exp.judge(measured).verdict is Verdict.HOLDS


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["flash_exp2"]
    assert (tmp_path / "flash_exp2.png").stat().st_size > 0
    assert (tmp_path / "flash_exp2.svg").stat().st_size > 0
