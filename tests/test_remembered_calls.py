"""Calls torch's kernel computes as they are, remembered by their signature in the compiled kernel
(``remember_torch_call``) after the full pipeline ran one: a later call of that signature makes
the same torch call and the guard's first check in one compiled call, without validation, choice
or guard in Python. Everything else (another signature, options off their defaults, a tensor
subclass, tracing, a torch.func transform or torch-function mode, a float mask with a NaN, an
output the check does not pass) takes the full pipeline, as before."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnscale
from attnscale import functional, kernels, reference

from .memory_spies import _nothing_remembered, counting  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the remembered calls live in the compiled kernel")


@pytest.fixture
def validated(monkeypatch) -> list[int]:
    """One entry per call that took the full pipeline (its validation)."""
    return counting(monkeypatch, functional, "check_attention_call")


def _qkv(seed: int, *, L=1, S=24, H=4, Hkv=None, D=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return draw(2, H, L, D), draw(2, Hkv or H, S, D), draw(2, Hkv or H, S, D)


def _bool_mask(L: int, S: int) -> torch.Tensor:
    keep = torch.rand(2, 1, L, S, generator=torch.Generator().manual_seed(7)) > 0.3
    keep[..., 0] = True
    return keep


CASES = {
    "plain": (dict(), dict()),
    "causal": (dict(L=24), dict(is_causal=True)),
    "scale": (dict(), dict(scale=0.3)),
    "gqa": (dict(Hkv=2), dict(enable_gqa=True)),
    "bool mask": (dict(L=3), dict(attn_mask=_bool_mask(3, 24))),
    "float mask": (dict(L=3), dict(attn_mask=torch.zeros(2, 1, 3, 24).masked_fill(~_bool_mask(3, 24), -math.inf))),
    "float64": (dict(dtype=torch.float64), dict(is_causal=True)),
    "bfloat16 gqa": (dict(L=24, Hkv=2, dtype=torch.bfloat16), dict(is_causal=True, enable_gqa=True)),
    "float16 float mask": (dict(L=3, dtype=torch.float16), dict(attn_mask=torch.zeros(2, 1, 3, 24, dtype=torch.float16).masked_fill(~_bool_mask(3, 24), -math.inf))),
}


@pytest.mark.parametrize("name", CASES, ids=str)
def test_a_remembered_call_skips_the_pipeline_and_equals_it_and_torch(name, validated):
    shape, options = CASES[name]
    q, k, v = _qkv(0, **shape)
    first = attnscale.scaled_dot_product_attention(q, k, v, **options)
    assert len(validated) == 1 and attnscale.last_backend() == "torch"
    again = attnscale.scaled_dot_product_attention(q, k, v, **options)
    assert len(validated) == 1, "a remembered call is not validated again"
    assert attnscale.last_backend() == "torch"
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(again, F.scaled_dot_product_attention(q, k, v, **options), rtol=0, atol=0)
    # other tensors of the same signature take the same route
    q2, k2, v2 = _qkv(1, **shape)
    torch.testing.assert_close(attnscale.scaled_dot_product_attention(q2, k2, v2, **options), F.scaled_dot_product_attention(q2, k2, v2, **options), rtol=0, atol=0)
    assert len(validated) == 1


def test_gradients_through_a_remembered_call_are_torchs(validated):
    q, k, v = _qkv(2, L=8, S=8)
    attnscale.scaled_dot_product_attention(q, k, v, is_causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    attnscale.scaled_dot_product_attention(*leaves, is_causal=True).square().sum().backward()
    F.scaled_dot_product_attention(*theirs, is_causal=True).square().sum().backward()
    assert len(validated) == 1
    for mine, want in zip(leaves, theirs):
        torch.testing.assert_close(mine.grad, want.grad, rtol=0, atol=0)


ATOL_16 = {torch.bfloat16: 4e-3, torch.float16: 4e-4}
"""16-bit outputs against the float64 oracle of their own inputs: twice the largest error of
test_a_remembered_16_bit_signature_still_follows_the_nan_rule's outputs (max |out - oracle| over
their non-NaN entries, every case alike: 2.1e-3 bfloat16, 2.0e-4 float16 on an AVX-512 Intel Xeon;
outputs below 0.81, so the output's own rounding). torch's kernel computes them, on every CPU."""


def _oracle(q, k, v) -> torch.Tensor:
    return torch.from_numpy(reference.attention(*(t.double().numpy() for t in (q, k, v)))).float()


@pytest.mark.parametrize("where", ["q", "k", "v"], ids=str)
@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_remembered_signature_still_follows_the_nan_rule(where, poison, validated):
    q, k, v = _qkv(3)
    attnscale.scaled_dot_product_attention(q, k, v)
    t = dict(q=q.clone(), k=k.clone(), v=v.clone())
    t[where][1, 2, 0, 5] = poison
    out = attnscale.scaled_dot_product_attention(t["q"], t["k"], t["v"])
    assert len(validated) == 2, "the check of the remembered call's output sends it down the full pipeline"
    want = _oracle(t["q"], t["k"], t["v"])
    assert torch.equal(out.isnan(), want.isnan()) and bool(out.isnan().any())
    torch.testing.assert_close(out.nan_to_num(0.0), want.nan_to_num(0.0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("where", ["q", "k", "v"], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_remembered_16_bit_signature_still_follows_the_nan_rule(dtype, where, validated):
    # The value checks read 16-bit floats by their bits: a NaN in q, k or v of a remembered
    # bfloat16 or float16 call sends it down the full pipeline, whose rows are the oracle's.
    q, k, v = _qkv(3, dtype=dtype)
    attnscale.scaled_dot_product_attention(q, k, v)
    attnscale.scaled_dot_product_attention(q, k, v)
    assert len(validated) == 1
    t = dict(q=q.clone(), k=k.clone(), v=v.clone())
    t[where][1, 2, 0, 5] = math.nan
    out = attnscale.scaled_dot_product_attention(t["q"], t["k"], t["v"])
    assert len(validated) == 2, "the full pipeline"
    want = _oracle(t["q"], t["k"], t["v"])
    assert out.dtype == dtype and torch.equal(out.isnan(), want.isnan()) and bool(out.isnan().any())
    torch.testing.assert_close(out.float().nan_to_num(0.0), want.nan_to_num(0.0), rtol=0, atol=ATOL_16[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_float_mask_with_a_nan_is_refused_on_a_remembered_signature(dtype, poison, validated):
    q, k, v = _qkv(4, L=3, dtype=dtype)
    mask = torch.zeros(2, 1, 3, 24, dtype=dtype)
    attnscale.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    attnscale.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(validated) == 1
    mask[0, 0, 1, 3] = poison
    with pytest.raises(ValueError, match="attn_mask: expected float values that are finite or -inf"):
        attnscale.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _Subclass(torch.Tensor):
    pass


class _Mode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _in_mode(q, k, v):
    with _Mode():
        return attnscale.scaled_dot_product_attention(q, k, v)


def _vmapped(q, k, v):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's fallback for its own kernel under vmap
        return torch.func.vmap(attnscale.scaled_dot_product_attention)(q, k, v)


OTHER_ROUTES = {
    "backend named": lambda q, k, v: attnscale.scaled_dot_product_attention(q, k, v, backend="torch"),
    "alignment as a string": lambda q, k, v: attnscale.scaled_dot_product_attention(q, k, v, causal_alignment="top_left"),
    "an int scale": lambda q, k, v: attnscale.scaled_dot_product_attention(q, k, v, scale=1) - F.scaled_dot_product_attention(q, k, v, scale=1.0) + _oracle(q, k, v),
    "a subclass": lambda q, k, v: attnscale.scaled_dot_product_attention(q.as_subclass(_Subclass), k, v),
    "torch-function mode": _in_mode,
    "vmap": _vmapped,
    "return_stats": lambda q, k, v: attnscale.scaled_dot_product_attention(q, k, v, return_stats=True)[0],
}


@pytest.mark.parametrize("route", OTHER_ROUTES, ids=str)
def test_calls_off_the_remembered_form_take_the_full_pipeline(route, validated):
    q, k, v = _qkv(5)
    attnscale.scaled_dot_product_attention(q, k, v)
    attnscale.scaled_dot_product_attention(q, k, v)
    assert len(validated) == 1
    out = OTHER_ROUTES[route](q, k, v)
    assert len(validated) >= 2, "validated in full"
    torch.testing.assert_close(torch.as_tensor(out), _oracle(q, k, v), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_remembered_signature_under_cpu_autocast_is_torchs_answer_there(dtype, validated):
    # torch's kernel answers in the autocast dtype: the full pipeline takes such calls, remembered
    # or not, and the signature stays remembered outside autocast.
    q, k, v = _qkv(10)
    attnscale.scaled_dot_product_attention(q, k, v)
    with torch.autocast("cpu", dtype=dtype):
        for _ in range(2):
            out = attnscale.scaled_dot_product_attention(q, k, v)
            want = F.scaled_dot_product_attention(q, k, v)
            assert out.dtype == want.dtype == dtype
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(validated) == 3
    torch.testing.assert_close(attnscale.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)
    assert len(validated) == 3


def test_jit_trace_is_refused_on_a_remembered_signature():
    q, k, v = _qkv(6)
    attnscale.scaled_dot_product_attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.trace itself
        with pytest.raises(RuntimeError, match="torch.jit.trace is not supported"):
            torch.jit.trace(lambda x: attnscale.scaled_dot_product_attention(x, k, v), (q,))


def test_torch_compile_traces_a_remembered_signature_as_one_graph():
    q, k, v = _qkv(7)
    attnscale.scaled_dot_product_attention(q, k, v)
    compiled = torch.compile(lambda a, b, c: attnscale.scaled_dot_product_attention(a, b, c) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), 2 * F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)


def test_a_mask_that_requires_grad_is_never_remembered(validated):
    q, k, v = _qkv(8, L=3)
    mask = torch.zeros(2, 1, 3, 24, requires_grad=True)
    for _ in range(2):
        attnscale.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(validated) == 2


def test_remembered_calls_from_several_threads_while_another_forgets_them():
    # The compiled call releases the GIL while torch's kernel runs; meanwhile another thread may
    # start the memory again. Every answer stays torch's.
    q, k, v = _qkv(11, L=64, S=256)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kernel, wrong, stop = kernels.load(), [], threading.Event()

    def attend() -> None:
        for _ in range(100):
            out = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True)
            if not torch.equal(out, want):
                wrong.append(out)

    def forget() -> None:
        while not stop.is_set():
            kernel.forget_calls()
            attnscale.scaled_dot_product_attention(q, k, v, is_causal=True)  # remembered again

    threads = [threading.Thread(target=attend) for _ in range(2)]
    other = threading.Thread(target=forget)
    other.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    other.join()
    assert not wrong


def test_a_process_that_remembered_calls_exits_cleanly():
    # The remembered calls hold Python objects (why each was chosen) past the interpreter's
    # finalisation: they are never released, rather than released without the GIL (an abort).
    code = "import torch, attnscale\nq = torch.randn(1, 2, 1, 8)\nfor _ in range(2): attnscale.scaled_dot_product_attention(q, q, q)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Fatal" not in done.stderr, done.stderr[-2000:]


def _plain_call(q, k):
    """A plain call's arguments as the compiled kernel's memory keys them."""
    options = dict(mask=None, is_causal=False, scale=None, enable_gqa=False, alignment=attnscale.CausalAlignment.TOP_LEFT)
    return dict(q=q, k=k, v=k, **options, softcap=None, alibi_slopes=None, window=None, sinks=None, return_stats=False)


def _remembered(kernel, q, k):
    args = _plain_call(q, k)
    return kernel.remembered_call(*(args[name] for name in ("q", "k", "v", "mask", "is_causal", "scale", "enable_gqa", "alignment", "softcap", "alibi_slopes", "window", "sinks", "return_stats")), kernels.CHECKS_MAX)


def test_the_remembered_calls_are_bounded():
    # More signatures than it keeps: it starts again rather than growing without bound.
    kernel = kernels.load()
    kernel.set_alignments(top_left=attnscale.CausalAlignment.TOP_LEFT, bottom_right=attnscale.CausalAlignment.BOTTOM_RIGHT)
    k = torch.randn(1, 1, 3, 4)
    torch_args = dict(torch_causal=False, torch_gqa=False, torch_scale=None, backend=attnscale.Backend.TORCH, why="why")
    for L in range(1, 600):
        q = torch.randn(1, 1, L, 4)
        assert kernel.remember_torch_call(**_plain_call(q, k), **torch_args)
    assert _remembered(kernel, q, k) is not None
    first = torch.randn(1, 1, 1, 4)
    assert _remembered(kernel, first, k) is None
    np.testing.assert_equal(kernel.remember_torch_call(**_plain_call(q.int(), k.int()), **torch_args), False)  # (a dtype the value checks do not read)


def test_the_remembered_calls_take_their_arguments_by_position_or_by_name_and_refuse_others():
    # They are vectorcall builtins of their own (csrc/fast_call.h), not pybind11 functions: the
    # same answer for arguments by position and by name, and a TypeError that names what is wrong.
    kernel = kernels.load()
    kernel.set_alignments(top_left=attnscale.CausalAlignment.TOP_LEFT, bottom_right=attnscale.CausalAlignment.BOTTOM_RIGHT)
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    assert kernel.remember_torch_call(**_plain_call(q, k), torch_causal=False, torch_gqa=False, torch_scale=None, backend=attnscale.Backend.TORCH, why="why")
    out_by_position, backend_by_position, _ = _remembered(kernel, q, k)
    out_by_name, backend_by_name, _ = kernel.remembered_call(**_plain_call(q, k), limit=kernels.CHECKS_MAX)
    assert backend_by_position is backend_by_name is attnscale.Backend.TORCH
    torch.testing.assert_close(out_by_position, out_by_name, rtol=0, atol=0)
    torch.testing.assert_close(out_by_name, F.scaled_dot_product_attention(q, k, k), rtol=0, atol=0)
    by_name = {name: value for name, value in _plain_call(q, k).items() if name != "return_stats"}
    transposed, backend_transposed, _ = kernel.remembered_transposed_call(*by_name.values(), kernels.CHECKS_MAX)
    assert backend_transposed is attnscale.Backend.TORCH and transposed.is_contiguous()
    torch.testing.assert_close(transposed, kernel.remembered_transposed_call(**by_name, limit=kernels.CHECKS_MAX)[0], rtol=0, atol=0)
    torch.testing.assert_close(transposed, out_by_name.transpose(1, 2), rtol=0, atol=0)
    args = _plain_call(q, k)
    refused = {
        "remembered_call() got an unexpected argument 'mask_'": lambda: kernel.remembered_call(**args, mask_=None, limit=1),
        "remembered_call() got a repeated argument 'q'": lambda: kernel.remembered_call(q, **args, limit=1),
        "remembered_call() missing argument 'limit'": lambda: kernel.remembered_call(**args),
        "remembered_call() takes 14 arguments (15 given)": lambda: kernel.remembered_call(*args.values(), 1, 2),
        "remembered_call(): limit must be an int, got float": lambda: kernel.remembered_call(**args, limit=1.0),
        "remembered_call(): limit must be an int, got bool": lambda: kernel.remembered_call(**args, limit=True),
        "remembered_packed_call() missing argument 'return_stats'": lambda: kernel.remembered_packed_call(*[None] * 13),
        "remembered_transposed_call() got an unexpected argument 'return_stats'": lambda: kernel.remembered_transposed_call(**args, limit=1),
        "remembered_transposed_call(): limit must be an int, got float": lambda: kernel.remembered_transposed_call(*list(args.values())[:-1], 1.0),
    }
    for message, call in refused.items():
        with pytest.raises(TypeError, match=re.escape(message)):
            call()
    module_args = dict(
        x=torch.randn(1, 3, 8), q_weight=torch.randn(8, 8), q_bias=None, k_weight=torch.randn(8, 8), k_bias=None, v_weight=torch.randn(8, 8), v_bias=None,
        out_weight=torch.randn(8, 8), out_bias=None, heads=2, kv_heads=2, head_dim=4, scale=None, enable_gqa=False,
        alignment=attnscale.CausalAlignment.TOP_LEFT, softcap=None, window=None, sinks=None, limit=1,
    )  # fmt: skip
    for name, wrong, message in [
        ("k_weight", None, "a Tensor, got NoneType"), ("v_bias", 1.0, "a Tensor or None, got float"), ("out_weight", None, "a Tensor, got NoneType"),
        ("heads", "2", "an int, got str"),
    ]:  # fmt: skip
        with pytest.raises(TypeError, match=re.escape(f"remembered_module_call(): {name} must be {message}")):
            kernel.remembered_module_call(**{**module_args, name: wrong})
    with pytest.raises(OverflowError):
        kernel.remembered_module_call(**{**module_args, "limit": 1 << 64})


def test_a_growing_cache_takes_the_remembered_call_at_every_length(validated):
    # Without a mask, keys and values of any length S > 0 share the answer (as the pipeline's own
    # memory of a growing cache's calls has it): one full call, then every step remembered.
    q, k, v = _qkv(9, Hkv=2, S=40)
    for S in range(20, 40):
        out = attnscale.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], is_causal=True, enable_gqa=True), rtol=0, atol=0)
    assert len(validated) == 1
    with pytest.raises(ValueError, match=r"value: expected length S = 30 \(dim -2\) like the key's"):
        attnscale.scaled_dot_product_attention(q, k[:, :, :30], v[:, :, :31], is_causal=True, enable_gqa=True)
    empty = attnscale.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0], is_causal=True, enable_gqa=True)
    assert len(validated) == 3 and attnscale.last_backend() != "torch" and torch.equal(empty, torch.zeros_like(q))


@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
def test_keys_past_one_cores_caches_take_the_remembered_call_and_the_nan_rule(threads, validated):
    # A decoding step over 1024 keys of 8 heads (2**19 entries): the compiled kernel's checks take
    # tensors of every size (on two threads, each a run of rows), so the step is remembered; a
    # non-finite key in the last run of rows still sends it down the full pipeline.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = _qkv(11, S=1024, H=8, D=64)
        for _ in range(2):
            out = attnscale.scaled_dot_product_attention(q, k, v)
            torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)
        assert len(validated) == 1 and attnscale.last_backend() == "torch"
        poisoned = k.clone()
        poisoned[1, 7, 1023, 63] = -math.copysign(math.inf, float(q[1, 7, 0, 63]))  # its product with the query row is -inf: torch's kernel gives the key weight 0
        out = attnscale.scaled_dot_product_attention(q, poisoned, v)
        assert len(validated) == 2
        want = _oracle(q, poisoned, v)
        assert torch.equal(out.isnan(), want.isnan()) and bool(out[1, 7].isnan().all()) and not bool(out[0].isnan().any())
    finally:
        torch.set_num_threads(before)


def _transposed(q, k, v, **options):
    """attnscale.functional.transposed_attention (HuggingFace's attention function's call) with
    scaled_dot_product_attention's defaults for the options not given."""
    given = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, softcap=None, window=None, sinks=None) | options
    return functional.transposed_attention(q, k, v, **given)


TRANSPOSED_CASES = {
    **CASES,
    "softcap (the compiled kernel's plan)": (dict(L=5), dict(softcap=4.0)),
    "window and sinks (the compiled kernel's plan)": (dict(L=24), dict(is_causal=True, window=(3, 0), sinks=torch.tensor([0.5, -1.0, 2.0, -math.inf]))),
    "gqa prefill (a HuggingFace layer's)": (dict(L=24, H=8, Hkv=2, D=16), dict(is_causal=True, enable_gqa=True)),
}


@pytest.mark.parametrize("name", TRANSPOSED_CASES, ids=str)
def test_the_transposed_call_is_the_pipelines_output_transposed(name, validated, monkeypatch):
    """transposed_attention, whose remembered call checks torch's output while copying it into
    (B, L, H, Dv): bit for bit scaled_dot_product_attention(...).transpose(1, 2).contiguous(), on
    the first call (the full pipeline) and on later ones (the remembered call alone: neither
    validated nor through scaled_dot_product_attention), for other tensors of the signature too."""
    shape, options = TRANSPOSED_CASES[name]
    q, k, v = _qkv(12, **shape)
    want = attnscale.scaled_dot_product_attention(q, k, v, **options).transpose(1, 2).contiguous()
    backend = attnscale.last_backend()
    kernels.load().forget_calls()
    entered = counting(monkeypatch, functional, "scaled_dot_product_attention")
    first = _transposed(q, k, v, **options)
    assert len(entered) == 1 and len(validated) == 2 and attnscale.last_backend() == backend
    again = _transposed(q, k, v, **options)
    assert len(entered) == 1 and len(validated) == 2, "the remembered call answers alone"
    assert attnscale.last_backend() == backend
    for out in (first, again):
        assert out.shape == want.shape and out.is_contiguous()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    q2, k2, v2 = _qkv(13, **shape)
    other = _transposed(q2, k2, v2, **options)
    assert len(entered) == 1
    torch.testing.assert_close(other, attnscale.scaled_dot_product_attention(q2, k2, v2, **options).transpose(1, 2).contiguous(), rtol=0, atol=0)


@pytest.mark.parametrize("where", ["q", "k", "v", "no visible key"], ids=str)
@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
def test_the_transposed_call_follows_the_nan_rule_on_a_remembered_signature(where, threads, validated):
    """A NaN in q, k or v, or a row that sees no key, on a remembered signature of torch's kernel:
    the check made while copying sends the call down the full pipeline, whose answer (the
    oracle's: NaN rows, zero rows) comes back transposed. The HuggingFace layer's shape (8 query
    heads of 64 over 2 key heads, 64 rows: 2^15 output entries, checked on every thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = _qkv(14, L=64, S=64, H=8, Hkv=2, D=64)
        mask = torch.ones(2, 1, 64, 64, dtype=torch.bool)
        _transposed(q, k, v, attn_mask=mask, enable_gqa=True)
        _transposed(q, k, v, attn_mask=mask, enable_gqa=True)
        assert len(validated) == 1
        t = dict(q=q.clone(), k=k.clone(), v=v.clone())
        if where == "no visible key":
            mask = mask.clone()
            mask[1, 0, 63] = False
        else:
            t[where][1, 1, 63, 5] = math.nan
        out = _transposed(t["q"], t["k"], t["v"], attn_mask=mask, enable_gqa=True)
        assert len(validated) == 2, "the full pipeline"
        kk, vv = (x.repeat_interleave(4, dim=1) for x in (t["k"], t["v"]))
        want = torch.from_numpy(reference.attention(*(x.double().numpy() for x in (t["q"], kk, vv)), attn_mask=mask.numpy())).float().transpose(1, 2)
        assert torch.equal(out.isnan(), want.isnan()) and (bool(out.isnan().any()) or where == "no visible key")
        torch.testing.assert_close(out.nan_to_num(0.0), want.nan_to_num(0.0), rtol=0, atol=1e-5)
        if where == "no visible key":
            assert torch.equal(out[1, 63], torch.zeros_like(out[1, 63]))
    finally:
        torch.set_num_threads(before)


def test_the_transposed_call_of_other_inputs_is_scaled_dot_product_attentions_transposed():
    """3-D inputs (no (B, L, H, Dv) to copy into: the remembered transposed call answers None) and
    dropout (never remembered) are scaled_dot_product_attention's output, transposed."""
    q, k, v = _qkv(15)
    q3, k3, v3 = q[0], k[0], v[0]
    for _ in range(2):
        out = _transposed(q3, k3, v3)
        torch.testing.assert_close(out, attnscale.scaled_dot_product_attention(q3, k3, v3).transpose(1, 2).contiguous(), rtol=0, atol=0)
    torch.manual_seed(0)
    dropped = _transposed(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    torch.testing.assert_close(dropped, attnscale.scaled_dot_product_attention(q, k, v, dropout_p=0.5).transpose(1, 2).contiguous(), rtol=0, atol=0)


@pytest.mark.parametrize("options", [dict(is_causal=True), dict(softcap=4.0)], ids=["torch's kernel", "the compiled kernel's plan"])
def test_gradients_through_the_transposed_call_are_the_pipelines(options, validated):
    """Inputs that require grad on a remembered signature (a HuggingFace layer in training): the
    transposed output carries the gradient, equal to the pipeline's output transposed (torch's
    kernel: its copy then goes through autograd, not the check's copy)."""
    q, k, v = _qkv(16, L=8, S=8)
    _transposed(q, k, v, **options)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = _transposed(*leaves, **options)
    assert len(validated) == 1, "the remembered call answered"
    ours.square().sum().backward()
    attnscale.scaled_dot_product_attention(*theirs, **options).transpose(1, 2).contiguous().square().sum().backward()
    for mine, want in zip(leaves, theirs):
        torch.testing.assert_close(mine.grad, want.grad, rtol=0, atol=0)
