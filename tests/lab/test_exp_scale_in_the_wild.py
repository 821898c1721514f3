"""scale-in-the-wild (rule version 6): the census wired into the lab. The rule itself is tested on
synthetic censuses in test_census_verdict.py; the probe's numbers per family in
tests/diagnostics/test_census.py."""

import math

import pytest

from attnscale.diagnostics import census
from attnscale.lab import census_verdict
from attnscale.lab.base import Verdict
from attnscale.lab.experiments import scale_in_the_wild as exp


def _record(model_type, cls, *, released=False):
    return {"model_type": model_type, "label": "", "class": cls, "after_norm_sqrt": None, "released": released}


def test_judge_is_the_census_rule_over_census_and_released_rows():
    rows = [_record(f"t{i}", census.SQRT) for i in range(30)]
    measured = {
        "transformers": "x",
        "census": rows,
        "released": [_record("granite", census.OTHER_CONSTANT, released=True)],
        "not_probed": [{"model_type": "odd", "reason": "the forward pass failed: boom"}],
    }
    judgement = exp.judge(measured)
    expected = census_verdict.judge_census(measured["census"] + measured["released"], measured["not_probed"], transformers="x")
    assert judgement == expected
    assert judgement.verdict is Verdict.HOLDS  # 30 of 31 tried probed (97%), all conform; granite beside, not counted
    assert "released configs that depart: granite" in judgement.reason


def test_judge_without_transformers_is_inconclusive():
    assert exp.judge({"transformers": None, "census": []}).verdict is Verdict.INCONCLUSIVE


def test_the_default_profile_is_a_systematic_sample_and_full_is_everything():
    assert exp.Config.for_profile("full").stride == 1
    assert exp.Config.for_profile("default").stride == exp.DEFAULT_STRIDE > 1
    assert {label for label, *_ in exp.RELEASED} == set(exp.Config.for_profile("default").released)


def test_the_tiny_census(tmp_path):
    pytest.importorskip("transformers")
    measured = exp.run(exp.Config.for_profile("tiny"), seed=0, progress=lambda done, total: None)
    rows = {r["model_type"]: r for r in measured["census"]}
    assert rows["llama"]["conforms"] and rows["gpt2"]["conforms"]
    assert rows["llama"]["at_position_0"] == pytest.approx(1.0, abs=1e-5)
    # T5 divides by nothing: m = 1, so m x sqrt(head_dim) = sqrt(64)
    assert rows["t5"]["class"] == census.OTHER_CONSTANT and rows["t5"]["at_far_position"] == pytest.approx(8.0, rel=1e-5)
    assert measured["no_attention"] == ["resnet"]  # outside the census: neither probed nor a failure
    assert measured["not_probed"] == []
    # Llama 4's NoPE layers: q times 1 + attn_scale log1p(floor((pos + 1) / floor_scale))
    curve = next(c for c in measured["position_curves"] if c["model_type"] == "llama4_text")
    far = curve["positions"][-1]
    assert curve["scale"][-1] == pytest.approx(1 + 0.1 * math.log1p((far + 1) // 8192), rel=1e-4)
    (granite,) = measured["released"]
    assert granite["at_position_0"] == pytest.approx(math.sqrt(128) / 128, rel=1e-4)  # attention_multiplier 1/128
    assert granite["source"].startswith("ibm-granite/")
    assert exp.plot(measured, tmp_path) == ["scale_in_the_wild", "scale_in_the_wild_position"]
    assert (tmp_path / "scale_in_the_wild.svg").exists() and (tmp_path / "scale_in_the_wild_position.svg").exists()
    assert set(exp.captions(measured)) == {"scale_in_the_wild", "scale_in_the_wild_position"}


def test_a_qk_norm_layer_whose_multiplier_after_the_norm_was_not_fitted_keeps_its_row():
    def layer(name, multiplier, *, normalised):
        return census.LayerScale(
            layer=name, head_dim=16, heads=4, positions=[0, 15], multiplier=multiplier, head_spread=0.0, r2=0.5 if normalised else 1.0,
            bias_slope=0.0, gain_response=0.25 if normalised else 1.0, after_norm=None, after_norm_r2=None, through_cache=False,
        )

    layers = [layer("a", [0.25, 0.25], normalised=False), layer("b", [0.1, 0.2], normalised=True)]
    cls, why = census.classify(layers)
    row = census.CensusRow("odd", "", cls, why, layers, {})
    record = exp._record(row)
    assert record["class"] == census.NORMALISED and not record["conforms"]
    assert record["at_position_0"] == pytest.approx(1.0) and record["by_layer_far"] == "1 -"  # the norm's layer: nothing read
    only = census.CensusRow("odd", "", cls, why, layers[1:], {})
    assert exp._record(only)["at_position_0"] is None


@pytest.mark.parametrize(("below", "conforms"), [pytest.param(0.25, True, id="sqrt-below-the-clamp"), pytest.param(0.5, False, id="other-below-the-clamp")])
def test_a_clipped_row_is_judged_by_its_multiplier_below_the_clamp(below, conforms):
    """The table's record carries what the rule reads: a released config with clip_qkv (OLMo 1.7 7B)
    conforms when 1/sqrt(head_dim) below the clamp, and is named as departing otherwise."""
    lay = census.LayerScale(
        layer="a", head_dim=16, heads=4, positions=[0, 15], multiplier=[below, below], head_spread=0.0, r2=1.0,
        bias_slope=0.0, gain_response=1.0, clip_response=0.24, clip_r2=0.7,
    )
    cls, why = census.classify([lay])
    assert cls == census.CLIPPED
    record = exp._record(census.CensusRow("olmo", "OLMo 1.7 7B", cls, why, [lay], {}, released=True), "source")
    assert record["below_clip_sqrt"] is conforms and census_verdict.conforms(record) is conforms
    measured = {"transformers": "x", "census": [_record(f"t{i}", census.SQRT) for i in range(30)], "released": [record], "not_probed": []}
    assert ("released configs that depart: olmo OLMo 1.7 7B" in exp.judge(measured).reason) is not conforms
