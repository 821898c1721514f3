import numpy as np
import pytest
import torch

import attnscale
from attnscale import reference
from attnscale.variants import RopeLayout, RotaryEmbedding, apply_rope, rope_qk


def rope_oracle(x: np.ndarray, positions: np.ndarray, base: float, rotary_dim: int, layout: str) -> np.ndarray:
    """Per-pair 2x2 rotation matrices, one pair at a time, in float64."""
    out = np.array(x, dtype=np.float64)
    half = rotary_dim // 2
    for i in range(half):
        a, b = (i, i + half) if layout == "half" else (2 * i, 2 * i + 1)
        theta = positions * base ** (-2.0 * i / rotary_dim)  # (L,)
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        xa, xb = x[..., :, a : a + 1], x[..., :, b : b + 1]
        out[..., :, a : a + 1] = c * xa - s * xb
        out[..., :, b : b + 1] = s * xa + c * xb
    return out


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 8, 24])
def test_matches_oracle(layout, rotary_dim):
    x = randn(2, 3, 7, 24)
    got = apply_rope(x, offset=5, base=500.0, rotary_dim=rotary_dim, layout=layout)
    want = rope_oracle(x.numpy(), np.arange(5, 12, dtype=np.float64), 500.0, rotary_dim or 24, layout)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", list(RopeLayout))
def test_norms_preserved(layout):
    x = randn(2, 4, 9, 16)
    torch.testing.assert_close(apply_rope(x, offset=1000, layout=layout).norm(dim=-1), x.norm(dim=-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", list(RopeLayout))
def test_score_depends_only_on_relative_offset(layout):
    q, k = randn(1, 1, 1, 32, seed=1), randn(1, 1, 1, 32, seed=2)
    scores = []
    for shift in (0, 7, 1234):
        qr = apply_rope(q, offset=3 + shift, layout=layout)
        kr = apply_rope(k, offset=11 + shift, layout=layout)
        scores.append(float((qr * kr).sum()))
    assert scores[0] == pytest.approx(scores[1], abs=1e-10) == pytest.approx(scores[2], abs=1e-10)
    assert scores[0] != pytest.approx(float((q * k).sum()), abs=1e-3)  # the offset does matter


def test_scale_commutes_with_rotation_and_attention_uses_default_scale():
    q, k, v = randn(2, 4, 6, 16, seed=3), randn(2, 2, 6, 16, seed=4), randn(2, 2, 6, 5, seed=5)
    c = 16**-0.5
    torch.testing.assert_close(apply_rope(c * q, offset=2), c * apply_rope(q, offset=2), rtol=0, atol=1e-14)
    qr, kr = rope_qk(q, k)
    out = attnscale.scaled_dot_product_attention(qr, kr, v, is_causal=True, enable_gqa=True)
    want = reference.attention(qr.numpy(), kr.numpy(), v.numpy(), is_causal=True)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-12)


def test_layouts_agree_up_to_a_permutation():
    r = 12
    perm = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, 20)))  # interleaved -> half
    x = randn(2, 3, 5, 20)
    half = apply_rope(x[..., perm], offset=4, rotary_dim=r, layout="half")
    interleaved = apply_rope(x, offset=4, rotary_dim=r, layout="interleaved")
    torch.testing.assert_close(half, interleaved[..., perm], rtol=0, atol=1e-14)


@pytest.mark.parametrize("layout", list(RopeLayout))
def test_partial_rotary_leaves_tail_unchanged(layout):
    x = randn(2, 3, 5, 32)
    y = apply_rope(x, offset=9, rotary_dim=8, layout=layout)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[..., :8], x[..., :8])


def test_kv_cache_offset_matches_full_sequence():
    x = randn(1, 2, 10, 16)
    full = apply_rope(x)
    torch.testing.assert_close(apply_rope(x[..., 6:, :], offset=6), full[..., 6:, :], rtol=0, atol=1e-12)


def test_module_low_precision_and_gradients():
    rope = RotaryEmbedding(16, rotary_dim=8, layout="interleaved")
    assert rope.effective_scale == 0.25
    q = randn(1, 4, 5, 16, dtype=torch.float32).requires_grad_()
    k = randn(1, 2, 5, 16, seed=1, dtype=torch.float32).requires_grad_()
    qr, kr = rope(q, k, offset=3)
    ((qr[..., :1, :] * kr[..., :1, :].repeat(1, 2, 1, 1)).sum()).backward()
    assert q.grad is not None and k.grad is not None and torch.isfinite(q.grad).all()
    half = rope(q.detach().half(), k.detach().half())[0]
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), rope(q.detach(), k.detach())[0], rtol=0, atol=4e-3)
    x64 = randn(1, 1, 1, 64)
    big = apply_rope(x64.float(), offset=10**6)  # float64 angles: no phase loss at long positions
    want = rope_oracle(x64.float().double().numpy(), np.array([1e6]), 10000.0, 64, "half")
    np.testing.assert_allclose(big.numpy(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(rotary_dim=7), ValueError, "rotary_dim"),
        (dict(rotary_dim=40), ValueError, "rotary_dim"),
        (dict(layout="neox"), ValueError, "layout"),
        (dict(offset=-1), ValueError, "offset"),
        (dict(base=0.0), ValueError, "base"),
        (dict(positions=torch.arange(3)), ValueError, "positions"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        apply_rope(torch.zeros(1, 1, 4, 32), **kwargs)
