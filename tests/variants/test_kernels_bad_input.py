"""Bad input to linear, Performer and INT8 attention: a clear error before any compute, or the documented answer (empty, zeros, NaN)."""

import pytest
import torch

import attnscale
from attnscale.variants import (
    PerformerAttention,
    dequantize_int8,
    favor_attention,
    favor_features,
    gaussian_features,
    int8_attention,
    int8_logits,
    kernel_attention,
    linear_attention,
    quantize_int8,
    smooth_keys,
)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


W8 = gaussian_features(16, 8, generator=torch.Generator().manual_seed(0))

ATTENTION = {
    "linear": lambda q, k, v, **kw: linear_attention(q, k, v, **kw),
    "kernel": lambda q, k, v, **kw: kernel_attention(q.exp(), k.exp(), v, **kw),
    "favor": lambda q, k, v, **kw: favor_attention(q, k, v, W8, **kw),
    "performer": lambda q, k, v, **kw: PerformerAttention(8, 16)(q, k, v, **kw),
    "int8": lambda q, k, v, **kw: int8_attention(q, k, v, **kw),
}
Q, K, V = randn(2, 4, 5, 8), randn(2, 2, 5, 8, seed=1), randn(2, 2, 5, 3, seed=2)

# (query, key, value, the argument the error must name: key/phi_k for kernel_attention's names)
SHAPES = {
    "batch mismatch": (Q, randn(3, 2, 5, 8), randn(3, 2, 5, 3), "key", "batch dims broadcastable"),
    "value batch mismatch": (Q, K, randn(3, 2, 5, 3), "key", "batch dims broadcastable"),
    "2-d query": (Q[0, 0], K, V, "query", "at least 3 dims"),
    "5-d query, 4-d key": (Q[None], K, V, "key", "5 dims like the "),
    "3-d value": (Q, K, V[0], "value", "4 dims like the "),
    "head dim mismatch": (Q, randn(2, 2, 5, 7), V, "key", "last dim D = 8"),
    "3 key heads for 4 query heads": (Q, randn(2, 3, 5, 8), randn(2, 3, 5, 3), "key", "dividing the .*4"),
    "value heads differ": (Q, K, randn(2, 1, 5, 3), "value", "Hkv=2"),
    "value length differs": (Q, K, randn(2, 2, 6, 3), "value", "S=5"),
    "D = 0": (randn(2, 4, 5, 0), randn(2, 2, 5, 0), V, "query", "D >= 1"),
    "key on another device": (Q, K.to("meta"), V, "key", "device"),
    "value dtype": (Q, K, V.double(), "value", "dtype"),
}


def expected_name(variant, name):
    return {"query": "phi_q", "key": "phi_k"}.get(name, name) if variant == "kernel" else name


@pytest.mark.parametrize("variant", list(ATTENTION))
@pytest.mark.parametrize("case", list(SHAPES))
def test_bad_shapes_name_the_argument(variant, case):
    q, k, v, name, what = SHAPES[case]
    if variant == "performer" and case == "D = 0":
        name = "query"  # the module checks its head_dim first
        what = "head_dim = 8"
    with pytest.raises((ValueError, TypeError), match=rf"^{expected_name(variant, name)}: expected .*{what}.*Fix: ") as info:
        ATTENTION[variant](q, k, v)
    assert type(info.value) in (ValueError, TypeError)


@pytest.mark.parametrize("variant", list(ATTENTION))
def test_broadcast_batch_matches_expanded(variant):
    got = ATTENTION[variant](Q, K[:1], V[:1])
    want = ATTENTION[variant](Q, K[:1].expand(2, -1, -1, -1), V[:1].expand(2, -1, -1, -1))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("variant", list(ATTENTION))
@pytest.mark.parametrize("causal", [False, True])
def test_no_keys_gives_zeros_like_softmax_attention(variant, causal):
    L = 0 if causal else 5  # causal needs L == S
    q, k, v = randn(2, 4, L, 8).requires_grad_(), randn(2, 2, 0, 8, seed=1), randn(2, 2, 0, 3, seed=2)
    out = ATTENTION[variant](q, k, v, is_causal=causal)
    want = attnscale.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert out.shape == want.shape == (2, 4, L, 3)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(want, torch.zeros_like(want))
    out.sum().backward()  # still part of the graph


@pytest.mark.parametrize("variant", list(ATTENTION))
def test_no_queries_gives_an_empty_output(variant):
    assert ATTENTION[variant](randn(2, 4, 0, 8), K, V).shape == (2, 4, 0, 3)


@pytest.mark.parametrize("fn", [linear_attention, lambda q, k, v, **kw: kernel_attention(q.exp(), k.exp(), v, **kw)])
def test_no_keys_is_zero_not_nan_without_eps(fn):
    out = fn(Q, K[..., :0, :], V[..., :0, :], eps=0.0)
    assert torch.equal(out, torch.zeros(2, 4, 5, 3))


def test_kernel_attention_checks_its_options():
    f = Q.exp()
    for kwargs, exc, name in [
        (dict(chunk_size=0, is_causal=True), ValueError, "chunk_size"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(is_causal="yes"), TypeError, "is_causal"),
    ]:
        with pytest.raises(exc, match=f"^{name}: "):
            kernel_attention(f, K.exp(), V, **kwargs)


# --- Performer's projection --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "projection, exc, match",
    [
        (W8.long(), TypeError, r"projection: expected a floating tensor \(m, D = 8\), got dtype torch.int64"),
        (W8.tolist(), TypeError, "projection: .* got list"),
        (torch.zeros(0, 8), ValueError, r"projection: expected shape \(m, D = 8\) with m >= 1, got shape \(0, 8\)"),
        (W8[None], ValueError, r"got shape \(1, 16, 8\)"),
        (W8[:, :4], ValueError, r"got shape \(16, 4\)"),
        (W8.to("meta"), ValueError, "projection: expected the query's device cpu"),
    ],
)
def test_projection_is_checked(projection, exc, match):
    with pytest.raises(exc, match=match):
        favor_attention(Q, K, V, projection)
    with pytest.raises(exc, match=match.replace("the query's", "x's")):
        favor_features(Q, projection, is_query=True)


def test_favor_features_of_no_keys_is_empty():
    assert favor_features(randn(2, 2, 0, 8), W8, is_query=False).shape == (2, 2, 0, 16)


def test_gaussian_features_checks_its_options():
    with pytest.raises(TypeError, match="^orthogonal: "):
        gaussian_features(4, 8, orthogonal=1)
    with pytest.raises(TypeError, match="^generator: expected None or a torch.Generator, got str"):
        gaussian_features(4, 8, generator="seed")
    with pytest.raises(ValueError, match="^query: expected last dim head_dim = 4"):
        PerformerAttention(4, 16)(Q, K, V)


# --- INT8: NaN and inf are never quantised into finite rows --------------------------------------------


def float_attention(q, k, v, causal):
    return attnscale.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, backend="math")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("smooth", [False, True])
def test_int8_non_finite_query_row_is_nan_and_spares_the_others(bad, smooth):
    q, k, v = randn(1, 2, 40, 16), randn(1, 2, 40, 16, seed=1), randn(1, 2, 40, 4, seed=2)
    q[0, 1, 7, 3] = bad
    out = int8_attention(q, k, v, smooth_k=smooth, block_q=16)
    assert torch.isnan(out[0, 1, 7]).all()
    assert torch.isnan(float_attention(q, k, v, False)[0, 1, 7]).all()  # float attention: NaN there too
    clean = q.clone()
    clean[0, 1, 7] = 0.0  # the non-finite row is left out of its block's quantisation scale
    want = int8_attention(clean, k, v, smooth_k=smooth, block_q=16)
    others = torch.ones(2, 40, dtype=torch.bool)
    others[1, 7] = False
    assert torch.equal(out[0][others], want[0][others])


@pytest.mark.parametrize("smooth", [False, True])
def test_int8_nan_key_reaches_exactly_the_rows_that_see_it(smooth):
    q, k, v = randn(1, 4, 30, 16), randn(1, 2, 30, 16, seed=1), randn(1, 2, 30, 4, seed=2)
    k[0, 1, 12, 5] = float("nan")
    out = int8_attention(q, k, v, is_causal=True, smooth_k=smooth, block_k=8)
    ref = float_attention(q, k, v, True)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.isnan(out[0, 2:, 12:]).all() and not torch.isnan(out[0, 2:, :12]).any()  # heads 2, 3 read key head 1
    finite = ~torch.isnan(ref)
    assert (out[finite] - ref[finite]).abs().max() < 0.05  # the usual INT8 error on the untouched rows


def test_int8_logits_mark_non_finite_rows_and_columns():
    q, k = randn(1, 2, 6, 8), randn(1, 1, 5, 8, seed=1)
    q[0, 0, 2, 0] = float("nan")
    k[0, 0, 4, 1] = float("inf")
    logits = int8_logits(q, k)
    nan = torch.zeros(1, 2, 6, 5, dtype=torch.bool)
    nan[0, 0, 2, :] = True
    nan[..., 4] = True
    assert torch.equal(torch.isnan(logits), nan)


def test_int8_nan_value_propagates():
    v = V.clone()
    v[0, 0, 3, 1] = float("nan")
    assert torch.isnan(int8_attention(Q, K, v)[0, :2, :, 1]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_int8_refuses_non_finite(bad):
    x = randn(2, 5, 8)
    x[1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"^x: expected finite values \(INT8 has no NaN or inf\), got 1 non-finite entries"):
        quantize_int8(x, block_size=2)


def test_quantize_int8_of_no_rows():
    values, scales = quantize_int8(randn(2, 0, 8), block_size=4)
    assert values.shape == (2, 0, 8) and scales.shape == (2, 0)
    assert dequantize_int8(values, scales, block_size=4).shape == (2, 0, 8)


@pytest.mark.parametrize(
    "values, scales, block_size, exc, match",
    [
        (torch.zeros(2, 5, 8), torch.ones(2, 3), 2, TypeError, r"^values: expected an int8 tensor"),
        ([1], torch.ones(1), 1, TypeError, r"^values: .* got list"),
        (torch.zeros(2, 5, 8, dtype=torch.int8), torch.ones(2, 7), 2, ValueError, r"^scales: expected shape \(2, 3\)"),
        (torch.zeros(2, 5, 8, dtype=torch.int8), torch.ones(2, 3, dtype=torch.long), 2, TypeError, r"^scales: "),
        (torch.zeros(2, 5, 8, dtype=torch.int8), torch.ones(2, 3), 0, ValueError, r"^block_size: "),
        (torch.zeros(2, 5, 8, dtype=torch.int8), torch.ones(2, 3, device="meta"), 2, ValueError, r"^scales: expected the values' device"),
    ],
)
def test_dequantize_int8_is_checked(values, scales, block_size, exc, match):
    with pytest.raises(exc, match=match):
        dequantize_int8(values, scales, block_size=block_size)


def test_smooth_keys_is_checked():
    with pytest.raises(TypeError, match="^key: expected a floating torch.Tensor, got dtype torch.int64"):
        smooth_keys(torch.ones(1, 2, 3, 4, dtype=torch.long))
