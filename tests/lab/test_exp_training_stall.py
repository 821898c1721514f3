"""training-stall: the rule on synthetic diagrams (every verdict, per arm and for the claim), and
the tiny profile run end to end (JSON, determinism, the figure)."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
import torch

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import training_stall as exp
from attnscale.lab.stall_phase import Point, fastest_per_seed, paired_ratios, seeds_needed


def _rung(name, dk, std, unscaled, scaled=(100, 110, 120, 105, 115)):
    """A rung's dict as ``run_part`` records it: unscaled steps per seed (None: never)."""
    return Point(dk, 1.0, std, tuple(unscaled), tuple(scaled), 1000, 10, name).as_dict()


SLOW = (300, 330, 360, 315, 345)  # 3x the scaled steps, seed by seed
FAST = (110, 121, 132, 115, 126)  # 1.1x
NEAR = (160, 250, 290, 180, 260)  # about 2x, spread wide
NEVER = (None, None, None, 400, None)


def _measured(**arms):
    """``arms``: "adamw_mqar" -> (default/64, unit/64) unscaled steps."""
    return {
        "config": dataclasses.asdict(exp.Config.for_profile("default")),
        "target_accuracy": 0.9,
        "arms": {
            name.replace("_", " "): [_rung("default", 64, 2.5, default), _rung("unit", 64, 7.5, unit), _rung("", 64, 27.0, NEVER)]
            for name, (default, unit) in arms.items()
        },
    }


@pytest.mark.parametrize(
    ("pair", "verdict"),
    [
        ((SLOW, NEVER), Verdict.HOLDS),
        ((FAST, FAST), Verdict.DOES_NOT_HOLD),
        ((FAST, SLOW), Verdict.HOLDS_APPROXIMATELY),
        ((FAST, NEAR), Verdict.INCONCLUSIVE),
    ],
    ids=["both clearly over 2x", "both clearly under", "one each side", "one within noise"],
)
def test_each_arm_is_judged_by_its_realistic_inits_against_2x(pair, verdict):
    judgement = exp.judge(_measured(adamw_mqar=pair))
    assert judgement.verdict is verdict and [a.verdict for a in judgement.arms] == [verdict]
    assert judgement.arms[0].name == "AdamW, MQAR"
    assert "2x crossed at an init logit std of" in judgement.arms[0].reason


def test_the_claim_gets_the_least_supportive_conclusive_arm():
    judgement = exp.judge(_measured(adamw_mqar=(FAST, FAST), adamw_copy=(FAST, SLOW), sgd_mqar=(FAST, NEAR)))
    assert [a.verdict for a in judgement.arms] == [Verdict.DOES_NOT_HOLD, Verdict.HOLDS_APPROXIMATELY, Verdict.INCONCLUSIVE]
    assert judgement.verdict is Verdict.DOES_NOT_HOLD and judgement.reason.startswith("the arms differ")
    assert judgement.arms[2].name == "SGD (lr tuned per rung on 0.003..3, momentum 0.9, 400 steps), MQAR"
    agree = exp.judge(_measured(adamw_mqar=(SLOW, NEVER), sgd_copy=(NEVER, NEVER)))
    assert agree.verdict is Verdict.HOLDS and agree.reason.startswith("every arm agrees")
    assert exp.judge(_measured(adamw_mqar=(FAST, NEAR))).reason == "no arm gives a conclusive verdict"


def test_a_scaled_model_that_misses_90_percent_leaves_its_arm_inconclusive():
    m = _measured(adamw_mqar=(FAST, FAST))
    m["arms"]["adamw mqar"][1] = _rung("unit", 64, 7.5, FAST, scaled=(None, None, None, 100, 100))
    arm = exp.judge(m).arms[0]
    assert arm.verdict is Verdict.INCONCLUSIVE and "missed 90% at unit/64" in arm.reason


@pytest.fixture(scope="module")
def measured():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress)
    finally:
        torch.set_num_threads(threads)


def test_run_tiny(measured, tmp_path):
    json.dumps(measured, allow_nan=False)
    cfg = exp.Config.for_profile("tiny")
    assert list(measured["arms"]) == ["adamw mqar", "sgd mqar"]
    for arm, points in measured["arms"].items():
        assert [p["name"] for p in points] == ["default", "unit"] and {p["dk"] for p in points} == {64}
        assert points[1]["gain"] == pytest.approx(3**0.5) and points[1]["logit_std"] > 2 * points[0]["logit_std"]
        seeds = cfg.sgd_seeds if arm.startswith("sgd") else cfg.seeds
        assert all(len(p["unscaled"]) == len(p["scaled"]) == seeds for p in points)
        assert all(0.0 <= p["saturated"] <= 1.0 for p in points)
        if arm.startswith("sgd"):  # each divisor's learning rate is one the ladder holds; each seed its fastest
            assert all(set(p["lrs"]) <= set(cfg.sgd_lrs) for p in points)
            for p in points:
                for key in ("unscaled", "scaled"):
                    tried = {float(lr): steps for lr, steps in p["by_lr"][key].items()}
                    assert set(tried) <= set(cfg.sgd_lrs) and len(tried) >= 2
                    assert tuple(p[key]) == fastest_per_seed(tried)
        else:
            assert all(p["lrs"] is None and p["by_lr"] == {} for p in points)
    assert set(measured["crossings"]) == set(measured["arms"])
    judgement = exp.judge(measured)  # tiny: AdamW's scaled model does not reach 90% in 40 steps, SGD's 2 seeds are noise
    assert judgement.verdict is Verdict.INCONCLUSIVE and "missed 90%" in judgement.arms[0].reason
    names = exp.plot(measured, tmp_path)
    assert names == ["training_stall_phase"] and set(exp.captions(measured)) == set(names)
    assert all((tmp_path / f"{n}.png").exists() and (tmp_path / f"{n}.svg").exists() for n in names)


def test_run_is_deterministic(measured):
    assert exp.run(exp.Config.for_profile("tiny"), seed=0, progress=no_progress) == measured


def test_profiles_keep_realistic_head_dims_and_enough_seeds():
    for profile in ("default", "full"):
        cfg = exp.Config.for_profile(profile)
        assert {64, 128} <= set(cfg.dks) and cfg.seeds >= 5 and cfg.sgd_steps > 0
    assert exp.Config.for_profile("default").tasks == ("mqar",) and set(exp.Config.for_profile("full").tasks) == {"mqar", "copy"}
    assert set(exp.Config.for_profile("full").dks) == {16, 64, 128, 256}
    assert 64 in exp.Config.for_profile("quick").dks and exp.Config.for_profile("quick").sgd_tasks == ()
    with pytest.raises(ValueError, match="profile"):
        exp.Config.for_profile("huge")


def test_the_seed_counts_the_docs_state_are_the_profiles():
    """The module's docstring (the claim's method) states each profile's seed counts; a profile
    that trains another count than it says is caught here, not only by the rule's fingerprint."""
    doc = " ".join(exp.__doc__.split())
    quick, full = exp.Config.for_profile("quick"), exp.Config.for_profile("full")
    assert f"``quick`` keeps MQAR at d_k 64, AdamW, the realistic rungs and {quick.seeds} seeds" in doc
    assert full.seeds == full.sgd_seeds and f"SGD on 1, 27 and 54, {full.seeds} seeds each" in doc


def test_reports_at_different_seeds_share_no_model():
    assert exp.model_seeds(0, 5) == [0, 1, 2, 3, 4]
    assert not set(exp.model_seeds(1, 8)) & (set(exp.model_seeds(0, 8)) | set(exp.model_seeds(2, 8)))



V11_SEEDS = json.loads((Path(__file__).resolve().parents[2] / "results" / "training_stall_v11_seeds.json").read_text(encoding="utf-8"))


def _pooled_v11() -> dict[tuple[str, str, int], list[Point]]:
    """Each realistic rung's points over the three v11 default runs (report seeds 0-2)."""
    pooled: dict[tuple[str, str, int], list[Point]] = {}
    for run in V11_SEEDS["runs"]:
        for arm, points in run["arms"].items():
            for d in points:
                pooled.setdefault((arm, d["name"], d["dk"]), []).append(Point.from_dict(d))
    return pooled


def test_the_power_calculation_the_seed_counts_rest_on():
    """The module's seed counts come from the three v11 default runs (15 seeds per realistic rung):
    each rung's median, standard deviation and the seeds its margin to 2x needs, as it cites them."""
    pooled = _pooled_v11()
    assert [run["seed"] for run in V11_SEEDS["runs"]] == [0, 1, 2]

    def at(arm, name, dk):
        r = [x for p in pooled[(arm, name, dk)] for x in paired_ratios(p)]
        assert len(r) == 15
        return round(statistics.median(r), 2), round(statistics.stdev(r), 2), seeds_needed(r)

    mqar = [at("adamw mqar", n, dk) for n in ("default", "unit") for dk in (64, 128)]
    assert min(m for m, _, _ in mqar) == 1.00 and max(m for m, _, _ in mqar) == 1.43
    assert min(s for _, s, _ in mqar) == 0.09 and max(s for _, s, _ in mqar) == 0.17 and max(n for _, _, n in mqar) == 3
    assert [at("adamw copy", "unit", dk) for dk in (64, 128)] == [(3.06, 1.58, 16), (3.43, 2.26, 18)]
    assert [at("sgd mqar", n, 64) for n in ("default", "unit")] == [(1.00, 0.96, 9), (3.10, 1.05, 9)]
    for name in ("default", "unit"):  # 3 of 15 scaled runs missed 90% at the rate v11 picked
        assert sum(s is None for p in pooled[("sgd mqar", name, 64)] for s in p.scaled) == 3
    assert at("sgd copy", "default", 64) == (1.78, 1.04, 135)
    assert (exp.Config.for_profile("default").seeds, exp.Config.for_profile("full").sgd_seeds) == (5, 8)
    assert exp.Config.for_profile("default").sgd_tasks == ()  # since v15: SGD at full alone


def test_v13s_reason_is_what_v12s_three_default_runs_measured():
    """v13 counts each SGD seed at its fastest rate because v12's shared pick decided the slowdown:
    the numbers its reason cites, from results/training_stall_v12_seeds.json."""
    from attnscale.lab.stall_phase import point_slowdown

    v12 = json.loads((Path(__file__).resolve().parents[2] / "results" / "training_stall_v12_seeds.json").read_text(encoding="utf-8"))
    assert v12["rule_version"] == 12 and [run["seed"] for run in v12["runs"]] == [0, 1, 2]

    def read(name):
        out = []
        for run in v12["runs"]:
            (d,) = [d for d in run["arms"]["sgd mqar"] if d["name"] == name]
            e = point_slowdown(Point.from_dict(d))
            out.append((tuple(d["lrs"]), round(e.centre, 2), round(e.spread, 2)))
        return out

    assert read("unit") == [((0.03, 0.3), 3.09, 0.17), ((0.03, 0.1), 1.65, 0.07), ((0.03, 0.1), 1.76, 0.03)]
    assert [(lrs, c) for lrs, c, _ in read("default")] == [((0.03, 0.1), 1.05), ((0.03, 0.1), 1.00), ((0.03, 0.3), 2.09)]
    assert read("default")[2][2] == 0.06
    assert all(d["lrs"][0] == 0.03 for run in v12["runs"] for arm in ("sgd mqar", "sgd copy") for d in run["arms"][arm])
    (reason,) = [v.why for v in exp.CLAIM.rule_history if v.version == 13]
    assert "x3.09 +- 0.17" in reason and "x1.65 +- 0.07 and x1.76 +- 0.03" in reason and "x2.09 +- 0.06" in reason


def test_v16s_reason_is_what_v15s_three_default_runs_measured():
    """v16 moved pointer copy to full because under v15 its arm was inconclusive at report seeds 0,
    1 and 2 and so never set the claim's verdict at default: the kept records say so."""
    kept = json.loads((Path(__file__).resolve().parents[2] / "results" / "training_stall_v15_default_seeds.json").read_text(encoding="utf-8"))
    assert [r["seed"] for r in kept["runs"]] == [0, 1, 2]
    v16 = exp.CLAIM.rule_history[-1]
    assert v16.version == 16 and "results/training_stall_v15_default_seeds.json" in v16.why and "cf2dd6c" in v16.why
    for run in kept["runs"]:
        claim = run["claim"]
        assert run["commit"].startswith("cf2dd6c") and claim["rule_version"] == 15
        arms = {a["name"]: a["verdict"] for a in claim["arms"]}
        assert arms == {"AdamW, MQAR": "does-not-hold", "AdamW, pointer copy": "inconclusive"}
        assert claim["verdict"] == arms["AdamW, MQAR"]  # the least supportive conclusive arm: MQAR's alone
