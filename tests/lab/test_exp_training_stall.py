import json

import pytest
import torch

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import training_stall as exp
from attnscale.lab.training import median_steps


TIGHTEN = 2.0 / 4.303
"""The cases below were written for a margin of 2 standard errors; the rule's margin for 3 seeds is
Student's t, 4.303. Drawing each seed list toward its median by 2 / 4.303 keeps every case the
same number of margins from its bounds."""


def _tighten(steps: list) -> list:
    found = sorted(s for s in steps if s is not None)
    if len(found) < 2 or len(steps) < 2:
        return steps
    centre = median_steps(steps) or found[-1]
    return [None if s is None else centre + TIGHTEN * (s - centre) for s in steps]


def synthetic(unscaled: dict[str, list], scaled: list | None = None, budget: int = 1000) -> dict:
    """Per-seed steps-to-90% for "init/d_k" conditions, the scaled arm at ``scaled`` everywhere
    (every list drawn toward its median: TIGHTEN)."""
    scaled = _tighten(scaled if scaled is not None else [100, 110, 120])
    unscaled = {cond: _tighten(steps) for cond, steps in unscaled.items()}
    per_seed: dict = {}
    for cond, steps in unscaled.items():
        init, dk = cond.split("/")
        per_seed.setdefault(init, {})[f"1/{dk}"] = steps
        per_seed[init][f"sqrt/{dk}"] = scaled
    medians = {i: {k: median_steps(v) for k, v in by.items()} for i, by in per_seed.items()}
    std = {i: {k: {"raw": 3.0, "scaled": 0.4} for k in by} for i, by in per_seed.items()}
    dks = tuple(sorted({int(c.split("/")[1]) for c in unscaled}))
    return {
        "config": {"steps": budget, "log_every": 10},
        "steps_to_90_per_seed": per_seed,
        "steps_to_90_by_init": medians,
        "slowdown": exp._slowdowns(medians, dks, budget),
        "init_logit_std": std,
    }


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        # slowdowns: 2.9x, clear of 2x, and a stall
        (synthetic({"unit/64": [300, 320, 340], "unit/128": [None, None, 500]}), Verdict.HOLDS),
        (synthetic({"default/64": [100, 130, 120], "unit/64": [300, 320, 340]}), Verdict.HOLDS_APPROXIMATELY),
        # 1.64x and 1.55x: clearly between 1.25x and 2x
        (synthetic({"default/64": [170, 180, 190], "default/128": [160, 170, 180]}), Verdict.HOLDS_APPROXIMATELY),
        (synthetic({"default/64": [100, 110, 120], "unit/128": [150, 160, 130]}), Verdict.DOES_NOT_HOLD),
        (synthetic({"default/64": [300, 300, 300]}, scaled=[None, None, 100]), Verdict.INCONCLUSIVE),
        (synthetic({"default/64": [300]}, scaled=[100]), Verdict.INCONCLUSIVE),
        # 1.3x: not clearly within 1.25x, nor clearly above it
        (synthetic({"default/64": [110, 143, 180], "default/128": [100, 143, 190]}), Verdict.INCONCLUSIVE),
        # 2.1x: within noise of 2x, and the other condition clearly under it
        (synthetic({"default/64": [100, 110, 120], "unit/64": [210, 230, 250]}), Verdict.INCONCLUSIVE),
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


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def measured():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the autouse one
    try:
        return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)
    finally:
        torch.set_num_threads(threads)


def with_sgd(measured: dict, unscaled: dict[str, list], scaled: list | None = None, budget: int = 400) -> dict:
    """``measured`` with an SGD arm built like ``synthetic`` builds the AdamW one."""
    sgd = synthetic(unscaled, scaled, budget)
    return {
        **measured,
        "sgd": {"lrs": [0.03, 0.1], "lr_start": 0.1, "momentum": 0.9, "weight_decay": 0.0, "budget": budget, "seeds": 3},
        "sgd_best_lr": {i: {k: 0.03 if k.startswith("1/") else 0.1 for k in by} for i, by in sgd["steps_to_90_per_seed"].items()},
        "steps_to_90_sgd_per_seed": sgd["steps_to_90_per_seed"],
        "steps_to_90_sgd_by_init": sgd["steps_to_90_by_init"],
        "slowdown_sgd": sgd["slowdown"],
        "peak_max_logit_sgd": {i: {k: [1e4] * 3 for k in by} for i, by in sgd["steps_to_90_per_seed"].items()},
        "accuracy_sgd": {i: {k: [{"best": 0.93, "final": 0.1}] * 3 for k in by} for i, by in sgd["steps_to_90_per_seed"].items()},
    }


ADAMW_NO = synthetic({"default/64": [100, 110, 120], "unit/64": [150, 160, 130]})
ADAMW_YES = synthetic({"default/64": [300, 310, 320], "unit/64": [None, None, 500]})


@pytest.mark.parametrize(
    ("measured", "verdict", "arms"),
    [
        (
            with_sgd(ADAMW_NO, {"default/64": [None, None, 110], "unit/64": [None, None, None]}),
            Verdict.DOES_NOT_HOLD,
            (Verdict.DOES_NOT_HOLD, Verdict.HOLDS),
        ),
        (
            with_sgd(ADAMW_YES, {"default/64": [None, None, 110], "unit/64": [400, 390, 380]}),
            Verdict.HOLDS,
            (Verdict.HOLDS, Verdict.HOLDS),
        ),
        (
            with_sgd(ADAMW_YES, {"default/64": [None, None, 110], "unit/64": [150, 160, 130]}),
            Verdict.HOLDS_APPROXIMATELY,
            (Verdict.HOLDS, Verdict.HOLDS_APPROXIMATELY),
        ),
        (
            with_sgd(ADAMW_NO, {"default/64": [100, 100, 100]}, scaled=[None, None, 90]),
            Verdict.DOES_NOT_HOLD,
            (Verdict.DOES_NOT_HOLD, Verdict.INCONCLUSIVE),
        ),
        (
            with_sgd(synthetic({"default/64": [300]}, scaled=[100]), {"default/64": [100]}, scaled=[90]),
            Verdict.INCONCLUSIVE,
            (Verdict.INCONCLUSIVE, Verdict.INCONCLUSIVE),
        ),
    ],
)
def test_each_optimizer_keeps_its_verdict_and_the_claim_gets_the_least_supportive(measured, verdict, arms):
    judgement = exp.judge(measured)
    assert judgement.verdict is verdict
    assert tuple(a.verdict for a in judgement.arms) == arms
    assert [a.name for a in judgement.arms] == ["AdamW", "SGD (lr tuned per condition on 0.03..0.1, momentum 0.9, 400 steps)"]


def test_sgd_arm_reports_the_peak_logit_and_disagreement():
    m = with_sgd(ADAMW_NO, {"default/64": [None, None, 110], "unit/64": [None, None, None]})
    judgement = exp.judge(m)
    assert judgement.reason.startswith("the optimizers disagree (AdamW: does-not-hold; SGD: holds)")
    adamw, sgd = judgement.arms
    assert adamw.reason.startswith("no condition is 2x slower")
    assert sgd.reason.startswith("without the scale learning is clearly >= 2x slower")
    assert "peak max logit without the scale: default/64 1e+04" in sgd.reason
    assert "accuracy without the scale, best -> final (medians): default/64 0.93 -> 0.10" in sgd.reason
    assert "best lr without / with the scale: default/64 0.03 / 0.1" in sgd.reason


def test_run_tiny(measured, tmp_path):
    json.dumps(measured, allow_nan=False)
    cfg = exp.Config.for_profile("tiny")
    assert set(measured["steps_to_90"]) == {"1/64", "sqrt/64"}
    assert measured["optimizers"] == ["adamw", "sgd"]
    assert set(measured["steps_to_90_sgd"]) == {"1/64", "sqrt/64"} and measured["sgd"]["lrs"] == list(cfg.sgd_lrs)
    tried = measured["steps_to_90_sgd_by_lr"]
    assert {f"{lr:g}" for lr in cfg.sgd_lrs} >= set(tried) >= {"0.1", "0.3"}  # the start and its neighbour
    for label, lr in measured["sgd_best_lr"]["default"].items():
        # the reported medians are those of the chosen learning rate, which no other one tried beats
        assert lr in cfg.sgd_lrs
        chosen = measured["steps_to_90_sgd_by_init"]["default"][label]
        assert tried[f"{lr:g}"]["default"][label] == chosen
        others = [by["default"][label] for by in tried.values() if label in by.get("default", {})]
        assert chosen is None and all(o is None for o in others) or all(o is None or chosen <= o for o in others)
    assert all(len(v) == cfg.sgd_seeds for v in measured["steps_to_90_sgd_per_seed"]["default"].values())
    assert measured["curves_sgd"]["default"]["1/64"][0]["steps"][-1] <= cfg.sgd_steps
    assert all(0 <= r["final"] <= r["best"] <= 1 for r in measured["accuracy_sgd"]["default"]["1/64"])
    assert all(len(v) == cfg.seeds for v in measured["steps_to_90_per_seed"]["default"].values())
    std = measured["init_logit_std"]["default"]
    assert std["1/64"]["scaled"] == pytest.approx(std["1/64"]["raw"])
    assert std["sqrt/64"]["scaled"] == pytest.approx(std["sqrt/64"]["raw"] / 8)
    curve = measured["curves"]["default"]["1/64"][0]
    assert curve["steps"][0] == 0 and len(curve["saturated"]) == len(curve["steps"])
    judgement = exp.judge(measured)  # tiny: AdamW's scaled model does not reach 90% in 40 steps
    assert [a.verdict for a in judgement.arms] == [Verdict.INCONCLUSIVE, Verdict.INCONCLUSIVE]
    assert "did not reach 90%" in judgement.arms[0].reason
    assert "within noise" in judgement.arms[1].reason  # SGD's 2 seeds leave a comparison within noise
    assert judgement.verdict is Verdict.INCONCLUSIVE
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
    assert exp.Config.for_profile("quick").sgd_steps == 0 and exp.Config.for_profile("default").sgd_steps > 0
    with pytest.raises(ValueError, match="profile"):
        exp.Config.for_profile("huge")


def test_sgd_counts_a_collapse_as_a_miss_and_picks_the_best_learning_rate():
    from attnscale.lab.training import RunLog

    def log(accuracy):
        return RunLog(steps=[10 * i for i in range(len(accuracy))], accuracy=accuracy)

    assert exp._kept(log([0.1, 0.95, 0.99])) == 10
    assert exp._kept(log([0.1, 0.95, 0.05])) is None  # passed 90%, then collapsed
    assert exp._kept(log([0.1, 0.5, 0.6])) is None
    assert exp._best_lr({0.03: 300, 0.1: 200, 0.3: None}) == 0.1
    assert exp._best_lr({0.03: 200, 0.1: 200}) == 0.03
    assert exp._best_lr({0.1: None, 0.3: None}) == 0.1


LADDER = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


@pytest.mark.parametrize(
    ("profile", "best", "tried"),
    [
        ({0.01: 500, 0.03: 300, 0.1: 200, 0.3: 250, 1.0: None}, 0.1, {0.03, 0.1, 0.3}),  # best at the start
        ({0.003: 90, 0.01: 100, 0.03: 150, 0.1: 300, 0.3: None}, 0.003, {0.003, 0.01, 0.03, 0.1, 0.3}),  # walks down to the end
        ({0.03: 400, 0.1: 300, 0.3: 200, 1.0: 100, 3.0: 120}, 1.0, {0.03, 0.1, 0.3, 1.0, 3.0}),  # walks up, stops
        ({0.003: 80, 0.01: None, 0.03: None, 0.1: None, 0.3: None}, 0.003, set(LADDER)),  # widens both ways
        ({}, 0.003, set(LADDER)),  # never reaches 90%: every rung tried, the smallest reported
    ],
)
def test_learning_rate_search_never_stops_at_an_untried_edge(profile, best, tried):
    seen = []

    def evaluate(lr):
        seen.append(lr)
        return profile.get(lr)

    result = exp._search_lr(LADDER, 0.1, evaluate)
    assert exp._best_lr(result) == best and set(result) == tried and len(seen) == len(set(seen))



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
