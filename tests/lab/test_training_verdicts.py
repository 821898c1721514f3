"""The five training-based experiments reach real verdicts, in the directions the published run found.

Each runs its ``tiny`` profile trained for a few hundred steps (so that the models learn the task,
which ``tiny``'s 30-40 steps do not) with AdamW, seed 0 and one torch thread, and asserts the verdict
and the measured directions behind it, not only that ``judge`` returns something. At these sizes each
verdict is the one the ``default`` profile reaches (results/published.json), except small-dk's: its
6 seeds here bound the effect under twice the rule's margin, not under the margin (holds
approximately). Each runs 6 or 8 seeds: a comparison is clear by Student's t quantile of standard
errors for the seed count (4.30 for 3 seeds, 2.57 for 6), and with fewer every verdict here is
inconclusive.
"""

import dataclasses

import pytest
import torch

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import hard_routing, inference_removal, logit_growth, small_dk, training_stall
from attnscale.lab.uncertainty import margin


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(module, **sizes):
    config = dataclasses.replace(module.Config.for_profile("tiny"), **sizes)
    measured = module.run(config, 0, no_progress)
    return measured, module.judge(measured)


def test_training_stall_adamw_learns_without_the_scale_at_d_k_64():
    # 8 seeds at the realistic inits: both clearly under 2x
    measured, judgement = _run(training_stall, steps=300, sgd_steps=0, seeds=8)
    assert judgement.verdict is Verdict.DOES_NOT_HOLD
    default, unit = measured["arms"]["adamw mqar"]
    assert (default["name"], unit["name"]) == ("default", "unit")
    for rung in (default, unit):  # no stall: both models reach 90%, the unscaled one within 2x
        assert rung["never_unscaled"] == 0 and None not in rung["scaled"]
        assert rung["slowdown"]["centre"] < training_stall.MUCH_SLOWER
    assert unit["slowdown"]["centre"] > default["slowdown"]["centre"]  # larger init logits cost more steps
    assert unit["logit_std"] > 2 * default["logit_std"]


def test_small_dk_the_scales_effect_is_small_at_d_k_2_and_4():
    measured, judgement = _run(small_dk, dks=(2, 4), seeds=6, context=4, queries=4, n_keys=8, n_values=8, steps=300, eval_batch=64)
    # six seeds bound the effect under twice the 25% margin, not under the margin itself
    assert judgement.verdict is Verdict.HOLDS_APPROXIMATELY
    for c in measured["comparison"].values():
        assert c["effect"] is not None and abs(c["effect"]) + margin(6) * c["effect_spread"] <= 2 * c["margin"]
        assert abs(c["effect"]) <= c["margin"]


def test_hard_routing_a_learned_temperature_routes_more_sharply_than_the_fixed_scale():
    # quick's sizes with 6 seeds: at smaller ones, or 4 seeds, the gap is within noise of 0
    measured, judgement = _run(hard_routing, **{**dataclasses.asdict(hard_routing.Config.for_profile("quick")), "seeds": 6})
    fixed, learned = measured["final_median"]["fixed"], measured["final_median"]["learned"]
    assert fixed["accuracy"] >= hard_routing.MIN_ACCURACY and learned["accuracy"] >= hard_routing.MIN_ACCURACY
    assert measured["sharpness_gap"] > 0
    assert judgement.verdict is Verdict.HOLDS_APPROXIMATELY  # sharper, but not near one-hot (>= 0.99)
    assert learned["max_prob"] < hard_routing.SATURATED


def test_inference_removal_one_over_d_k_degrades_and_removing_the_scale_barely_does():
    measured, judgement = _run(
        inference_removal, exponents=(0.0, 0.5, 1.0), seeds=6, steps=300, eval_batch=128
    )
    assert judgement.verdict is Verdict.HOLDS_APPROXIMATELY
    removed, one_over_dk = measured["lab_summary"]["64/1"], measured["lab_summary"]["64/dk"]
    assert removed["accuracy_trained"] >= inference_removal.MIN_TRAINED_ACCURACY
    assert removed["accuracy_drop"] < inference_removal.ACC_DROP
    assert one_over_dk["accuracy_drop"] > 10 * inference_removal.ACC_DROP
    assert one_over_dk["entropy_change"] > 0 > removed["entropy_change"]  # 1/d_k flattens, no scale sharpens


def test_logit_growth_logits_grow_without_a_guard_and_qk_norm_bounds_them():
    measured, judgement = _run(logit_growth, lrs=(3e-3, 5e-2), steps=100, seeds=6)
    # At this size QK-Clip's peak sits at its bound (1.25 tau), just above or below it as the kernel's
    # rounding changes: within noise of it (or, on some CPU, clearly above), never clearly under, so
    # holds-approximately on every machine; QK-norm clearly holds, and softcap's saturated share
    # (0.63 +- 0.04 over 6 seeds at one thread on an AMD EPYC) clearly holds or is within noise.
    assert judgement.verdict is Verdict.HOLDS_APPROXIMATELY
    assert "qk-norm clearly as claimed" in judgement.reason or "qk-norm, softcap clearly as claimed" in judgement.reason
    assert "softcap failed" not in judgement.reason
    assert "qk-clip within noise" in judgement.reason or "qk-clip failed" in judgement.reason
    tau, high = measured["config"]["tau"], f"{max(measured['config']['lrs']):g}"
    assert abs(measured["table"]["qk-clip"][high]["peak_max_logit"] / (logit_growth.CLIP_SLACK * tau) - 1) < 0.1
    over = measured["over_reference"]
    assert over["none"] > logit_growth.GROWTH
    assert over["qk-norm"] <= logit_growth.QKNORM_BOUND
    assert measured["softcap_max_logit_over_run"] <= measured["config"]["cap"] * (1 + 1e-6)
