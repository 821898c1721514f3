"""AttentionStats from every backend against the fp64 reference, and the diagnostic reductions."""

import itertools
import json
import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale import AttentionStats, reference
from attnscale.stats import HeadSummary, normalized_entropy, share_above, summarize

NEG_INF = float("-inf")
FIELDS = ("lse", "max_logit", "max_prob", "entropy", "visible_keys")


def make_case(*, L=21, S=37, H=4, Hkv=2, dtype=torch.float64, seed=0, mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, H, L, 8, generator=gen, dtype=torch.float64) * mag).to(dtype)  # (B, H, L, D)
    k = (torch.randn(2, Hkv, S, 8, generator=gen, dtype=torch.float64) * mag).to(dtype)  # (B, Hkv, S, D)
    v = torch.randn(2, Hkv, S, 8, generator=gen, dtype=torch.float64).to(dtype)  # (B, Hkv, S, Dv)
    keep = torch.rand(2, 1, L, S, generator=gen) > 0.25  # (B, 1, L, S)
    keep[1, 0, 4] = False
    return q, k, v, keep


def assert_stats_close(stats, expected, atol):
    for name in FIELDS:
        got = getattr(stats, name).detach().double().numpy()
        want = expected[name]
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=name)  # -inf == -inf passes


CASES = list(
    itertools.product(
        [None, 4.0],  # softcap
        [False, True],  # alibi
        [None, (6, 0)],  # window
        [None, "top_left", "bottom_right"],  # causal alignment
        [None, "bool", "float"],  # mask
    )
)


@pytest.mark.parametrize("case", range(0, len(CASES), 3))
@pytest.mark.parametrize("backend", ["tiled", "math"])
def test_stats_match_reference(backend, case):
    softcap, alibi, window, causal, mask_kind = CASES[case]
    q, k, v, keep = make_case(seed=case, L=33 if case % 2 else 21)
    mask = None
    if mask_kind == "bool":
        mask = keep
    elif mask_kind == "float":
        mask = torch.randn(keep.shape, dtype=torch.float64).masked_fill(~keep, NEG_INF)
    opts = {"softcap": softcap, "window": window}
    if alibi:
        opts["alibi_slopes"] = attnscale.alibi_slopes(4).double()
    if causal is not None:
        opts.update(is_causal=True, causal_alignment=causal)
    out, stats = attnscale.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, return_stats=True, backend=backend, **opts)
    assert attnscale.last_backend() == backend
    np_opts = {key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in opts.items()}
    np_mask = None if mask is None else mask.numpy()
    _, expected = reference.attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=np_mask, return_stats=True, **np_opts)
    assert_stats_close(stats, expected, atol=1e-12)


@pytest.mark.parametrize("mag", [1.0, 30.0])
def test_tiled_stats_float32_against_math(mag):
    """Streaming statistics in float32 are as close to fp64 as the dense ones, also for peaked rows."""
    q, k, v, keep = make_case(dtype=torch.float32, seed=3, mag=mag, L=300, S=700)
    opts = dict(attn_mask=keep, enable_gqa=True, return_stats=True, softcap=50.0, is_causal=True, causal_alignment="bottom_right")
    _, tiled = attnscale.scaled_dot_product_attention(q, k, v, backend="tiled", **opts)
    _, dense = attnscale.scaled_dot_product_attention(q, k, v, backend="math", **opts)
    _, expected = reference.attention(
        q.numpy(), k.numpy(), v.numpy(), attn_mask=keep.numpy(), return_stats=True, softcap=50.0, is_causal=True, causal_alignment="bottom_right"
    )
    for name in FIELDS:
        want = expected[name]
        finite = np.isfinite(want)
        err_tiled = np.abs(getattr(tiled, name).double().numpy()[finite] - want[finite]).max()
        err_dense = np.abs(getattr(dense, name).double().numpy()[finite] - want[finite]).max()
        assert err_tiled <= 4 * err_dense + 1e-5, (name, err_tiled, err_dense)
        assert np.array_equal(np.isfinite(getattr(tiled, name).numpy()), finite)


@pytest.mark.parametrize("mag", [1e7, 1e14, 1e15], ids=["gaps-1e14", "gaps-1e29", "maxima-above-1e31"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["tiled", "fused", "math"])
def test_entropy_of_rows_with_huge_logit_gaps(backend, dtype, mag):
    """Logits of +-mag^2 (one-hot rows: entropy 0 where one key dominates). The tiled kernel once
    gave a weight it floors at 1.1e-30 the term 1.1e-30 times its logit gap (entropy 0.15 at gaps
    of 1e29, 25 beside 3 keys at 1e30), and NaN where a row's first maximum exceeded 1e31 (its
    running max starts at float32's lowest, and 0 * -inf)."""
    q, k, v, keep = make_case(dtype=dtype, seed=4, mag=mag, L=40, S=300)
    opts = dict(attn_mask=keep, enable_gqa=True, return_stats=True, is_causal=True)
    _, stats = attnscale.scaled_dot_product_attention(q, k, v, backend=backend, **opts)
    _, expected = reference.attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=keep.numpy(), return_stats=True, is_causal=True)
    assert expected["entropy"].max() < 1e-6  # the premise: no two keys of a row within rounding of each other
    np.testing.assert_allclose(stats.entropy.numpy(), expected["entropy"], rtol=0, atol=1e-6)


def test_stats_lse_gradient_on_tiled_matches_math():
    q, k, v, keep = make_case(seed=5)
    q.requires_grad_()
    grads = []
    for backend in ("tiled", "math"):
        _, stats = attnscale.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, return_stats=True, softcap=3.0, backend=backend)
        finite = torch.isfinite(stats.lse)
        grads.append(torch.autograd.grad(stats.lse[finite].sum(), q)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


def test_visible_keys_counts_masks_causality_and_window():
    q, k, v, keep = make_case(L=5, S=9, seed=2)
    _, stats = attnscale.scaled_dot_product_attention(
        q, k, v, keep, enable_gqa=True, return_stats=True, is_causal=True, window=(2, 0), backend="tiled"
    )
    i = torch.arange(5)[:, None]
    j = torch.arange(9)[None, :]
    direct = (keep & (j <= i) & (j >= i - 2)).sum(-1).expand(2, 4, 5)
    assert torch.equal(stats.visible_keys, direct)


def test_to_dict_is_json_with_none_for_empty_rows():
    q, k, v, keep = make_case(L=6, S=7, seed=1)
    keep[1, 0, 4] = False
    for backend in ("tiled", "math"):
        _, stats = attnscale.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, return_stats=True, backend=backend)
        data = json.loads(json.dumps(stats.to_dict()))
        assert set(data) == set(FIELDS)
        assert data["lse"][1][0][4] is None and data["visible_keys"][1][0][4] == 0


def synthetic_stats():
    """Stats (B=2, H=3, L=4) with a few empty rows, and the matching flat per-head NumPy values."""
    gen = torch.Generator().manual_seed(0)
    values = {name: torch.rand(2, 3, 4, generator=gen, dtype=torch.float64) for name in FIELDS[:4]}
    visible = torch.randint(1, 9, (2, 3, 4), generator=gen)
    visible[0, 1, 2] = 0
    visible[:, 2, :] = 0  # head 2 is empty everywhere
    visible[1, 0, 3] = 1
    empty = visible == 0
    values["lse"] = values["lse"].masked_fill(empty, NEG_INF)
    values["max_logit"] = values["max_logit"].masked_fill(empty, NEG_INF)
    values["max_prob"] = values["max_prob"].masked_fill(empty, 0.0)
    values["entropy"] = values["entropy"].masked_fill(empty, 0.0)
    return AttentionStats(**values, visible_keys=visible)


def test_normalized_entropy():
    stats = synthetic_stats()
    got = normalized_entropy(stats)
    n = stats.visible_keys.double()
    direct = stats.entropy / torch.log(n)
    many = n > 1
    torch.testing.assert_close(got[many], direct[many])
    assert (got[n == 1] == 0).all() and torch.isnan(got[n == 0]).all()


def test_normalized_entropy_is_one_for_uniform_attention():
    q = torch.zeros(1, 2, 5, 4)
    k, v = torch.randn(1, 2, 11, 4), torch.randn(1, 2, 11, 4)
    _, stats = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, return_stats=True, backend="tiled")
    ratio = normalized_entropy(stats)
    assert ratio[..., 0].eq(0).all()  # the first row sees one key
    torch.testing.assert_close(ratio[..., 1:], torch.ones(1, 2, 4))


@pytest.mark.parametrize("statistic", ["lse", "max_prob", "entropy", "normalized_entropy"])
def test_summarize_matches_direct_computation(statistic):
    stats = synthetic_stats()
    quantiles = (0.0, 0.25, 0.5, 0.9)
    summary = summarize(stats, statistic, quantiles=quantiles)
    assert isinstance(summary, HeadSummary) and summary.statistic == statistic
    full = normalized_entropy(stats) if statistic == "normalized_entropy" else getattr(stats, statistic)
    for h in range(2):
        rows = stats.visible_keys[:, h].flatten() > 0
        kept = full[:, h].flatten()[rows].numpy()
        kept = kept[~np.isnan(kept)]
        assert summary.rows[h] == int(rows.sum())
        assert summary.mean[h] == pytest.approx(kept.mean())
        assert summary.min[h] == kept.min() and summary.max[h] == kept.max()
        for level, per_head in summary.quantiles:
            assert per_head[h] == pytest.approx(np.quantile(kept, level))
    assert summary.rows[2] == 0 and summary.mean[2] is None and summary.quantiles[0][1][2] is None
    data = json.loads(json.dumps(summary.to_dict()))
    assert list(data["quantiles"]) == ["0.0", "0.25", "0.5", "0.9"]


def test_share_above_matches_direct_computation():
    stats = synthetic_stats()
    shares = share_above(stats, 0.5)
    for h in range(2):
        rows = stats.visible_keys[:, h] > 0
        direct = ((stats.max_prob[:, h] > 0.5) & rows).sum() / rows.sum()
        assert shares[h] == pytest.approx(float(direct))
    assert shares[2] is None
    json.dumps(shares)


def test_reductions_on_real_stats_ignore_empty_rows():
    q, k, v, keep = make_case(L=6, S=5, seed=4)
    _, stats = attnscale.scaled_dot_product_attention(
        q, k, v, keep, enable_gqa=True, return_stats=True, is_causal=True, causal_alignment="bottom_right", backend="tiled"
    )
    summary = summarize(stats, "max_logit")
    assert all(x is not None and math.isfinite(x) for x in summary.min)
    assert summary.rows == tuple(int(n) for n in (stats.visible_keys > 0).sum(dim=(0, 2)))


def test_reduction_bad_inputs():
    stats = synthetic_stats()
    with pytest.raises(ValueError, match="statistic"):
        summarize(stats, "entropy_bits")
    with pytest.raises(ValueError, match="quantiles"):
        summarize(stats, quantiles=(0.5, 1.5))
    with pytest.raises(ValueError, match="threshold"):
        share_above(stats, float("nan"))
