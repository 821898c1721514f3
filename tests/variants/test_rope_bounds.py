"""RoPE positions must be exact in the float64 angle computation: |position| <= 2**53."""

import numpy as np
import pytest
import torch

from attnscale.variants import RotaryEmbedding, apply_rope, rope_angles, rope_qk


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --- RoPE positions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [2**63, 2**62, 2**53])
def test_rope_offset_beyond_float64_exact_integers(offset):
    with pytest.raises(ValueError, match=r"^offset: expected an int with offset \+ L - 1 <= 2\*\*53 = 9007199254740992 .* got offset = \d+ with L = 4\. Fix: "):
        apply_rope(torch.zeros(1, 1, 4, 8), offset=offset)
    with pytest.raises(ValueError, match="^offset: "):
        rope_qk(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), offset=offset)
    with pytest.raises(ValueError, match="^offset: "):
        RotaryEmbedding(8)(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), offset=offset)


def test_rope_offset_at_the_bound_is_exact():
    x = randn(1, 1, 4, 2, dtype=torch.float64)
    offset = 2**53 - 3  # last position 2**53
    got = apply_rope(x, offset=offset)
    theta = np.array([float(offset + i) for i in range(4)])  # rotary_dim 2: one pair at frequency 1
    c, s = np.cos(theta), np.sin(theta)
    a, b = x[0, 0, :, 0].numpy(), x[0, 0, :, 1].numpy()
    np.testing.assert_allclose(got[0, 0].numpy(), np.stack((c * a - s * b, s * a + c * b), axis=-1), rtol=0, atol=1e-12)


def test_rope_offset_accepts_numpy_ints():
    x = randn(1, 2, 4, 8)
    assert torch.equal(apply_rope(x, offset=np.int64(7)), apply_rope(x, offset=7))


@pytest.mark.parametrize(
    "positions, exc, match",
    [
        (torch.full((4,), 2**63 - 1), ValueError, r"^positions: expected finite values in \[-2\*\*53, 2\*\*53\]"),
        (torch.tensor([0.0, 1.0, float("nan"), 3.0]), ValueError, "^positions: .* got 1 NaN or out of range"),
        (torch.tensor([0.0, 1.0, float("inf"), 3.0]), ValueError, "^positions: "),
        (torch.ones(4, dtype=torch.bool), TypeError, "^positions: expected an integer or float tensor, got dtype torch.bool"),
        (torch.ones(4, dtype=torch.complex64), TypeError, "^positions: "),
        ([0, 1, 2, 3], TypeError, "^positions: .* got list"),
        (torch.arange(4)[None], ValueError, r"^positions: expected shape \(4,\)"),
        (torch.arange(4, device="meta"), ValueError, "^positions: expected x's device cpu"),
    ],
)
def test_rope_positions_are_checked(positions, exc, match):
    with pytest.raises(exc, match=match):
        apply_rope(torch.zeros(1, 1, 4, 8), positions=positions)


def test_rope_positions_exclude_an_offset_and_may_be_negative():
    x = randn(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="^offset: expected 0 when positions is given"):
        apply_rope(x, positions=torch.arange(4), offset=3)
    torch.testing.assert_close(apply_rope(x, positions=torch.arange(-2, 2)).norm(dim=-1), x.norm(dim=-1), rtol=0, atol=1e-12)


def test_rope_angles_are_checked():
    with pytest.raises(TypeError, match="^positions: "):
        rope_angles([1, 2], 8)
    with pytest.raises(ValueError, match="^positions: "):
        rope_angles(torch.tensor([2**60]), 8)
    with pytest.raises(ValueError, match="^rotary_dim: expected an even int"):
        rope_angles(torch.arange(3), 7)
    with pytest.raises(TypeError, match="^base: "):
        rope_angles(torch.arange(3), 8, base="10000")


def test_rope_names_query_and_key():
    with pytest.raises(TypeError, match="^key: expected a floating torch.Tensor"):
        rope_qk(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="^query: expected at least 3 dims"):
        RotaryEmbedding(8)(torch.tensor(1.0), torch.zeros(1, 1, 4, 8))
    with pytest.raises(ValueError, match="^x: expected an even head dim D when rotary_dim is None"):
        apply_rope(torch.zeros(1, 1, 4, 7))
