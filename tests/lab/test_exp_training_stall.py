import json

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import training_stall as exp
from attnscale.lab.training import median_steps


def synthetic(unscaled: dict[str, list], scaled: list | None = None, budget: int = 1000) -> dict:
    """Per-seed steps-to-90% for "init/d_k" conditions, the scaled arm at ``scaled`` everywhere."""
    scaled = scaled if scaled is not None else [100, 110, 120]
    per_seed: dict = {}
    for cond, steps in unscaled.items():
        init, dk = cond.split("/")
        per_seed.setdefault(init, {})[f"1/{dk}"] = steps
        per_seed[init][f"sqrt/{dk}"] = scaled
    medians = {i: {k: median_steps(v) for k, v in by.items()} for i, by in per_seed.items()}
    std = {i: {k: {"raw": 3.0, "scaled": 0.4} for k in by} for i, by in per_seed.items()}
    dks = tuple(sorted({int(c.split("/")[1]) for c in unscaled}))
    return {
        "steps_to_90_per_seed": per_seed,
        "steps_to_90_by_init": medians,
        "slowdown": exp._slowdowns(medians, dks, budget),
        "init_logit_std": std,
    }


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic({"unit/64": [300, 250, 400], "unit/128": [None, None, 500]}), Verdict.HOLDS),
        (synthetic({"default/64": [100, 130, 120], "unit/64": [300, 250, 400]}), Verdict.HOLDS_APPROXIMATELY),
        (synthetic({"default/64": [150, 160, 170], "default/128": [140, 150, 160]}), Verdict.HOLDS_APPROXIMATELY),
        (synthetic({"default/64": [100, 110, 120], "unit/128": [150, 160, 130]}), Verdict.DOES_NOT_HOLD),
        (synthetic({"default/64": [300, 300, 300]}, scaled=[None, None, 100]), Verdict.INCONCLUSIVE),
        (synthetic({"default/64": [300]}, scaled=[100]), Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_a_stall_is_reported_as_the_budget_bound():
    m = synthetic({"unit/64": [None, None, 500]}, scaled=[100, 100, 100], budget=800)
    assert m["slowdown"] == {"unit/64": 8.0}
    assert "stalls" in exp.judge(m).reason
    medians = m["steps_to_90_by_init"]
    assert exp._slowdowns(medians, (64,), 800, {"unit/64": 4000}) == {"unit/64": 40.0}


@pytest.fixture(scope="module")
def measured():
    return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)


def test_run_tiny(measured, tmp_path):
    json.dumps(measured, allow_nan=False)
    cfg = exp.Config.for_profile("tiny")
    assert set(measured["steps_to_90"]) == {"1/64", "sqrt/64"}
    assert all(len(v) == cfg.seeds for v in measured["steps_to_90_per_seed"]["default"].values())
    std = measured["init_logit_std"]["default"]
    assert std["1/64"]["scaled"] == pytest.approx(std["1/64"]["raw"])
    assert std["sqrt/64"]["scaled"] == pytest.approx(std["sqrt/64"]["raw"] / 8)
    curve = measured["curves"]["default"]["1/64"][0]
    assert curve["steps"][0] == 0 and len(curve["saturated"]) == len(curve["steps"])
    assert exp.judge(measured).verdict in set(Verdict)
    assert measured["long_run"]["init"] == "default" and len(measured["long_run"]["runs"]) == cfg.seeds
    assert measured["curves"]["default"]["1/64"][0]["steps"][-1] <= cfg.long_steps
    names = exp.plot(measured, tmp_path)
    assert names and all((tmp_path / f"{n}.png").exists() and (tmp_path / f"{n}.svg").exists() for n in names)


def test_run_is_deterministic(measured):
    assert exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress) == measured


def test_profiles_keep_realistic_head_dims():
    for profile in ("quick", "default", "full"):
        cfg = exp.Config.for_profile(profile)
        assert cfg.dks == (64, 128) and {"1", "sqrt"} <= set(cfg.divisors) and cfg.seeds >= 2
    assert exp.Config.for_profile("default").long_steps > exp.Config.for_profile("default").steps
    assert exp.Config.for_profile("quick").long_steps == 0
    with pytest.raises(ValueError, match="profile"):
        exp.Config.for_profile("huge")


def test_reason_reports_the_long_run_and_small_init_ratio_is_per_dk():
    m = synthetic({"unit/128": [300, 250, 400]})
    m["long_run"] = {"label": "1/128", "init": "large", "budget": 4000, "runs": [{"steps_to_90": 300}, {"steps_to_90": None}]}
    assert "1/2 seeds reached 90%" in exp.judge(m).reason
    medians = {"default": {"sqrt/64": 100, "sqrt/128": None}, "small": {"1/64": 150, "1/128": 90}}
    assert exp._small_init_ratio(medians, (64, 128)) == {"64": 1.5, "128": None}
    assert exp._small_init_ratio({"default": {}}, (64,)) == {}


def test_large_and_small_inits_are_reported_but_left_out_of_the_verdict():
    m = synthetic({"default/128": [100, 110, 120], "large/128": [None, None, 900]})
    judgement = exp.judge(m)
    assert judgement.verdict is Verdict.DOES_NOT_HOLD
    assert "outside the rule, large/128: the unscaled one did not reach 90%" in judgement.reason
    grid = exp._conditions(exp.Config.for_profile("default"))
    assert ("large", "1", 128) in grid and ("large", "sqrt", 128) in grid and ("small", "1", 64) in grid
