import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale import reference
from attnscale.variants import DoubleShrinkWarning, QKNorm, normalize_qk


def norm_oracle(x: np.ndarray, kind: str, eps: float, gain=None, bias=None) -> np.ndarray:
    if kind == "l2":
        return x / np.maximum(np.sqrt((x * x).sum(-1, keepdims=True)), eps)
    if kind == "layer":
        x = x - x.mean(-1, keepdims=True)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = y * (1.0 if gain is None else gain)
    return y + (0.0 if bias is None else bias)


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("scale", ["inverse_sqrt", "none", "learned"])
def test_oracle_gqa(kind, scale):
    D = 24
    norm = QKNorm(D, kind=kind, scale=scale).double()
    with torch.no_grad():
        for p in norm.parameters():
            p.mul_(1.5).add_(0.3)
    q, k, v = 3 * randn(2, 6, 7, D, seed=1), randn(2, 2, 9, D, seed=2), randn(2, 2, 9, 5, seed=3)
    qn, kn = norm(q, k)
    out = attnscale.scaled_dot_product_attention(qn, kn, v, scale=norm.effective_scale, enable_gqa=True)

    bias = lambda b: None if b is None else b.detach().numpy()  # noqa: E731
    qo = norm_oracle(q.numpy(), kind, 1e-6, norm.q_weight.detach().numpy(), bias(norm.q_bias))
    ko = norm_oracle(k.numpy(), kind, 1e-6, norm.k_weight.detach().numpy(), bias(norm.k_bias))
    logit_scale = {"inverse_sqrt": D**-0.5, "none": 1.0, "learned": None}[scale]
    if scale == "learned":
        logit_scale = norm.logit_scale.item()
        assert logit_scale == pytest.approx(D**-0.5 * 1.5 + 0.3, rel=1e-6)
    want = reference.attention(qo, ko, v.numpy(), scale=logit_scale)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=0, atol=1e-10)


def test_l2_learned_matches_henry_init_and_oracle():
    D, L = 16, 64
    norm = QKNorm(D, kind="l2", scale="learned", seq_len=L).double()
    assert norm.logit_scale.item() == pytest.approx(math.log2(L * L - L))
    assert norm.effective_scale == 1.0
    q, k, v = randn(1, 4, 5, D, seed=4), randn(1, 1, 6, D, seed=5), randn(1, 1, 6, 3, seed=6)
    qn, kn = norm(q, k)
    out = attnscale.scaled_dot_product_attention(qn, kn, v, scale=norm.effective_scale, enable_gqa=True)
    g = norm.logit_scale.item()  # the float32 parameter's value
    want = reference.attention(norm_oracle(q.numpy(), "l2", 1e-6), norm_oracle(k.numpy(), "l2", 1e-6), v.numpy(), scale=g)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=0, atol=1e-10)
    out.sum().backward()
    assert norm.logit_scale.grad is not None and norm.logit_scale.grad != 0


def test_l2_with_inverse_sqrt_warns_and_double_shrinks():
    D = 64
    with pytest.warns(DoubleShrinkWarning, match="2/sqrt"):
        norm = QKNorm(D, kind="l2", scale="inverse_sqrt")
    assert issubclass(DoubleShrinkWarning, UserWarning)
    q = randn(1, 1, 1, D, seed=7)
    k = torch.cat((q, -q, 5 * randn(1, 1, 30, D, seed=8)), dim=-2)  # best and worst possible keys
    qn, kn = norm(q, k)
    logits = norm.effective_scale * (qn @ kn.transpose(-1, -2))  # (1, 1, 1, 32)
    gap = float(logits.max() - logits.min())
    assert gap == pytest.approx(2 / math.sqrt(D), abs=1e-12)
    p = torch.softmax(logits, dim=-1)
    assert float(p.max()) < 1.3 / 32  # nearly uniform over 32 keys even for a perfect match


def test_rms_learned_init_is_standard_scale():
    norm_fixed, norm_learned = QKNorm(16, kind="rms"), QKNorm(16, kind="rms", scale="learned")
    q, k, v = randn(2, 4, 5, 16, dtype=torch.float32), randn(2, 2, 5, 16, seed=1, dtype=torch.float32), randn(2, 2, 5, 16, seed=2, dtype=torch.float32)
    a = attnscale.scaled_dot_product_attention(*norm_fixed(q, k), v, scale=norm_fixed.effective_scale, enable_gqa=True)
    b = attnscale.scaled_dot_product_attention(*norm_learned(q, k), v, scale=norm_learned.effective_scale, enable_gqa=True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_functional_and_half_precision():
    q, k = randn(1, 2, 3, 8, dtype=torch.float16), randn(1, 2, 3, 8, seed=1, dtype=torch.float16)
    qn, kn = normalize_qk(q, k, kind="rms")
    assert qn.dtype == torch.float16
    torch.testing.assert_close(qn.float().pow(2).mean(-1), torch.ones(1, 2, 3), rtol=0, atol=2e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="batch"), "kind"),
        (dict(scale="sqrt"), "scale"),
        (dict(kind="l2", scale="learned"), "seq_len"),
        (dict(scale_init=1.0), "scale_init"),
        (dict(scale="learned", scale_init=-1.0), "scale_init"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QKNorm(8, **kwargs)
    with pytest.raises(ValueError, match="head_dim"):
        QKNorm(8)(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
