"""Calls the compiled kernel computes by its plan (a feature torch lacks: softcap, window, ALiBi,
sinks, bottom-right alignment, return_stats), remembered by their signature in the compiled kernel
(``remember_kernel_call``) after the full pipeline ran one: a later call of that signature makes
the same kernel call with the checks of values (finite slopes, sinks below +inf) and the guard's
first check, in one compiled call, also where a gradient is asked (the kernel's autograd rule as a
C++ node). Every answer is the pipeline's, bit for bit; anything the memory cannot vouch for takes
the full pipeline."""

from __future__ import annotations

import math

import pytest
import torch

import attnscale
from attnscale import CausalAlignment, functional, kernels, reference
from attnscale.kernels import ops

from .memory_spies import _nothing_remembered, counting  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the remembered calls live in the compiled kernel")


@pytest.fixture
def validated(monkeypatch) -> list[int]:
    """One entry per call that took the full pipeline (its validation)."""
    return counting(monkeypatch, functional, "check_attention_call")


def _qkv(seed: int, *, L=3, S=24, H=4, Hkv=2, D=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return draw(2, H, L, D), draw(2, Hkv, S, D), draw(2, Hkv, S, D)


_SINKS = torch.tensor([0.5, -1.0, -math.inf, 2.0])
CASES = {
    "softcap": dict(softcap=5.0),
    "window": dict(window=(4, 0), is_causal=True),
    "window, sides as None and an int": dict(window=(None, 2)),
    "alibi": dict(alibi_slopes=attnscale.alibi_slopes(4)),
    "alibi per batch entry": dict(alibi_slopes=attnscale.alibi_slopes(4).expand(2, 4).contiguous()),
    "bottom-right causal": dict(is_causal=True, causal_alignment=CausalAlignment.BOTTOM_RIGHT),
    "bottom-right causal window, the alignment as a str": dict(is_causal=True, causal_alignment="bottom_right", window=(5, 0)),
    "softcap, top-left as a str": dict(softcap=5.0, causal_alignment="top_left", is_causal=True),
    "sinks": dict(sinks=_SINKS),
    "return_stats": dict(return_stats=True),
    "return_stats with sinks and softcap": dict(return_stats=True, sinks=_SINKS, softcap=3.0),
    "scale": dict(softcap=5.0, scale=0.7),
    "float64": dict(softcap=5.0, dtype=torch.float64),
    "float32 slopes, float64 inputs": dict(alibi_slopes=attnscale.alibi_slopes(4), dtype=torch.float64),
}


def _split(case: dict) -> tuple[dict, dict]:
    options = dict(case)
    dtype = options.pop("dtype", torch.float32)
    return dict(dtype=dtype), dict(options, enable_gqa=True)


def _equal(a, b) -> None:
    """Bit for bit: the output, and every statistic where there are statistics."""
    if isinstance(a, tuple):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0, equal_nan=True)
        for name in ("lse", "max_logit", "max_prob", "entropy", "visible_keys", "sink_share"):
            x, y = getattr(a[1], name), getattr(b[1], name)
            assert (x is None) == (y is None), name
            if x is not None:
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=name)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", CASES, ids=str)
def test_a_remembered_kernel_call_skips_the_pipeline_and_equals_it(name, validated):
    shape, options = _split(CASES[name])
    q, k, v = _qkv(0, **shape)
    first = attnscale.scaled_dot_product_attention(q, k, v, **options)
    assert len(validated) == 1 and attnscale.last_backend() == "fused"
    again = attnscale.scaled_dot_product_attention(q, k, v, **options)
    assert len(validated) == 1, "a remembered call is not validated again"
    assert attnscale.last_backend() == "fused"
    _equal(again, first)
    # and both are the semantics: the float64 reference
    out = again[0] if isinstance(again, tuple) else again
    # (measured: at most 5.3e-7 in float32, 6.7e-16 in float64 over these cases)
    torch.testing.assert_close(out.double(), _reference(q, k, v, **options), rtol=0, atol=2e-6 if q.dtype == torch.float32 else 4e-15)


def _reference(q, k, v, **options):
    """The float64 reference (numpy; key and value heads repeated for the query heads they serve)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    options = {name: value for name, value in options.items() if name not in ("enable_gqa", "return_stats")}
    numpy = {name: (x.detach().double().numpy() if isinstance(x, torch.Tensor) else x) for name, x in options.items()}
    if "causal_alignment" in numpy:
        numpy["causal_alignment"] = CausalAlignment(numpy["causal_alignment"]).value
    return torch.from_numpy(reference.attention(*(t.detach().double().numpy() for t in (q, k, v)), **numpy))


def _forced(q, k, v, **options):
    """The same call through the full pipeline every time (a named backend is never remembered)."""
    return attnscale.scaled_dot_product_attention(q, k, v, backend="fused", **options)


def test_a_growing_cache_with_a_feature_takes_the_remembered_call_at_every_length(validated):
    # Top-left alignment: the query offset is 0 at every key length, so one signature serves all.
    q, k, v = _qkv(1, L=1, S=40)
    for S in range(20, 40):
        out = attnscale.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], softcap=5.0, is_causal=True, enable_gqa=True)
        _equal(out, _forced(q, k[:, :, :S], v[:, :, :S], softcap=5.0, is_causal=True, enable_gqa=True))
    assert len(validated) == 1 + 20, "one full call, then every step remembered (the forced calls validate)"


def test_bottom_right_alignment_is_remembered_per_key_length(validated):
    # There the query offset is S - L: each key length is a signature of its own.
    q, k, v = _qkv(2, L=3, S=40)
    options = dict(is_causal=True, causal_alignment=CausalAlignment.BOTTOM_RIGHT, enable_gqa=True)
    for S in (20, 21, 20, 21):
        out = attnscale.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], **options)
        _equal(out, _forced(q, k[:, :, :S], v[:, :, :S], **options))
    assert len(validated) == 2 + 4, "two full calls, then both lengths remembered (the forced calls validate)"


def _gradients(q, k, v, slopes, **options):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    slopes = slopes.clone().requires_grad_()
    result = attnscale.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, enable_gqa=True, **options)
    out, stats = result if isinstance(result, tuple) else (result, None)
    loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum() + (0 if stats is None else stats.lse.sum())
    loss.backward()
    return out.detach(), q.grad, k.grad, v.grad, slopes.grad


GRAD_CASES = {
    "learned slopes": dict(),
    "learned slopes, statistics (lse carries a gradient)": dict(return_stats=True),
    "learned slopes per batch entry": dict(per_batch=True),
    "learned slopes, window, softcap": dict(window=(3, 1), softcap=4.0),
    "float32 slopes, float64 inputs": dict(dtype=torch.float64),
}


@pytest.mark.parametrize("name", GRAD_CASES, ids=str)
def test_gradients_through_a_remembered_kernel_call_are_the_pipelines(name, validated):
    options = dict(GRAD_CASES[name])
    dtype, per_batch = options.pop("dtype", torch.float32), options.pop("per_batch", False)
    q, k, v = _qkv(3, dtype=dtype)
    slopes = attnscale.alibi_slopes(4)
    slopes = slopes.expand(2, 4).contiguous() if per_batch else slopes
    first = _gradients(q, k, v, slopes, **options)
    again = _gradients(q, k, v, slopes, **options)
    assert len(validated) == 1, "the second call is remembered"
    for got, want in zip(again, first):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert first[4].dtype == slopes.dtype and first[4].shape == slopes.shape


def test_a_remembered_kernel_call_refuses_a_double_backward():
    q, k, v = _qkv(4)
    slopes = attnscale.alibi_slopes(4).requires_grad_()
    q.requires_grad_()
    for _ in range(2):  # the full pipeline, then the remembered call
        out = attnscale.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, enable_gqa=True)
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="attnscale's fused backend has no double backward"):
            dq.sum().backward()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(dict(alibi_slopes=torch.tensor([0.5, math.nan, 0.25, 0.125])), id="a NaN slope"),
        pytest.param(dict(alibi_slopes=torch.tensor([0.5, math.inf, 0.25, 0.125])), id="an infinite slope"),
        pytest.param(dict(sinks=torch.tensor([0.5, math.inf, 0.0, 0.0])), id="a +inf sink"),
        pytest.param(dict(sinks=torch.tensor([0.5, math.nan, 0.0, 0.0])), id="a NaN sink"),
    ],
)
def test_values_a_signature_cannot_prove_are_checked_on_every_remembered_call(bad, validated):
    q, k, v = _qkv(5)
    good = {name: torch.full_like(t, 0.25) for name, t in bad.items()}
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, **good)
    assert len(validated) == 1
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name}: expected finite"):
        attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, **bad)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_a_remembered_kernel_signature_still_follows_the_nan_rule(where, validated):
    q, k, v = _qkv(6)
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
    poisoned = dict(q=q.clone(), k=k.clone(), v=v.clone())
    poisoned[where][1, 1, 2, 3] = math.nan
    out = attnscale.scaled_dot_product_attention(poisoned["q"], poisoned["k"], poisoned["v"], softcap=5.0, enable_gqa=True)
    assert len(validated) == 2, "the kernel's verdict sends the call to the full pipeline"
    want = _reference(poisoned["q"], poisoned["k"], poisoned["v"], softcap=5.0)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6, equal_nan=True)


def test_an_inf_in_k_under_a_gradient_takes_the_full_pipeline(validated):
    # Its products with a row may all be -inf: the kernel's rows look right, the gradients need the look at k.
    q, k, v = _qkv(7)
    q.requires_grad_()
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
    assert len(validated) == 1
    bad = k.clone()
    bad[0, 0, 5, 0] = math.inf
    out = attnscale.scaled_dot_product_attention(q, bad, v, softcap=5.0, enable_gqa=True)
    assert len(validated) == 2
    out.nan_to_num().sum().backward()
    assert torch.isfinite(q.grad).all()


def test_sinks_that_require_grad_take_the_full_pipeline_and_get_their_gradient(validated):
    q, k, v = _qkv(8)
    for _ in range(3):
        sinks = _SINKS.clone().requires_grad_()
        attnscale.scaled_dot_product_attention(q, k, v, sinks=sinks, enable_gqa=True).sum().backward()
        assert sinks.grad is not None and torch.isfinite(sinks.grad[[0, 1, 3]]).all()
    assert len(validated) == 3


OTHER_ROUTES = {
    "the alignment as a str subclass": dict(causal_alignment=type("Alignment", (str,), {})("bottom_right"), is_causal=True),
    "a window as a list": dict(window=[4, 0]),
    "an int softcap": dict(softcap=5),
    "a named backend": dict(softcap=5.0, backend="fused"),
    "a mask": dict(softcap=5.0, attn_mask=torch.ones(3, 24, dtype=torch.bool)),
}


@pytest.mark.parametrize("route", OTHER_ROUTES, ids=str)
def test_calls_off_the_remembered_form_take_the_full_pipeline(route, validated):
    q, k, v = _qkv(9)
    options = OTHER_ROUTES[route]
    first = attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)
    again = attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)
    assert len(validated) == 2, "validated in full each time"
    _equal(again, first)


def test_inputs_blas_cannot_read_as_they_lie_take_the_full_pipeline(validated):
    q, k, v = _qkv(10)
    attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same sizes, a last dim of stride L
    out = attnscale.scaled_dot_product_attention(strided, k, v, softcap=5.0, enable_gqa=True)
    assert len(validated) == 2
    _equal(out, _forced(q, k, v, softcap=5.0, enable_gqa=True))


# --- 16-bit plans: remembered where no gradient is asked and ATTNSCALE_HALF_PRODUCTS is unset ----

SIXTEEN_CASES = {
    "softcap": dict(softcap=5.0),
    "float32 slopes": dict(alibi_slopes=attnscale.alibi_slopes(4)),
    "float32 sinks (rows merged in float32, then rounded)": dict(sinks=_SINKS),
    "bottom-right window, statistics": dict(is_causal=True, causal_alignment="bottom_right", window=(5, 0), return_stats=True),
    "statistics with sinks and softcap": dict(return_stats=True, sinks=_SINKS, softcap=3.0),
}
SHAPES_16 = {"a decoding step, one query head per key head": dict(L=1, Hkv=4), "three rows, two query heads per key head": dict(L=3, Hkv=2)}


@pytest.fixture(params=["float32 tiles", "16-bit products"])
def products(request, monkeypatch) -> bool:
    """The product path the CPU would choose (ops._half_hardware), each in turn: True for 16-bit
    products, taken by calls of more than FEW_ROWS rows or of grouped heads."""
    native = request.param == "16-bit products"
    if native and not (kernels.load().half_gemm(1) and kernels.load().half_gemm(2)):
        pytest.skip("this torch has no oneMKL 16-bit products")
    monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS", raising=False)
    monkeypatch.setattr(ops, "_half_hardware", lambda dtype: native)
    return native


@pytest.mark.parametrize("shape", SHAPES_16, ids=str)
@pytest.mark.parametrize("name", SIXTEEN_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_remembered_16_bit_kernel_call_is_the_pipelines_on_either_product_path(dtype, name, shape, products, validated):
    sizes = SHAPES_16[shape]
    options = dict(SIXTEEN_CASES[name], enable_gqa=True)
    q, k, v = _qkv(11, dtype=dtype, **sizes)
    few_rows = sizes["L"] <= ops.FEW_ROWS and sizes["Hkv"] == q.shape[1]
    assert ops.half_products(dtype, sizes["L"], q.shape[1] // sizes["Hkv"]) is (products and not few_rows)
    first = attnscale.scaled_dot_product_attention(q, k, v, **options)
    again = attnscale.scaled_dot_product_attention(q, k, v, **options)
    assert len(validated) == 1 and attnscale.last_backend() == "fused", "the second call is remembered"
    _equal(again, first)
    out = again[0] if isinstance(again, tuple) else again
    assert out.dtype == dtype
    q2, k2, v2 = _qkv(12, dtype=dtype, **sizes)  # other tensors of the signature
    _equal(attnscale.scaled_dot_product_attention(q2, k2, v2, **options), _forced(q2, k2, v2, **options))
    assert len(validated) == 2, "the forced call validates; the remembered one does not"
    if set(options) <= {"softcap", "sinks", "enable_gqa"}:  # the HuggingFace layer's call: (B, L, H, Dv), remembered as well
        given = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softcap=None, window=None, sinks=None) | options
        for _ in range(2):
            _equal(functional.transposed_attention(q2, k2, v2, **given), _forced(q2, k2, v2, **options).transpose(1, 2).contiguous())
        assert len(validated) == 4, "the transposed calls take the signature's remembered plan (only the forced calls validate)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_set_half_products_flag_is_read_by_the_pipeline_on_a_remembered_16_bit_signature(dtype, monkeypatch, validated):
    """A signature remembered with the CPU's product path is not answered while the flag is set,
    which then chooses the path (and its errors), nor remembered while it is set."""
    monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS", raising=False)
    monkeypatch.setattr(ops, "_half_hardware", lambda dtype: False)
    q, k, v = _qkv(13, dtype=dtype)
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
    assert len(validated) == 1
    monkeypatch.setenv("ATTNSCALE_HALF_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="ATTNSCALE_HALF_PRODUCTS: expected 0 or 1"):
        attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
    if kernels.load().half_gemm(1) and kernels.load().half_gemm(2):  # the other path, where this torch has it
        monkeypatch.setenv("ATTNSCALE_HALF_PRODUCTS", "1")
        forced = [attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True) for _ in range(2)]
        _equal(forced[0], _forced(q, k, v, softcap=5.0, enable_gqa=True))
        _equal(forced[1], forced[0])
        monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS")
        tiles = attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
        assert not torch.equal(tiles, forced[0]), "the two paths round the weights apart"
    # A new signature is not remembered while the flag is set (with "1", a plan of the path the
    # CPU would not choose, which calls made once the flag is unset must not take).
    native = kernels.load().half_gemm(1) and kernels.load().half_gemm(2)
    monkeypatch.setenv("ATTNSCALE_HALF_PRODUCTS", "1" if native else "0")
    q3, k3, v3 = _qkv(14, dtype=dtype, L=2)
    before = len(validated)
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q3, k3, v3, softcap=5.0, enable_gqa=True)
    assert len(validated) == before + 2
    monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS")
    _equal(attnscale.scaled_dot_product_attention(q3, k3, v3, softcap=5.0, enable_gqa=True), _forced(q3, k3, v3, softcap=5.0, enable_gqa=True))


@pytest.mark.parametrize("where", ["q", "k", "v"], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_remembered_16_bit_kernel_signature_still_follows_the_nan_rule(dtype, where, validated):
    q, k, v = _qkv(15, dtype=dtype)
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
    assert len(validated) == 1
    poisoned = dict(q=q.clone(), k=k.clone(), v=v.clone())
    poisoned[where][1, 1, 2, 3] = math.nan
    out = attnscale.scaled_dot_product_attention(poisoned["q"], poisoned["k"], poisoned["v"], softcap=5.0, enable_gqa=True)
    assert len(validated) == 2, "the kernel's verdict sends the call to the full pipeline"
    assert bool(out.isnan().any())
    _equal(out, _forced(poisoned["q"], poisoned["k"], poisoned["v"], softcap=5.0, enable_gqa=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_calls_that_ask_a_gradient_take_the_full_pipeline(dtype, validated):
    """Remembered without a gradient, asked with one: the pipeline's float32 copies and their
    autograd rule; asked with one first: never remembered."""
    q, k, v = _qkv(16, dtype=dtype)
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, enable_gqa=True)
    grads = []
    for _ in range(2):
        leaf = q.clone().requires_grad_()
        attnscale.scaled_dot_product_attention(leaf, k, v, softcap=5.0, enable_gqa=True).float().sum().backward()
        grads.append(leaf.grad)
    assert len(validated) == 3
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    leaf = q[:, :, :2].clone().requires_grad_()  # a new signature, a gradient asked on its first call
    for _ in range(2):
        attnscale.scaled_dot_product_attention(leaf, k, v, softcap=5.0, enable_gqa=True)
    with torch.no_grad():
        attnscale.scaled_dot_product_attention(leaf, k, v, softcap=5.0, enable_gqa=True)
    assert len(validated) == 6, "a call that asks a gradient leaves nothing remembered"


# --- packed calls (varlen_attention): their sequences read from the lengths at every call -------


@pytest.fixture
def packed_validated(monkeypatch) -> list[int]:
    """One entry per packed call that took the full pipeline (its validation)."""
    from attnscale import varlen

    return counting(monkeypatch, varlen, "check_packed_call")


def _packed(seed: int, lengths_q=(1, 3, 0, 2), lengths_k=(16, 24, 8, 5), H=4, Hkv=2, D=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return draw(sum(lengths_q), H, D), draw(sum(lengths_k), Hkv, D), draw(sum(lengths_k), Hkv, D), cu(lengths_q), cu(lengths_k)


PACKED_CASES = {
    "causal": dict(is_causal=True),
    "softcap, window": dict(softcap=5.0, window=(3, 0)),
    "ALiBi per sequence, statistics": dict(alibi_slopes=torch.rand(4, 4, generator=torch.Generator().manual_seed(1)), return_stats=True),
    "ALiBi, float64": dict(alibi_slopes=attnscale.alibi_slopes(4), is_causal=True, dtype=torch.float64),
    "max_seqlen given, scale": dict(max_seqlen_q=3, max_seqlen_k=24, scale=0.3),
}


@pytest.mark.parametrize("name", PACKED_CASES, ids=str)
def test_a_remembered_packed_call_skips_the_pipeline_and_equals_it(name, packed_validated):
    options = dict(PACKED_CASES[name])
    q, k, v, cu_q, cu_k = _packed(11, dtype=options.pop("dtype", torch.float32))
    first = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options)
    assert len(packed_validated) == 1 and attnscale.last_backend() == "fused"
    again = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options)
    assert len(packed_validated) == 1, "a remembered packed call is not validated again"
    assert attnscale.last_backend() == "fused"
    _equal(again, first)
    if options.get("return_stats"):
        assert again[1].lse.shape == (4, q.shape[0])


PACKED_16 = {name: PACKED_CASES[name] for name in ("causal", "softcap, window", "ALiBi per sequence, statistics")}


@pytest.mark.parametrize("name", PACKED_16, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_remembered_16_bit_packed_call_is_the_pipelines_on_either_product_path(dtype, name, products, packed_validated):
    options = PACKED_16[name]
    q, k, v, cu_q, cu_k = _packed(17, dtype=dtype)
    assert ops.half_products(dtype) is products
    first = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options)
    again = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options)
    assert len(packed_validated) == 1 and attnscale.last_backend() == "fused", "the second call is remembered"
    _equal(again, first)
    out = again[0] if isinstance(again, tuple) else again
    assert out.dtype == dtype and out.shape == (q.shape[0], 4, 16)
    q2, k2, v2, _, _ = _packed(18, dtype=dtype)
    _equal(attnscale.varlen_attention(q2, k2, v2, cu_q, cu_k, **options), attnscale.varlen_attention(q2, k2, v2, cu_q, cu_k, backend="fused", **options))
    assert len(packed_validated) == 2, "the forced call validates; the remembered one does not"


def test_a_set_half_products_flag_is_read_by_the_pipeline_on_a_remembered_16_bit_packed_signature(monkeypatch, packed_validated):
    monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS", raising=False)
    native = kernels.load().half_gemm(1)  # the CPU's path 16-bit products where this torch has them: not the flag's "0" below
    monkeypatch.setattr(ops, "_half_hardware", lambda dtype: native)
    q, k, v, cu_q, cu_k = _packed(19, dtype=torch.bfloat16)
    for _ in range(2):
        attnscale.varlen_attention(q, k, v, cu_q, cu_k, softcap=5.0)
    assert len(packed_validated) == 1
    monkeypatch.setenv("ATTNSCALE_HALF_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="ATTNSCALE_HALF_PRODUCTS: expected 0 or 1"):
        attnscale.varlen_attention(q, k, v, cu_q, cu_k, softcap=5.0)
    monkeypatch.setenv("ATTNSCALE_HALF_PRODUCTS", "0")
    q3, k3, v3, cu_q3, cu_k3 = _packed(20, lengths_q=(2, 2), lengths_k=(7, 9), dtype=torch.bfloat16)  # a new signature
    before = len(packed_validated)
    for _ in range(2):
        attnscale.varlen_attention(q3, k3, v3, cu_q3, cu_k3, softcap=5.0)
    assert len(packed_validated) == before + 2, "not remembered while the flag is set"
    monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS")
    _equal(attnscale.varlen_attention(q3, k3, v3, cu_q3, cu_k3, softcap=5.0), attnscale.varlen_attention(q3, k3, v3, cu_q3, cu_k3, softcap=5.0, backend="fused"))


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_new_lengths_with_the_same_longest_query_take_the_remembered_call(packed_validated):
    # Decoding steps of a batch: the sequences' keys grow (and the packed rows with them) every
    # call; the most queries of a sequence, which the plan's tiles are chosen from, stays 3.
    q, k, v, _, _ = _packed(12, lengths_k=(40, 40, 40, 40))
    slopes = torch.rand(4, 4, generator=torch.Generator().manual_seed(2))
    options = dict(is_causal=True, softcap=5.0, alibi_slopes=slopes, return_stats=True)
    steps = [((1, 3, 0, 2), (16, 24, 8, 5)), ((1, 3, 0, 2), (17, 25, 9, 6)), ((3, 1, 2, 0), (6, 9, 25, 17)), ((3, 2, 1, 0), (3, 30, 12, 0))]
    got = []
    for lengths_q, lengths_k in steps:
        rows_q, rows_k = sum(lengths_q), sum(lengths_k)
        got.append(attnscale.varlen_attention(q[:rows_q], k[:rows_k], v[:rows_k], _cu(lengths_q), _cu(lengths_k), max_seqlen_k=max(lengths_k), **options))
        assert attnscale.last_backend() == "fused"
    assert len(packed_validated) == 1, "one full call, then every step remembered"
    kernels.load().forget_calls()
    for (lengths_q, lengths_k), (out, stats) in zip(steps, got):
        rows_q, rows_k = sum(lengths_q), sum(lengths_k)
        want, want_stats = attnscale.varlen_attention(q[:rows_q], k[:rows_k], v[:rows_k], _cu(lengths_q), _cu(lengths_k), backend="fused", **options)
        _equal(out, want)
        for field in ("lse", "max_logit", "max_prob", "entropy", "visible_keys"):
            _equal(getattr(stats, field), getattr(want_stats, field))


def test_another_longest_query_is_another_signature(packed_validated):
    q, k, v, cu_q, cu_k = _packed(14)
    for _ in range(2):
        attnscale.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    longer = _cu((4, 0, 0, 2))  # the same total, 4 queries in one sequence
    out = attnscale.varlen_attention(q, k, v, longer, cu_k, is_causal=True)
    assert len(packed_validated) == 2
    _equal(out, attnscale.varlen_attention(q, k, v, longer, cu_k, is_causal=True, backend="fused"))


BAD_LENGTHS = {
    "cu_seqlens_q not starting at 0": dict(cu_seqlens_q=torch.tensor([1, 2, 5, 5, 6], dtype=torch.int32)),
    "cu_seqlens_k decreasing": dict(cu_seqlens_k=torch.tensor([0, 16, 12, 48, 53], dtype=torch.int32)),
    "cu_seqlens_k ending short of the keys": dict(cu_seqlens_k=torch.tensor([0, 16, 40, 48, 52], dtype=torch.int32)),
    "cu_seqlens_q, int64, past the queries": dict(cu_seqlens_q=torch.tensor([0, 1, 4, 4, 7])),
    "max_seqlen_q below the longest": dict(max_seqlen_q=2),
    "max_seqlen_k below the longest": dict(max_seqlen_k=23),
    "fewer key sequences": dict(cu_seqlens_k=torch.tensor([0, 16, 40, 53], dtype=torch.int32)),
}


@pytest.mark.parametrize("name", BAD_LENGTHS, ids=str)
def test_bad_lengths_on_a_remembered_signature_get_the_pipelines_error(name, packed_validated):
    q, k, v, cu_q, cu_k = _packed(15)
    given = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=24, is_causal=True)
    for _ in range(2):
        attnscale.varlen_attention(q, k, v, **given)
    if "int64" in name:  # an int64 twin of the remembered signature, remembered too
        for _ in range(2):
            attnscale.varlen_attention(q, k, v, **dict(given, cu_seqlens_q=cu_q.long()))
    bad = dict(given, **BAD_LENGTHS[name])
    with pytest.raises(ValueError) as remembered:
        attnscale.varlen_attention(q, k, v, **bad)
    kernels.load().forget_calls()
    with pytest.raises(ValueError) as full:
        attnscale.varlen_attention(q, k, v, **bad)
    assert str(remembered.value) == str(full.value)


@pytest.mark.parametrize("q_shape", [(), (6, 4), (1, 6, 4, 16)], ids=["0-d", "2-d", "4-d"])
def test_a_packed_call_of_another_rank_gets_the_pipelines_error(q_shape, packed_validated):
    # the key leaves the packed row counts out and reads them from q, k, v: of those shapes only
    q, k, v, cu_q, cu_k = _packed(16)
    for _ in range(2):
        attnscale.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    bad = torch.zeros(q_shape)
    with pytest.raises(ValueError) as remembered:
        attnscale.varlen_attention(bad, k, v, cu_q, cu_k, is_causal=True)
    kernels.load().forget_calls()
    with pytest.raises(ValueError) as full:
        attnscale.varlen_attention(bad, k, v, cu_q, cu_k, is_causal=True)
    assert str(remembered.value) == str(full.value)


@pytest.mark.parametrize("route", ["gradient", "sinks", "NaN in q", "strided rows"])
def test_packed_calls_the_memory_cannot_vouch_for_take_the_full_pipeline(route, packed_validated):
    q, k, v, cu_q, cu_k = _packed(13)
    for _ in range(2):
        attnscale.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    assert len(packed_validated) == 1
    options = dict(is_causal=True)
    if route == "gradient":
        q = q.clone().requires_grad_()
    elif route == "sinks":
        options["sinks"] = torch.zeros(4)
    elif route == "NaN in q":
        q = q.clone()
        q[3, 1, 0] = math.nan
    else:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same sizes, a last dim of stride H
    got = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options)
    assert len(packed_validated) == 2, "validated in full"
    kernels.load().forget_calls()
    _equal(got.detach(), attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options).detach())
    if route == "NaN in q":
        assert torch.isnan(got[3, 1]).all() and torch.isfinite(got[torch.arange(q.shape[0]) != 3]).all()
