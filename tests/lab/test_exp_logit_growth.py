import json

import pytest
import torch

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import logit_growth as exp


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def row(end: float, *, init: float = 1.0, peak: float | None = None, saturated: float = 0.9, accuracy: float = 1.0) -> dict:
    return {
        "init_max_logit": init,
        "end_max_logit": end,
        "peak_max_logit": end if peak is None else peak,
        "growth": end / init,
        "final_loss": 0.01,
        "final_accuracy": accuracy,
        "saturated": saturated,
        "entropy": 0.1,
        "clipped_heads": 0.0,
    }


def synthetic(
    *,
    none_high: float = 800.0,
    qknorm: float = 15.0,
    softcap_max: float = 30.0,
    softcap_saturated: float = 0.8,
    clip_peak: float = 33.0,
    reference_accuracy: float = 1.0,
    seeds: int = 3,
    jitter: float = 0.02,
) -> dict:
    """Medians at lr 0.001 (reference, max logit 12) and 0.03 (highest); cap = tau = 30. Each seed's
    numbers are the median's times 1 - jitter, 1, 1 + jitter, ... (seed-to-seed spread)."""
    table = {
        "none": {"0.001": row(12.0, accuracy=reference_accuracy), "0.03": row(none_high)},
        "qk-norm": {"0.03": row(qknorm, init=3.0)},
        "softcap": {"0.03": row(min(softcap_max, 30.0), saturated=softcap_saturated)},
        "qk-clip": {"0.03": row(30.0, peak=clip_peak)},
    }
    return {
        "config": {"cap": 30.0, "tau": 30.0},
        "reference_lr": 0.001,
        "highest_lr": 0.03,
        "softcap_max_logit_over_run": softcap_max,
        "table": table,
        "per_seed": {g: {lr: [_scaled(r, 1 + jitter * f) for f in _factors(seeds)] for lr, r in by.items()} for g, by in table.items()},
    }


def _factors(seeds: int) -> list[int]:
    return [0, -1, 1, -2, 2, -3, 3][:seeds]


def _scaled(r: dict, factor: float) -> dict:
    keep = {"final_accuracy", "clipped_heads"}
    return {k: v if k in keep else v * factor for k, v in r.items()}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(), Verdict.HOLDS),
        (synthetic(qknorm=40.0), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(softcap_saturated=0.2), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(clip_peak=60.0), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(none_high=50.0), Verdict.DOES_NOT_HOLD),
        (synthetic(qknorm=40.0, softcap_max=31.0, clip_peak=60.0), Verdict.DOES_NOT_HOLD),
        (synthetic(reference_accuracy=0.5), Verdict.INCONCLUSIVE),
        (synthetic(seeds=1), Verdict.INCONCLUSIVE),
        # QK-Clip's peak within noise of its bound (37.5): not clearly held, not clearly failed
        (synthetic(clip_peak=37.3), Verdict.HOLDS_APPROXIMATELY),
        # growth within noise of 10 R (120)
        (synthetic(none_high=125.0, jitter=0.1), Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_judge_names_the_failing_guard_and_needs_every_guard_at_the_highest_lr():
    judgement = exp.judge(synthetic(clip_peak=60.0))
    assert "qk-clip failed" in judgement.reason and "QK-Clip peak 60 +- 0.87" in judgement.reason
    judgement = exp.judge(synthetic(clip_peak=37.3))
    assert "qk-clip within noise" in judgement.reason and "QK-Clip peak 37.3 +- 0.54" in judgement.reason
    m = synthetic()
    del m["table"]["softcap"], m["per_seed"]["softcap"]
    assert exp.judge(m).verdict is Verdict.INCONCLUSIVE


def test_profiles_sweep_learning_rates_under_every_guard():
    for profile in ("quick", "default", "full"):
        cfg = exp.Config.for_profile(profile)
        grid = exp._conditions(cfg)
        assert len(cfg.lrs) >= 2 and cfg.seeds >= 2 and set(cfg.guards) == set(exp.GUARDS)
        assert {g for g, lr in grid if lr == max(cfg.lrs)} == set(exp.GUARDS)
        assert ("none", min(cfg.lrs)) in grid
    assert len(exp._conditions(exp.Config.for_profile("default"))) == 4 * 3
    with pytest.raises(ValueError, match="profile"):
        exp.Config.for_profile("huge")


@pytest.fixture(scope="module")
def measured():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the autouse one
    try:
        return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)
    finally:
        torch.set_num_threads(threads)


def test_run_tiny(measured, tmp_path):
    json.dumps(measured, allow_nan=False)
    cfg = exp.Config.for_profile("tiny")
    assert set(measured["table"]) == set(exp.GUARDS)
    assert set(measured["table"]["none"]) == {"0.003", "0.03"} and set(measured["table"]["qk-norm"]) == {"0.03"}
    assert all(len(runs) == cfg.seeds for by_lr in measured["per_seed"].values() for runs in by_lr.values())
    assert measured["softcap_max_logit_over_run"] <= cfg.cap
    clip = measured["table"]["qk-clip"]["0.03"]
    assert clip["clipped_heads"] == 0 or clip["peak_max_logit"] > 0
    curve = measured["curves"]["none"]["0.03"][0]
    assert curve["steps"][0] == 0 and curve["steps"][-1] == cfg.steps, "never stopped early"
    # tiny trains too briefly to learn the task, and the rule says so (real verdicts: test_training_verdicts.py)
    judgement = exp.judge(measured)
    assert judgement.verdict is Verdict.INCONCLUSIVE and "no reference for the logit that learning needs" in judgement.reason
    names = exp.plot(measured, tmp_path)
    assert names and all((tmp_path / f"{n}.png").exists() and (tmp_path / f"{n}.svg").exists() for n in names)
