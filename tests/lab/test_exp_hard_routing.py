import json

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import hard_routing as exp


def synthetic(fixed: list[float], learned: list[float], acc_fixed: float = 1.0, acc_learned: float = 1.0) -> dict:
    final = {
        "fixed": {"max_prob": fixed, "accuracy": [acc_fixed] * len(fixed)},
        "learned": {"max_prob": learned, "accuracy": [acc_learned] * len(learned)},
    }
    median = {arm: {k: sorted(v)[len(v) // 2] for k, v in row.items()} for arm, row in final.items()}
    return {"final": final, "final_median": median, "learned_temperature": {"learned": [[2.0]] * len(learned)}}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic([0.94, 0.95, 0.945], [0.995, 0.996, 0.9955]), Verdict.HOLDS),
        (synthetic([0.94, 0.95, 0.945], [0.965, 0.97, 0.968]), Verdict.HOLDS_APPROXIMATELY),
        (synthetic([0.991, 0.992, 0.992], [0.998, 0.999, 0.999]), Verdict.HOLDS_APPROXIMATELY),
        # gap 0.000 +- 0.001: clearly under the 0.005 that counts
        (synthetic([0.944, 0.945, 0.946], [0.945, 0.946, 0.944]), Verdict.DOES_NOT_HOLD),
        # gap +0.001 +- 0.005: within noise of both 0 and 0.005
        (synthetic([0.94, 0.95, 0.945], [0.94, 0.951, 0.946]), Verdict.INCONCLUSIVE),
        (synthetic([0.94, 0.95, 0.945], [0.995, 0.996, 0.9955], acc_learned=0.95), Verdict.DOES_NOT_HOLD),
        (synthetic([0.5, 0.6, 0.55], [0.9, 0.95, 0.93], acc_fixed=0.4), Verdict.INCONCLUSIVE),
        (synthetic([0.9], [0.99]), Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_run_tiny(tmp_path):
    cfg = exp.Config.for_profile("tiny")
    measured = exp.run(cfg, seed=0, progress=no_progress)
    json.dumps(measured, allow_nan=False)
    assert set(measured["final"]) == {"fixed", "learned"}
    assert "fixed" not in measured["learned_temperature"]
    assert len(measured["learned_temperature"]["learned"]) == cfg.seeds
    for run in measured["final"].values():
        assert all(0.0 <= p <= 1.0 for p in run["max_prob"])
        assert all(s <= m + 1e-6 for s, m in zip(run["source_prob"], run["max_prob"]))
    # tiny trains too briefly to learn the task, and the rule says so (real verdicts: test_training_verdicts.py)
    judgement = exp.judge(measured)
    assert judgement.verdict is Verdict.INCONCLUSIVE and "the routing was not learned" in judgement.reason
    names = exp.plot(measured, tmp_path)
    assert all((tmp_path / f"{n}.png").exists() for n in names)
