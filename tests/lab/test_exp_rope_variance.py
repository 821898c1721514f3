import json

import pytest
import torch

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import rope_variance as exp


def synthetic(var: float, gap: float = 1e-15, d_ks=(16, 64), offsets=(0, 100)) -> dict:
    rows = [{"d_k": d, "offset": o, "var_plain": 1.0, "var_rope": var} for d in d_ks for o in offsets]
    return {"rows": rows, "commutation_max_abs_diff": {str(d): gap for d in d_ks}}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(1.02), Verdict.HOLDS),
        (synthetic(1.5), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(1.0, gap=1e-9), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(3.0), Verdict.DOES_NOT_HOLD),
        (synthetic(1.0, gap=1e-3), Verdict.DOES_NOT_HOLD),
        (synthetic(1.0, d_ks=(16,)), Verdict.INCONCLUSIVE),
        ({}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_rotation_depends_only_on_the_offset():
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(5, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    m = torch.tensor([0, 7, 100, 1000, 5000])
    near = (exp.rotate_at(q, m) * exp.rotate_at(k, m + 3)).sum(-1)
    origin = (q * exp.rotate_at(k, torch.full((5,), 3))).sum(-1)
    torch.testing.assert_close(near, origin, rtol=0, atol=1e-9)


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured):
    json.dumps(measured, allow_nan=False)
    for r in measured["rows"]:
        assert 0.85 < r["var_rope"] < 1.15
        assert 0.85 < r["var_plain"] < 1.15
        if r["offset"] == 0:
            assert r["mean_self_rope"] == pytest.approx(1.0, abs=0.05)
    far = [r["mean_self_rope"] for r in measured["rows"] if r["offset"] == 2000 and r["d_k"] == 128]
    assert far[0] < 0.2  # correlated q.k decays with the offset
    assert max(measured["commutation_max_abs_diff"].values()) < 1e-12
    assert exp.judge(measured).verdict is Verdict.HOLDS


def test_plot_writes_files(measured, tmp_path):
    assert exp.plot(measured, tmp_path) == ["rope_variance"]
    assert (tmp_path / "rope_variance.png").stat().st_size > 0
    assert (tmp_path / "rope_variance.svg").stat().st_size > 0
