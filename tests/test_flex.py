"""backend="flex": the score path on torch's FlexAttention, against the fp64 reference and the math
backend. On CPU, torch 2.13 runs FlexAttention's compiled forward (float32/16-bit, no lse) and its
eager implementation (float64, lse; no backward): the forward of every feature is checked through
both; the backward, the compiled lse and the CUDA dispatch need a GPU (marked, skipped without)."""

import itertools
import math
import types

import numpy as np
import pytest
import torch
import torch._dynamo

import attnscale
from attnscale import ScorePath, flex, reference
from attnscale._validate import check_attention_call
from attnscale import backends
from attnscale.tiled import attention_partial, merge_sinks

from .features import FEATURES, feature_id


pytestmark = [
    pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),  # inside inductor itself
]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STAT_NAMES = ("lse", "max_logit", "max_prob", "entropy", "visible_keys", "sink_share")
NEG_INF = float("-inf")

# The tiled kernel's feature matrix (tests/test_tiled.py), at lengths across FlexAttention's 128 block.
SHAPES = [(4, 4, 9, 17), (4, 2, 131, 13), (4, 1, 5, 257)]  # (H, Hkv, L, S): MHA, GQA, MQA


def make_inputs(*, B=2, H=4, Hkv=2, L=9, S=17, D=7, Dv=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)  # (B, H, L, D)
    k = torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64)  # (B, Hkv, S, D)
    v = torch.randn(B, Hkv, S, Dv, generator=gen, dtype=torch.float64)  # (B, Hkv, S, Dv)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def make_mask(kind, *, B, H, L, S, seed=1):
    if kind is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, 1, L, S, generator=gen) > 0.3  # (B, 1, L, S)
    keep[0, 0, 1] = False  # one fully masked row
    if kind == "bool":
        return keep
    return torch.randn(1, H, L, S, generator=gen, dtype=torch.float64).masked_fill(~keep, NEG_INF)  # (1, H, L, S)


def options(*, softcap, alibi, window, causal, H):
    opts = {"softcap": softcap, "window": window}
    if alibi:
        opts["alibi_slopes"] = attnscale.alibi_slopes(H).double()
    if causal is not None:
        opts.update(is_causal=True, causal_alignment=causal)
    return opts


def run_reference(q, k, v, mask, **opts):
    np_opts = {key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in opts.items()}
    np_mask = None if mask is None else mask.double().numpy() if mask.is_floating_point() else mask.numpy()
    return reference.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), attn_mask=np_mask, **np_opts)


def run_flex(q, k, v, mask=None, **opts):
    with torch.no_grad():
        return attnscale.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend="flex", **opts)


def run_math(q, k, v, mask=None, **opts):
    return attnscale.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend="math", **opts)


def case_inputs(case, dtype=torch.float64, D=7, Dv=5):
    softcap, alibi, window, causal, mask_kind = FEATURES[case]
    H, Hkv, L, S = SHAPES[case % len(SHAPES)]
    q, k, v = make_inputs(H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv, seed=case, dtype=dtype)
    mask = make_mask(mask_kind, B=2, H=H, L=L, S=S, seed=case)
    return q, k, v, mask, options(softcap=softcap, alibi=alibi, window=window, causal=causal, H=H)


@pytest.mark.parametrize("case", range(len(FEATURES)), ids=feature_id)
def test_every_feature_matches_the_reference_in_float64(case):
    """float64 runs FlexAttention's eager implementation: the whole feature matrix of the tiled
    kernel (softcap, ALiBi, window, both causal alignments, bool and float masks, MHA/GQA/MQA,
    lengths across a block), rows with no visible key included. Measured largest error: 1.1e-15."""
    q, k, v, mask, opts = case_inputs(case)
    out = run_flex(q, k, v, mask, **opts)
    assert attnscale.last_backend() == "flex"
    np.testing.assert_allclose(out.numpy(), run_reference(q, k, v, mask, **opts), rtol=0, atol=1e-13)


# Through torch's compiled CPU FlexAttention (each mod set, dtype and shape compiles once: about
# 4 s on a cold cache, mostly the C++ compiler): the plain call and mixes that between them turn on
# every feature (softcap, ALiBi, window, both causal alignments, bool and float masks) on all three
# head layouts and lengths across a block. The float64 matrix above runs every case eagerly with
# the same mods.
COMPILED_CASES = [0, 13, 47, 58, 71]


@pytest.mark.parametrize("case", COMPILED_CASES, ids=feature_id)
def test_compiled_forward_error_is_like_math_in_float32(case):
    """float32 runs the compiled forward: error against fp64 at most twice the math backend's
    float32 error, plus a floor of 1e-6 (measured: at most 1.3x)."""
    q, k, v, mask, opts = case_inputs(case, dtype=torch.float32)
    opts = {name: (val.float() if isinstance(val, torch.Tensor) else val) for name, val in opts.items()}
    want = run_reference(q, k, v, mask, **opts)
    got = run_flex(q, k, v, mask, **opts)
    assert got.dtype == torch.float32
    math_err = np.abs(run_math(q, k, v, mask, **opts).numpy() - want).max()
    assert np.abs(got.numpy() - want).max() <= 2 * math_err + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [0, 71], ids=feature_id)
def test_half_precision_error_is_like_math(dtype, case):
    """16-bit inputs (compiled forward, float32 scores inside): error against fp64 at most twice
    the math backend's in the same dtype, plus a floor of one unit in the last place at 1."""
    q, k, v, mask, opts = case_inputs(case, dtype=dtype)
    want = run_reference(q, k, v, mask, **opts)
    got = run_flex(q, k, v, mask, **opts)
    assert got.dtype == dtype
    math_err = np.abs(run_math(q, k, v, mask, **opts).double().numpy() - want).max()
    err = np.abs(got.double().numpy() - want).max()
    assert err <= 2 * math_err + torch.finfo(dtype).eps, (err, math_err)


@pytest.mark.parametrize("case", [0, 13, 23, 47, 58, 71], ids=feature_id)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_statistics_and_sinks_match_math_in_float64(case, with_sinks):
    """Statistics (lse from FlexAttention, the rest from the chunked second pass) and the sinks
    epilogue against the math backend, every statistic, in float64 (measured: 1.8e-15)."""
    q, k, v, mask, opts = case_inputs(case)
    if with_sinks:
        opts["sinks"] = torch.tensor([0.5, -1.0, 2.0, -math.inf], dtype=torch.float64)
    out, stats = run_flex(q, k, v, mask, return_stats=True, **opts)
    want_out, want = run_math(q, k, v, mask, return_stats=True, **opts)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-13)
    for name in STAT_NAMES:
        got_s, want_s = getattr(stats, name), getattr(want, name)
        assert (got_s is None) == (want_s is None), name
        if got_s is not None:
            assert got_s.shape == want_s.shape, name
            torch.testing.assert_close(got_s, want_s, rtol=0, atol=1e-13, msg=name)


def test_sinks_without_statistics_match_math():
    q, k, v, mask, opts = case_inputs(23)
    sinks = torch.tensor([0.5, -1.0, 2.0, -math.inf], dtype=torch.float64)
    torch.testing.assert_close(run_flex(q, k, v, mask, sinks=sinks, **opts), run_math(q, k, v, mask, sinks=sinks, **opts), rtol=0, atol=1e-13)


def test_statistics_pass_in_chunks_equals_one_pass(monkeypatch):
    """The second pass over query chunks gives the rows one pass gives (chunks of 3 rows here)."""
    q, k, v, mask, opts = case_inputs(71)
    whole = run_flex(q, k, v, mask, return_stats=True, **opts)[1]
    monkeypatch.setattr(flex, "CHUNK_SCORES", 3 * 2 * 4 * k.shape[-2])
    chunked = run_flex(q, k, v, mask, return_stats=True, **opts)[1]
    for name in ("lse", "max_logit", "max_prob", "entropy", "visible_keys"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), rtol=0, atol=1e-14, msg=name)


def test_sink_epilogue_equals_merge_sinks_with_gradients():
    """The epilogue ``out * sigmoid(lse - sink)`` and its gradient (to out, lse and the sinks)
    against the tiled kernel's merge of a valueless partial, in float64 on finished partials."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(6, 6, generator=gen) > 0.3
    keep[2] = False  # a row with no visible key
    out, lse = attention_partial(q, k, v, path=ScorePath(scale=0.5), attn_mask=keep)
    assert lse[0, 0, 2] == -math.inf
    sinks = torch.tensor([0.5, -1.0, -math.inf], dtype=torch.float64)
    leaves = [t.detach().requires_grad_() for t in (out, lse, sinks)]
    got = flex.sink_epilogue(*leaves)
    want = merge_sinks(*leaves)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got_g = torch.autograd.grad((got * grad).sum(), leaves)
    want_g = torch.autograd.grad((want * grad).sum(), leaves)
    for name, g, w in zip(("out", "lse", "sinks"), got_g, want_g):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=0, atol=1e-14, msg=name)


def test_broadcast_batch_dims_and_a_per_batch_float_mask():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 4, 7, 8, generator=gen, dtype=torch.float64)  # (B1, B2, H, L, D)
    k = torch.randn(1, 2, 2, 11, 8, generator=gen, dtype=torch.float64)  # broadcast over B1, Hkv = 2
    v = torch.randn(3, 1, 2, 11, 5, generator=gen, dtype=torch.float64)  # broadcast over B2
    mask = torch.randn(3, 1, 1, 7, 11, generator=gen, dtype=torch.float64)
    slopes = attnscale.alibi_slopes(4).double().expand(2, 4).contiguous() * torch.tensor([[1.0], [0.5]], dtype=torch.float64)
    opts = dict(alibi_slopes=slopes, softcap=4.0, return_stats=True)
    out, stats = run_flex(q, k, v, mask, **opts)
    want, want_stats = run_math(q, k, v, mask, **opts)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(stats.entropy, want_stats.entropy, rtol=0, atol=1e-13)


def test_empty_lengths():
    for L, S in ((0, 5), (4, 0)):
        q, k, v = torch.randn(1, 2, L, 4), torch.randn(1, 2, S, 4), torch.randn(1, 2, S, 3)
        out, stats = run_flex(q, k, v, return_stats=True)
        assert out.shape == (1, 2, L, 3) and not out.any()
        assert (stats.visible_keys == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_under_no_grad_inputs_that_require_grad_are_computed(dtype):
    """Under torch.no_grad, float64 inputs that require grad (a model's nn.Parameter) raised torch's
    NotImplementedError "FlexAttention does not support backward on CPU": no backward is needed there."""
    q, k, v = make_inputs(H=2, Hkv=2, L=5, S=6, dtype=dtype)
    q, k = torch.nn.Parameter(q), k.requires_grad_()
    got = run_flex(q, k, v, is_causal=True)
    assert not got.requires_grad
    torch.testing.assert_close(got, run_math(q, k, v, is_causal=True).detach(), rtol=0, atol=1e-13 if dtype == torch.float64 else 1e-6)


def test_non_finite_inputs_follow_the_documented_rule():
    """The NaN-row rule of every backend: a NaN query row with a visible key is NaN, a NaN key
    spoils only the rows that see it."""
    q, k, v = make_inputs(H=2, Hkv=2, L=6, S=6, dtype=torch.float32)
    q[0, 0, 1, 0] = math.nan
    k[1, 1, 4, 2] = math.inf
    got = run_flex(q, k, v, is_causal=True)
    want = run_math(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6, equal_nan=True)
    assert torch.isnan(got[1, 1, 4:]).all() and not torch.isnan(got[1, 1, :4]).any()


def test_huge_windows_are_unlimited():
    """Window sides up to the documented 2**62 - 1 never overflow FlexAttention's index arithmetic."""
    q, k, v = make_inputs(H=2, Hkv=2, L=5, S=9)
    big = 2**62 - 1
    got = run_flex(q, k, v, window=(big, 1), is_causal=True, causal_alignment="bottom_right")
    torch.testing.assert_close(got, run_math(q, k, v, window=(big, 1), is_causal=True, causal_alignment="bottom_right"), rtol=0, atol=1e-13)


def test_one_compilation_per_shape_family():
    """New softcap values, new ALiBi slopes and new masks of one shape reuse the compiled
    FlexAttention (their constants are captured tensors); positional block masks are cached."""
    q, k, v = make_inputs(H=4, Hkv=2, L=33, S=40, dtype=torch.float32)
    slopes = attnscale.alibi_slopes(4)
    run_flex(q, k, v, softcap=5.0, alibi_slopes=slopes, is_causal=True)
    run_flex(q, k, v, torch.rand(33, 40) > 0.5)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for cap in (3.0, 7.0):
        run_flex(q, k, v, softcap=cap, alibi_slopes=slopes * cap, is_causal=True)
        run_flex(q, k, v, torch.rand(33, 40) > 0.5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    path = ScorePath(scale=0.5, causal=True)
    assert flex._positional_block_mask(path, 33, 40, "cpu") is flex._positional_block_mask(path, 33, 40, "cpu")


@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated:DeprecationWarning")  # dynamo's vmap of the mask
@pytest.mark.parametrize("case", [58, 71], ids=feature_id)
def test_inside_torch_compile_one_graph(case):
    """Under torch.compile (fullgraph) the call is one flex_attention op in the caller's graph;
    statistics take the second pass's log-sum-exp where compiled CPU FlexAttention has none.

    Each case starts from a fresh dynamo: in torch 2.13 on CPU, recompiling one function for a
    second mod set with statistics fails inside inductor ("A subgraph argument other than
    striding has been modified"), a known limitation of its CPU FlexAttention template."""
    torch._dynamo.reset()
    q, k, v, mask, opts = case_inputs(case, dtype=torch.float32)
    opts = {name: (val.float() if isinstance(val, torch.Tensor) else val) for name, val in opts.items()}

    def f(q, k, v):
        return attnscale.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend="flex", return_stats=True, **opts)

    with torch.no_grad():
        out, stats = torch.compile(f, fullgraph=True)(q, k, v)
        want, want_stats = run_math(q, k, v, mask, return_stats=True, **opts)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6)
    for name in ("lse", "max_logit", "entropy"):
        torch.testing.assert_close(getattr(stats, name), getattr(want_stats, name), rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")  # measured 5.7e-6 (entropies near 1)


def test_sinks_inside_torch_compile_on_cpu_are_refused():
    q, k, v = make_inputs(H=4, Hkv=4, L=5, S=5, dtype=torch.float32)

    def f(q, k, v):
        return attnscale.scaled_dot_product_attention(q, k, v, backend="flex", sinks=torch.zeros(4))

    with torch.no_grad(), pytest.raises(Exception, match="sinks under torch.compile on CPU"):
        torch.compile(f, fullgraph=True)(q, k, v)


@pytest.mark.parametrize(
    "opts, needle",
    [
        ({"dropout_p": 0.1}, "dropout"),
        ({"alibi_slopes": "learned"}, "alibi_slopes that require grad"),
        ({"attn_mask": "learned"}, "float attn_mask that requires grad"),
        ({"grad": True}, "no CPU backward"),
    ],
)
def test_what_flex_cannot_run_is_refused_clearly(opts, needle):
    q, k, v = make_inputs(H=4, Hkv=4, L=5, S=5, dtype=torch.float32)
    opts = dict(opts)
    if opts.pop("grad", False):
        q.requires_grad_()
    if opts.get("alibi_slopes") == "learned":
        opts["alibi_slopes"] = attnscale.alibi_slopes(4).requires_grad_()
    if opts.get("attn_mask") == "learned":
        opts["attn_mask"] = torch.zeros(5, 5, requires_grad=True)
    with pytest.raises(ValueError, match=f"backend: expected a call FlexAttention can run.*{needle}.*Fix: use backend='tiled'"):
        attnscale.scaled_dot_product_attention(q, k, v, backend="flex", **opts)


def _call(**opts):
    q, k, v = make_inputs(H=4, Hkv=4, L=5, S=5, Dv=7, dtype=torch.float32)
    call = check_attention_call(
        q, k, v, attn_mask=None, dropout_p=opts.get("dropout_p", 0.0), is_causal=False, scale=None, enable_gqa=False,
        causal_alignment="top_left", backend="auto", softcap=opts.get("softcap"), alibi_slopes=None, window=None,
        return_stats=opts.get("return_stats", False),
    )  # fmt: skip
    return call, q


def test_auto_never_takes_flex_on_cpu():
    """On CPU the compiled kernel (or tiled) serves every feature: eager FlexAttention there
    holds the whole score matrix."""
    q, k, v = make_inputs(H=4, Hkv=4, L=5, S=5, dtype=torch.float32)
    attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0)
    assert attnscale.last_backend() != "flex"


def test_auto_on_cuda_prefers_torch_then_flex_then_the_rest(monkeypatch):
    """The rule on a CUDA tensor (a stand-in: the rule reads only where it lies): torch's fused
    kernel where it is exact, FlexAttention where it can run, otherwise as on CPU."""
    gpu = types.SimpleNamespace(device=torch.device("cuda"), is_cpu=False, is_meta=False, is_cuda=True, requires_grad=False)

    def chosen(call, flex_cannot):
        monkeypatch.setattr(flex, "cannot", lambda **kwargs: flex_cannot)
        return backends.choose(backends.Call(call, gpu, gpu, gpu, None, None, None))[0].backend.value

    call, _ = _call()
    assert chosen(call, None) == "torch"
    call, _ = _call(softcap=5.0)
    assert chosen(call, None) == "flex"
    assert chosen(call, "some reason") == "tiled"
    call, _ = _call(softcap=5.0, dropout_p=0.1)
    assert chosen(call, "dropout") == "math"


@cuda
@pytest.mark.parametrize("case", COMPILED_CASES, ids=feature_id)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cuda_forward_backward_and_statistics_match_math(case, with_sinks):
    """On a GPU: compiled FlexAttention, forward and backward in float32, statistics with the
    compiled lse, against the math backend on the same device (head dims 16: the least
    FlexAttention's GPU kernels take)."""
    q, k, v, mask, opts = case_inputs(case, dtype=torch.float32, D=16, Dv=16)
    dev = "cuda"
    q, k, v = (t.to(dev).requires_grad_() for t in (q, k, v))
    mask = None if mask is None else mask.to(dev)
    opts = {name: (val.float().to(dev) if isinstance(val, torch.Tensor) else val) for name, val in opts.items()}
    if with_sinks:
        opts["sinks"] = torch.tensor([0.5, -1.0, 2.0, -math.inf], device=dev).requires_grad_()
    out, stats = attnscale.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, return_stats=True, **opts)
    assert attnscale.last_backend() == "flex"
    want, want_stats = run_math(q, k, v, mask, return_stats=True, **opts)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    for name in ("lse", "max_logit", "max_prob", "entropy"):
        torch.testing.assert_close(getattr(stats, name), getattr(want_stats, name), rtol=0, atol=1e-5, msg=name)
    leaves = [q, k, v] + ([opts["sinks"]] if with_sinks else [])
    grad = torch.randn_like(out)
    got_g = torch.autograd.grad((out * grad).sum() + stats.lse.sum(), leaves)
    want_g = torch.autograd.grad((want * grad).sum() + want_stats.lse.sum(), leaves)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


@cuda
def test_cuda_compiles_once_per_shape_family():
    q, k, v = (t.cuda() for t in make_inputs(H=4, Hkv=2, L=300, S=300, dtype=torch.bfloat16))
    attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=5.0, is_causal=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for cap in (3.0, 7.0):
        attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=cap, is_causal=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("window", [(254, None), (127, 0), (None, 128)])
def test_a_window_edge_on_a_block_edge_through_compiled_flexattention(window):
    """A window whose edge falls on a block's edge, end to end through compiled CPU FlexAttention in
    float32 (a key interval off by one marked a block full: 2.6e-3 off, where right is 4e-7)."""
    q, k, v = make_inputs(B=1, H=2, Hkv=2, L=256, S=256, D=16, Dv=16, dtype=torch.float32, seed=9)
    opts = {"is_causal": window[1] is None, "window": window}
    want = run_math(q.double(), k.double(), v.double(), **opts)
    got = run_flex(q, k, v, **opts)
    assert (got.double() - want).abs().max() < 2e-6


def test_mods_are_the_score_path():
    """The score_mod and mask_mod alone, on flex_attention itself, give ScorePath's logits."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = make_inputs(H=2, Hkv=2, L=6, S=8)
    path = ScorePath(scale=0.3, softcap=2.0, causal=True, window=(3, None), q_offset=2)
    slopes = torch.tensor([0.25, 0.5], dtype=torch.float64)
    score_mod, mask_mod, by = flex.mods(path, batch=(2,), alibi_slopes=slopes, dtype=torch.float64)
    assert by == (False, False)
    block = create_block_mask(mask_mod, None, None, 6, 8, device="cpu")
    got = flex._eager(q, k, v, score_mod=score_mod, block_mask=block, scale=path.scale)
    q_pos, k_pos = path.positions(0, 6, 0, 8, q.device)
    logits = path.logits(q @ k.mT, q_pos=q_pos, k_pos=k_pos, alibi_slopes=slopes)
    logits = logits.masked_fill(~path.visibility(q_pos, k_pos), -math.inf)
    torch.testing.assert_close(got, torch.softmax(logits, -1) @ v, rtol=0, atol=1e-14)


# --- BlockMasks from key intervals -------------------------------------------------------------

def _dense_blocks(block_mask, nk):
    """A BlockMask's (nq, nk) partial and full block tables (row i: the first counts[i] entries of
    indices[i] are its blocks; written here, as torch's private helper for it changes signature)."""

    def dense(counts, indices):
        counts, indices = counts[0, 0], indices[0, 0]  # (nq,), (nq, max blocks)
        listed = torch.arange(indices.shape[-1]) < counts[:, None]
        table = torch.zeros(counts.shape[0], nk + 1, dtype=torch.bool)
        return table.scatter_(1, torch.where(listed, indices, nk).long(), True)[:, :nk]  # unlisted -> column nk, dropped

    return dense(block_mask.kv_num_blocks, block_mask.kv_indices), dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)


@pytest.mark.parametrize(
    "L, S, causal, window, offset",
    [(1, 1, True, None, 0), (300, 400, True, None, 0), (300, 400, True, None, 100), (128, 129, False, (5, 2), 0),
     (257, 256, True, (200, None), -50), (100, 400, False, (None, 3), 7), (300, 129, True, (5, 2), 300),
     (256, 256, True, (254, None), 0), (256, 256, False, (126, 1), 0)],  # windows whose edge is a block's edge
)
def test_interval_block_masks_equal_create_block_mask(L, S, causal, window, offset):
    """For causal and windows the interval BlockMask has exactly create_block_mask's partial and
    full blocks (which evaluates the mask_mod on every pair)."""
    from torch.nn.attention.flex_attention import create_block_mask

    path = ScorePath(scale=1.0, causal=causal, window=window, q_offset=offset)
    _, mask_mod, _ = flex.mods(path)
    mine = flex.interval_block_mask(*flex.key_intervals(path, L, S, torch.device("cpu")), S, mask_mod)
    want = create_block_mask(mask_mod, None, None, L, S, device="cpu")
    nk = -(-S // flex.BLOCK)
    for got_t, want_t in zip(_dense_blocks(mine, nk), _dense_blocks(want, nk)):
        assert torch.equal(got_t, want_t)


def _packing(lens_q, lens_k):
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)])
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)])
    return cu_q, cu_k


@pytest.mark.parametrize("seed", range(6))
def test_packed_block_masks_hold_every_visible_pair_and_only_whole_full_blocks(seed):
    """Packed sequences of random lengths (empty ones too), with causal and windows: every block
    holding a visible pair is in the BlockMask, and a block marked full has every pair visible
    (full blocks skip the mask_mod)."""
    from torch.nn.attention.flex_attention import create_mask

    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=gen))
    lens_q = torch.randint(0, 300, (n,), generator=gen).tolist()
    lens_k = torch.randint(0, 300, (n,), generator=gen).tolist()
    lens_q[0], lens_k[0] = max(lens_q[0], 1), max(lens_k[0], 1)
    cu_q, cu_k = _packing(lens_q, lens_k)
    L, S = int(cu_q[-1]), int(cu_k[-1])
    path = ScorePath(scale=1.0, causal=bool(seed % 2), window=[None, (40, 3), (None, 0)][seed % 3])
    documents = flex.Documents.from_cu_seqlens(cu_q, cu_k)
    _, mask_mod, _ = flex.mods(path, documents=documents)
    mine = flex.interval_block_mask(*flex.key_intervals(path, L, S, torch.device("cpu"), documents), S, mask_mod)
    dense = create_mask(mask_mod, 1, 1, L, S, device="cpu")[0, 0]  # (L, S)
    nq, nk = -(-L // flex.BLOCK), -(-S // flex.BLOCK)
    padded = torch.nn.functional.pad(dense, (0, nk * flex.BLOCK - S, 0, nq * flex.BLOCK - L))
    blocks = padded.view(nq, flex.BLOCK, nk, flex.BLOCK).transpose(1, 2)  # (nq, nk, BLOCK, BLOCK)
    partial, full = _dense_blocks(mine, nk)
    assert not (partial & full).any()
    assert ((partial | full) >= blocks.any(-1).any(-1)).all(), "a block with a visible pair is missing"
    assert (blocks.all(-1).all(-1) >= full).all(), "a block marked full hides a pair"


# --- packed sequences (varlen_attention) ---------------------------------------------------------

LENS = ([5, 0, 130, 7, 200], [9, 3, 130, 0, 260])  # an empty query sequence, an empty key sequence, L > S
VARLEN_OPTIONS = [
    {},
    {"is_causal": True},
    {"is_causal": True, "softcap": 5.0, "window": (20, 3)},
    {"is_causal": True, "alibi": "shared"},
    {"alibi": "per_sequence", "window": (None, 4)},
    {"is_causal": True, "sinks": True},
]


def _varlen_inputs(dtype, opts, H=4, Hkv=2, D=16, Dv=8):
    gen = torch.Generator().manual_seed(11)
    cu_q, cu_k = _packing(*LENS)
    q = torch.randn(int(cu_q[-1]), H, D, generator=gen, dtype=torch.float64).to(dtype)  # (total_q, H, D)
    k = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen, dtype=torch.float64).to(dtype)  # (total_k, Hkv, D)
    v = torch.randn(int(cu_k[-1]), Hkv, Dv, generator=gen, dtype=torch.float64).to(dtype)  # (total_k, Hkv, Dv)
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    if alibi == "shared":
        opts["alibi_slopes"] = attnscale.alibi_slopes(H).to(dtype)
    elif alibi == "per_sequence":
        opts["alibi_slopes"] = torch.rand(len(LENS[0]), H, generator=gen, dtype=torch.float64).to(dtype)  # (B, H)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.tensor([0.5, -1.0, 2.0, -math.inf], dtype=dtype)
    return q, k, v, cu_q, cu_k, opts


@pytest.mark.parametrize("opts", VARLEN_OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_packed_sequences_in_one_call_match_math_in_float64(opts):
    """One FlexAttention call over the packed rows (eager FlexAttention in float64), output and
    every statistic against the math backend's per-sequence calls (measured: 8.9e-16)."""
    q, k, v, cu_q, cu_k, opts = _varlen_inputs(torch.float64, opts)
    with torch.no_grad():
        out, stats = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="flex", return_stats=True, **opts)
        assert attnscale.last_backend() == "flex"
        want, want_stats = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="math", return_stats=True, **opts)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
    for name in STAT_NAMES:
        got_s, want_s = getattr(stats, name), getattr(want_stats, name)
        assert (got_s is None) == (want_s is None), name
        if got_s is not None:
            torch.testing.assert_close(got_s, want_s, rtol=0, atol=1e-13, msg=name)


@pytest.mark.parametrize("opts", VARLEN_OPTIONS[2:4], ids=lambda o: "-".join(o) or "plain")  # the causal document mask with the other mods
def test_packed_sequences_compiled_forward_is_like_math_in_float32(opts):
    """The compiled CPU FlexAttention on the document mask: error against float64 at most twice the
    math backend's float32 error plus 1e-6 (measured: at most 1.1x)."""
    q, k, v, cu_q, cu_k, opts = _varlen_inputs(torch.float32, opts)
    wide = {name: (val.double() if isinstance(val, torch.Tensor) else val) for name, val in opts.items()}
    want = attnscale.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, backend="math", **wide)
    with torch.no_grad():
        got = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="flex", **opts)
    math_err = (attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="math", **opts).double() - want).abs().max()
    assert (got.double() - want).abs().max() <= 2 * math_err + 1e-6


def test_packed_sequences_with_a_nan_take_one_call_per_sequence():
    """A NaN in one sequence: the packed call would skip the NaN-row rule, so every sequence runs
    as its own flex call, which applies it; the other sequences are untouched."""
    q, k, v, cu_q, cu_k, opts = _varlen_inputs(torch.float64, {"is_causal": True})
    q[int(cu_q[2]) + 3, 1, 0] = math.nan
    with torch.no_grad():
        got = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="flex", **opts)
    assert attnscale.last_backend() == "flex"
    want = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="math", **opts)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13, equal_nan=True)
    assert torch.isnan(got[int(cu_q[2]) + 3, 1]).all() and not torch.isnan(got[: int(cu_q[2])]).any()


def test_packed_sequences_that_flex_cannot_run_are_refused_clearly():
    q, k, v, cu_q, cu_k, opts = _varlen_inputs(torch.float32, {"is_causal": True})
    q.requires_grad_()
    with pytest.raises(ValueError, match="backend: expected a call FlexAttention can run.*no CPU backward"):
        attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="flex", **opts)


@pytest.mark.parametrize(
    "shape, dtype, needle",
    [
        ((4, 4, 300, 8, 8), torch.float32, "head dims D = 8, Dv = 8"),
        ((4, 4, 300, 64, 8), torch.bfloat16, "Dv = 8"),
        ((4, 4, 300, 64, 64), torch.float64, "torch.float64"),
        ((6, 2, 1, 64, 64), torch.float16, "3 query heads per key/value head with 1 query rows"),
        ((6, 2, 300, 64, 64), torch.float16, None),
        ((8, 2, 1, 64, 64), torch.float32, None),
    ],
)
def test_what_gpu_flexattention_refuses_sends_auto_elsewhere(shape, dtype, needle):
    """On a GPU, calls torch's Triton FlexAttention refuses (or does not test) are not flex's: auto
    takes the tiled kernel, backend='flex' says why (the rule reads shapes and dtype only)."""
    H, Hkv, L, D, Dv = shape
    q, k, v = torch.zeros(1, H, L, D, dtype=dtype), torch.zeros(1, Hkv, 9, D, dtype=dtype), torch.zeros(1, Hkv, 9, Dv, dtype=dtype)
    why = flex.cannot(device=torch.device("cuda"), dropout_p=0.0, attn_mask=None, alibi_slopes=None, sinks=None, tensors=(q, k, v))
    if needle is None:
        assert why is None
    else:
        assert needle in why


@cuda
@pytest.mark.parametrize("opts", VARLEN_OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_cuda_packed_sequences_forward_and_backward_match_math(opts):
    """On a GPU auto runs packed sequences as one compiled FlexAttention call, forward and
    backward, float32, against the math backend's per-sequence calls on the same device (head
    dims 16: the least FlexAttention's GPU kernels take)."""
    q, k, v, cu_q, cu_k, opts = _varlen_inputs(torch.float32, opts, Dv=16)
    q, k, v = (t.cuda().requires_grad_() for t in (q, k, v))
    cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
    opts = {name: (val.cuda() if isinstance(val, torch.Tensor) else val) for name, val in opts.items()}
    out = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **opts)
    assert attnscale.last_backend() == "flex"
    want = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="math", **opts)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad((out * grad).sum(), (q, k, v)), torch.autograd.grad((want * grad).sum(), (q, k, v))):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [3, 59])  # q and k padded to 24 dims (D < 24), and as they are
def test_half_precision_softcap_through_the_compiled_forward(dtype, D):
    """16-bit inputs with a small softcap (0.7) through compiled CPU FlexAttention, and with
    statistics through the eager one: error at most twice the math backend's in the same dtype
    plus one ulp at 1 (a score_mod that cast the score to float32 and back was off by up to 1.6
    in float16), statistics within 1e-4 of float64's on the same rounded inputs."""
    gen = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(1, 2, n, D, generator=gen, dtype=torch.float64) for n in (17, 33, 33))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    want, want_stats = run_math(q.double(), k.double(), v.double(), softcap=0.7, return_stats=True)  # of the rounded inputs
    math_err = (run_math(q, k, v, softcap=0.7).double() - want).abs().max()
    got = run_flex(q, k, v, softcap=0.7)
    assert (got.double() - want).abs().max() <= 2 * math_err + torch.finfo(dtype).eps
    got, stats = run_flex(q, k, v, softcap=0.7, return_stats=True)
    assert (got.double() - want).abs().max() <= 2 * math_err + torch.finfo(dtype).eps
    for name in ("lse", "max_logit", "entropy"):
        assert stats.lse.dtype == torch.float32
        torch.testing.assert_close(getattr(stats, name).double(), getattr(want_stats, name), rtol=0, atol=1e-4, msg=name)


def test_more_mod_structures_than_torchs_recompile_limit_stay_compiled():
    """Each mod structure compiles FlexAttention once; past torch's recompile limit (8 by default,
    1 here) torch would run it eagerly, which holds the whole score matrix. The backend keeps
    RECOMPILE_LIMIT compilations instead: three structures, three compiled graphs."""
    torch._dynamo.reset()
    q, k, v = make_inputs(H=2, Hkv=2, L=9, S=9, dtype=torch.float32)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=1):
        for opts in ({"softcap": 5.0}, {"is_causal": True}, {"window": (2, 1)}):
            torch.testing.assert_close(run_flex(q, k, v, **opts), run_math(q, k, v, **opts), rtol=0, atol=2e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 3


def test_packed_sequences_are_judged_by_heads_and_rows(monkeypatch):
    """flex's GPU limits read (H, rows, D) of the packed tensors, not (total, H, D): 3 query heads
    per key/value head over 300 packed rows is not a decoding call (a stand-in for a CUDA tensor:
    the rule reads only the device)."""
    seen = []
    real = flex.cannot

    def spy(**kwargs):
        seen.append(tuple(tuple(t.shape) for t in kwargs["tensors"]))
        return real(**{**kwargs, "device": torch.device("cuda")})

    monkeypatch.setattr(flex, "cannot", spy)
    cu = torch.tensor([0, 100, 300])
    q, k, v = torch.randn(300, 6, 16), torch.randn(300, 2, 16), torch.randn(300, 2, 16)
    with torch.no_grad():
        attnscale.varlen_attention(q, k, v, cu, cu, backend="flex")
    assert seen == [((6, 300, 16), (2, 300, 16), (2, 300, 16))]
    assert attnscale.last_backend() == "flex"


@pytest.mark.parametrize("layout", ["expanded", "unfolded", "transposed"])
def test_inputs_whose_rows_share_memory_are_read_right(layout):
    """Values expanded along the keys and dims (stride 0) and keys built by unfold (rows
    overlapping) go to FlexAttention as contiguous copies (its compiled CPU forward read the
    expanded ones as garbage, up to 2e24); a transposed view is read as it lies."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 9, 8, generator=gen)
    k = torch.randn(1, 2, 9, 8, generator=gen)
    v = torch.randn(1, 2, 9, 8, generator=gen)
    if layout == "expanded":
        v = torch.randn(1, 2, 1, 1, generator=gen).expand(1, 2, 9, 8)  # one value per head: strides 0 along keys and dims
    elif layout == "unfolded":
        k = torch.randn(1, 2, 16, generator=gen).unfold(-1, 8, 1)  # (1, 2, 9, 8): row j is entries j..j+7
    else:
        q = torch.randn(1, 9, 2, 8, generator=gen).transpose(1, 2)
    for opts in ({}, {"softcap": 5.0, "is_causal": True}):
        torch.testing.assert_close(run_flex(q, k, v, **opts), run_math(q, k, v, **opts), rtol=0, atol=2e-6)


@pytest.mark.parametrize(("D", "dtype"), [(8, torch.float32), (16, torch.float32), (8, torch.bfloat16)])
def test_small_head_dims_in_avx2_code_are_right(D, dtype):
    """Compiled CPU FlexAttention generated as for a CPU without AVX-512 (inductor's
    ``cpp.simdlen`` 256, the AVX2 code such CPUs get): key lengths that leave a block of 8 keys
    (8, 24; 136 = 128 + 8 under a block mask's 128-key splits) at head dims 8 and 16 were off by
    up to 1.2 or NaN; q and k now reach it padded to 24 dims. Error against float64 at most
    twice the math backend's in the same dtype plus one ulp at 1."""
    import torch._inductor.config as inductor_config

    eps = torch.finfo(dtype).eps
    torch._dynamo.reset()
    try:
        with inductor_config.patch({"cpp.simdlen": 256}):
            for L, S, opts in [(1, 8, {}), (6, 24, {"softcap": 5.0}), (3, 136, {"is_causal": True, "window": (140, 0)})]:
                q, k, v = make_inputs(B=1, H=2, Hkv=2, L=L, S=S, D=D, Dv=D, seed=L)
                want = run_math(q, k, v, **opts)
                q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
                math_err = (run_math(q, k, v, **opts).double() - want).abs().max()
                err = (run_flex(q, k, v, **opts).double() - want).abs().max()
                assert err <= 2 * math_err + eps, (L, S, opts, err.item(), math_err.item())
    finally:
        torch._dynamo.reset()  # the graphs compiled here hold AVX2 code
