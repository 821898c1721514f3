import pytest

from attnscale.lab.base import Verdict
from attnscale.lab.experiments import scale_in_the_wild as exp


def _row(name, conforms):
    return {"architecture": name, "conforms": conforms}


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        ({"transformers": None, "rows": []}, Verdict.INCONCLUSIVE),
        ({"transformers": "x", "rows": [_row("a", True)] * 4}, Verdict.INCONCLUSIVE),
        ({"transformers": "x", "rows": [_row("a", True)] * 6}, Verdict.HOLDS),
        ({"transformers": "x", "rows": [_row("a", True)] * 5 + [_row("b", False)]}, Verdict.HOLDS_APPROXIMATELY),
        ({"transformers": "x", "rows": [_row("a", True)] * 3 + [_row("b", False)] * 3}, Verdict.DOES_NOT_HOLD),
    ],
)
def test_verdict_rule(measured, verdict):
    assert exp.judge(measured).verdict is verdict


def test_architectures_that_fail_to_probe_are_counted_and_named():
    failed = [{"architecture": "Odd", "model_type": "odd", "reason": "RuntimeError: no attention"}]
    judgement = exp.judge({"transformers": "x", "rows": [_row("a", True)] * 6, "not_probed": failed})
    assert judgement.verdict is Verdict.HOLDS_APPROXIMATELY  # holds needs every architecture probed
    assert "6 of 6 probed use 1/sqrt(head_dim)" in judgement.reason
    assert "1 of 7 could not be probed: Odd (RuntimeError: no attention)" in judgement.reason
    few = exp.judge({"transformers": "x", "rows": [_row("a", True)] * 4, "not_probed": failed})
    assert few.verdict is Verdict.INCONCLUSIVE and "only 4 of 5" in few.reason and "Odd" in few.reason


def test_the_alibi_models_with_attention_of_their_own_are_probed():
    pytest.importorskip("transformers")
    config = exp.Config(architectures=("Falcon", "BLOOM", "MPT"), length=8)
    measured = exp.run(config, seed=0, progress=lambda done, total: None)
    assert measured["not_probed"] == []
    for row in measured["rows"]:  # each divides by sqrt(head_dim); BLOOM and MPT once ALiBi is zeroed
        assert row["scale_times_sqrt_head_dim"] == pytest.approx(1.0, rel=1e-4), row["architecture"]
        assert row["r2"] > 0.999


def test_probes_real_architectures(tmp_path):
    pytest.importorskip("transformers")
    measured = exp.run(exp.Config.for_profile("tiny"), seed=0, progress=lambda done, total: None)
    rows = {r["architecture"]: r for r in measured["rows"]}
    # Llama divides by sqrt(head_dim); T5 by nothing; Granite 3 by head_dim (attention_multiplier = 1/128).
    assert rows["Llama"]["scale_times_sqrt_head_dim"] == pytest.approx(1.0, rel=1e-4)
    assert rows["T5"]["scale"] == pytest.approx(1.0, rel=1e-4)
    assert rows["Granite 3"]["scale"] == pytest.approx(1 / 128, rel=1e-4)
    for row in rows.values():  # the black-box fit agrees with the argument the model passes
        assert row["scale"] == pytest.approx(row["scaling_argument"], rel=1e-4)
        assert row["r2"] > 0.999
    assert exp.plot(measured, tmp_path) == ["scale_in_the_wild"]
    assert (tmp_path / "scale_in_the_wild.svg").exists()
