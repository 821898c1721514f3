"""scale-in-the-wild's census rule (attnscale.lab.census_verdict) on synthetic censuses: every
verdict reached, and the edges of each threshold."""

import pytest

from attnscale.lab.base import Verdict
from attnscale.lab.census_verdict import CLIPPED, LEARNED, NORMALISED, OTHER_CONSTANT, POSITION, SQRT, conforms, judge_census


def _rows(sqrt=0, other=0, normalised_sqrt=0, normalised_other=0, position=0):
    rows = [{"model_type": f"sqrt{i}", "class": SQRT} for i in range(sqrt)]
    rows += [{"model_type": f"other{i}", "class": OTHER_CONSTANT} for i in range(other)]
    rows += [{"model_type": f"normed{i}", "class": NORMALISED, "after_norm_sqrt": True} for i in range(normalised_sqrt)]
    rows += [{"model_type": f"normed_other{i}", "class": NORMALISED, "after_norm_sqrt": False} for i in range(normalised_other)]
    rows += [{"model_type": f"pos{i}", "class": POSITION} for i in range(position)]
    return rows


def _missing(n):
    return [{"model_type": f"missing{i}", "reason": "ImportError: needs timm"} for i in range(n)]


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        pytest.param({"class": SQRT}, True, id="sqrt"),
        pytest.param({"class": OTHER_CONSTANT}, False, id="other-constant"),
        pytest.param({"class": NORMALISED, "after_norm_sqrt": True}, True, id="qk-norm-then-sqrt"),
        pytest.param({"class": NORMALISED, "after_norm_sqrt": False}, False, id="qk-norm-then-other"),
        pytest.param({"class": NORMALISED}, False, id="qk-norm-unmeasured-after-norm"),
        pytest.param({"class": POSITION}, False, id="position-dependent"),
        pytest.param({"class": CLIPPED, "below_clip_sqrt": True}, True, id="clipped-sqrt-below-the-clamp"),
        pytest.param({"class": CLIPPED, "below_clip_sqrt": False}, False, id="clipped-other-below-the-clamp"),
        pytest.param({"class": LEARNED}, False, id="learned"),
    ],
)
def test_what_conforms(row, expected):
    assert conforms(row) is expected


def test_holds_when_every_probed_type_conforms_and_nine_in_ten_were_probed():
    j = judge_census(_rows(sqrt=80, normalised_sqrt=10), _missing(10), transformers="5")
    assert j.verdict is Verdict.HOLDS
    assert "90 of 90 probed types (100%)" in j.reason and "10 of 100 types tried could not be probed (ImportError: 10)" in j.reason


def test_all_conforming_but_too_many_unprobed_is_only_approximate():
    j = judge_census(_rows(sqrt=89), _missing(11), transformers="5")
    assert j.verdict is Verdict.HOLDS_APPROXIMATELY


def test_one_departure_makes_it_approximate_and_is_named():
    j = judge_census(_rows(sqrt=99, other=1), [], transformers="5")
    assert j.verdict is Verdict.HOLDS_APPROXIMATELY
    assert "departing: other0" in j.reason and "another constant 1" in j.reason


@pytest.mark.parametrize(
    ("good", "bad", "expected"),
    [
        pytest.param(20, 10, Verdict.HOLDS_APPROXIMATELY, id="exactly-two-thirds"),
        pytest.param(19, 11, Verdict.DOES_NOT_HOLD, id="under-two-thirds"),
    ],
)
def test_two_thirds_is_the_edge(good, bad, expected):
    assert judge_census(_rows(sqrt=good, position=bad), [], transformers="5").verdict is expected


@pytest.mark.parametrize(
    ("probed", "missing", "expected"),
    [
        pytest.param(24, 0, Verdict.INCONCLUSIVE, id="under-25-probed"),
        pytest.param(25, 0, Verdict.HOLDS, id="25-probed"),
        pytest.param(30, 31, Verdict.INCONCLUSIVE, id="under-half-probed"),
        pytest.param(30, 30, Verdict.HOLDS_APPROXIMATELY, id="half-probed"),
    ],
)
def test_too_few_probed_is_inconclusive(probed, missing, expected):
    assert judge_census(_rows(sqrt=probed), _missing(missing), transformers="5").verdict is expected


def test_released_configs_are_named_beside_the_verdict_not_counted():
    released = [{"model_type": "gemma2", "label": "27B", "class": OTHER_CONSTANT, "released": True}]
    j = judge_census(_rows(sqrt=30) + released, [], transformers="5")
    assert j.verdict is Verdict.HOLDS
    assert "released configs that depart: gemma2 27B" in j.reason


def test_without_transformers_it_is_inconclusive():
    assert judge_census([], [], transformers=None).verdict is Verdict.INCONCLUSIVE
