import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale.variants import LearnedTemperature, temperature_qk


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def oracle(q, k, v, head_scales):
    """Softmax attention head by head in float64, head h's logits multiplied by head_scales[h]."""
    H, Hkv = q.shape[-3], k.shape[-3]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for h in range(H):
        logits = head_scales[h] * q[..., h, :, :] @ np.swapaxes(k[..., h // (H // Hkv), :, :], -1, -2)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[..., h, :, :] = (w / w.sum(-1, keepdims=True)) @ v[..., h // (H // Hkv), :, :]
    return out


def test_init_is_standard_attention():
    temp = LearnedTemperature(num_heads=6, head_dim=20).double()
    assert temp.log_scale.detach().tolist() == pytest.approx([math.log(20**-0.5)] * 6)
    q, k, v = randn(2, 6, 5, 20), randn(2, 3, 7, 20, seed=1), randn(2, 3, 7, 4, seed=2)
    out = attnscale.scaled_dot_product_attention(*temp(q, k), v, scale=temp.effective_scale, enable_gqa=True)
    want = attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-7)  # the log-scale is a float32 parameter
    exact = attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=math.exp(temp.log_scale[0].item()))
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-12)


def test_per_head_oracle_and_gradient():
    temp = LearnedTemperature(num_heads=4, head_dim=8).double()
    with torch.no_grad():
        temp.log_scale.copy_(torch.tensor([-2.0, -1.0, 0.0, 1.0]))
    q, k, v = randn(1, 4, 6, 8, seed=3), randn(1, 2, 6, 8, seed=4), randn(1, 2, 6, 3, seed=5)
    out = attnscale.scaled_dot_product_attention(*temp(q, k), v, scale=temp.effective_scale, enable_gqa=True, is_causal=True)
    # causal oracle: every row of the oracle sees a prefix
    for i in range(6):
        want = oracle(q[..., i : i + 1, :].numpy(), k[..., : i + 1, :].numpy(), v[..., : i + 1, :].numpy(), np.exp([-2.0, -1.0, 0.0, 1.0]))
        np.testing.assert_allclose(out[..., i : i + 1, :].detach().numpy(), want, rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    assert temp.log_scale.grad is not None and (temp.log_scale.grad != 0).all()


def test_bad_input():
    with pytest.raises(ValueError, match="log_scale"):
        temperature_qk(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(3))
    with pytest.raises(ValueError, match="num_heads"):
        LearnedTemperature(num_heads=0, head_dim=8)
    with pytest.raises(ValueError, match="head_dim"):
        LearnedTemperature(2, 8)(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
