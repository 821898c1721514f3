"""Attention sinks: one logit per query head in every row's softmax denominator, with no value.

Every backend against the fp64 NumPy reference (which writes the formula out directly), the
statistics' treatment of the sink, gradients to the sinks, empty rows and bad input.
"""

import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale import reference
from attnscale.stats import normalized_entropy, summarize
from attnscale.tiled import ScorePath, attention_partial, merge_partials, merge_sinks

from .features import FEATURES, feature_id

NEG_INF = float("-inf")
SINKS = (0.5, -1.0, 2.5, NEG_INF)  # (H,) = 4 heads; the last has no sink

NO_KERNEL = attnscale.kernels.build_precondition()  # None: the compiled kernel must build here
KERNEL = "fused" if attnscale.kernels.available() else "tiled"  # what auto runs for sinks


def make_inputs(*, H=4, Hkv=2, L=9, S=17, D=7, Dv=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, D, generator=gen, dtype=torch.float64)  # (B, H, L, D)
    k = torch.randn(2, Hkv, S, D, generator=gen, dtype=torch.float64)  # (B, Hkv, S, D)
    v = torch.randn(2, Hkv, S, Dv, generator=gen, dtype=torch.float64)  # (B, Hkv, S, Dv)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def make_mask(kind, *, H, L, S, seed=1):
    if kind is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(2, 1, L, S, generator=gen) > 0.3  # (B, 1, L, S)
    keep[0, 0, 1] = False  # one fully masked row: all its mass goes to the sink
    if kind == "bool":
        return keep
    return torch.randn(1, H, L, S, generator=gen, dtype=torch.float64).masked_fill(~keep, NEG_INF)


def run_reference(q, k, v, mask, sinks, **opts):
    np_opts = {key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in opts.items()}
    np_mask = None if mask is None else mask.numpy()
    return reference.attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), attn_mask=np_mask, sinks=sinks.double().numpy(), **np_opts
    )


SHAPES = [(4, 4, 9, 17), (4, 2, 19, 13), (4, 1, 5, 49)]  # MHA, GQA, MQA; L != S both ways


def options(case):
    softcap, alibi, window, causal, mask_kind = FEATURES[case]
    H, Hkv, L, S = SHAPES[case % len(SHAPES)]
    opts = {"softcap": softcap, "window": window}
    if alibi:
        opts["alibi_slopes"] = attnscale.alibi_slopes(H).double()
    if causal is not None:
        opts.update(is_causal=True, causal_alignment=causal)
    return (H, Hkv, L, S), mask_kind, opts


def sdpa(q, k, v, mask, sinks, backend, **opts):
    return attnscale.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, sinks=sinks, backend=backend, **opts)


@pytest.mark.parametrize("case", range(len(FEATURES)), ids=feature_id)
def test_every_backend_matches_the_reference_fp64(case):
    (H, Hkv, L, S), mask_kind, opts = options(case)
    q, k, v = make_inputs(H=H, Hkv=Hkv, L=L, S=S, seed=case)
    mask = make_mask(mask_kind, H=H, L=L, S=S, seed=case)
    sinks = torch.tensor(SINKS, dtype=torch.float64)
    expected = run_reference(q, k, v, mask, sinks, **opts)
    backends = ["math", "tiled", "auto"] + ([] if opts["softcap"] else ["torch"]) + (["fused"] if NO_KERNEL is None else [])
    for backend in backends:
        out = sdpa(q, k, v, mask, sinks, backend, **opts)
        np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-12, err_msg=backend)
        # auto: sinks are a feature torch's fused kernel lacks, so the online-softmax kernel runs
        assert attnscale.last_backend() == (KERNEL if backend == "auto" else backend)


def test_auto_sends_sinks_to_the_online_softmax_kernel():
    q, k, v = make_inputs()
    sdpa(q, k, v, None, torch.zeros(4, dtype=torch.float64), "auto")
    assert attnscale.last_backend() == KERNEL
    sdpa(q, k, v, None, torch.zeros(4, dtype=torch.float64), "auto", dropout_p=0.5)
    assert attnscale.last_backend() == "math"


@pytest.mark.parametrize("case", [0, 17, 35, 46, 71], ids=feature_id)
@pytest.mark.parametrize("backend", ["math", "tiled", "fused"])
def test_statistics_count_the_sink_as_one_more_outcome(case, backend):
    if backend == "fused" and NO_KERNEL is not None:
        pytest.skip(f"the compiled kernel cannot be had here: {NO_KERNEL}")
    (H, Hkv, L, S), mask_kind, opts = options(case)
    q, k, v = make_inputs(H=H, Hkv=Hkv, L=L, S=S, seed=case)
    mask = make_mask(mask_kind, H=H, L=L, S=S, seed=case)
    sinks = torch.tensor(SINKS, dtype=torch.float64)
    _, want = run_reference(q, k, v, mask, sinks, return_stats=True, **opts)
    _, got = sdpa(q, k, v, mask, sinks, backend, return_stats=True, **opts)
    for name in ("lse", "max_logit", "max_prob", "entropy", "visible_keys", "sink_share"):
        np.testing.assert_allclose(getattr(got, name).numpy(), want[name], rtol=0, atol=1e-12, err_msg=name)
    # The key weights and the sink's share make one distribution.
    weights = sdpa(q, k, torch.eye(S, dtype=torch.float64).expand(2, Hkv, S, S), mask, sinks, "math", **opts)
    total = weights.sum(-1) + got.sink_share
    has_mass = got.lse > NEG_INF
    torch.testing.assert_close(total[has_mass], torch.ones_like(total[has_mass]), rtol=0, atol=1e-12)


def test_a_row_with_no_visible_key_gives_its_mass_to_the_sink():
    q, k, v = make_inputs(H=4, Hkv=4)
    mask = torch.ones(9, 17, dtype=torch.bool)
    mask[3] = False
    sinks = torch.tensor(SINKS, dtype=torch.float64, requires_grad=True)
    for t in (q, k, v):
        t.requires_grad_()
    for backend in ("math", "tiled", "torch"):
        out = sdpa(q, k, v, mask, sinks, backend)
        assert (out[..., 3, :] == 0).all(), backend
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
        assert all(torch.isfinite(g).all() for g in grads), backend
        assert (grads[0][..., 3, :] == 0).all(), backend
    _, stats = sdpa(q.detach(), k.detach(), v.detach(), mask, sinks.detach(), "tiled", return_stats=True)
    row = (slice(None), slice(0, 3), 3)  # heads with a finite sink
    torch.testing.assert_close(stats.lse[row], sinks.detach()[:3].expand(2, 3), rtol=0, atol=0)
    assert (stats.sink_share[row] == 1).all() and (stats.entropy[row] == 0).all() and (stats.max_prob[row] == 0).all()
    assert stats.lse[0, 3, 3] == NEG_INF and stats.sink_share[0, 3, 3] == 0  # no key and no sink


@pytest.mark.parametrize("backend", ["math", "tiled", "torch"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64_reaches_the_sinks(backend, causal):
    q, k, v = make_inputs(H=4, Hkv=2, L=5, S=6, D=3, Dv=2)
    q, k, v = (t[:1].clone().requires_grad_() for t in (q, k, v))
    sinks = torch.tensor((0.5, -1.0, 2.5, 0.1), dtype=torch.float64, requires_grad=True)
    mask = None if causal else make_mask("bool", H=4, L=5, S=6)[:1]

    def f(q, k, v, sinks):
        return sdpa(q, k, v, mask, sinks, backend, is_causal=causal)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


@pytest.mark.parametrize("backend", ["math", "tiled"])
def test_gradcheck_of_the_statistics_lse_with_sinks(backend):
    q, k, v = make_inputs(H=4, Hkv=2, L=5, S=6, D=3, Dv=2)
    q, k, v = (t[:1].clone().requires_grad_() for t in (q, k, v))
    sinks = torch.tensor((0.5, -1.0, 2.5, 0.1), dtype=torch.float64, requires_grad=True)
    mask = make_mask("bool", H=4, L=5, S=6)[:1]

    def f(q, k, v, sinks):
        return sdpa(q, k, v, mask, sinks, backend, return_stats=True)[1].lse

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_a_minus_inf_sink_is_no_sink_and_keeps_gradients_finite():
    q, k, v = make_inputs(H=4, Hkv=4)
    sinks = torch.full((4,), NEG_INF, dtype=torch.float64, requires_grad=True)
    plain = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
    for backend in ("math", "tiled", "torch"):
        out, *_ = (sdpa(q, k, v, None, sinks, backend, is_causal=True),)
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-14)
        (grad,) = torch.autograd.grad(out.sum(), sinks)
        assert (grad == 0).all(), backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", [0, 23, 47, 71], ids=feature_id)
def test_low_precision_error_is_like_math(dtype, case):
    """The tiled kernel's error against fp64 is at most twice the math backend's (same dtype), plus
    the floor that test_tiled.py uses for the kernel without sinks."""
    floor = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    (H, Hkv, L, S), mask_kind, opts = options(case)
    q, k, v = make_inputs(H=H, Hkv=Hkv, L=L, S=S, seed=case, dtype=dtype)
    mask = make_mask(mask_kind, H=H, L=L, S=S, seed=case)
    sinks = torch.tensor(SINKS, dtype=dtype)  # the sinks may have any float dtype
    expected = run_reference(q, k, v, mask, sinks, **opts)
    tiled = sdpa(q, k, v, mask, sinks, "tiled", **opts)
    assert tiled.dtype == dtype
    err_tiled = np.abs(tiled.double().numpy() - expected).max()
    err_math = np.abs(sdpa(q, k, v, mask, sinks, "math", **opts).double().numpy() - expected).max()
    assert err_tiled <= 2 * err_math + floor


def test_the_sink_enters_once_after_merging_key_shards():
    q, k, v = make_inputs(H=4, Hkv=4, L=6, S=12)
    path = ScorePath(scale=0.4, causal=True)
    sinks = torch.tensor(SINKS, dtype=torch.float64)
    a = attention_partial(q, k[..., :5, :], v[..., :5, :], path=path)
    b = attention_partial(q, k[..., 5:, :], v[..., 5:, :], path=path, k_start=5)
    out, lse = merge_sinks(*merge_partials(*a, *b), sinks)
    want = sdpa(q, k, v, None, sinks, "math", is_causal=True, scale=0.4)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
    _, stats = sdpa(q, k, v, None, sinks, "math", is_causal=True, scale=0.4, return_stats=True)
    torch.testing.assert_close(lse, stats.lse, rtol=0, atol=1e-13)


def test_normalized_entropy_counts_the_sink_and_summarize_reads_its_share():
    # Every logit 0 and sink 0: a uniform distribution over 5 keys and the sink.
    q = torch.zeros(1, 2, 3, 4)
    k, v = torch.zeros(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    _, stats = attnscale.scaled_dot_product_attention(q, k, v, sinks=torch.zeros(2), return_stats=True)
    torch.testing.assert_close(stats.entropy, torch.full((1, 2, 3), math.log(6)))
    torch.testing.assert_close(normalized_entropy(stats), torch.ones(1, 2, 3))
    assert summarize(stats, "sink_share").mean == pytest.approx((1 / 6, 1 / 6))
    assert "sink_share" in stats.to_dict()
    _, plain = attnscale.scaled_dot_product_attention(q, k, v, return_stats=True)
    assert plain.sink_share is None and "sink_share" not in plain.to_dict()
    with pytest.raises(ValueError, match="sink_share"):
        summarize(plain, "sink_share")


@pytest.mark.parametrize(
    "sinks, exc, match",
    [
        (torch.zeros(3), ValueError, r"shape \(H,\) = \(4,\)"),
        (torch.zeros(1, 4), ValueError, r"shape \(H,\)"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "float tensor"),
        ([0.0] * 4, TypeError, "float tensor"),
        (torch.tensor([0.0, math.nan, 0.0, 0.0]), ValueError, r"NaN or \+inf at heads \[1\]"),
        (torch.tensor([0.0, 0.0, 0.0, math.inf]), ValueError, r"NaN or \+inf at heads \[3\]"),
    ],
)
def test_bad_sinks_are_refused_before_any_compute(sinks, exc, match):
    q, k, v = make_inputs(dtype=torch.float32)
    for backend in ("auto", "math", "tiled", "torch"):
        with pytest.raises(exc, match=match):
            attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, sinks=sinks, backend=backend)


def test_sink_scaled_is_merge_sinks_output_with_its_gradients():
    """The kernels' four-op form of the sinks (sigmoid of lse - sink) against merge_sinks, the
    merge with a value-less partial: rows without keys and heads without a sink (-inf) included."""
    from attnscale.tiled import merge_sinks, sink_scaled

    gen = torch.Generator().manual_seed(0)
    out = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=gen).requires_grad_()
    lse = torch.randn(2, 4, 5, dtype=torch.float64, generator=gen)
    lse[0, 1, 2] = -math.inf
    lse[1, 3, :] = -math.inf  # a head whose rows see no key, and which has no sink either
    lse.requires_grad_()
    sinks = torch.tensor([0.5, -math.inf, 2.0, -math.inf], dtype=torch.float64, requires_grad=True)
    want, got = merge_sinks(out, lse, sinks)[0], sink_scaled(out, lse, sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    grads = torch.autograd.grad(got.sum(), (out, lse, sinks))
    for g, w in zip(grads, torch.autograd.grad(want.sum(), (out, lse, sinks))):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=0, atol=1e-14)


@pytest.mark.skipif(KERNEL != "fused", reason="the compiled kernel did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["float32", "float64", "bfloat16"])
def test_a_repeated_call_merges_its_sinks_in_the_kernel_and_learned_sinks_keep_their_gradient(dtype):
    """A signature's second call goes straight to the kernel, which merges constant sinks in place;
    sinks that require grad (q, k and v constant, as when only the sinks learn) are merged by torch
    ops on that path, so their gradient is the math backend's."""
    q, k, v = make_inputs(H=4, Hkv=2, L=3, S=11, D=8, Dv=8, dtype=dtype)
    q, k, v = q[:1], k[:1], v[:1]  # (1, H, L, D): one batch, the plannable layout
    sinks = torch.tensor(SINKS[:3] + (0.25,), dtype=torch.float64)
    want = torch.from_numpy(run_reference(q, k, v, None, sinks)).to(dtype)
    # measured (Intel Xeon, AVX-512): output 2.8e-7, 2.2e-16, 3.0e-3 (bfloat16's rounding: at most
    # half its ulp, 2^-8, for |out| < 2); the sinks' gradient against math 2.8e-7, 4.2e-16, 2.1e-3
    tol = {torch.float32: 6e-7, torch.float64: 1e-15, torch.bfloat16: 4e-3}[dtype]
    for _ in range(3):  # plan, then direct
        torch.testing.assert_close(sdpa(q, k, v, None, sinks, "auto"), want, rtol=0, atol=tol)
        assert attnscale.last_backend() == "fused"
    learned = sinks.clone().requires_grad_()
    for _ in range(2):
        (got,) = torch.autograd.grad(sdpa(q, k, v, None, learned, "auto").double().square().sum(), learned)
        (ref,) = torch.autograd.grad(sdpa(q, k, v, None, learned, "math").double().square().sum(), learned)
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)
