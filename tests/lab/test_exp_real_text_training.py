"""real-text-training: the rule through the experiment's judge on synthetic sweeps (every verdict,
per condition and for the claim), and the tiny profile run end to end (JSON, determinism, figures,
captions)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import real_text_training as exp

RATES = ("0.0003162", "0.001", "0.003162", "0.01", "0.03162")
L0 = 4.3


def _arm(best, *, noise=0.004, seeds=5, diverge_from=None):
    """An arm as ``combine`` records it: a V in log rate, lowest (``best``) at the middle rate."""
    runs = {}
    for i, lr in enumerate(RATES):
        runs[lr] = [
            {"final": L0 if diverge_from is not None and i >= diverge_from else best + 0.3 * abs(i - 2) + noise * (s - (seeds - 1) / 2),
             "init": L0, "max_logit": 10.0 * (i + 1), "min_entropy": 1.0, "diverged_at": None}
            for s in range(seeds)
        ]  # fmt: skip
    return {"runs": runs}


def _measured(**conditions):
    """``conditions``: name -> (scaled arm, unscaled arm)."""
    return {
        "config": dataclasses.asdict(exp.Config.for_profile("default")),
        "conditions": {name: {"init": "nanogpt", "dk": 32, "arms": {"scaled": s, "unscaled": u}} for name, (s, u) in conditions.items()},
        "headline": None,
    }


@pytest.mark.parametrize(
    ("unscaled", "verdict"),
    [
        (_arm(1.9), Verdict.HOLDS),
        (_arm(1.6), Verdict.HOLDS_APPROXIMATELY),
        (_arm(1.5, diverge_from=3), Verdict.HOLDS_APPROXIMATELY),
        (_arm(1.5), Verdict.DOES_NOT_HOLD),
        (_arm(1.55, noise=0.2), Verdict.INCONCLUSIVE),
    ],
    ids=["stalls", "costs", "narrows", "no effect", "within noise"],
)
def test_each_condition_is_judged_by_the_rule(unscaled, verdict):
    judgement = exp.judge(_measured(a=(_arm(1.5), unscaled)))
    assert judgement.verdict is verdict and [a.verdict for a in judgement.arms] == [verdict]


def test_the_claim_gets_the_least_supportive_conclusive_condition():
    judgement = exp.judge(_measured(a=(_arm(1.5), _arm(1.9)), b=(_arm(1.5), _arm(1.5)), c=(_arm(1.5), _arm(1.55, noise=0.2))))
    assert [a.verdict for a in judgement.arms] == [Verdict.HOLDS, Verdict.DOES_NOT_HOLD, Verdict.INCONCLUSIVE]
    assert judgement.verdict is Verdict.DOES_NOT_HOLD


def test_the_tiny_profile_runs_end_to_end(tmp_path):
    config = exp.Config.for_profile("tiny")
    measured = exp.run(config, 0, no_progress)
    again = exp.combine(config, 0, {p: exp.run_part(config, 0, p, no_progress) for p in exp.parts(config)})
    assert json.loads(json.dumps(measured)) == json.loads(json.dumps(again))  # deterministic, JSON-able
    condition = measured["conditions"]["d_k 64, PyTorch's default init"]
    assert set(condition["arms"]) == {"scaled", "unscaled"}
    for arm in condition["arms"].values():
        assert len(arm["runs"]) == 3 and all(len(runs) == config.seeds for runs in arm["runs"].values())
        assert arm["summary"]["seeds"] == config.seeds
    judgement = exp.judge(measured)
    assert [a.name for a in judgement.arms] == ["d_k 64, PyTorch's default init"] and judgement.arms[0].reason
    with_, without = (condition["arms"][a]["summary"]["best"]["centre"] for a in exp.JUDGED)
    assert measured["headline"]["centre"] == without - with_  # the headline condition's
    names = exp.plot(measured, tmp_path)
    assert set(names) == set(exp.captions(measured))
    for name in names:
        assert (tmp_path / f"{name}.svg").is_file() and (tmp_path / f"{name}.png").is_file()
