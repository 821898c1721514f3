"""The fp64 NumPy oracle itself, judged by brute force, closed forms and torch."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale import reference


def brute_attention(q, k, v, *, scale=None, mask=None, causal=False, offset=0, softcap=None, slopes=None, window=None):
    """One (head, query) row at a time, in plain Python floats: q (H, L, D), k (Hkv, S, D), v (Hkv, S, Dv)."""
    H, L, D = q.shape
    Hkv, S, Dv = v.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = np.zeros((H, L, Dv))
    for h in range(H):
        kv = h // (H // Hkv)
        for i in range(L):
            a = i + offset
            logits = {}
            for j in range(S):
                s = scale * sum(float(q[h, i, d]) * float(k[kv, j, d]) for d in range(D))
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                if slopes is not None:
                    s -= slopes[h] * abs(a - j)
                hidden = causal and j > a
                if window is not None:
                    hidden = hidden or (window[0] is not None and j < a - window[0]) or (window[1] is not None and j > a + window[1])
                if mask is not None:
                    if mask.dtype == bool:
                        hidden = hidden or not mask[i, j]
                    else:
                        s += float(mask[i, j])
                        hidden = hidden or mask[i, j] == -math.inf
                if not hidden:
                    logits[j] = s
            if not logits:
                continue
            top = max(logits.values())
            total = sum(math.exp(s - top) for s in logits.values())
            for j, s in logits.items():
                out[h, i] += math.exp(s - top) / total * v[kv, j]
    return out


def test_reference_doctest_runs():
    result = doctest.testmod(reference, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


def test_single_query_closed_form():
    # Two keys with logits 1/sqrt(2) and 0: weight sigmoid(1/sqrt(2)) on the first value.
    q = np.array([[[1.0, 0.0]]])
    k = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    v = np.array([[[3.0], [-1.0]]])
    w = 1 / (1 + math.exp(-1 / math.sqrt(2)))
    np.testing.assert_allclose(reference.attention(q, k, v), [[[3 * w - (1 - w)]]], rtol=1e-15)
    w = 1 / (1 + math.exp(-0.25))
    np.testing.assert_allclose(reference.attention(q, k, v, scale=0.25), [[[3 * w - (1 - w)]]], rtol=1e-15)


CASES = {
    "plain": dict(),
    "scale": dict(scale=0.9),
    "causal": dict(causal=True),
    "causal-bottom-right": dict(causal=True, alignment="bottom_right"),
    "softcap": dict(softcap=0.5),
    "alibi": dict(slopes=True, alignment="bottom_right"),
    "window": dict(window=(1, 0)),
    "window-unlimited-left": dict(window=(None, 1), alignment="bottom_right"),
    "bool-mask": dict(mask="bool"),
    "float-mask": dict(mask="float"),
    "everything": dict(causal=True, softcap=2.0, slopes=True, window=(2, 2), mask="float", alignment="bottom_right"),
}


@pytest.mark.parametrize(("L", "S"), [(3, 5), (5, 3), (4, 4)])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_brute_force(name, L, S):
    case = CASES[name]
    rng = np.random.default_rng(0)
    H, Hkv, D, Dv = 4, 2, 3, 2
    q, k, v = rng.normal(size=(H, L, D)), rng.normal(size=(Hkv, S, D)), rng.normal(size=(Hkv, S, Dv))
    keep = rng.random((L, S)) > 0.3
    keep[0] = False  # an empty row
    mask = {None: None, "bool": keep, "float": np.where(keep, rng.normal(size=(L, S)), -np.inf)}[case.get("mask")]
    slopes = np.array([0.5, 0.25, 0.125, 0.0625]) if case.get("slopes") else None
    alignment = case.get("alignment", "top_left")
    offset = S - L if alignment == "bottom_right" else 0
    got = reference.attention(
        q[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=case.get("causal", False),
        scale=case.get("scale"),
        causal_alignment=alignment,
        softcap=case.get("softcap"),
        alibi_slopes=slopes,
        window=case.get("window"),
    )[0]
    expected = brute_attention(
        q,
        k,
        v,
        scale=case.get("scale"),
        mask=mask,
        causal=case.get("causal", False),
        offset=offset,
        softcap=case.get("softcap"),
        slopes=slopes,
        window=case.get("window"),
    )
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-13)


def test_gqa_head_h_reads_kv_head_h_floordiv_g():
    v = np.arange(3.0).reshape(1, 3, 1, 1) * np.ones((1, 3, 4, 2))  # kv head j holds j
    q, k = np.ones((1, 6, 2, 5)), np.ones((1, 3, 4, 5))
    out = reference.attention(q, k, v)
    np.testing.assert_array_equal(out[0, :, 0, 0], [0, 0, 1, 1, 2, 2])


def test_fully_masked_rows_are_zero_with_empty_row_stats():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(1, 2, 3, 4)), rng.normal(size=(1, 2, 5, 4)), rng.normal(size=(1, 2, 5, 6))
    keep = np.ones((3, 5), dtype=bool)
    keep[1] = False
    out, stats = reference.attention(q, k, v, attn_mask=keep, return_stats=True)
    np.testing.assert_array_equal(out[..., 1, :], 0.0)
    assert np.all(np.isfinite(out))
    assert np.all(stats["lse"][..., 1] == -np.inf) and np.all(stats["max_logit"][..., 1] == -np.inf)
    np.testing.assert_array_equal(stats["max_prob"][..., 1], 0.0)
    np.testing.assert_array_equal(stats["entropy"][..., 1], 0.0)
    out_empty = reference.attention(q, k[..., :0, :], v[..., :0, :])
    assert out_empty.shape == (1, 2, 3, 6) and not out_empty.any()


def test_stats_are_the_softmax_row_statistics():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(2, 3, 4, 8)), rng.normal(size=(2, 3, 6, 8)), rng.normal(size=(2, 3, 6, 2))
    _, stats = reference.attention(q, k, v, scale=0.7, return_stats=True)
    logits = np.einsum("bhld,bhsd->bhls", q, k) * 0.7
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(stats["lse"], np.log(np.exp(logits).sum(-1)), rtol=1e-14)
    np.testing.assert_allclose(stats["max_logit"], logits.max(-1), rtol=1e-14)
    np.testing.assert_allclose(stats["max_prob"], p.max(-1), rtol=1e-14)
    np.testing.assert_allclose(stats["entropy"], -(p * np.log(p)).sum(-1), rtol=1e-12)
    # Entropy in nats: a uniform row over S keys has entropy log(S).
    _, uniform = reference.attention(np.zeros((1, 1, 2, 8)), k[:1, :1], v[:1, :1], return_stats=True)
    np.testing.assert_allclose(uniform["entropy"], math.log(6), rtol=1e-14)


@pytest.mark.parametrize("options", [dict(), dict(is_causal=True), dict(mask="bool"), dict(mask="float"), dict(gqa=True), dict(scale=0.2)])
def test_agrees_with_torch_sdpa_in_float64(options):
    gen = torch.Generator().manual_seed(3)
    H, Hkv = (4, 2) if options.get("gqa") else (4, 4)
    q = torch.randn(2, H, 7, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, Hkv, 9, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, Hkv, 9, 5, generator=gen, dtype=torch.float64)
    keep = torch.rand(7, 9, generator=gen) > 0.3
    keep[:, 0] = True
    mask = {None: None, "bool": keep, "float": torch.randn(7, 9, generator=gen, dtype=torch.float64).masked_fill(~keep, -math.inf)}[options.get("mask")]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=options.get("is_causal", False), scale=options.get("scale"), enable_gqa=H != Hkv
    )
    got = reference.attention(
        q.numpy(), k.numpy(), v.numpy(), attn_mask=None if mask is None else mask.numpy(), is_causal=options.get("is_causal", False), scale=options.get("scale")
    )
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-13)


def test_accepts_causal_alignment_enum_and_window_minus_one():
    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(1, 1, 2, 3)), rng.normal(size=(1, 1, 5, 3)), rng.normal(size=(1, 1, 5, 3))
    by_enum = reference.attention(q, k, v, is_causal=True, causal_alignment=attnscale.CausalAlignment.BOTTOM_RIGHT)
    by_name = reference.attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_array_equal(by_enum, by_name)
    np.testing.assert_array_equal(reference.attention(q, k, v, window=(-1, -1)), reference.attention(q, k, v))


def missing_case(seed: int = 5):
    """q (1, 2, 4, 3), k (1, 2, 6, 3), v (1, 2, 6, 2) and a mask where row 1 sees nothing, key 2 is hidden."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(1, 2, 4, 3)), rng.normal(size=(1, 2, 6, 3)), rng.normal(size=(1, 2, 6, 2))
    keep = np.ones((4, 6), dtype=bool)
    keep[1] = False
    keep[:, 2] = False
    keep[0, 4] = False
    return q, k, v, keep


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_missing_entries_poison_exactly_the_rows_that_see_them(bad):
    q, k, v, keep = missing_case()
    clean = reference.attention(q, k, v, attn_mask=keep)
    q[0, 0, 3, 1] = bad  # a row that sees keys: NaN
    q[0, 1, 1, 0] = bad  # the row that sees nothing: still zeros
    k[0, 1, 4, 2] = bad  # seen by every row of head 1 but rows 0 and 1
    v[0, 0, 2, 1] = bad  # hidden from every row: no effect
    out = reference.attention(q, k, v, attn_mask=keep)
    nan_rows = np.zeros((1, 2, 4), dtype=bool)
    nan_rows[0, 0, 3] = True
    nan_rows[0, 1, [2, 3]] = True
    np.testing.assert_array_equal(np.isnan(out).any(-1), nan_rows)
    np.testing.assert_array_equal(np.isnan(out).all(-1), nan_rows)
    np.testing.assert_allclose(out[~nan_rows], clean[~nan_rows], rtol=0, atol=1e-15)  # the rest is as without them
    np.testing.assert_array_equal(out[0, :, 1], 0.0)


def test_missing_entries_give_nan_statistics_on_nan_rows_only():
    q, k, v, keep = missing_case()
    v[0, 0, 0, 0] = math.nan  # seen by rows 0, 2 and 3 of head 0
    out, stats = reference.attention(q, k, v, attn_mask=keep, return_stats=True, sinks=np.array([0.0, -1.0]))
    rows = np.isnan(out).any(-1)
    np.testing.assert_array_equal(rows[0, 0], [True, False, True, True])
    assert not rows[0, 1].any()
    for name in ("lse", "max_logit", "max_prob", "entropy", "sink_share"):
        np.testing.assert_array_equal(np.isnan(stats[name]), rows, err_msg=name)
    np.testing.assert_array_equal(stats["visible_keys"][0, 0], [4, 0, 5, 5])


def test_window_sides_of_max_length_or_more_mean_no_limit():
    q, k, v, _ = missing_case()
    unlimited = reference.attention(q, k, v, window=(None, 1), is_causal=True)
    np.testing.assert_array_equal(reference.attention(q, k, v, window=(6, 1), is_causal=True), unlimited)
    np.testing.assert_array_equal(reference.attention(q, k, v, window=(10**30, 1), is_causal=True), unlimited)
