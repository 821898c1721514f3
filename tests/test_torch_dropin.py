"""attnscale as a drop-in for torch's SDPA: torch's documented behaviours run through
``torch.nn.functional.scaled_dot_product_attention`` replaced by attnscale's
(:func:`attnscale.patch_torch`) and through each of attnscale's backends, against torch's own
kernel (bound before any patch: ``torch._C._nn.scaled_dot_product_attention``).

Two documented differences stand (docs/semantics.md): an explicit ``attn_mask`` with
``is_causal=True`` applies both (torch's math kernel raises), and a row with no visible key is
zeros (torch gives NaN); no case here has either.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnscale
from attnscale import functional, kernels
from attnscale.patch import patched_sdpa

TORCH = torch._C._nn.scaled_dot_product_attention  # torch's own, whatever F holds
BACKENDS = ["patched", "auto", "torch", "math", "tiled", "fused", "flex"]
NO_KERNEL = kernels.build_precondition()


def _inputs(*, B=(2,), H=4, Hkv=None, L=5, S=7, D=8, Dv=None, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    Dv = D if Dv is None else Dv
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    return draw(*B, H, L, D), draw(*B, Hkv, S, D), draw(*B, Hkv, S, Dv)


def _mask(L, S, *, kind, seed=1):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(L, S, generator=gen) > 0.3
    keep[:, 0] = True  # every row sees a key: torch would give NaN where none is seen
    if kind == "bool":
        return keep
    return torch.zeros(L, S, dtype=torch.float64).masked_fill(~keep, -math.inf) + torch.randn(L, S, generator=gen, dtype=torch.float64)


def _cases():
    """(id, inputs, options): torch's documented behaviours (the SDPA docstring's shapes, masks,
    causal alignment, scale, enable_gqa) and the cases torch's tests add (negative and zero
    scales, no heads, a head dim of 0, its causal bias objects)."""
    yield "4-d", _inputs(), {}
    yield "3-d, no batch", _inputs(B=()), {}
    yield "5-d, two batch dims", _inputs(B=(2, 3)), {}
    yield "Ev != E", _inputs(Dv=3), {}
    yield "bool mask (L, S)", _inputs(), {"attn_mask": _mask(5, 7, kind="bool")}
    yield "bool mask (B, 1, L, S)", _inputs(), {"attn_mask": _mask(5, 7, kind="bool").expand(2, 1, 5, 7)}
    yield "float mask added", _inputs(), {"attn_mask": _mask(5, 7, kind="float")}
    yield "is_causal, L = S", _inputs(L=7), {"is_causal": True}
    yield "is_causal, L < S (top-left)", _inputs(), {"is_causal": True}
    yield "scale", _inputs(), {"scale": 0.3}
    yield "negative scale (pytorch#105190)", _inputs(), {"scale": -0.7}
    yield "zero scale", _inputs(), {"scale": 0.0}
    yield "enable_gqa", _inputs(H=8, Hkv=2), {"enable_gqa": True}
    yield "no heads", _inputs(H=0), {}
    yield "head dim 0", _inputs(D=0, Dv=3), {}
    yield "head dim 0, causal", _inputs(D=0, Dv=3, L=7), {"is_causal": True}
    yield "causal_upper_left(L, S)", _inputs(), {"attn_mask": causal_upper_left(5, 7)}
    yield "causal_lower_right(L, S)", _inputs(), {"attn_mask": causal_lower_right(5, 7)}
    yield "causal_lower_right(S, S)", _inputs(L=7), {"attn_mask": causal_lower_right(7, 7)}


CASES = list(_cases())


def _run(backend, q, k, v, options):
    if backend == "patched":
        with attnscale.patch_torch():
            return F.scaled_dot_product_attention(q, k, v, **options)
    return attnscale.scaled_dot_product_attention(q, k, v, backend=backend, **options)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "inputs", "options"), CASES, ids=[c[0] for c in CASES])
def test_torch_documented_behaviours_hold_through_attnscale(name, inputs, options, backend):
    if backend == "fused" and NO_KERNEL is not None:
        pytest.skip(f"the compiled kernel cannot be had here: {NO_KERNEL}")
    if backend == "flex" and inputs[0].ndim == 3:
        pytest.skip("FlexAttention takes (B, H, L, D): no batch dim is attnscale's own reshape, run by the other backends")
    q, k, v = (t.clone().requires_grad_(backend != "flex") for t in inputs)  # CPU FlexAttention has no backward
    want = TORCH(q, k, v, **options)
    got = _run(backend, q, k, v, options)
    assert type(got) is torch.Tensor and got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64: measured 4e-16 and less
    if want.numel() and backend != "flex":
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=want.dtype)
        expected = torch.autograd.grad(want, (q, k, v), grad)
        for g, e in zip(torch.autograd.grad(got, (q, k, v), grad), expected):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-11)


def test_replacing_torchs_function_never_recurses_and_is_undone():
    """With torch's function replaced by attnscale's (the ordinary way to make a program use a
    drop-in) every call recursed: the "torch" backend looked F.scaled_dot_product_attention up at
    call time. It binds torch's kernel at import."""
    q, k, v = _inputs()
    with attnscale.patch_torch() as patch:
        assert F.scaled_dot_product_attention is patched_sdpa and patch.active
        assert not torch.backends.mha.get_fastpath_enabled()
        out = F.scaled_dot_product_attention(q, k, v)
        assert functional.last_backend() == "torch"  # attnscale -> torch's kernel, once
        torch.testing.assert_close(out, TORCH(q, k, v), rtol=0, atol=0)
        out = attnscale.scaled_dot_product_attention(q, k, v, backend="torch")  # forced, while patched
        torch.testing.assert_close(out, TORCH(q, k, v), rtol=0, atol=0)
        with pytest.raises(TypeError, match="softcap"):  # torch's signature: attnscale's keywords go to attnscale's function
            F.scaled_dot_product_attention(q, k, v, softcap=5.0)
        inner = attnscale.patch_torch()  # a second patch puts back what it found: attnscale's
        inner.undo()
        assert F.scaled_dot_product_attention is patched_sdpa
    assert F.scaled_dot_product_attention is TORCH and torch.backends.mha.get_fastpath_enabled() and not patch.active
    patch.undo()  # a second undo changes nothing
    assert F.scaled_dot_product_attention is TORCH
    # by hand, without patch_torch: the same
    F.scaled_dot_product_attention = attnscale.scaled_dot_product_attention
    try:
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, backend="torch"), TORCH(q, k, v), rtol=0, atol=0)
    finally:
        F.scaled_dot_product_attention = TORCH


# torch warns about its own nested tensors while building them (a prototype API, it says)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_nested_tensors_go_to_torchs_kernel_while_patched_and_are_refused_clearly_otherwise():
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, 2, 8, generator=gen) for n in (3, 5)]  # (length, heads, dim) per sequence
    q = torch.nested.nested_tensor(rows, layout=torch.jagged).transpose(1, 2)  # (B, heads, ragged length, dim)
    with attnscale.patch_torch():
        got = F.scaled_dot_product_attention(q, q, q)
        with pytest.raises(TypeError, match="query: expected a dense \\(strided\\) tensor, got a nested tensor"):
            attnscale.scaled_dot_product_attention(q, q, q, softcap=5.0)  # attnscale's keywords: attnscale's answer
    for row, out in zip(rows, got.unbind()):
        row = row.transpose(0, 1)  # (heads, length, dim)
        torch.testing.assert_close(out, TORCH(row, row, row), rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="query: expected a dense"):
        attnscale.scaled_dot_product_attention(q, q, q)


def _modules():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False)
    decoder = torch.nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return mha, encoder, decoder


@pytest.mark.parametrize("mode", ["train", "eval without grad (torch's fast path)"])
def test_torchs_attention_modules_run_through_attnscale_when_patched(mode):
    """nn.MultiheadAttention, nn.TransformerEncoder and a decoder layer give torch's results through
    attnscale, their eval-mode fast path included (off while patched, so that they call SDPA)."""
    mha, encoder, decoder = _modules()
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 7:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(10)
    calls = {
        "mha": lambda: mha(x, x, x, need_weights=False)[0],
        "mha, padding": lambda: mha(x, x, x, key_padding_mask=pad, need_weights=False)[0],
        "encoder, padding": lambda: encoder(x, src_key_padding_mask=pad),
        "encoder, causal": lambda: encoder(x, mask=causal, is_causal=True),
        "decoder, causal": lambda: decoder(x, x, tgt_mask=causal, tgt_is_causal=True),
    }
    for module in (mha, encoder, decoder):
        module.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        want = {name: call() for name, call in calls.items()}
        with attnscale.patch_torch():
            for name, call in calls.items():
                functional._state.backend = None
                got = call()
                assert attnscale.last_backend() is not None, f"{name}: attnscale did not run"
                # float32; torch's fast path sums in another order: measured up to 9.5e-7
                torch.testing.assert_close(got, want[name], rtol=0, atol=4e-6, msg=name)


def test_a_causal_bias_with_is_causal_or_other_lengths_is_refused_as_torch_refuses_it():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        attnscale.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 7), is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask: expected a CausalBias of the call's lengths \(L, S\) = \(5, 7\)"):
        attnscale.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(5, 6))
    with pytest.raises(ValueError, match="causal_alignment: expected 'top_left', the alignment of the CausalBias given"):
        attnscale.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(5, 7), causal_alignment="bottom_right")


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        pytest.param(lambda q, k, v: (q, k.float(), v), TypeError, id="mixed dtypes"),
        pytest.param(lambda q, k, v: (q[0, 0, 0], k, v), ValueError, id="a 1-d query"),
        pytest.param(lambda q, k, v: (q, k[..., :3], v), ValueError, id="head dims that differ"),
    ],
)
def test_errors_are_runtime_errors_as_torchs_are_and_keep_their_kind(call, kind):
    """torch raises RuntimeError for these; code that falls back on ``except RuntimeError`` (common
    in models that choose a kernel) catches attnscale's too, which stay ValueError or TypeError
    with the argument, what was expected, what came and the fix."""
    q, k, v = call(*_inputs())
    with pytest.raises(RuntimeError):
        TORCH(q, k, v)
    with pytest.raises(RuntimeError) as info:
        attnscale.scaled_dot_product_attention(q, k, v)
    assert isinstance(info.value, kind) and "expected" in str(info.value) and "Fix:" in str(info.value)


def test_export_with_a_data_dependent_batch_size():
    """A batch whose size is known only at run time (an unbacked size in torch.export): the "torch"
    backend's test of whether a mask broadcasts over the batch guarded on it (Eq(u0, 1))."""

    class Select(torch.nn.Module):
        def forward(self, q, k, v, mask, chosen):
            rows = chosen.nonzero().squeeze(-1)  # how many: data-dependent
            torch._check(rows.shape[0] >= 1)
            return attnscale.scaled_dot_product_attention(q[rows], k[rows], v[rows], attn_mask=mask[rows])

    q, k, v = _inputs(B=(4,), dtype=torch.float32)
    mask = torch.rand(4, 1, 5, 7, generator=torch.Generator().manual_seed(2)) > 0.2
    mask[..., 0] = True
    chosen = torch.tensor([1, 0, 1, 1])
    program = torch.export.export(Select(), (q, k, v, mask, chosen))
    rows = chosen.nonzero().squeeze(-1)
    torch.testing.assert_close(program.module()(q, k, v, mask, chosen), TORCH(q[rows], k[rows], v[rows], attn_mask=mask[rows]), rtol=0, atol=1e-6)


def test_a_causal_bias_compiles_to_one_graph():
    """torch's own test compiles SDPA with a CausalBias and counts one frame: attnscale's reading of
    the bias (sys.modules, the bias's fields) traces without a break."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    q, k, v = (t.float().requires_grad_() for t in _inputs())
    out = torch.compile(attnscale.scaled_dot_product_attention, backend=counter)(q, k, v, attn_mask=causal_lower_right(5, 7))
    out.sum().backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(out, TORCH(q, k, v, attn_mask=causal_lower_right(5, 7)._materialize()), rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # deprecated, still used
def test_torchscript_compiles_torchs_modules_while_patched_and_they_run_through_attnscale():
    """torch.jit.script of nn.MultiheadAttention or a TransformerEncoder while patched failed
    ("Compiled functions can't take variable number of arguments"): the patched function had
    attnscale's keywords. It has torch's signature, and the scripted module calls attnscale."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 16, generator=gen)
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    with attnscale.patch_torch():
        torch.manual_seed(0)
        encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2).eval()
        mha = torch.nn.MultiheadAttention(16, 4, kdim=8, vdim=8, batch_first=True).eval()
        scripted, scripted_mha = torch.jit.script(encoder), torch.jit.script(mha)
        kv = torch.randn(2, 5, 8, generator=gen)
        for module, script, args, kwargs in (
            (encoder, scripted, (x,), {"mask": ~keep}),
            (mha, scripted_mha, (x, kv, kv), {"need_weights": False}),
        ):
            functional._state.backend = None
            got = script(*args, **kwargs)
            assert functional.last_backend() is not None  # the scripted module's attention ran through attnscale
            want = module(*args, **kwargs)
            got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same calls, eager and scripted
