import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale.variants import PerformerAttention, favor_attention, gaussian_features


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def favor_oracle(q, k, v, W, causal):
    """The FAVOR+ estimator written out in float64, no stabilisation, quadratic in L."""
    D, m = q.shape[-1], W.shape[0]
    phi = lambda x: np.exp(x @ W.T - (x * x).sum(-1, keepdims=True) / 2) / math.sqrt(m)  # noqa: E731
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    w = phi(q * D**-0.25) @ np.swapaxes(phi(k * D**-0.25), -1, -2)  # (..., H, L, S): estimates exp(q.k / sqrt(D))
    if causal:
        w = np.tril(w)
    return (w @ v) / w.sum(-1, keepdims=True)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_unstabilised_oracle_gqa(causal):
    q, k, v = 0.7 * randn(2, 6, 21, 10), 0.7 * randn(2, 2, 21, 10, seed=1), randn(2, 2, 21, 4, seed=2)
    W = gaussian_features(40, 10, generator=torch.Generator().manual_seed(3))
    got = favor_attention(q, k, v, W, is_causal=causal, chunk_size=8, eps=0.0)
    np.testing.assert_allclose(got.numpy(), favor_oracle(q.numpy(), k.numpy(), v.numpy(), W.numpy(), causal), rtol=0, atol=1e-11)


def relative_error(m: int, seed: int, causal: bool) -> float:
    g = torch.Generator().manual_seed(100 + seed)
    q = 0.5 * torch.randn(1, 4, 48, 16, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(1, 2, 48, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 48, 8, generator=g, dtype=torch.float64)
    W = gaussian_features(m, 16, generator=torch.Generator().manual_seed(seed))
    approx = favor_attention(q, k, v, W, is_causal=causal)
    exact = attnscale.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return float((approx - exact).norm() / exact.norm())


@pytest.mark.parametrize("causal", [False, True])
def test_error_falls_as_features_grow(causal):
    ms = (8, 32, 128, 512)
    errors = [np.mean([relative_error(m, seed, causal) for seed in range(4)]) for m in ms]
    # ~ m^(-1/2): each 4x more features should roughly halve the error; demand at least 0.8x per step
    for before, after in zip(errors, errors[1:]):
        assert after < 0.8 * before, errors
    assert errors[-1] < 0.35 * errors[0], errors


def test_orthogonal_blocks_and_marginal_norms():
    W = gaussian_features(40, 16, generator=torch.Generator().manual_seed(0))
    block = W[:16] / W[:16].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-12)
    norms = gaussian_features(4096, 16, generator=torch.Generator().manual_seed(1)).norm(dim=-1)
    assert float(norms.pow(2).mean()) == pytest.approx(16, rel=0.05)  # E|w|^2 = D as for N(0, I_D)


def test_seeded_redraw():
    a, b = PerformerAttention(8, 32, seed=5), PerformerAttention(8, 32, seed=5)
    assert torch.equal(a.projection, b.projection)
    first = a.projection.clone()
    a.redraw()
    assert not torch.equal(a.projection, first)
    b.redraw()
    assert torch.equal(a.projection, b.projection)  # the same seeded stream
    a.redraw(seed=5)
    assert torch.equal(a.projection, first)


def test_stabilised_against_overflow_and_differentiable():
    favor = PerformerAttention(16, 64, seed=0)
    q = (20 * randn(1, 2, 12, 16, dtype=torch.float32)).requires_grad_()
    k = (20 * randn(1, 2, 12, 16, seed=1, dtype=torch.float32)).requires_grad_()
    v = randn(1, 2, 12, 4, seed=2, dtype=torch.float32)
    with torch.no_grad():
        raw = (q * 16**-0.25) @ favor.projection.float().T
    assert torch.isinf(torch.exp(raw)).any()  # the unstabilised features would overflow
    out = favor(q, k, v, is_causal=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_bad_input():
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="projection"):
        favor_attention(q, q, q, torch.zeros(16, 4))
    with pytest.raises(ValueError, match="key"):
        favor_attention(q, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(16, 8), is_causal=True)
    with pytest.raises(ValueError, match="num_features"):
        PerformerAttention(8, 0)
