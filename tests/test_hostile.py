"""Hostile inputs get one right answer on every backend: the reference's, or a clear error.

Low-rank masks, a single key/value head without enable_gqa, products that overflow the
accumulation dtype, NaN and inf inside q, k or v (at visible and at hidden keys), non-finite ALiBi
slopes and absurd window sides. Shape letters as everywhere: B batch, H query heads, Hkv key/value
heads, L query length, S key length, D query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnscale
from attnscale import kernels, reference

BACKENDS = [b.value for b in attnscale.Backend]
# torch 2.13's FlexAttention has no CPU backward, and backend="flex" refuses CPU inputs that require
# grad (tests/test_flex.py checks the refusal, and flex's gradients on a GPU): tests that
# differentiate on CPU run the other backends.
GRAD_BACKENDS = [b for b in BACKENDS if b != "flex"]
OWN_BACKENDS = [b for b in BACKENDS if b not in ("auto", "torch")]  # the ones with softcap and statistics


def sdpa(*args, **kwargs):
    return attnscale.scaled_dot_product_attention(*args, **kwargs)


def numpy(t: torch.Tensor | None) -> np.ndarray | None:
    if t is None:
        return None
    return t.detach().numpy() if t.dtype == torch.bool else t.detach().double().numpy()


def oracle(q, k, v, **options) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """The fp64 reference on the same (already rounded) inputs."""
    for name in ("attn_mask", "alibi_slopes", "sinks"):
        options[name] = numpy(options.get(name))
    result = reference.attention(numpy(q), numpy(k), numpy(v), **options)
    if options.get("return_stats"):
        return torch.from_numpy(np.ascontiguousarray(result[0])), result[1]
    return torch.from_numpy(np.ascontiguousarray(result))


def qkv(*shape_q, S, Hkv=None, Dv=None, seed=0, dtype=torch.float32, std=1.0):
    *batch, H, L, D = shape_q
    gen = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    Dv = D if Dv is None else Dv
    draw = lambda *s: (torch.randn(*s, generator=gen, dtype=torch.float64) * std).to(dtype)  # noqa: E731
    return draw(*batch, H, L, D), draw(*batch, Hkv, S, D), draw(*batch, Hkv, S, Dv)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    """Same NaN pattern, and the other entries within ``atol`` of the reference."""
    assert torch.equal(out.isnan(), ref.isnan()), (out.isnan().any(-1), ref.isnan().any(-1))
    finite = ~ref.isnan()
    assert torch.isfinite(out[finite]).all()
    err = (out.double()[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= atol, err


# 1. Masks of fewer than two dims -----------------------------------------------------------------

LOW_RANK_MASKS = {
    "bool-0d": lambda S: torch.tensor(True),
    "bool-S": lambda S: torch.arange(S) % 3 != 1,
    "float-0d": lambda S: torch.tensor(0.5),
    "float-S": lambda S: torch.where(torch.arange(S) % 3 == 1, -math.inf, torch.linspace(-1, 1, S)),
}
FEATURES = {
    "plain": {},
    "softcap": dict(softcap=2.0),
    "window": dict(window=(2, 1)),
    "alibi": dict(alibi_slopes=attnscale.alibi_slopes(2)),
    "bottom-right": dict(is_causal=True, causal_alignment="bottom_right"),
    "stats": dict(return_stats=True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("mask", list(LOW_RANK_MASKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_of_zero_and_one_dims_broadcast_like_torch(backend, mask, feature):
    options = FEATURES[feature]
    if backend == "torch" and ("softcap" in options or "return_stats" in options):
        pytest.skip("torch's SDPA has no softcap and no statistics")
    q, k, v = qkv(2, 2, 3, 8, S=5)
    attn_mask = LOW_RANK_MASKS[mask](5)
    result = sdpa(q, k, v, attn_mask=attn_mask, backend=backend, **options)
    ref = oracle(q, k, v, attn_mask=attn_mask, **options)
    if options.get("return_stats"):
        (result, stats), (ref, ref_stats) = result, ref
        np.testing.assert_allclose(stats.lse.numpy(), ref_stats["lse"], rtol=1e-5, atol=1e-5)
    assert_matches(result, ref, atol=1e-5)


# 2. One key/value head without enable_gqa, and what torch does -----------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_kv_head_broadcasts_without_enable_gqa_as_in_torch(backend):
    q, k, v = qkv(2, 4, 3, 8, S=6, Hkv=1)
    out = sdpa(q, k, v, backend=backend)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=0)
    assert_matches(out, oracle(q, k, v), atol=1e-6)


def test_torch_refuses_two_kv_heads_without_enable_gqa_and_so_does_attnscale():
    q, k, v = qkv(2, 4, 3, 8, S=6, Hkv=2)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="^key: expected 4 heads"):
        sdpa(q, k, v)


def test_torch_on_cpu_applies_both_attn_mask_and_is_causal_in_its_fused_kernel_and_raises_in_its_math_kernel():
    # The claims of the scaled_dot_product_attention docstring about torch itself (torch 2.13 CPU).
    q, k, v = qkv(1, 2, 4, 8, S=4)
    keep = torch.tensor([[True, False, True, True]]).expand(4, 4)
    both = keep & attnscale.causal_mask(4, 4)
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True)
    torch.testing.assert_close(fused, F.scaled_dot_product_attention(q, k, v, attn_mask=both), atol=1e-6, rtol=0)
    math_kernel = {
        "dropout": dict(dropout_p=0.5),
        "Dv != D": dict(value=v[..., :3]),
        "3 dims": dict(query=q[0], key=k[0], value=v[0]),
        "mask requires grad": dict(attn_mask=torch.zeros(4, 4).masked_fill(~keep, -math.inf).requires_grad_()),
        "one kv head without enable_gqa": dict(key=k[:, :1], value=v[:, :1]),
    }
    for name, change in math_kernel.items():
        call = dict(query=q, key=k, value=v, attn_mask=keep, is_causal=True) | change
        with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal=True"):
            F.scaled_dot_product_attention(**call)


# 3. Products that overflow the accumulation dtype ------------------------------------------------


def huge_inputs(dtype: torch.dtype, *, sign: float = 1.0):
    """q and k of norm ~1e30: q.k ~ 1e60 overflows float32; the fp64 logits are finite."""
    q, k, v = qkv(1, 2, 4, 8, S=6, seed=3)
    return (q * 1e30).to(dtype), (k * sign * 1e30).to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_products_beyond_float32_give_the_float64_answer(backend, dtype):
    q, k, v = huge_inputs(dtype)
    out = sdpa(q, k, v, backend=backend)
    assert out.dtype == dtype
    assert_matches(out, oracle(q, k, v), atol=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend", ["torch", "auto", "fused", "tiled", "math"])
def test_last_backend_names_what_computed_the_returned_output(backend, caplog):
    """After the float64 recompute, last_backend() said 'torch' for an output the fused kernel had
    computed in float64. It names the recompute's backend (torch's SDPA never recomputes, see
    guard._float64; the kernels recompute themselves), and the log says why."""
    q, k, v = huge_inputs(torch.float32)
    wide = "fused" if kernels.available() else "tiled"
    with caplog.at_level("DEBUG", logger="attnscale"):
        sdpa(q, k, v, backend=backend)
    assert attnscale.last_backend() == (backend if backend in ("fused", "tiled", "math") else wide)
    assert f"ran backend={attnscale.last_backend()} (float64 recompute: " in caplog.text
    if backend != "auto":  # no recompute: the backend asked for
        sdpa(q / 1e30, k / 1e30, v, backend=backend)
        assert attnscale.last_backend() == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_products_that_overflow_only_through_the_sum_over_d_give_the_float64_answer(backend):
    """Each entry's product q_d k_d (about -1e38 to -2e38) fits float32; their sum over D = 64 does
    not. Only the D in the logits' bound (D max|q| max|k| scale) says these rows may have overflowed:
    without it the tiled kernel's floored rows came back 0.75 off the float64 answer."""
    gen = torch.Generator().manual_seed(4)
    q = torch.full((1, 2, 3, 64), 1e19)
    k = -1e19 * (1 + torch.rand(1, 2, 5, 64, generator=gen))
    v = torch.randn(1, 2, 5, 8, generator=gen)
    one = q[..., :1, :] * k  # (1, 2, 5, 64): every query row is the same
    assert torch.isfinite(one).all() and not torch.isfinite(one.sum(-1)).any()
    assert_matches(sdpa(q, k, v, backend=backend), oracle(q, k, v), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_products_that_all_overflow_to_minus_inf_are_not_an_empty_row(backend):
    # Every q.k is about -1e60: float32 sees a row of -inf logits, fp64 a sharp softmax.
    q, k, v = huge_inputs(torch.float32)
    q = q.abs()
    k = -k.abs()
    out = sdpa(q, k, v, backend=backend)
    ref = oracle(q, k, v)
    assert (ref.abs().amax(-1) > 0).all()
    assert_matches(out, ref, atol=1e-6)


@pytest.mark.parametrize("backend", OWN_BACKENDS)
def test_overflowing_products_with_softcap_and_statistics(backend):
    q, k, v = huge_inputs(torch.float32)
    out, stats = sdpa(q, k, v, softcap=5.0, return_stats=True, backend=backend)
    ref, ref_stats = oracle(q, k, v, softcap=5.0, return_stats=True)
    assert_matches(out, ref, atol=1e-5)
    assert stats.lse.dtype == torch.float32
    np.testing.assert_allclose(stats.lse.numpy(), ref_stats["lse"], rtol=1e-5)


def test_gradients_through_the_float64_recompute_are_those_of_float64():
    # q.k ~ 1e38 overflows float32 for some pairs, while scale 1e-38 keeps the softmax soft. (The
    # tiled kernel folds the scale into q first, so it does not overflow here.)
    q, k, v = huge_inputs(torch.float32)
    q, k = q * 1e-12, k * 1e-10
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa(*leaves, backend="math", scale=1e-38)
    out.sum().backward()
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    sdpa(*wide, backend="math", scale=1e-38).sum().backward()
    assert torch.isfinite(out).all()
    for got, want in zip(leaves, wide):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-30)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_gradients_of_overflowing_products_are_finite_and_those_of_float64(backend):
    q, k, v = huge_inputs(torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa(*leaves, backend=backend).sum().backward()
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    sdpa(*wide, backend="math").sum().backward()
    for got, want in zip(leaves, wide):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_products_beyond_float64_are_refused(backend):
    q, k, v = qkv(1, 2, 4, 8, S=6, seed=3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^query/key: expected products q\.k \* scale .*Fix: "):
        sdpa(q * 1e160, k * 1e160, v, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_near_the_float32_maximum_give_the_float64_answer(backend):
    # Weighted sums of values near 3.4e38 may overflow a kernel's float32 accumulator on the way.
    q, k, v = qkv(1, 2, 4, 8, S=6, seed=4)
    v = v.sign() * 3e38
    assert_matches(sdpa(q, k, v, backend=backend), oracle(q, k, v), atol=3e38 * 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_near_the_float64_maximum_give_the_answer_or_a_clear_error(backend):
    q, k, v = qkv(1, 2, 4, 8, S=6, seed=4, dtype=torch.float64)
    v = v.sign() * 1.5e308
    try:
        out = sdpa(q, k, v, backend=backend)
    except ValueError as error:
        assert str(error).startswith("value: expected values whose weighted sums fit float64, got torch.float64 values up to |v| = 1.5e+308")
    else:
        assert_matches(out, oracle(q, k, v), atol=1.5e308 * 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scale_beyond_the_accumulation_dtype_is_refused_and_float64_takes_it(backend):
    q, k, v = qkv(1, 2, 4, 8, S=6)
    with pytest.raises(ValueError, match=r"^scale: expected a value that fits torch\.float32.*got 1e\+39"):
        sdpa(q, k, v, scale=1e39, backend=backend)
    with pytest.raises(ValueError, match=r"^scale: expected a value that fits torch\.float32"):
        sdpa(q.half(), k.half(), v.half(), scale=1e39, backend=backend)
    q, k, v = (t.double() * 1e-40 for t in (q, k, v))
    assert_matches(sdpa(q, k, v, scale=1e39, backend=backend), oracle(q, k, v, scale=1e39), atol=1e-45)


# 4. NaN and inf inside q, k or v ------------------------------------------------------------------

L, S = 6, 8


def bool_mask() -> torch.Tensor:
    keep = torch.rand(L, S, generator=torch.Generator().manual_seed(5)) > 0.4
    keep[1] = False  # a row with no visible key
    keep[:, 3] = False  # a key hidden from every row
    return keep


def float_mask() -> torch.Tensor:
    bias = torch.randn(L, S, generator=torch.Generator().manual_seed(6))
    return bias.masked_fill(~bool_mask(), -math.inf)


SITUATIONS = {
    "none": {},
    "bool-mask": dict(attn_mask=bool_mask()),
    "float-mask": dict(attn_mask=float_mask()),
    "causal": dict(is_causal=True),
    "causal-bottom-right": dict(is_causal=True, causal_alignment="bottom_right"),
    "window": dict(window=(1, 1)),
    "bool-mask-causal-window": dict(attn_mask=bool_mask(), is_causal=True, window=(2, None)),
}
# (tensor, head, position, dim): entries that become NaN or inf. Key 3 is hidden by both masks,
# the last key from every causal top-left row but the last ones, key 0 outside most windows.
POISON = {
    "q-row": [("q", 0, 2, 1)],
    "q-empty-row": [("q", 1, 1, 0)],
    "k-key": [("k", 0, 5, 2)],
    "k-hidden-key": [("k", 0, 3, 2)],
    "v-key": [("v", 1, 0, 0)],
    "v-hidden-key": [("v", 0, 3, 4)],
    "v-last-key": [("v", 0, S - 1, 1)],
    "k-and-v-and-q": [("k", 1, 6, 0), ("v", 0, 3, 0), ("q", 1, 4, 3)],
}


def poisoned(dtype=torch.float32, *, H=2, Hkv=2, value=math.nan, where=()):
    q, k, v = qkv(2, H, L, 8, S=S, Hkv=Hkv, Dv=5, seed=7, dtype=dtype)
    tensors = dict(q=q, k=k, v=v)
    for name, head, pos, dim in where:
        tensors[name][1, head % tensors[name].shape[1], pos, dim] = value
    return tensors["q"], tensors["k"], tensors["v"]


@pytest.mark.parametrize("poison", list(POISON))
@pytest.mark.parametrize("situation", list(SITUATIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_pattern_matches_the_reference(backend, situation, poison):
    q, k, v = poisoned(where=POISON[poison])
    options = SITUATIONS[situation]
    out = sdpa(q, k, v, backend=backend, **options)
    ref = oracle(q, k, v, **options)
    assert_matches(out, ref, atol=1e-5)


@pytest.mark.parametrize("value", [math.inf, -math.inf])
@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_entries_are_missing_like_nan(backend, value):
    q, k, v = poisoned(value=value, where=POISON["k-and-v-and-q"])
    options = dict(attn_mask=bool_mask())
    ref = oracle(q, k, v, **options)
    assert ref.isnan().any() and not ref.isnan().all()
    assert_matches(sdpa(q, k, v, backend=backend, **options), ref, atol=1e-5)


def minus_inf_products(value, dtype=torch.float32, *, H=2, Hkv=2, L=L, S=S, key=5) -> tuple[torch.Tensor, ...]:
    """q, k, v with an infinite entry in k (at key ``key`` of batch 1, k-head 0, dim 2) whose product
    with every query row is -inf: IEEE arithmetic gives that key weight 0 and leaves every row
    finite, where the rules make each row that sees the key NaN. (A random q gives some rows +inf
    or NaN products, and the output check alone finds those.)"""
    q, k, v = qkv(2, H, L, 8, S=S, Hkv=Hkv, Dv=5, seed=7, dtype=dtype)
    k[1, 0, key, 2] = value
    q[..., 2] = q[..., 2].abs().clamp_min(0.5) * (-1 if value > 0 else 1)
    return q, k, v


@pytest.mark.parametrize("situation", list(SITUATIONS))
@pytest.mark.parametrize("value", [math.inf, -math.inf])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inf_in_k_whose_products_are_all_minus_inf_is_missing_too(backend, value, situation):
    q, k, v = minus_inf_products(value)
    options = SITUATIONS[situation]
    ref = oracle(q, k, v, **options)
    assert ref.isnan().any() and not ref.isnan().all()
    assert_matches(sdpa(q, k, v, backend=backend, **options), ref, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [dict(alibi_slopes=attnscale.alibi_slopes(4)), dict(return_stats=True), dict(attn_mask=float_mask(), sinks=torch.tensor([0.5, -1.0, 0.0, 2.0]))],
    ids=["alibi", "stats", "float-mask-sinks"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", OWN_BACKENDS)
def test_an_inf_in_k_whose_products_are_all_minus_inf_with_gqa_features_and_dtypes(backend, dtype, options):
    q, k, v = minus_inf_products(math.inf, dtype, H=4, Hkv=2)
    out = sdpa(q, k, v, enable_gqa=True, backend=backend, **options)
    ref = oracle(q, k, v, **options)
    if options.get("return_stats"):
        (out, stats), (ref, ref_stats) = out, ref
        np.testing.assert_array_equal(stats.lse.isnan().numpy(), np.isnan(ref_stats["lse"]))
    assert ref.isnan().any() and not ref.isnan().all()
    assert_matches(out, ref, atol={torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype])


@pytest.mark.skipif(kernels.build_precondition() is not None, reason="the compiled kernel cannot be had here")
@pytest.mark.parametrize("key", [1000, 1023])
@pytest.mark.parametrize("hidden", [False, True], ids=["visible", "hidden-by-causal"])
def test_an_inf_in_k_whose_products_are_all_minus_inf_over_many_key_tiles(hidden, key):
    # 1100 rows and keys: the compiled kernel meets the key in one of several key tiles, beside
    # rows that could take a static offset (the key is hidden from the causal rows before it).
    # Key 1023 ends a key tile, so every causal row that sees it has it inside a whole vector.
    # With softcap the key's infinite norm must keep rows from a static offset: softcap tanh(inf) is
    # finite, and a static row's softcap bounds the infinite product to a finite logit.
    q, k, v = minus_inf_products(-math.inf, L=1100, S=1100, key=key)
    options = dict(is_causal=True, softcap=30.0) if hidden else {}
    ref = oracle(q, k, v, **options)
    assert ref.isnan().any() and not ref.isnan().all()
    assert_matches(sdpa(q, k, v, backend="fused", **options), ref, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_and_slopes_are_validated_as_they_are_used(backend):
    # float64 values that are finite, but +inf in float32, where float32 inputs are scored: the
    # math backend once returned 31.5 for a sink of 1e300 (no weighted average of the values).
    q, k, v = qkv(1, 2, 4, 8, S=6, seed=8)
    with pytest.raises(ValueError, match=r"^sinks: expected finite logits in torch.float32 .*at heads \[1\]"):
        sdpa(q, k, v, sinks=torch.tensor([0.0, 1e300], dtype=torch.float64), backend=backend)
    with pytest.raises(ValueError, match=r"^alibi_slopes: expected finite slopes in torch.float32"):
        sdpa(q, k, v, alibi_slopes=torch.tensor([0.5, 1e300], dtype=torch.float64), backend=backend)
    out = sdpa(q, k, v, sinks=torch.tensor([0.0, -1e300], dtype=torch.float64), backend=backend)  # -inf in float32: no sink
    torch.testing.assert_close(out[:, 1], sdpa(q, k, v, backend=backend)[:, 1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("situation", ["none", "causal", "bool-mask"])
@pytest.mark.parametrize("poison", ["q-row", "k-key", "k-hidden-key", "k-and-v-and-q"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("backend", OWN_BACKENDS + ["auto"])
def test_non_finite_q_and_k_under_a_softcap_are_missing_too(backend, value, poison, situation):
    # tanh(+-inf) = +-1: the cap turns an infinite product into a finite logit, and the output
    # check alone would pass the row (unless, as with this bool mask, some row is empty).
    q, k, v = poisoned(value=value, where=POISON[poison])
    options = dict(SITUATIONS[situation], softcap=5.0)
    ref = oracle(q, k, v, **options)
    assert ref.isnan().any() or poison == "k-hidden-key"
    assert_matches(sdpa(q, k, v, backend=backend, **options), ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"softcap": 5.0}], ids=lambda o: "-".join(o) or "plain")
def test_auto_gradients_of_products_beyond_float32_are_those_of_float64(options, dtype):
    # torch's own float64 SDPA, where auto first sends this plain call, returns NaN gradients for
    # logits near 1e60 at this shape: the float64 recompute must not run there.
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=gen) * m for m in (1e30, 1e30, 1.0))
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = sdpa(*leaves, **options)
    out.float().sum().backward()
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want = sdpa(*wide, backend="math", **options)
    want.sum().backward()
    assert_matches(out, want.detach(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    for got, expected in zip(leaves, wide):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad.double(), expected.grad, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-6)


@pytest.mark.parametrize("situation", ["none", "bool-mask", "causal-bottom-right"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_pattern_with_gqa(backend, situation):
    q, k, v = poisoned(H=4, Hkv=2, where=[("k", 1, 5, 0), ("v", 0, 3, 1), ("q", 2, 0, 0)])
    options = SITUATIONS[situation]
    out = sdpa(q, k, v, enable_gqa=True, backend=backend, **options)
    assert_matches(out, oracle(q, k, v, **options), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_pattern_in_every_dtype(backend, dtype):
    q, k, v = poisoned(dtype, where=POISON["k-and-v-and-q"])
    options = dict(attn_mask=float_mask().to(dtype), is_causal=True)
    out = sdpa(q, k, v, backend=backend, **options)
    assert out.dtype == dtype
    assert_matches(out, oracle(q, k, v, **options), atol={torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}[dtype])


@pytest.mark.parametrize("backend", ["auto", "math", "torch"])
def test_nan_pattern_with_dropout(backend):
    # Dropout may zero a weight, but the key stays visible: its NaN still reaches the row.
    q, k, v = poisoned(where=POISON["k-and-v-and-q"])
    options = dict(attn_mask=bool_mask())
    torch.manual_seed(0)
    out = sdpa(q, k, v, dropout_p=0.5, backend=backend, **options)
    ref = oracle(q, k, v, **options)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.isfinite(out[~ref.isnan()]).all()


@pytest.mark.parametrize("backend", OWN_BACKENDS)
def test_nan_rows_have_nan_statistics_and_sinks_change_nothing_else(backend):
    q, k, v = poisoned(where=POISON["k-and-v-and-q"])
    sinks = torch.tensor([0.5, -1.0])
    options = dict(attn_mask=bool_mask(), softcap=3.0, alibi_slopes=attnscale.alibi_slopes(2), sinks=sinks, return_stats=True)
    out, stats = sdpa(q, k, v, backend=backend, **options)
    ref, ref_stats = oracle(q, k, v, **options)
    assert_matches(out, ref, atol=1e-5)
    for name in ("lse", "max_logit", "max_prob", "entropy", "sink_share"):
        got, want = getattr(stats, name).numpy(), np.broadcast_to(ref_stats[name], stats.lse.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)  # NaN where the reference has NaN
    np.testing.assert_array_equal(stats.visible_keys.numpy(), np.broadcast_to(ref_stats["visible_keys"], stats.lse.shape))


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_gradients_are_finite_and_right_for_the_finite_rows(backend):
    q, k, v = poisoned(where=POISON["k-and-v-and-q"])
    options = dict(attn_mask=bool_mask(), is_causal=True, causal_alignment="bottom_right")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa(*leaves, backend=backend, **options)
    keep = ~out.isnan()
    assert keep.any() and not keep.all()
    out.nan_to_num(0.0).sum().backward()
    # The same loss on the finite rows only, from inputs whose non-finite entries are 0: those
    # entries sit where they cannot matter, so its gradient is the right one.
    clean = [torch.where(torch.isfinite(t), t, 0.0).requires_grad_() for t in (q, k, v)]
    (sdpa(*clean, backend="math", **options) * keep).sum().backward()
    for got, want in zip(leaves, clean):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def key_3_hidden(kind: str) -> dict:
    """Options that hide key 3 from every row and leave every row some key (an empty row is a zero
    output row, which sends a call down the careful path by itself)."""
    keep = torch.ones(L, S, dtype=torch.bool)
    keep[:, 3] = False
    if kind == "bool-mask":
        return dict(attn_mask=keep)
    if kind == "float-mask":
        return dict(attn_mask=torch.zeros(L, S).masked_fill(~keep, -math.inf))
    return dict(attn_mask=keep, is_causal=True, causal_alignment="bottom_right")


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("situation", ["bool-mask", "float-mask", "bool-mask-causal"])
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_gradients_with_a_non_finite_key_hidden_from_every_row(backend, situation, value, softcap):
    # Every output row is finite, so only a look at k finds the entry; dS k once multiplied the
    # hidden key's zero by it: NaN gradients from the compiled and tiled kernels (and the math
    # backend's, for a key hidden by causal alone, as in the last key of a top-left causal call
    # with L < S, below).
    # A softcap: a NaN bound on the logits once lost its NaN in max(softcap, NaN) = softcap.
    if softcap is not None and backend == "torch":
        pytest.skip("torch's SDPA has no softcap")
    q, k, v = poisoned(value=value, where=[("k", 0, 3, 2)])  # (a NaN in v's row: a NaN output row, which is looked at)
    options = key_3_hidden(situation)
    for options in (options, dict(is_causal=True)) if situation == "bool-mask" else (options,):
        options = dict(options, softcap=softcap)
        if options.get("is_causal") and "attn_mask" not in options:
            q, k, v = poisoned(value=value, where=[("k", 0, S - 1, 2)])
        ref = oracle(q, k, v, **options)
        assert not ref.isnan().any()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sdpa(*leaves, backend=backend, **options)
        assert_matches(out.detach(), ref, atol=1e-5)
        out.sum().backward()
        clean = [torch.where(torch.isfinite(t), t, 0.0).requires_grad_() for t in (q, k, v)]
        sdpa(*clean, backend="math", **options).sum().backward()
        for got, want in zip(leaves, clean):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_inputs_take_the_fast_path_whole(backend, monkeypatch):
    # The careful path runs only when an output row is NaN, inf or zero.
    import attnscale.guard as guard

    def refuse(*args, **kwargs):
        raise AssertionError("careful path on finite, well-scaled inputs")

    monkeypatch.setattr(guard, "_careful", refuse)
    q, k, v = qkv(2, 2, 5, 8, S=7)
    sdpa(q, k, v, backend=backend, attn_mask=torch.rand(5, 7, generator=torch.Generator().manual_seed(1)) > 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_no_visible_key_and_zero_values_stay_zero(backend):
    q, k, v = qkv(1, 2, 4, 8, S=6)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[2] = False
    out = sdpa(q, k, torch.zeros_like(v), attn_mask=keep, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    out = sdpa(q, k, v, attn_mask=keep, backend=backend)
    assert (out[:, :, 2] == 0).all() and (out[:, :, [0, 1, 3]].abs().amax(-1) > 0).all()
