"""scaled_dot_product_attention against the fp64 NumPy oracle and torch, on every backend.

Shape letters as everywhere in attnscale: B batch, H query heads, Hkv key/value heads, G = H // Hkv,
L query length, S key length, D query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnscale
from attnscale import kernels, reference

from .memory_spies import counting

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
LOW_PRECISION = [torch.float16, torch.bfloat16, torch.float32]
BACKENDS = [b.value for b in attnscale.Backend]  # auto, torch, math and any further kernel
# torch 2.13's FlexAttention has no CPU backward, and backend="flex" refuses CPU inputs that require
# grad (tests/test_flex.py checks the refusal, and flex's gradients on a GPU): tests that
# differentiate on CPU run the other backends.
GRAD_BACKENDS = [b for b in BACKENDS if b != "flex"]
DROPOUT_BACKENDS = ["auto", "math", "torch"]
# The backends a loop inside one test may call here: "fused" refuses every call where the compiled
# kernel cannot be had (a parametrized backend="fused" is skipped there, tests/conftest.py).
KERNEL = kernels.build_precondition() is None
RUNNABLE = [b for b in BACKENDS if b != "fused" or KERNEL]
# Absolute tolerance against the fp64 oracle, relative to max |value|: outputs are convex
# combinations of value rows, so the value scale bounds them.
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def sdpa(*args, **kwargs):
    return attnscale.scaled_dot_product_attention(*args, **kwargs)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float64, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype)


def as_numpy(t: torch.Tensor | None) -> np.ndarray | None:
    if t is None:
        return None
    return t.detach().numpy() if t.dtype == torch.bool else t.detach().double().numpy()


def oracle(q, k, v, **kwargs):
    """attnscale.reference.attention on the (already rounded) inputs: a float64 tensor (and stats)."""
    for name in ("attn_mask", "alibi_slopes"):
        kwargs[name] = as_numpy(kwargs.get(name))
    result = reference.attention(as_numpy(q), as_numpy(k), as_numpy(v), **kwargs)
    if kwargs.get("return_stats"):
        return torch.from_numpy(np.ascontiguousarray(result[0])), result[1]
    return torch.from_numpy(np.ascontiguousarray(result))


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def identity_values(S: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """value = eye(S) of shape (1, 1, S, S): the output row is then the attention-weight row."""
    return torch.eye(S, dtype=dtype)[None, None]


def weights(L: int, S: int, backend: str, **kwargs) -> torch.Tensor:
    """Observed attention weights (L, S) for all-equal logits (q = 0), D = S so torch's kernel can run."""
    q = torch.zeros(1, 1, L, S)
    k = torch.randn(1, 1, S, S, generator=torch.Generator().manual_seed(0))
    return sdpa(q, k, identity_values(S), backend=backend, **kwargs)[0, 0]


# --------------------------------------------------------------------------------------------
# 1. Properties: random shapes and options against the oracle and against torch
# --------------------------------------------------------------------------------------------

HEADS = [(1, 1), (2, 2), (3, 3), (2, 1), (4, 1), (4, 2), (6, 3)]  # (H, Hkv): MHA, MQA, GQA
WINDOWS = [None, (0, 0), (2, None), (None, 1), (3, 1), (-1, 2)]


# On CPU FlexAttention compiles its forward for float32 and 16-bit inputs, once per shape and
# score-path combination (about 4 s each on a cold cache, mostly the C++ compiler), and runs
# float64 eagerly with the same mods: one flex example in five is compiled (float32 or bfloat16),
# the rest take float64, and tests/test_flex.py compiles the feature matrix.
FLEX_DTYPES = [torch.float64] * 8 + [torch.float32, torch.bfloat16]


@st.composite
def attention_cases(draw):
    softcap = draw(st.sampled_from([None, None, 0.7, 5.0]))
    backend = draw(st.sampled_from([b for b in RUNNABLE if b != "torch" or softcap is None]))
    dtype = draw(st.sampled_from(FLEX_DTYPES if backend == "flex" else DTYPES))
    H, Hkv = draw(st.sampled_from(HEADS))
    L = draw(st.sampled_from([1, 2, 5, 17]))
    S = draw(st.sampled_from([1, 3, 8, 33]))
    D = draw(st.sampled_from([1, 3, 59, 128]))
    Dv = draw(st.sampled_from([D, D, 1, 7]))
    n_batch = draw(st.integers(0, 2))
    batch = [draw(st.sampled_from([1, 2, 3])) for _ in range(n_batch)]
    # Per tensor and batch dim: full size or 1 (broadcast).
    bshape = {name: [n if draw(st.booleans()) else 1 for n in batch] for name in ("q", "k", "v")}
    full = [max(sizes) for sizes in zip(*bshape.values())]
    bshape["mask"] = [n if draw(st.booleans()) else 1 for n in full]  # a mask never widens the batch
    return dict(
        dtype=dtype,
        H=H,
        Hkv=Hkv,
        L=L,
        S=S,
        D=D,
        Dv=Dv,
        bshape=bshape,
        mask=draw(st.sampled_from(["none", "bool", "float", "bool_empty_rows", "float_empty_rows"])),
        mask_dims=draw(st.sampled_from(["LS", "HLS", "full", "padding"])),
        mask_dtype=draw(st.sampled_from(["query", "float32"])),
        is_causal=draw(st.booleans()),
        alignment=draw(st.sampled_from(["top_left", "bottom_right"])),
        softcap=softcap,
        alibi=draw(st.booleans()),
        window=draw(st.sampled_from(WINDOWS)),
        backend=backend,
        return_stats=backend != "torch" and draw(st.booleans()),
        std=draw(st.sampled_from([0.5, 1.0, 3.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def build_mask(case: dict, gen: torch.Generator) -> torch.Tensor | None:
    kind = case["mask"]
    if kind == "none":
        return None
    H, L, S, lead = case["H"], case["L"], case["S"], case["bshape"]["mask"]
    shape = {"LS": (L, S), "HLS": (H, L, S), "full": (*lead, H, L, S), "padding": (*lead, 1, 1, S)}[case["mask_dims"]]
    keep = torch.rand(shape, generator=gen) > 0.3
    if kind.endswith("empty_rows"):
        keep[..., :1, :] = False  # every query row 0 (or every row, for a padding mask) sees no key
    if kind.startswith("bool"):
        return keep
    dtype = case["dtype"] if case["mask_dtype"] == "query" else torch.float32
    bias = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return bias.masked_fill(~keep, float("-inf"))


def torch_expressible(case: dict, mask: torch.Tensor | None) -> bool:
    """True when torch's own SDPA computes exactly this call (its is_causal is top-left only)."""
    same_alignment = case["alignment"] == "top_left" or case["L"] == case["S"]
    plain = case["softcap"] is None and not case["alibi"] and case["window"] is None
    return plain and (not case["is_causal"] or (mask is None and same_alignment))


@settings(max_examples=300)
@given(case=attention_cases())
def test_matches_oracle_and_torch(case):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, H, Hkv, L, S, D, Dv = (case[n] for n in ("dtype", "H", "Hkv", "L", "S", "D", "Dv"))
    bs = case["bshape"]
    q = randn(*bs["q"], H, L, D, gen=gen, dtype=dtype, std=case["std"])
    k = randn(*bs["k"], Hkv, S, D, gen=gen, dtype=dtype, std=case["std"])
    v = randn(*bs["v"], Hkv, S, Dv, gen=gen, dtype=dtype)
    mask = build_mask(case, gen)
    slopes = attnscale.alibi_slopes(H) if case["alibi"] else None
    options = dict(
        attn_mask=mask,
        is_causal=case["is_causal"],
        causal_alignment=case["alignment"],
        softcap=case["softcap"],
        alibi_slopes=slopes,
        window=case["window"],
    )
    result = sdpa(q, k, v, enable_gqa=H != Hkv, backend=case["backend"], return_stats=case["return_stats"], **options)
    out, stats = result if case["return_stats"] else (result, None)
    ran = attnscale.last_backend()
    if case["backend"] != "auto":
        assert ran == case["backend"]
    elif case["softcap"] is not None or case["alibi"] or case["window"] is not None or case["return_stats"]:
        assert ran != "torch"

    ref = oracle(q, k, v, **options, return_stats=case["return_stats"])
    ref, ref_stats = ref if case["return_stats"] else (ref, None)
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    assert out.shape == (*batch, H, L, Dv) and out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = TOL[dtype] * max(1.0, v.abs().max().item())
    assert max_err(out, ref) <= tol, (ran, max_err(out, ref), tol)

    if stats is not None:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        for name in ("lse", "max_logit", "max_prob", "entropy"):
            got, want = getattr(stats, name), ref_stats[name]
            assert got.dtype == acc and got.shape == (*batch, H, L)
            want = np.broadcast_to(want, got.shape)  # the oracle's stats skip value's batch dims
            np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-4, atol=1e-4 if acc == torch.float32 else 1e-10)

    if torch_expressible(case, mask):
        full = lambda t, h, n, d: t.expand(*batch, h, n, d).reshape(-1, h, n, d)  # noqa: E731  (B, h, n, d)
        tmask = mask
        if mask is not None:
            tmask = mask if mask.dtype == torch.bool else mask.to(dtype)
            tmask = tmask.expand(*batch, H, L, S).reshape(-1, H, L, S)  # (B, H, L, S)
        expected = F.scaled_dot_product_attention(
            full(q, H, L, D),
            full(k, Hkv, S, D),
            full(v, Hkv, S, Dv),
            attn_mask=tmask,
            is_causal=case["is_causal"],
            enable_gqa=H != Hkv,
        ).reshape(*batch, H, L, Dv)
        assert max_err(out, expected) <= 2 * tol


# --------------------------------------------------------------------------------------------
# 2. Low precision: error at most K times that of a plain same-precision implementation
# --------------------------------------------------------------------------------------------

# Largest measured ratio err(attnscale) / err(plain), max-abs error vs fp64, over PRECISION_CASES
# and every backend (torch 2.13 CPU): forward fp16 1.08, bf16 0.73, fp32 1.58; gradients
# (dq, dk, dv) fp16 1.28, bf16 1.28, fp32 2.56 (torch's own backward with a bool mask).
# Half precision: the fp32 softmax leaves mostly the final rounding, so ~0.1-1x plain fp16/bf16;
# fp32 is plain fp32 up to summation order. A max-abs error over a few thousand entries is noisy,
# hence the headroom (flash-attention's tests use 2 as well).
K_FORWARD = 2.0
K_GRADIENT = 4.0

PRECISION_CASES = {
    "mha": dict(B=2, H=4, Hkv=4, L=128, S=128, D=64),
    "gqa-causal-awkward": dict(B=1, H=4, Hkv=2, L=17, S=33, D=59, is_causal=True),
    "mqa-long-d128": dict(B=1, H=2, Hkv=1, L=96, S=200, D=128),
    "sharp-logits": dict(B=1, H=2, Hkv=2, L=64, S=64, D=16, std=3.0),
    "bool-mask": dict(B=1, H=2, Hkv=2, L=40, S=70, D=32, mask="bool"),
    "float-mask": dict(B=1, H=2, Hkv=2, L=40, S=70, D=32, mask="float"),
    "softcap-alibi-window": dict(B=1, H=4, Hkv=4, L=48, S=48, D=32, softcap=2.0, alibi=True, window=(8, 0)),
}


def plain_attention(q, k, v, *, scale, keep=None, bias=None, softcap=None) -> torch.Tensor:
    """softmax(q k^T * scale) v entirely in the inputs' dtype: what flash-attention calls attention_pt."""
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, L, S)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(s.dtype)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def precision_inputs(case: dict, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1234)
    B, H, Hkv, L, S, D = (case[n] for n in ("B", "H", "Hkv", "L", "S", "D"))
    std = case.get("std", 1.0)
    q, k, v = (randn(B, h, n, D, gen=gen, dtype=dtype, std=s) for h, n, s in ((H, L, std), (Hkv, S, std), (Hkv, S, 1.0)))
    options, keep, bias = {}, None, None
    if case.get("is_causal"):
        options["is_causal"] = True
        keep = attnscale.causal_mask(L, S)
    if case.get("mask"):
        keep = torch.rand(L, S, generator=gen) > 0.3
        keep[:, 0] = True  # no empty rows: the plain implementation would turn them into NaN
        if case["mask"] == "bool":
            options["attn_mask"] = keep
        else:
            bias = randn(L, S, gen=gen, dtype=dtype)
            options["attn_mask"] = bias.masked_fill(~keep, float("-inf"))
    if case.get("softcap"):
        options["softcap"] = case["softcap"]
    if case.get("alibi"):
        options["alibi_slopes"] = attnscale.alibi_slopes(H)
        bias = attnscale.alibi_bias(options["alibi_slopes"], L, S)
    if case.get("window"):
        options["window"] = case["window"]
        keep = attnscale.sliding_window_mask(L, S, case["window"])
    return (q, k, v), options, keep, bias


def precision_errors(name: str, dtype: torch.dtype, backend: str) -> tuple[list[float], list[float]]:
    """Forward and gradient (dq, dk, dv) errors vs fp64: [attnscale, plain] for output and each grad."""
    case = PRECISION_CASES[name]
    (q, k, v), options, keep, bias = precision_inputs(case, dtype)
    G = case["H"] // case["Hkv"]
    gen = torch.Generator().manual_seed(99)
    dout = randn(case["B"], case["H"], case["L"], case["D"], gen=gen)

    def grads(fn, inputs):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(dout.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    exact = grads(lambda a, b, c: sdpa(a, b, c, enable_gqa=G > 1, backend="math", **options), [t.double() for t in (q, k, v)])
    ref = oracle(q, k, v, **options)
    assert max_err(exact[0], ref) < 1e-12  # the fp64 gradients below come from an exact forward
    ours = grads(lambda a, b, c: sdpa(a, b, c, enable_gqa=G > 1, backend=backend, **options), [q, k, v])
    plain = grads(
        lambda a, b, c: plain_attention(
            a,
            b.repeat_interleave(G, dim=-3),
            c.repeat_interleave(G, dim=-3),
            scale=case["D"] ** -0.5,
            keep=keep,
            bias=bias,
            softcap=case.get("softcap"),
        ),
        [q, k, v],
    )
    return [max_err(a, b) for a, b in zip(ours, exact)], [max_err(a, b) for a, b in zip(plain, exact)]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("name", list(PRECISION_CASES))
def test_error_is_at_most_k_times_plain_same_precision(name, dtype):
    has_softcap = "softcap" in PRECISION_CASES[name]
    for backend in [b for b in GRAD_BACKENDS if b in RUNNABLE and (b != "torch" or not has_softcap)]:
        ours, plain = precision_errors(name, dtype, backend)
        eps = torch.finfo(dtype).eps
        for what, a, b in zip(("out", "dq", "dk", "dv"), ours, plain):
            k = K_FORWARD if what == "out" else K_GRADIENT
            assert a <= k * b + eps, f"{backend} {what}: error {a:.3g} > {k} x plain {b:.3g}"


# --------------------------------------------------------------------------------------------
# 3. Autograd: gradcheck in float64 through every backend and mask kind
# --------------------------------------------------------------------------------------------

GRAD_CASES = {
    "none": dict(),
    "bool": dict(mask="bool"),
    "float-inf": dict(mask="float"),
    "causal-top-left": dict(is_causal=True),
    "causal-bottom-right": dict(is_causal=True, causal_alignment="bottom_right"),
    "causal-bottom-right-L>S": dict(is_causal=True, causal_alignment="bottom_right", L=4, S=3),
    "causal-and-mask": dict(is_causal=True, mask="bool"),
    "mha-dv-differs": dict(Hkv=2, Dv=2),
}
SCORE_PATH_GRAD_CASES = {
    "softcap": dict(softcap=1.5, is_causal=True),
    "alibi": dict(alibi=True, mask="float"),
    "window": dict(window=(1, 1), causal_alignment="bottom_right"),
    "all": dict(softcap=0.8, alibi=True, window=(2, 0), mask="bool"),
}


def grad_inputs(case: dict):
    gen = torch.Generator().manual_seed(7)
    L, S, Hkv, Dv = case.get("L", 3), case.get("S", 5), case.get("Hkv", 1), case.get("Dv", 3)
    q, k, v = randn(1, 2, L, 4, gen=gen), randn(1, Hkv, S, 4, gen=gen), randn(1, Hkv, S, Dv, gen=gen)
    inputs = [q, k, v]
    options = {n: case[n] for n in ("is_causal", "causal_alignment", "softcap", "window") if n in case}
    keep = torch.rand(L, S, generator=gen) > 0.4
    keep[1] = False  # a fully masked row
    keep[0, 0] = True
    if case.get("mask") == "bool":
        options["attn_mask"] = keep
    if case.get("mask") == "float":
        inputs.append(randn(L, S, gen=gen).masked_fill(~keep, float("-inf")))
    return inputs, options, case.get("mask") == "float", Hkv


def run_gradcheck(case: dict, backend: str) -> None:
    inputs, options, float_mask, Hkv = grad_inputs(case)
    if float_mask and backend == "fused":  # the compiled kernel gives masks no gradient: a constant mask
        options["attn_mask"] = inputs.pop()
        float_mask = False
    alibi = case.get("alibi", False) and backend == "math"  # slopes get gradients on math only
    if case.get("alibi"):
        slopes = attnscale.alibi_slopes(2).double()
        if alibi:
            inputs.append(slopes)
        else:
            options["alibi_slopes"] = slopes
    leaves = [t.requires_grad_() for t in inputs]

    def fn(q, k, v, *extra):
        extra = list(extra)
        kwargs = dict(options)
        if float_mask:
            kwargs["attn_mask"] = extra.pop(0)
        if alibi:
            kwargs["alibi_slopes"] = extra.pop(0)
        return sdpa(q, k, v, enable_gqa=Hkv != 2, backend=backend, **kwargs)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8)
    if backend != "auto":
        assert attnscale.last_backend() == backend


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradcheck_every_backend(name, backend):
    run_gradcheck(GRAD_CASES[name], backend)


@pytest.mark.parametrize("backend", [b for b in GRAD_BACKENDS if b != "torch"])
@pytest.mark.parametrize("name", list(SCORE_PATH_GRAD_CASES))
def test_gradcheck_score_path_variants(name, backend):
    run_gradcheck(SCORE_PATH_GRAD_CASES[name], backend)
    assert attnscale.last_backend() != "torch"


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_have_zero_output_and_exactly_zero_gradients(backend, dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(2, 4, 6, 8, gen=gen, dtype=dtype).requires_grad_() for _ in range(3))
    keep = torch.rand(6, 6, generator=gen) > 0.5
    keep[2] = False
    mask = torch.zeros(6, 6, dtype=dtype).masked_fill(~keep, float("-inf"))
    for attn_mask in (keep, mask):
        out = sdpa(q, k, v, attn_mask=attn_mask, backend=backend)
        out.backward(torch.ones_like(out))
        assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
        assert torch.equal(q.grad[..., 2, :], torch.zeros_like(q.grad[..., 2, :]))
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
            t.grad = None


def test_gradcheck_of_the_statistics_on_math():
    gen = torch.Generator().manual_seed(18)
    q, k, v = (randn(1, 2, 4, 3, gen=gen).requires_grad_() for _ in range(3))
    keep = torch.rand(4, 4, generator=gen) > 0.3
    keep[2] = False

    def fn(q, k, v):
        out, stats = sdpa(q, k, v, attn_mask=keep, is_causal=True, backend="math", return_stats=True)
        finite_lse = torch.where(torch.isfinite(stats.lse), stats.lse, 0.0)
        return out, finite_lse, stats.entropy, stats.max_prob

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8)


def test_fully_masked_rows_do_not_feed_key_or_value_gradients():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (randn(1, 1, 3, 4, gen=gen).requires_grad_() for _ in range(3))
    keep = torch.tensor([[True, True, False], [False, False, False], [True, False, True]])
    out = sdpa(q, k, v, attn_mask=keep)
    out[:, :, 1].sum().backward()  # only the empty row contributes to the loss
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t.grad))


# --------------------------------------------------------------------------------------------
# 5. Documented semantics, one test each
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_return_zeros_for_every_kind_of_mask(backend):
    gen = torch.Generator().manual_seed(5)
    q, k, v = randn(1, 2, 4, 3, gen=gen), randn(1, 2, 3, 3, gen=gen), randn(1, 2, 3, 3, gen=gen)
    empty_row = torch.ones(4, 3, dtype=torch.bool)
    empty_row[0] = False
    cases = [
        dict(attn_mask=empty_row),
        dict(attn_mask=torch.zeros(4, 3, dtype=torch.float64).masked_fill(~empty_row, float("-inf"))),
        dict(is_causal=True, causal_alignment="bottom_right"),  # L > S: row 0 sees no key
    ]
    cases.append(dict(window=(0, 0), causal_alignment="bottom_right"))  # row 0 sits at key position -1
    for options in cases:
        out = sdpa(q, k, v, backend=backend, **options)
        assert torch.equal(out[..., 0, :], torch.zeros(1, 2, 3, dtype=torch.float64)), options
        assert torch.isfinite(out).all() and out[..., 1:, :].abs().sum() > 0


def parse_alignment_drawing() -> dict[str, torch.Tensor]:
    """The two L = 2, S = 5 matrices drawn in CausalAlignment's docstring, as bool tensors."""
    lines = attnscale.CausalAlignment.__doc__.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("q0", "q1")]
    assert len(rows) == 2
    left = torch.tensor([[c == "x" for c in row[1:6]] for row in rows])
    right = torch.tensor([[c == "x" for c in row[7:12]] for row in rows])
    return {"top_left": left, "bottom_right": right}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_alignment_matches_the_docstring_drawing(alignment, backend):
    drawn = parse_alignment_drawing()[alignment]
    expected = {"top_left": [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], "bottom_right": [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]}
    assert torch.equal(drawn, torch.tensor(expected[alignment], dtype=torch.bool))
    assert torch.equal(attnscale.causal_mask(2, 5, alignment=alignment), drawn)
    observed = weights(2, 5, backend, is_causal=True, causal_alignment=alignment)
    assert torch.equal(observed > 0, drawn)
    torch.testing.assert_close(observed, drawn / drawn.sum(-1, keepdim=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_mask_true_means_attend(backend):
    keep = torch.tensor([[False, False, True, False], [True, False, False, True]])
    observed = weights(2, 4, backend, attn_mask=keep)
    assert torch.equal(observed > 0, keep)
    torch.testing.assert_close(observed, keep / keep.sum(-1, keepdim=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_is_added_and_minus_inf_hides_a_key(backend):
    gen = torch.Generator().manual_seed(6)
    q, k, v = randn(1, 2, 3, 4, gen=gen), randn(1, 2, 5, 4, gen=gen), randn(1, 2, 5, 4, gen=gen)
    mask = torch.zeros(3, 5, dtype=torch.float64)
    mask[:, 1] = float("-inf")
    out = sdpa(q, k, v, attn_mask=mask, backend=backend)
    without_key_1 = sdpa(q, k[..., [0, 2, 3, 4], :], v[..., [0, 2, 3, 4], :], backend=backend)
    torch.testing.assert_close(out, without_key_1, rtol=0, atol=1e-12)
    # A finite float entry is added to the logit: +log(2) doubles that key's unnormalised weight.
    bias = torch.zeros(2, 4)
    bias[:, 1] = math.log(2.0)
    observed = weights(2, 4, backend, attn_mask=bias)
    torch.testing.assert_close(observed, torch.tensor([[1, 2, 1, 1], [1, 2, 1, 1]]) / 5.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_scale_is_one_over_sqrt_of_the_per_head_dim(backend):
    gen = torch.Generator().manual_seed(8)
    H, D = 4, 16
    q, k, v = randn(2, H, 6, D, gen=gen), randn(2, H, 6, D, gen=gen), randn(2, H, 6, D, gen=gen)
    default = sdpa(q, k, v, backend=backend)
    torch.testing.assert_close(default, sdpa(q, k, v, scale=D**-0.5, backend=backend), rtol=0, atol=1e-14)
    assert not torch.allclose(default, sdpa(q, k, v, scale=(H * D) ** -0.5, backend=backend), atol=1e-3)
    assert not torch.allclose(default, sdpa(q, k, v, scale=1.0, backend=backend), atol=1e-3)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    torch.testing.assert_close(default, torch.softmax(logits, -1) @ v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_is_causal_and_attn_mask_both_apply(backend, alignment):
    keep = torch.tensor([[True, False, True, True, True], [False, True, True, True, False]])
    observed = weights(2, 5, backend, attn_mask=keep, is_causal=True, causal_alignment=alignment)
    expected = keep & attnscale.causal_mask(2, 5, alignment=alignment)
    assert torch.equal(observed > 0, expected)


# flex compiles per shape on CPU: it takes one grouping here (tests/test_flex.py: MHA, GQA, MQA).
GQA_CASES = [(backend, H, Hkv) for H, Hkv in [(6, 3), (4, 1), (4, 2), (8, 4)] for backend in BACKENDS if backend != "flex" or H == 6]


@pytest.mark.parametrize(("backend", "H", "Hkv"), GQA_CASES)
def test_gqa_query_head_h_reads_kv_head_h_floordiv_g(backend, H, Hkv):
    q = torch.randn(1, H, 3, 8, generator=torch.Generator().manual_seed(9))
    k = torch.randn(1, Hkv, 4, 8, generator=torch.Generator().manual_seed(10))
    v = torch.arange(Hkv, dtype=torch.float32).view(1, Hkv, 1, 1).expand(1, Hkv, 4, 8)  # kv head j holds j
    out = sdpa(q, k, v, enable_gqa=True, backend=backend)
    read = out[0, :, :, :].mean(dim=(-1, -2))  # (H,): which kv head each query head read
    G = H // Hkv
    torch.testing.assert_close(read, torch.tensor([h // G for h in range(H)], dtype=torch.float32))
    if Hkv > 1:
        assert not torch.equal(read, torch.tensor([h % Hkv for h in range(H)], dtype=torch.float32))


def test_score_path_order_scale_then_softcap_then_bias_then_mask():
    # q.k = 0 everywhere except key 1 (raw product 8): scale 0.5 gives 4, softcap 1 gives tanh(4).
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.0, 1.0], [8.0, 0.0], [0.0, 1.0], [0.0, 1.0]]]], dtype=torch.float64)
    v = torch.eye(4, dtype=torch.float64)[None, None]
    bias = torch.tensor([[0.0, 0.0, 3.0, float("-inf")]], dtype=torch.float64)
    out = sdpa(q, k, v, scale=0.5, softcap=1.0, attn_mask=bias)[0, 0, 0]
    # The float mask is added after the cap (3.0 is not capped); -inf still gets exactly zero.
    logits = torch.tensor([0.0, math.tanh(4.0), 3.0], dtype=torch.float64)
    torch.testing.assert_close(out[:3], torch.softmax(logits, -1), rtol=0, atol=1e-14)
    assert out[3].item() == 0.0
    # ALiBi is added after the cap too, never scaled.
    slopes = torch.tensor([2.0], dtype=torch.float64)
    out = sdpa(q, k, v, scale=0.5, softcap=1.0, alibi_slopes=slopes)[0, 0, 0]
    logits = torch.tensor([0.0, math.tanh(4.0) - 2.0, -4.0, -6.0], dtype=torch.float64)
    torch.testing.assert_close(out, torch.softmax(logits, -1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("softcap", [0.01, 1.0, 50.0])
def test_hidden_keys_get_exactly_zero_weight_whatever_softcap_does(softcap):
    keep = torch.tensor([[True, False, True, False, True]] * 3)
    observed = weights(3, 5, "math", attn_mask=keep, softcap=softcap, is_causal=True, causal_alignment="bottom_right")
    assert torch.equal(observed > 0, keep & attnscale.causal_mask(3, 5, alignment="bottom_right"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_output_dtype_is_input_dtype_and_accumulation_is_wide(backend, dtype):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn(1, 2, 4, 8, gen=gen, dtype=dtype) for _ in range(3))
    out = sdpa(q, k, v, backend=backend)
    assert out.dtype == dtype
    if backend != "torch":
        _, stats = sdpa(q, k, v, backend=backend, return_stats=True)
        assert stats.lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_fp16_products_above_65504_stay_finite(backend):
    gen = torch.Generator().manual_seed(12)
    q = (40.0 + randn(1, 2, 8, 64, gen=gen)).half().requires_grad_()
    k = (40.0 + randn(1, 2, 8, 64, gen=gen)).half().requires_grad_()
    v = randn(1, 2, 8, 64, gen=gen).half().requires_grad_()
    raw = q.detach().double() @ k.detach().double().transpose(-1, -2)
    assert raw.min() > 65504 and torch.isinf(q.detach() @ k.detach().transpose(-1, -2)).all()
    for options in (dict(), dict(is_causal=True), dict(attn_mask=torch.rand(8, 8, generator=gen) > 0.5)):
        out = sdpa(q, k, v, backend=backend, **options)
        assert torch.isfinite(out).all()
        assert max_err(out, oracle(q, k, v, **options)) <= TOL[torch.float16] * v.abs().max().item()
        out.backward(torch.ones_like(out))
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        q.grad = k.grad = v.grad = None


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_fp16_query_with_a_wider_float_mask_beyond_the_fp16_range(backend):
    gen = torch.Generator().manual_seed(19)
    q, k, v = (randn(1, 2, 4, 8, gen=gen, dtype=torch.float16) for _ in range(3))
    mask = torch.zeros(4, 4)
    mask[0] = -70000.0  # finite but beyond fp16: a shift of the whole row, which softmax ignores
    mask[1, :2] = -70000.0  # two keys with (numerically) zero weight
    out = sdpa(q, k, v, attn_mask=mask, backend=backend)
    assert max_err(out, oracle(q, k, v, attn_mask=mask)) <= TOL[torch.float16] * v.abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    gen = torch.Generator().manual_seed(20)
    q, k, v = (randn(2, 6, 3, 8, gen=gen).transpose(1, 2) for _ in range(3))  # (B, L, H, D) -> (B, H, L, D)
    mask = (torch.rand(6, 6, generator=gen) > 0.3).t()
    assert not q.is_contiguous() and not mask.is_contiguous()
    out = sdpa(q, k, v, attn_mask=mask, backend=backend)
    torch.testing.assert_close(out, oracle(q, k, v, attn_mask=mask), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
@pytest.mark.parametrize(("L", "S"), [(0, 5), (4, 0), (0, 0)])
def test_empty_lengths_give_shaped_empty_or_zero_outputs(backend, L, S):
    q = torch.randn(2, 4, L, 8, requires_grad=True)
    k = torch.randn(2, 2, S, 8, requires_grad=True)
    v = torch.randn(2, 2, S, 3, requires_grad=True)
    mask = torch.ones(L, S, dtype=torch.bool)
    for options in (dict(), dict(is_causal=True), dict(attn_mask=mask)):
        out = sdpa(q, k, v, enable_gqa=True, backend=backend, **options)
        assert out.shape == (2, 4, L, 3)
        assert torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert q.grad.shape == q.shape and torch.equal(q.grad, torch.zeros_like(q))
        q.grad = k.grad = v.grad = None
    if backend != "torch":
        _, stats = sdpa(q, k, v, enable_gqa=True, backend=backend, return_stats=True)
        assert stats.lse.shape == (2, 4, L) and torch.all(stats.lse == float("-inf"))


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_an_empty_batch_from_broadcasting_gives_the_empty_output(backend):
    """q's batch of 0 against k and v of batch 1: the tiled kernel raised "cannot reshape tensor of
    0 elements" (fused, math and torch returned the empty output); k and v get zero gradients."""
    q = torch.randn(0, 2, 3, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 4, requires_grad=True), torch.randn(1, 2, 5, 4, requires_grad=True)
    for options in (dict(), dict(is_causal=True), dict(softcap=2.0) if backend != "torch" else {}):
        out = sdpa(q, k, v, backend=backend, **options)
        assert out.shape == (0, 2, 3, 4)
        out.sum().backward()
        assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))
        k.grad = v.grad = None


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_dims_broadcast_and_may_be_absent(backend):
    gen = torch.Generator().manual_seed(13)
    q = randn(3, 1, 2, 5, 8, gen=gen)  # (B1, B2, H, L, D)
    k = randn(1, 4, 2, 6, 8, gen=gen)
    v = randn(3, 4, 2, 6, 8, gen=gen)
    mask = torch.rand(4, 1, 5, 6, generator=gen) > 0.3
    out = sdpa(q, k, v, attn_mask=mask, backend=backend)
    assert out.shape == (3, 4, 2, 5, 8)
    torch.testing.assert_close(out, oracle(q, k, v, attn_mask=mask), rtol=0, atol=1e-12)
    out3 = sdpa(q[0, 0], k[0, 0], v[0, 0], backend=backend)  # no batch dim at all: (H, L, D)
    torch.testing.assert_close(out3, oracle(q[0, 0], k[0, 0], v[0, 0]), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_is_reproducible_under_manual_seed(backend):
    gen = torch.Generator().manual_seed(14)
    q, k, v = (randn(2, 2, 16, 8, gen=gen, dtype=torch.float32) for _ in range(3))
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(sdpa(q, k, v, dropout_p=0.3, backend=backend))
    assert attnscale.last_backend() == ("torch" if backend == "torch" else "math")
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert not torch.allclose(runs[0], sdpa(q, k, v, backend=backend))


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_is_inverted_dropout_on_the_attention_weights(backend):
    p, N, L, S = 0.25, 4000, 3, 4
    torch.manual_seed(0)
    # q = 0: uniform weights 1/S; value = eye(S): each output row is that row's dropped weights.
    out = sdpa(torch.zeros(N, 1, L, S), torch.randn(N, 1, S, S), identity_values(S).expand(N, 1, S, S), dropout_p=p, backend=backend)
    kept = out != 0
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / S / (1 - p)))
    n = out.numel()
    assert abs((~kept).sum().item() / n - p) < 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_mean_over_draws_approaches_the_no_dropout_output(backend):
    p, N = 0.3, 20000
    gen = torch.Generator().manual_seed(15)
    q, k, v = randn(1, 1, 4, 8, gen=gen, dtype=torch.float32), randn(1, 1, 6, 8, gen=gen, dtype=torch.float32), randn(1, 1, 6, 5, gen=gen, dtype=torch.float32)
    torch.manual_seed(0)
    draws = sdpa(q.expand(N, 1, 4, 8), k, v, dropout_p=p, backend=backend)  # independent masks per batch row
    exact = sdpa(q, k, v, backend=backend)[0]
    sem = draws.std(dim=0) / math.sqrt(N)
    assert ((draws.mean(dim=0) - exact).abs() <= 5 * sem + 1e-6).all()


# --------------------------------------------------------------------------------------------
# Backend choice: auto runs torch's kernel exactly when torch computes these semantics
# --------------------------------------------------------------------------------------------

AUTO_TORCH = {
    "plain fp32 4-D": dict(),
    "3-D": dict(shape=(2, 8, 16)),
    "5-D": dict(shape=(2, 3, 2, 8, 16)),
    "fp16": dict(dtype=torch.float16),
    "bf16": dict(dtype=torch.bfloat16),
    "causal top-left": dict(is_causal=True),
    "causal bottom-right L == S": dict(is_causal=True, causal_alignment="bottom_right"),
    "bool mask": dict(mask="bool"),
    "float mask": dict(mask="float"),
    "causal + mask": dict(mask="bool", is_causal=True),
    "gqa": dict(gqa=True),
    "L != S": dict(S=11),
    "causal top-left L != S": dict(S=11, is_causal=True),
}
AUTO_OWN = {
    "softcap": dict(softcap=30.0),
    "return_stats": dict(return_stats=True),
    "alibi": dict(alibi=True),
    "window": dict(window=(4, 0)),
    "causal bottom-right L != S": dict(S=11, is_causal=True, causal_alignment="bottom_right"),
    "dropout": dict(dropout_p=0.1),
    "Dv != D": dict(Dv=5),
    "empty S": dict(S=0),
}


def auto_call(case: dict, backend: str = "auto"):
    gen = torch.Generator().manual_seed(16)
    case = dict(case)
    shape = case.pop("shape", (2, 2, 8, 16))
    dtype = case.pop("dtype", torch.float32)
    S, Dv = case.pop("S", shape[-2]), case.pop("Dv", shape[-1])
    Hkv = 1 if case.pop("gqa", False) else shape[-3]
    q = randn(*shape, gen=gen, dtype=dtype)
    k = randn(*shape[:-3], Hkv, S, shape[-1], gen=gen, dtype=dtype)
    v = randn(*shape[:-3], Hkv, S, Dv, gen=gen, dtype=dtype)
    mask = case.pop("mask", None)
    if mask is not None:
        keep = torch.rand(shape[-2], S, generator=gen) > 0.3
        case["attn_mask"] = keep if mask == "bool" else torch.zeros(shape[-2], S, dtype=dtype).masked_fill(~keep, float("-inf"))
    if case.pop("alibi", False):
        case["alibi_slopes"] = attnscale.alibi_slopes(shape[-3])
    return sdpa(q, k, v, enable_gqa=Hkv != shape[-3], backend=backend, **case)


@pytest.mark.parametrize("name", list(AUTO_TORCH))
def test_auto_runs_torch_when_torch_computes_these_semantics(name):
    out = auto_call(AUTO_TORCH[name])
    assert attnscale.last_backend() == "torch"
    tol = TOL[out.dtype] * 4  # randn values: |v| < 4
    torch.testing.assert_close(out, auto_call(AUTO_TORCH[name], backend="math"), rtol=0, atol=tol)


@pytest.mark.parametrize("name", list(AUTO_OWN))
def test_auto_runs_its_own_kernel_when_torch_would_compute_something_else(name):
    out = auto_call(AUTO_OWN[name])
    out = out[0] if isinstance(out, tuple) else out
    assert attnscale.last_backend() != "torch"
    if "dropout_p" not in AUTO_OWN[name]:
        expected = auto_call(AUTO_OWN[name], backend="math")
        torch.testing.assert_close(out, expected[0] if isinstance(expected, tuple) else expected)


def test_forced_backends_run_and_are_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="attnscale"):
        auto_call({}, backend="math")
        assert attnscale.last_backend() == "math"
        auto_call({"window": (2, 2)}, backend="torch")
        assert attnscale.last_backend() == "torch"
    assert "backend=math" in caplog.text and "backend=torch" in caplog.text


@pytest.mark.parametrize("option", [dict(softcap=30.0), dict(return_stats=True)])
def test_torch_backend_refuses_what_torch_cannot_compute(option):
    with pytest.raises(ValueError, match=r"backend.*Fix:"):
        auto_call(option, backend="torch")


def test_return_stats_shapes_and_meaning():
    gen = torch.Generator().manual_seed(17)
    q, k, v = randn(2, 4, 5, 8, gen=gen), randn(2, 2, 7, 8, gen=gen), randn(2, 2, 7, 3, gen=gen)
    out, stats = sdpa(q, k, v, enable_gqa=True, return_stats=True, is_causal=True)
    assert isinstance(stats, attnscale.AttentionStats)
    for t in (stats.lse, stats.max_logit, stats.max_prob, stats.entropy):
        assert t.shape == (2, 4, 5)
    logits = (q @ k.repeat_interleave(2, -3).transpose(-1, -2)) / math.sqrt(8)
    logits = logits.masked_fill(~attnscale.causal_mask(5, 7), float("-inf"))
    torch.testing.assert_close(stats.lse, torch.logsumexp(logits, -1))
    torch.testing.assert_close(stats.max_prob, torch.softmax(logits, -1).amax(-1))
    torch.testing.assert_close(out, sdpa(q, k, v, enable_gqa=True, is_causal=True))


# The compiled kernel's planned route (backends._PLANS, kernels.fused.run_planned): a validated
# call's second and later calls go straight to the kernel with the options planned on the first;
# their output, backend and log line are the general route's, and tensors that are not the
# kernel's plain layout take the general route.
def _planned_probe(monkeypatch):
    """A list that records each call of the planned route."""
    from attnscale.kernels import fused

    return counting(monkeypatch, fused, "run_planned")


def _general_route(monkeypatch, fn):
    """``fn()`` with no plan remembered or made: every call takes fused_attention_checked."""
    from attnscale import backends

    with monkeypatch.context() as m:
        m.setattr(backends, "_PLANS", {})
        m.setattr(backends.fused_kernel, "plan", lambda *args, **kwargs: None)
        return fn()


PLAIN = {  # name -> (dtype, B, H, L, S, D, Dv, options, layout)
    "decoding step": (torch.float32, 1, 8, 1, 600, 64, 64, dict(softcap=30.0), "contiguous"),
    "several rows, Dv != D": (torch.float32, 2, 3, 5, 7, 8, 3, dict(softcap=5.0, scale=0.3), "contiguous"),
    "one key, D = 1": (torch.float32, 1, 2, 3, 1, 1, 2, dict(softcap=1.0, backend=attnscale.Backend.AUTO), "contiguous"),
    "heads-second layout": (torch.float32, 2, 4, 9, 33, 16, 16, dict(softcap=50.0, backend="auto"), "transposed"),
    "float64, a tight cap": (torch.float64, 1, 2, 4, 2100, 32, 32, dict(softcap=0.5, dropout_p=0.0), "contiguous"),
    "bfloat16 decoding step": (torch.bfloat16, 1, 8, 1, 600, 64, 64, dict(softcap=30.0), "contiguous"),
    "float16, heads-second": (torch.float16, 2, 4, 3, 40, 16, 16, dict(softcap=20.0), "transposed"),
    "GQA decoding step": (torch.float32, 1, 8, 1, 600, 64, 64, dict(softcap=30.0, enable_gqa=True), "contiguous"),
    "bfloat16 GQA, odd D": (torch.bfloat16, 2, 6, 2, 33, 15, 15, dict(softcap=30.0, enable_gqa=True), "contiguous"),
    "causal window, statistics": (torch.float32, 1, 4, 6, 40, 16, 16, dict(is_causal=True, window=(8, 0), return_stats=True), "contiguous"),
    "ALiBi and sinks": (torch.float32, 2, 4, 3, 40, 16, 16, dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.05]), sinks=torch.tensor([0.0, 1.0, -1.0, 2.0])), "contiguous"),
    "bfloat16 bottom-right, sinks, statistics": (
        torch.bfloat16, 1, 4, 3, 40, 16, 16, dict(is_causal=True, causal_alignment="bottom_right", sinks=torch.zeros(4), return_stats=True), "transposed"
    ),
}
KV_HEADS = {"GQA decoding step": 2, "bfloat16 GQA, odd D": 3}  # the others: one key head per query head


def _plain_inputs(dtype, B, H, L, S, D, Dv, layout, Hkv=None):
    gen = torch.Generator().manual_seed(7)
    shapes = ((H, L, D), (Hkv or H, S, D), (Hkv or H, S, Dv))
    if layout == "transposed":  # (B, n, H, d) storage, as projections lay it out
        return tuple(randn(B, n, h, d, gen=gen, dtype=dtype, std=3.0).transpose(1, 2) for h, n, d in shapes)
    return tuple(randn(B, h, n, d, gen=gen, dtype=dtype, std=3.0) for h, n, d in shapes)


def _equal(a, b):
    if a is None or b is None:
        return a is b
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    if dataclasses.is_dataclass(a):
        return all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return torch.equal(a, b) and a.dtype == b.dtype


@pytest.mark.skipif(not KERNEL, reason="the planned route is the compiled kernel's")
@pytest.mark.parametrize("name", list(PLAIN))
def test_a_signatures_later_calls_take_the_planned_route_to_the_general_routes_bits(monkeypatch, caplog, name):
    dtype, B, H, L, S, D, Dv, options, layout = PLAIN[name]
    q, k, v = _plain_inputs(dtype, B, H, L, S, D, Dv, layout, KV_HEADS.get(name))
    calls = _planned_probe(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="attnscale"):
        sdpa(q, k, v, **options)
        assert calls == []  # the first call of a signature plans
        kernels.load().forget_calls()  # (else the compiled kernel's memory answers: tests/test_remembered_kernel_calls.py)
        caplog.clear()
        out = sdpa(q, k, v, **options)
        planned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        want = _general_route(monkeypatch, lambda: sdpa(q, k, v, **options))
        general = [r.getMessage() for r in caplog.records]
    assert calls == [1] and _equal(out, want)
    assert attnscale.last_backend() == "fused" and planned == general


DEPARTURES = {  # tensors the plan cannot take as they are: the general route, to the same result
    "a mask": dict(attn_mask=torch.ones(3, 7, dtype=torch.bool)),
    "q requires grad": dict(),
    "3-d": dict(),
    "overlapping key rows": dict(),
    "broadcast batch": dict(),
    "float64 after a float32 plan": dict(),
}


@pytest.mark.skipif(not KERNEL, reason="the planned route is the compiled kernel's")
@pytest.mark.parametrize("name", list(DEPARTURES))
def test_tensors_that_are_not_the_kernels_plain_layout_take_the_general_route(monkeypatch, name):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(2, 2, n, 4, gen=gen, dtype=torch.float32) for n in (3, 7, 7))
    options = {"softcap": 5.0, **DEPARTURES[name]}
    if name == "q requires grad":
        q = q.requires_grad_()
    elif name == "3-d":
        q, k, v = q[0], k[0], v[0]
    elif name == "overlapping key rows":
        k = k[:, :, :1].expand(2, 2, 7, 4)
    elif name == "broadcast batch":
        k, v = k[:1], v[:1]
    calls = _planned_probe(monkeypatch)
    for _ in range(2):
        out = sdpa(q, k, v, **options)
    if name == "float64 after a float32 plan":  # the guard's float64 recompute runs the same call's kernel on wider tensors
        from attnscale import backends

        c = backends.Call(check_attention_call_for(q, k, v, options), q, k, v, None, None, None)
        backends.FUSED.run(c, q, k, v)  # plans c's signature (if no call before did)
        planned = len(calls)
        assert backends.FUSED.run(c, q, k, v).out.dtype == torch.float32 and len(calls) == planned + 1
        wide = backends.FUSED.run(c, q.double(), k.double(), v.double()).out
        torch.testing.assert_close(wide.float(), out, rtol=0, atol=1e-6)
        assert wide.dtype == torch.float64 and len(calls) == planned + 1
        return
    assert calls == []
    want = _general_route(monkeypatch, lambda: sdpa(q, k, v, **options))
    assert torch.equal(out.detach(), want.detach())


def check_attention_call_for(q, k, v, options):
    from attnscale._validate import check_attention_call

    return check_attention_call(
        q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, causal_alignment="top_left",
        backend="auto", softcap=options["softcap"], alibi_slopes=None, window=None, return_stats=False, sinks=None,
    )  # fmt: skip


@pytest.mark.parametrize("poison", ["none", "nan_q", "inf_k", "big_k", "zero_out_row", "inf_out_row", "nan_out_row"])
@pytest.mark.parametrize("backend", ["tiled", "flex", "math"])
def test_the_one_read_guard_decides_as_the_eager_one(poison, backend):
    """On accelerators the guard reads its numbers (row peaks, max |q|, |k|, slopes, float mask) in
    one transfer (guard._OneRead); its answers must be the eager guard's, number for number
    and decision for decision. Checked here on CPU tensors, where both can run."""
    import math as m

    from attnscale._validate import check_attention_call
    from attnscale.backends import IMPLEMENTATIONS, Call
    from attnscale.guard import _finite_sum, _OneRead, _Read, _row_peaks, _rows_look_right, _rows_may_hide_trouble, abs_max

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 7, 8, generator=gen)
    out = torch.randn(1, 2, 6, 8, generator=gen)
    if poison == "nan_q":
        q[0, 1, 2, 3] = m.nan
    elif poison == "inf_k":
        k[0, 0, 4, 1] = m.inf
    elif poison == "big_k":
        k *= 1e30
    elif poison == "zero_out_row":
        out[0, 0, 3] = 0.0
    elif poison == "inf_out_row":  # the top of the peaks' range: a row with +inf fails
        out[0, 1, 2, 5] = m.inf
    elif poison == "nan_out_row":
        out[0, 1, 4, 0] = m.nan
    slopes = attnscale.alibi_slopes(2)
    mask = torch.randn(6, 7, generator=gen).masked_fill(torch.rand(6, 7, generator=gen) < 0.3, -m.inf)
    for opts in ({}, {"softcap": 5.0}, {"alibi_slopes": slopes, "attn_mask": mask}):
        call = check_attention_call(
            q, k, k, attn_mask=opts.get("attn_mask"), dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, causal_alignment="top_left",
            backend="auto", softcap=opts.get("softcap"), alibi_slopes=opts.get("alibi_slopes"), window=None, return_stats=False, sinks=None, values=False,
        )  # fmt: skip
        read = _OneRead(out, (q, k, opts.get("alibi_slopes")), opts.get("attn_mask"))
        assert read.rows_look_right() == _rows_look_right(_row_peaks(out))
        for t in (q, k, slopes):
            want = abs_max(t)
            assert (m.isnan(read(t)) and m.isnan(want)) or read(t) == want
        assert read.finite(k) == _finite_sum(k)
        args = (IMPLEMENTATIONS[attnscale.Backend(backend)], Call(call, q, k, k, opts.get("attn_mask"), opts.get("alibi_slopes"), None))
        assert _rows_may_hide_trouble(*args, read) == _rows_may_hide_trouble(*args, _Read(out, None)), opts
