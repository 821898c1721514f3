"""`attnscale check` as a gate: wrong scale or semantics exit 1 with the fix, robustness findings exit 3."""

import json
import math
import uuid

import pytest
import torch.nn.functional as F

import attnscale
from attnscale.cli import main
from attnscale.diagnostics import check_attention

# Attention implementations, written to a module the command imports from the current folder.
TARGETS = '''
import math
import torch
import torch.nn.functional as F


def plain_fp16(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """Right semantics, computed in the input dtype: q.k overflows fp16."""
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def no_scale(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, scale=1.0)


class Attention(torch.nn.Module):
    """Projections under names the probe does not guess."""

    def __init__(self, width=32, heads=4, scale=None):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(width, width) for _ in range(4))
        self.scale = scale

    def forward(self, x):
        B, L, E = x.shape
        q, k, v = (w(x).unflatten(-1, (self.heads, -1)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))  # (B, H, L, D)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.wo(out.transpose(1, 2).flatten(-2))


layer = Attention()
unscaled_layer = Attention(scale=1.0)
'''


@pytest.fixture
def targets(tmp_path, monkeypatch):
    name = f"attn_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TARGETS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _last_line(capsys):
    return capsys.readouterr().out.rstrip("\n").splitlines()[-1]


def test_correct_attention_passes_with_status_0(capsys):
    assert main(["check", "attnscale:scaled_dot_product_attention"]) == 0
    assert _last_line(capsys) == (
        "attnscale check attnscale:scaled_dot_product_attention: PASS: 0 failed, 0 warnings, 9 passed, 0 not supported"
    )


def test_wrong_scale_fails_with_status_1_and_the_fix(targets, capsys):
    assert main(["check", f"{targets}:no_scale"]) == 1
    out = capsys.readouterr().out
    assert "fix (scale): divide q.k by sqrt(q.size(-1)) before the softmax" in out
    last = out.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"attnscale check {targets}:no_scale: FAIL: 1 failed, ") and last.endswith("(failed: scale)")


def test_fp16_overflow_alone_is_a_warning_with_status_3(targets, capsys):
    assert main(["check", f"{targets}:plain_fp16"]) == 3
    out = capsys.readouterr().out
    assert "warn" in out and "fix (" not in out
    assert out.rstrip("\n").splitlines()[-1] == f"attnscale check {targets}:plain_fp16: WARN: 0 failed, 1 warnings, 8 passed, 0 not supported"


def test_quiet_prints_only_the_summary(targets, capsys):
    assert main(["check", "--quiet", f"{targets}:plain_fp16"]) == 3
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_check_json_has_the_status_and_every_check(targets, capsys):
    assert main(["check", "--json", f"{targets}:plain_fp16"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "attnscale.check/1" and data["status"] == "WARN" and data["exit_code"] == 3
    assert data["ok"] is True and data["warnings"] == ["fp16 overflow"] and data["failures"] == []
    kinds = {c["name"]: c["kind"] for c in data["checks"]}
    assert kinds["fp16 overflow"] == kinds["large logits"] == "robustness"
    assert {kinds[n] for n in kinds if n not in ("fp16 overflow", "large logits")} == {"semantics"}
    assert data["scale"]["scale"] and data["diagnosis"] == "1/sqrt(head_dim)"


def test_report_separates_failures_from_warnings(targets):
    import importlib

    module = importlib.import_module(targets)
    report = check_attention(module.plain_fp16)
    assert report.ok and [c.name for c in report.warnings] == ["fp16 overflow"] and report.failures == ()
    wrong = check_attention(module.no_scale)
    assert not wrong.ok and [c.name for c in wrong.failures] == ["scale"]
    assert wrong.checks[0].fix == "divide q.k by sqrt(q.size(-1)) before the softmax"


@pytest.mark.parametrize(
    ("divisor", "fix"),
    [
        (lambda q: q.shape[-1], "divide q.k by sqrt(q.size(-1)) once"),
        (lambda q: math.sqrt(q.shape[-1] * q.shape[-3]), "the per-head dim, not by the model width"),
    ],
    ids=["twice", "d_model"],
)
def test_each_wrong_scale_gets_its_own_fix(divisor, fix):
    def attend(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, scale=1 / divisor(q))

    report = check_attention(attend)
    assert fix in report.checks[0].fix


def test_correct_attention_has_no_fix():
    assert all(c.fix is None for c in check_attention(attnscale.scaled_dot_product_attention).checks)


def test_module_without_known_projection_names_says_how_to_name_them(targets, capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", f"{targets}:layer"])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "projections: expected names of the module's (q, k, v, out) linear layers" in err
    assert "Fix: pass --projections Q,K,V[,OUT]" in err and "linear layers in this module: wq, wk, wv, wo" in err


def test_module_projections_named_on_the_command_line(targets, capsys):
    argv = ["check", f"{targets}:layer", "--projections", "wq,wk,wv,wo", "--num-heads", "4"]
    assert main(argv) == 0
    assert _last_line(capsys) == f"attnscale check {targets}:layer: PASS: scale 0.353553 per head is 1/sqrt(head_dim)"
    assert main(["check", f"{targets}:unscaled_layer", "--projections", "wq,wk,wv,wo", "--num-heads", "4"]) == 1
    out = capsys.readouterr().out
    assert "fix: divide q.k by sqrt(q.size(-1)) before the softmax" in out
    assert out.splitlines()[-1].startswith(f"attnscale check {targets}:unscaled_layer: FAIL: scale 1 per head is no scale")


def test_module_without_head_count_asks_for_num_heads(targets, capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", f"{targets}:layer", "--projections", "wq,wk,wv,wo"])
    assert info.value.code == 2
    assert "Fix: pass --num-heads N" in " ".join(capsys.readouterr().err.split())


def test_module_json(targets, capsys):
    assert main(["check", f"{targets}:layer", "--projections", "wq,wk,wv,wo", "--num-heads", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "PASS" and data["head_dim"] == 8 and data["num_heads"] == 4 and data["fix"] is None
    assert data["scale"] == pytest.approx([1 / math.sqrt(8)] * 4, rel=1e-9)


def test_projections_with_a_callable_target_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", "attnscale:scaled_dot_product_attention", "--projections", "a,b,c"])
    assert info.value.code == 2
    assert "--projections: expected only with an nn.Module TARGET" in capsys.readouterr().err


def test_torch_passes_quietly(capsys):
    assert main(["check", "torch.nn.functional:scaled_dot_product_attention", "-q"]) == 0
    assert "PASS" in capsys.readouterr().out


NOISY = '''
import torch
import torch.nn.functional as F

print("importing the noisy target")


def attention(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    print("called with", tuple(q.shape))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


class Layer(torch.nn.MultiheadAttention):
    def forward(self, *args, **kwargs):
        print("layer called")
        return super().forward(*args, **kwargs)


layer = Layer(32, 4, batch_first=True)
'''


@pytest.mark.parametrize("attribute", ["attention", "layer"])
def test_json_holds_nothing_but_the_json_when_the_target_prints(attribute, tmp_path, monkeypatch, capsys):
    name = f"noisy_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(NOISY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["check", f"{name}:{attribute}", "--json"])
    data = json.loads(capsys.readouterr().out)  # the whole of stdout is one JSON document
    assert data["exit_code"] == code
    assert data["target_output"].startswith("importing the noisy target\n")
    assert ("called with" if attribute == "attention" else "layer called") in data["target_output"]
