import math

import pytest
import torch
import torch.nn.functional as F

import attnscale
from attnscale.diagnostics import diagnose_scale, fit_logit_scale, probe_attention

D, H = 64, 4


def _softmax_attention(divisor):
    return lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / divisor, dim=-1) @ v


@pytest.mark.parametrize(
    ("fn", "expected_scale", "diagnosis"),
    [
        (attnscale.scaled_dot_product_attention, 1 / math.sqrt(D), "1/sqrt(head_dim)"),
        (F.scaled_dot_product_attention, 1 / math.sqrt(D), "1/sqrt(head_dim)"),
        (_softmax_attention(1.0), 1.0, "no scale"),
        (_softmax_attention(math.sqrt(D * H)), 1 / math.sqrt(D * H), "1/sqrt(d_model) (uses the model width)"),
        (_softmax_attention(D), 1 / D, "1/head_dim (scale applied twice, or muP)"),
        (_softmax_attention(3.7), 1 / 3.7, "learned or unusual scale"),
    ],
)
def test_probe_recovers_the_scale_and_names_it(fn, expected_scale, diagnosis):
    fit = probe_attention(fn, head_dim=D, num_heads=H)
    assert fit.mean_scale == pytest.approx(expected_scale, rel=1e-5)
    assert fit.min_r2 > 0.999999
    assert diagnose_scale(fit.mean_scale, D, H) == diagnosis


def test_fit_is_per_head_and_handles_masks_and_gqa():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 16, generator=gen, dtype=torch.float64)
    scales = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    logits = (q * scales[:, None, None]) @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    logits = logits.masked_fill(~attnscale.causal_mask(6, 9, alignment="bottom_right"), float("-inf"))
    fit = fit_logit_scale(q, k, torch.softmax(logits, dim=-1))
    assert fit.scale == pytest.approx(scales.tolist(), rel=1e-9)


def test_a_position_bias_lowers_r2():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 8, 16, generator=gen), torch.randn(1, 1, 8, 16, generator=gen)
    bias = attnscale.alibi_bias(torch.tensor([1.0]), 8, 8)
    weights = torch.softmax(q @ k.transpose(-1, -2) / 4 + bias, dim=-1)
    assert fit_logit_scale(q, k, weights).min_r2 < 0.9


def test_bad_inputs_name_the_argument():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="weights"):
        fit_logit_scale(q, q, torch.rand(1, 2, 3, 5))
    with pytest.raises(ValueError, match="fn"):
        probe_attention(lambda q, k, v: (q, k))
