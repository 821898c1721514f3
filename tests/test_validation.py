"""Bad input is refused before any compute, with an error that names the argument, says what was
expected and what arrived, and gives a fix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnscale


def qkv(*, H=4, Hkv=4, L=5, S=6, D=8, Dv=8, batch=(2,), dtype=torch.float32):
    return torch.randn(*batch, H, L, D, dtype=dtype), torch.randn(*batch, Hkv, S, D, dtype=dtype), torch.randn(*batch, Hkv, S, Dv, dtype=dtype)


def refused(exc: type[Exception], arg: str, *args, **kwargs) -> str:
    """Call attention with bad input; check the exception type and the message's parts."""
    with pytest.raises(exc) as info:
        attnscale.scaled_dot_product_attention(*args, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{arg}: expected "), message
    assert ", got " in message and "Fix: " in message, message
    return message


q, k, v = qkv()


# Tensors: type, dtype, rank, shapes -----------------------------------------------------------


@pytest.mark.parametrize("arg", ["query", "key", "value"])
def test_non_tensor_inputs(arg):
    inputs = dict(query=q, key=k, value=v)
    inputs[arg] = inputs[arg].tolist()
    refused(TypeError, arg, **inputs)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8])
@pytest.mark.parametrize("arg", ["query", "key", "value"])
def test_integer_bool_and_complex_dtypes(arg, dtype):
    inputs = dict(query=q, key=k, value=v)
    inputs[arg] = torch.ones(inputs[arg].shape, dtype=dtype)
    assert "float" in refused(TypeError, arg, **inputs)


@pytest.mark.parametrize(("arg", "dtype"), [("key", torch.float64), ("value", torch.float16), ("key", torch.bfloat16)])
def test_mixed_dtypes(arg, dtype):
    inputs = dict(query=q, key=k, value=v)
    inputs[arg] = inputs[arg].to(dtype)
    message = refused(TypeError, arg, **inputs)
    assert "torch.float32" in message and str(dtype) in message


@pytest.mark.parametrize("arg", ["key", "value"])
def test_mixed_devices(arg):
    # The meta device carries shapes only, so a mismatch is observable without a GPU.
    inputs = dict(query=q, key=k, value=v)
    inputs[arg] = inputs[arg].to("meta")
    assert "meta" in refused(ValueError, arg, **inputs)


@pytest.mark.parametrize(("arg", "shape"), [("query", (5, 8)), ("key", (6,)), ("value", (6, 8))])
def test_too_few_dims(arg, shape):
    inputs = dict(query=q, key=k, value=v)
    inputs[arg] = torch.randn(shape)
    assert "at least 3 dims" in refused(ValueError, arg, **inputs)


def test_key_rank_differs_from_query():
    refused(ValueError, "key", q, k[0], v)


def test_head_dim_mismatch_between_query_and_key():
    _, k7, _ = qkv(D=7)
    assert "D = 8" in refused(ValueError, "key", q, k7, v)


def test_length_mismatch_between_key_and_value():
    assert "S = 6" in refused(ValueError, "value", q, k, v[..., :5, :])


def test_head_mismatch_between_key_and_value():
    refused(ValueError, "value", q, k, v[:, :2])


def test_a_zero_head_dim_gives_uniform_weights_as_torch():
    """D = 0: every logit is the empty sum 0 (whatever the scale), so each row averages the values
    it sees, as torch computes it; it was refused."""
    q0, k0, v0 = qkv(D=0)
    v0 = torch.randn(*v0.shape[:-1], 3)
    out = attnscale.scaled_dot_product_attention(q0, k0, v0)
    torch.testing.assert_close(out, v0.mean(-2, keepdim=True).expand_as(out), rtol=0, atol=1e-6)


def test_no_key_heads_for_query_heads_are_refused_and_no_heads_at_all_is_the_empty_output():
    q4, k0, v0 = qkv(H=4, Hkv=0)
    refused(ValueError, "key", q4, k0, v0, enable_gqa=True)
    q0, k0, v0 = qkv(H=0, Hkv=0)
    assert attnscale.scaled_dot_product_attention(q0, k0, v0).shape == (*q0.shape[:-1], v0.shape[-1])


def test_heads_differ_without_enable_gqa():
    qg, kg, vg = qkv(H=8, Hkv=2)
    assert "enable_gqa=True" in refused(ValueError, "key", qg, kg, vg)


def test_one_kv_head_broadcasts_without_enable_gqa():
    q1, k1, v1 = qkv(H=4, Hkv=1)
    out = attnscale.scaled_dot_product_attention(q1, k1, v1, backend="math")
    torch.testing.assert_close(out, attnscale.scaled_dot_product_attention(q1, k1.expand(2, 4, 6, 8), v1.expand(2, 4, 6, 8), backend="math"))


@pytest.mark.parametrize(("H", "Hkv"), [(6, 4), (4, 3), (2, 4)])
def test_query_heads_not_a_multiple_of_kv_heads(H, Hkv):
    qg, kg, vg = qkv(H=H, Hkv=Hkv)
    assert "divides" in refused(ValueError, "key", qg, kg, vg, enable_gqa=True)


def test_non_broadcastable_batch_dims():
    q3, _, _ = qkv(batch=(3,))
    assert "broadcastable" in refused(ValueError, "key", q3, k, v)


# attn_mask --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(5, 7), (6, 5), (3, 4, 5, 6), (2, 2, 5, 6), (1, 2, 4, 5, 6)],
    ids=["S", "L", "heads", "more-heads-than-H", "widens-batch"],
)
def test_mask_not_broadcastable(shape):
    assert "(2, 4, 5, 6)" in refused(ValueError, "attn_mask", q, k, v, attn_mask=torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.complex64])
def test_mask_dtype(dtype):
    assert "mask.bool()" in refused(TypeError, "attn_mask", q, k, v, attn_mask=torch.ones(5, 6, dtype=dtype))


def test_mask_not_a_tensor():
    refused(TypeError, "attn_mask", q, k, v, attn_mask=[[True] * 6] * 5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_mask_nan_or_plus_inf(bad):
    mask = torch.zeros(5, 6)
    mask[1, 2] = bad
    refused(ValueError, "attn_mask", q, k, v, attn_mask=mask)


def test_mask_on_another_device():
    refused(ValueError, "attn_mask", q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool, device="meta"))


# Scalars and choices ----------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_scale_must_be_finite(scale):
    refused(ValueError, "scale", q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_a_zero_or_negative_scale_is_a_formula_like_any_other(scale):
    """torch computes them (its regression test for pytorch#105190); they were refused."""
    want = torch._C._nn.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(attnscale.scaled_dot_product_attention(q, k, v, scale=scale), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale", ["0.125", True, torch.tensor(0.125), [0.125]])
def test_scale_must_be_a_number(scale):
    refused(TypeError, "scale", q, k, v, scale=scale)


@pytest.mark.parametrize("softcap", [0.0, -1.0, math.nan, math.inf])
def test_softcap_must_be_finite_and_positive(softcap):
    refused(ValueError, "softcap", q, k, v, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("arg", ["scale", "softcap"])
def test_scale_and_softcap_must_fit_the_float32_accumulation(arg, dtype):
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    message = refused(ValueError, arg, qd, kd, vd, **{arg: 1e39})
    assert "torch.float32" in message and "1e+39" in message
    out = attnscale.scaled_dot_product_attention(qd.double(), kd.double(), vd.double(), **{arg: 1e39}, backend="math")
    assert torch.isfinite(out).all()  # float64 inputs are scored in float64, where 1e39 fits


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_dropout_outside_zero_one(p):
    refused(ValueError, "dropout_p", q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", ["0.1", True, None])
def test_dropout_must_be_a_number(p):
    refused(TypeError, "dropout_p", q, k, v, dropout_p=p)


@pytest.mark.parametrize("arg", ["is_causal", "enable_gqa", "return_stats"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_flags_must_be_bool(arg, value):
    refused(TypeError, arg, q, k, v, **{arg: value})


@pytest.mark.parametrize(("arg", "value"), [("causal_alignment", "bottom-right"), ("causal_alignment", "upper_left"), ("backend", "flash"), ("backend", "Torch")])
def test_unknown_choice(arg, value):
    message = refused(ValueError, arg, q, k, v, **{arg: value})
    assert repr(value) in message


@pytest.mark.parametrize(("arg", "value"), [("causal_alignment", 0), ("backend", None)])
def test_choice_of_wrong_type(arg, value):
    refused(TypeError, arg, q, k, v, **{arg: value})


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (-2, 0), (1.5, 0), (True, 0), "left", 4])
def test_bad_window(window):
    refused(ValueError, "window", q, k, v, window=window)


@pytest.mark.parametrize("window", [(10**20, 0), (0, 2**62)])
def test_window_sides_beyond_int64_positions_are_refused(window):
    assert "pass None" in refused(ValueError, "window", q, k, v, window=window)


@pytest.mark.parametrize("backend", ["auto", "torch", "math", "tiled"])
def test_the_largest_window_side_means_no_limit(backend):
    largest = attnscale.scaled_dot_product_attention(q, k, v, window=(2**62 - 1, 0), backend=backend)
    unlimited = attnscale.scaled_dot_product_attention(q, k, v, window=(None, 0), backend=backend)
    torch.testing.assert_close(largest, unlimited, rtol=0, atol=0)


def test_alibi_slopes_shape():
    assert "(H,) or (B, H)" in refused(ValueError, "alibi_slopes", q, k, v, alibi_slopes=torch.ones(5))
    refused(ValueError, "alibi_slopes", q, k, v, alibi_slopes=torch.tensor(0.5))
    refused(ValueError, "alibi_slopes", q, k, v, alibi_slopes=torch.ones(3, 4))


@pytest.mark.parametrize("slopes", [[0.5] * 4, torch.ones(4, dtype=torch.int64)], ids=["list", "int"])
def test_alibi_slopes_type(slopes):
    refused(TypeError, "alibi_slopes", q, k, v, alibi_slopes=slopes)


def test_alibi_slopes_device():
    refused(ValueError, "alibi_slopes", q, k, v, alibi_slopes=torch.ones(4, device="meta"))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_alibi_slopes_must_be_finite(bad):
    assert "finite" in refused(ValueError, "alibi_slopes", q, k, v, alibi_slopes=torch.tensor([0.5, bad, 0.25, 0.125]))


@pytest.mark.parametrize("option", [dict(softcap=30.0), dict(return_stats=True)])
def test_torch_backend_with_what_torch_lacks(option):
    refused(ValueError, "backend", q, k, v, backend="torch", **option)


# Validation runs first --------------------------------------------------------------------------


def test_validation_runs_before_any_compute():
    # Meta tensors have no data: any attempt to compute would fail differently or silently succeed.
    qm, km, vm = (t.to("meta") for t in qkv())
    refused(ValueError, "scale", qm, km, vm, scale=math.nan)
    refused(ValueError, "key", qm, km[..., :7], vm)
    before = attnscale.last_backend()
    refused(ValueError, "dropout_p", q, k, v, dropout_p=2.0)
    assert attnscale.last_backend() == before  # nothing ran


def test_a_signature_that_passed_is_not_checked_again_but_values_are(monkeypatch):
    """What a call's signature proved (shapes, dtypes, devices, options) is not checked twice; what
    it cannot prove is checked on every call: a float mask that turns NaN, slopes that turn inf."""
    from attnscale import _validate

    full = []
    original = _validate.check_tensors  # the first of the full checks
    monkeypatch.setattr(_validate, "check_tensors", lambda *a, **kw: full.append(1) or original(*a, **kw))
    gen = torch.Generator().manual_seed(7)
    qs, ks, vs = (torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3))
    mask = torch.zeros(3, 3)
    slopes = torch.tensor([0.5, 0.25])
    call = dict(attn_mask=mask, alibi_slopes=slopes, scale=0.3, window=(2, 0))
    first = attnscale.scaled_dot_product_attention(qs, ks, vs, **call)
    again = attnscale.scaled_dot_product_attention(qs, ks, vs, **call)
    assert len(full) == 1 and torch.equal(first, again)
    mask[0, 1] = math.nan
    refused(ValueError, "attn_mask", qs, ks, vs, **call)
    mask[0, 1] = 0.0
    slopes[1] = math.inf
    refused(ValueError, "alibi_slopes", qs, ks, vs, **call)
    slopes[1] = 0.25
    for changed in (dict(scale=0.31), dict(window=(1, 0)), dict(is_causal=True), dict(scale=1)):  # 1 (an int) is not 1.0's signature
        attnscale.scaled_dot_product_attention(qs, ks, vs, **{**call, **changed})
    assert len(full) == 5
    refused(ValueError, "key", qs, ks[..., :2], vs, **call)  # another shape: checked, and refused
    refused(TypeError, "scale", qs, ks, vs, **{**call, "scale": np.array([0.3, 0.4])})  # its == is an array: never asked
    refused(ValueError, "window", qs, ks, vs, **{**call, "window": [2, "0"]})  # unhashable: checked every time
    attnscale.scaled_dot_product_attention(qs, ks, vs, **{**call, "window": [2, 0]})
    assert len(full) == 9


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_keys_grown_along_s_reuse_the_validated_call_with_their_length(monkeypatch, alignment):
    """A decoding step over a growing cache is a new signature every call; nothing validation
    checks turns on the key length S but that k and v share it, so a call whose keys and values
    differ from a validated one only in S takes its spec with S (and, bottom-right, the query
    offset S - L) set, and nothing else is checked again but the values. The spec is the one the
    full checks make; k and v of different lengths are still refused by them; a mask (whose shape
    may hold S) is never taken this way."""
    from attnscale import _validate

    full = []
    original = _validate.check_tensors
    monkeypatch.setattr(_validate, "check_tensors", lambda *a, **kw: full.append(1) or original(*a, **kw))
    monkeypatch.setattr(_validate, "_SIGNATURES", {})  # no call of another test validated before
    monkeypatch.setattr(_validate, "_FAMILIES", {})
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    options = dict(is_causal=True, causal_alignment=alignment, enable_gqa=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    for S in (5, 9, 2, 17):
        k, v = torch.randn(1, 2, S, 8, generator=gen), torch.randn(1, 2, S, 6, generator=gen)
        out = attnscale.scaled_dot_product_attention(q, k, v, **options)
        grown = _validate.check_attention_call(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, backend="auto", softcap=None, window=None,
                                               return_stats=False, sinks=None, **options)  # fmt: skip
        fresh = _validate.check_attention_call(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, backend="auto", softcap=None, window=None,
                                               return_stats=False, sinks=None, values=False, **options)  # fmt: skip  (values=False: no memo)
        assert grown._replace(family=None) == fresh and grown.S == S  # (grown from the first call's spec: its family)
        torch.testing.assert_close(out, attnscale.scaled_dot_product_attention(q, k, v, backend="math", **options), rtol=0, atol=1e-6)
    assert len(full) == 1 + 1 + 4 + 1  # the first call; grown's first (backend as a str: another signature); each fresh spec; the math backend's first call
    refused(ValueError, "value", q, torch.randn(1, 2, 7, 8), torch.randn(1, 2, 6, 6), **options)
    options["alibi_slopes"][1] = math.inf
    refused(ValueError, "alibi_slopes", q, torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 6), **options)
    full.clear()
    mask = torch.ones(3, 4, dtype=torch.bool)
    attnscale.scaled_dot_product_attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 6), attn_mask=mask, enable_gqa=True)
    attnscale.scaled_dot_product_attention(q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 6), attn_mask=torch.ones(3, 5, dtype=torch.bool), enable_gqa=True)
    assert len(full) == 2
