import json
import math

import pytest
import torch

import attnscale
from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import alibi_order as exp


def synthetic(error: float, d_ks=(16, 64)) -> dict:
    rows = []
    for d_k in d_ks:
        for h, m in enumerate((0.25, 0.0625)):
            before = m / math.sqrt(d_k) / (1.0 + error)
            rows.append({"d_k": d_k, "head": h, "slope": m, "after": m, "before": before, "ratio": m / before})
    return {"heads": 2, "rows": rows}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(0.0), Verdict.HOLDS),
        (synthetic(0.05), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(-0.5), Verdict.DOES_NOT_HOLD),
        (synthetic(0.0, d_ks=(64,)), Verdict.INCONCLUSIVE),
        (synthetic(float("nan")), Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_folded_bias_equals_the_bias_inside_the_scaled_term():
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 6, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64)
    p = exp.probabilities(q, k, slopes, order="before")
    i, j = torch.arange(6).unsqueeze(-1), torch.arange(6).unsqueeze(0)
    logits = (q @ k.transpose(-1, -2) - slopes.reshape(2, 1, 1) * (i - j)) / 2.0
    expected = torch.softmax(logits.masked_fill(j > i, float("-inf")), dim=-1)
    torch.testing.assert_close(p, expected, rtol=0, atol=1e-12)
    after = exp.probabilities(q, k, slopes, order="after")
    bias = attnscale.alibi_bias(slopes, 6, 6)  # (H, L, S)
    expected_after = torch.softmax((q @ k.transpose(-1, -2) / 2.0 + bias).masked_fill(j > i, float("-inf")), dim=-1)
    torch.testing.assert_close(after, expected_after, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured):
    json.dumps(measured, allow_nan=False)
    for r in measured["rows"]:
        assert r["after"] == pytest.approx(r["slope"], rel=1e-9)
        assert r["before"] == pytest.approx(r["slope"] / math.sqrt(r["d_k"]), rel=1e-9)
    steep = [r for r in measured["rows"] if r["slope"] >= 0.25]
    assert all(r["after_noisy"] == pytest.approx(r["slope"], rel=0.2) for r in steep)
    assert exp.judge(measured).verdict is Verdict.HOLDS


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["alibi_order"]
    assert (tmp_path / "alibi_order.png").stat().st_size > 0
    assert (tmp_path / "alibi_order.svg").stat().st_size > 0
