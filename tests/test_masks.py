"""Masks and ALiBi: causal (both alignments), sliding windows, padding, slopes and bias."""

from __future__ import annotations

import math

import pytest
import torch

import attnscale
from attnscale.masks import query_offset, visible


def press_slopes(n: int) -> list[float]:
    """ALiBi slopes as written in Press et al.'s reference code (ofirpress/attention_with_linear_biases)."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest_power_of_2) + press_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]


def brute_visible(L: int, S: int, offset: int, *, causal: bool = False, window=None) -> torch.Tensor:
    """Visibility by the definition, one (i, j) at a time."""
    out = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        a = i + offset
        for j in range(S):
            ok = not causal or j <= a
            if window is not None:
                left, right = window
                ok = ok and (left is None or j >= a - left) and (right is None or j <= a + right)
            out[i, j] = ok
    return out


# ALiBi slopes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64])
def test_alibi_slopes_powers_of_two_are_a_geometric_sequence(n):
    expected = torch.tensor([2.0 ** (-8.0 * h / n) for h in range(1, n + 1)])
    torch.testing.assert_close(attnscale.alibi_slopes(n), expected, rtol=1e-7, atol=0)


def test_alibi_slopes_paper_values():
    # Press et al. (2021), section 3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    torch.testing.assert_close(attnscale.alibi_slopes(8), torch.tensor([1 / 2**h for h in range(1, 9)]), rtol=0, atol=0)
    # Not a power of two: the 4-head slopes, then every other 8-head slope.
    torch.testing.assert_close(
        attnscale.alibi_slopes(6), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]), rtol=0, atol=0
    )
    torch.testing.assert_close(
        attnscale.alibi_slopes(12)[8:], torch.tensor([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]), rtol=1e-7, atol=0
    )


@pytest.mark.parametrize("n", list(range(1, 41)) + [48, 96, 100])
def test_alibi_slopes_match_the_authors_reference_code(n):
    slopes = attnscale.alibi_slopes(n)
    assert slopes.shape == (n,) and slopes.dtype == torch.float32
    torch.testing.assert_close(slopes, torch.tensor(press_slopes(n)), rtol=1e-6, atol=0)
    assert len(set(slopes.tolist())) == n and (slopes > 0).all() and (slopes < 1).all()


@pytest.mark.parametrize(("n", "exc"), [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError), ("8", TypeError)])
def test_alibi_slopes_bad_head_count(n, exc):
    with pytest.raises(exc, match=r"^num_heads: expected .*Fix: "):
        attnscale.alibi_slopes(n)


# ALiBi bias -------------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_alibi_bias_values(alignment):
    slopes = attnscale.alibi_slopes(3)
    L, S = 3, 6
    bias = attnscale.alibi_bias(slopes, L, S, alignment=alignment)
    assert bias.shape == (3, L, S) and bias.dtype == torch.float32
    offset = 0 if alignment == "top_left" else S - L
    for h in range(3):
        for i in range(L):
            for j in range(S):
                assert bias[h, i, j].item() == pytest.approx(-slopes[h].item() * abs(i + offset - j))
    # Zero where the key sits at the query's aligned position, and never positive.
    assert (bias <= 0).all()
    assert torch.equal(bias[:, torch.arange(L), torch.arange(L) + offset], torch.zeros(3, L))


def test_alibi_bias_batched_slopes_and_dtype():
    slopes = torch.rand(2, 4, dtype=torch.float64)  # (B, H)
    bias = attnscale.alibi_bias(slopes, 5, 5)
    assert bias.shape == (2, 4, 5, 5) and bias.dtype == torch.float64
    torch.testing.assert_close(bias[1, 2], attnscale.alibi_bias(slopes[1, 2:3], 5, 5)[0])


def test_alibi_bias_is_what_attention_adds_after_the_scale():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    slopes = attnscale.alibi_slopes(4).double()
    with_slopes = attnscale.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, scale=0.3)
    as_mask = attnscale.scaled_dot_product_attention(q, k, v, attn_mask=attnscale.alibi_bias(slopes, 5, 5), scale=0.3)
    torch.testing.assert_close(with_slopes, as_mask, rtol=0, atol=1e-12)


# Causal masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("L", "S"), [(1, 1), (4, 4), (2, 5), (5, 2), (1, 7), (7, 1)])
def test_causal_mask_both_alignments(L, S):
    top_left = attnscale.causal_mask(L, S)
    bottom_right = attnscale.causal_mask(L, S, alignment="bottom_right")
    assert top_left.dtype == torch.bool and top_left.shape == (L, S)
    assert torch.equal(top_left, torch.ones(L, S, dtype=torch.bool).tril())
    assert torch.equal(bottom_right, torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L))
    assert torch.equal(top_left, brute_visible(L, S, 0, causal=True))
    assert torch.equal(bottom_right, brute_visible(L, S, S - L, causal=True))
    assert bottom_right[-1].all()  # the last query sees every key
    if L == S:
        assert torch.equal(top_left, bottom_right)


def test_causal_mask_bottom_right_with_more_queries_than_keys_leaves_empty_rows():
    mask = attnscale.causal_mask(5, 2, alignment="bottom_right")
    assert not mask[:3].any() and torch.equal(mask[3:], torch.tensor([[True, False], [True, True]]))


def test_causal_mask_matches_torch_is_causal():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 6, 4, generator=gen), torch.randn(1, 2, 6, 4, generator=gen)
    F = torch.nn.functional
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, attn_mask=attnscale.causal_mask(3, 6)),
    )


def test_query_offset():
    assert query_offset(2, 5, "top_left") == 0
    assert query_offset(2, 5, attnscale.CausalAlignment.BOTTOM_RIGHT) == 3
    assert query_offset(5, 2, "bottom_right") == -3


# Sliding windows --------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [(0, 0), (1, 0), (2, 1), (None, 0), (0, None), (None, None), (3, 3), (-1, 1), (1, -1)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize(("L", "S"), [(4, 4), (3, 7), (6, 2)])
def test_sliding_window_mask_matches_the_definition(window, alignment, L, S):
    mask = attnscale.sliding_window_mask(L, S, window, alignment=alignment)
    normalised = tuple(None if w == -1 else w for w in window)
    assert mask.shape == (L, S) and mask.dtype == torch.bool
    assert torch.equal(mask, brute_visible(L, S, query_offset(L, S, alignment), window=normalised))


def test_sliding_window_mask_special_cases():
    assert torch.equal(attnscale.sliding_window_mask(4, 4, (0, 0)), torch.eye(4, dtype=torch.bool))
    assert attnscale.sliding_window_mask(3, 5, (None, None)).all()
    assert torch.equal(attnscale.sliding_window_mask(4, 4, (None, 0)), attnscale.causal_mask(4, 4))
    assert torch.equal(attnscale.sliding_window_mask(4, 4, (-1, 0)), attnscale.causal_mask(4, 4))


@pytest.mark.parametrize("window", [(1, 0), (2, 1), (-1, 0)])
def test_window_option_equals_the_window_mask(window):
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 2, 5, 4, generator=gen), torch.randn(1, 2, 7, 4, generator=gen), torch.randn(1, 2, 7, 4, generator=gen)
    for alignment in ("top_left", "bottom_right"):
        mask = attnscale.sliding_window_mask(5, 7, window, alignment=alignment)
        torch.testing.assert_close(
            attnscale.scaled_dot_product_attention(q, k, v, window=window, causal_alignment=alignment),
            attnscale.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        )


def test_visible_combines_causal_and_window_and_is_none_when_nothing_is_hidden():
    q_pos, k_pos = torch.arange(4)[:, None], torch.arange(6)[None, :]
    assert visible(q_pos, k_pos) is None
    assert visible(q_pos, k_pos, window=(None, None)) is None
    both = visible(q_pos, k_pos, causal=True, window=(1, 5))
    assert torch.equal(both, brute_visible(4, 6, 0, causal=True, window=(1, 5)))


# Padding ----------------------------------------------------------------------------------------


def test_padding_mask_values_and_shape():
    mask = attnscale.padding_mask(torch.tensor([2, 0, 5]), 5)
    assert mask.shape == (3, 1, 1, 5) and mask.dtype == torch.bool
    expected = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[:, 0, 0], expected)


def test_padding_mask_hides_padded_keys_in_attention():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 0, 6])
    q, k, v = torch.randn(3, 2, 4, 8, generator=gen), torch.randn(3, 2, 6, 8, generator=gen), torch.randn(3, 2, 6, 8, generator=gen)
    out = attnscale.scaled_dot_product_attention(q, k, v, attn_mask=attnscale.padding_mask(lengths, 6))
    for b, n in enumerate(lengths.tolist()):
        expected = attnscale.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        torch.testing.assert_close(out[b : b + 1], expected)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # a sequence with no real key


def test_masks_are_created_on_the_requested_device():
    for mask in (
        attnscale.causal_mask(3, 4, device="meta"),
        attnscale.sliding_window_mask(3, 4, (1, 1), device="meta"),
        attnscale.padding_mask(torch.tensor([1, 2], device="meta"), 4),
        attnscale.alibi_bias(torch.ones(2, device="meta"), 3, 4),
    ):
        assert mask.device.type == "meta"
