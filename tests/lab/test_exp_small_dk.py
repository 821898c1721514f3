import json

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import small_dk as exp


def synthetic(arms: dict[str, list], log_every: int = 10, budget: int = 800) -> dict:
    dks = tuple(sorted({int(k.split("/")[1]) for k in arms}))
    return {"steps_to_90_per_seed": arms, "comparison": exp._compare(arms, dks, log_every, budget)}


SAME = {"1/2": [195, 200, 205], "sqrt/2": [195, 200, 205], "1/4": [95, 100, 105], "sqrt/4": [98, 100, 103]}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(SAME), Verdict.HOLDS),
        # effect 15 +- 4.2 against a margin of 25: within 4.3 standard errors (t, 3 seeds) of it, clearly under 50
        (synthetic({**SAME, "1/4": [110, 115, 120]}), Verdict.HOLDS_APPROXIMATELY),
        (synthetic({**SAME, "1/2": [400, 420, 440]}), Verdict.DOES_NOT_HOLD),
        # effect 20 +- 29 against a margin of 25: within noise of 50 too
        (synthetic({**SAME, "1/4": [80, 120, 150]}), Verdict.INCONCLUSIVE),
        (synthetic({**SAME, "sqrt/2": [None, None, 200]}), Verdict.INCONCLUSIVE),
        (synthetic({"1/2": [100], "sqrt/2": [100]}), Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_the_effect_carries_each_arms_standard_error_floored_at_the_logging_resolution():
    c = exp._compare({"1/2": [100, 140], "sqrt/2": [100, 100]}, (2,), log_every=10, budget=800)["2"]
    assert c["effect"] == 20 and c["margin"] == 25
    se_unscaled = (3.14159265 / 2) ** 0.5 * 28.2842712 / 2**0.5  # 1.25 s / sqrt(n)
    se_scaled = (3.14159265 / 2) ** 0.5 * (10 / 12**0.5) / 2**0.5  # s floored at 10 / sqrt(12)
    assert c["effect_spread"] == pytest.approx((se_unscaled**2 + se_scaled**2) ** 0.5, rel=1e-6)
    # a run that never reaches 90% counts at the step budget
    c = exp._compare({"1/2": [100, 100, None], "sqrt/2": [100, 100, 100]}, (2,), log_every=10, budget=800)["2"]
    assert c["unscaled"] == 100 and c["effect_spread"] > 200


def test_run_tiny(tmp_path):
    cfg = exp.Config.for_profile("tiny")
    measured = exp.run(cfg, seed=0, progress=no_progress)
    json.dumps(measured, allow_nan=False)
    assert set(measured["steps_to_90_per_seed"]) == {"1/2", "sqrt/2"}
    init = measured["init_attention"]
    assert init["sqrt/2"]["logit_std"] == pytest.approx(init["1/2"]["logit_std"] / 2**0.5, rel=1e-5)
    # tiny trains too briefly to learn the task, and the rule says so (real verdicts: test_training_verdicts.py)
    judgement = exp.judge(measured)
    assert judgement.verdict is Verdict.INCONCLUSIVE and "did not reach 90%" in judgement.reason
    names = exp.plot(measured, tmp_path)
    assert all((tmp_path / f"{n}.png").exists() for n in names)


def test_profiles_use_small_head_dims():
    for profile in ("quick", "default", "full"):
        cfg = exp.Config.for_profile(profile)
        assert cfg.dks == (2, 4) and cfg.seeds >= 3
