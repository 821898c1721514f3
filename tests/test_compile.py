"""attnscale inside torch.compile, torch.export, FakeTensor / meta tensors and torch.func: the
compiled kernel as custom ops (``torch.ops.attnscale.*``, checked by ``torch.library.opcheck``),
one graph without breaks for every feature, results equal to eager, and the refusals (double
backward, torch.jit.trace) that keep anything from being silently wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._subclasses.fake_tensor import FakeTensorMode

import attnscale
from attnscale import kernels, reference
from attnscale.kernels import ops

NO_KERNEL = kernels.build_precondition()
needs_kernel = pytest.mark.skipif(NO_KERNEL is not None, reason=f"the compiled kernel cannot be had here: {NO_KERNEL}")

H, D = 4, 16
FEATURES = {
    "causal": dict(is_causal=True),
    "softcap": dict(softcap=5.0, is_causal=True),
    "alibi": dict(alibi_slopes=attnscale.alibi_slopes(H)),
    "window": dict(window=(8, 0), is_causal=True),
    "sinks": dict(sinks=torch.linspace(-1.0, 1.0, H)),
    "stats": dict(return_stats=True, causal_alignment="bottom_right"),
    "softcap-sinks-window": dict(softcap=20.0, sinks=torch.zeros(H), window=(4, 0)),
}


class Block(torch.nn.Module):
    """qkv projection -> attnscale -> output projection, over (B, L, H * D)."""

    def __init__(self, **options) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out, self.options = torch.nn.Linear(H * D, 3 * H * D), torch.nn.Linear(H * D, H * D), options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) each
        result = attnscale.scaled_dot_product_attention(q, k, v, **self.options)
        if self.options.get("return_stats"):
            result, stats = result
            result = result + stats.entropy.unsqueeze(-1) + stats.lse.unsqueeze(-1)  # statistics reach the loss
        return self.out(result.transpose(1, 2).reshape(B, L, H * D))


class Packed(torch.nn.Module):
    """The same over packed sequences (total, H * D) with their cumulative lengths."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)

    def forward(self, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, H, D).unbind(1)  # (total, H, D) each
        return attnscale.varlen_attention(q, k, v, cu, cu, is_causal=True, softcap=20.0, window=(6, 0))


def inputs(L: int = 40, B: int = 2) -> torch.Tensor:
    return torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(L))


def assert_same_forward_and_backward(model: torch.nn.Module, compiled, *args) -> None:
    x = args[0].clone().requires_grad_()
    want = model(x, *args[1:])
    want_grads = torch.autograd.grad(want.square().sum(), [x, *model.parameters()])
    x = args[0].clone().requires_grad_()
    got = compiled(x, *args[1:])
    got_grads = torch.autograd.grad(got.square().sum(), [x, *model.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------------------------


def op_cases():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8, generator=gen), torch.randn(2, 2, 11, 8, generator=gen), torch.randn(2, 2, 11, 5, generator=gen)
    slopes = attnscale.alibi_slopes(4).expand(2, 4)
    keep = (torch.rand(2, 1, 9, 11, generator=gen) > 0.3).expand(2, 4, 9, 11)
    bias = torch.randn(1, 4, 9, 11, generator=gen).expand(2, 4, 9, 11)
    options = ops.KernelOptions
    yield "plain", (q, k, v, None, None, None, *options(scale=0.35))
    yield "softcap-causal-stats", (q, k, v, None, None, None, *options(scale=0.35, softcap=5.0, causal=True, q_offset=2, with_stats=True))
    yield "alibi-window-bool-mask", (q, k, v, slopes, keep, None, *options(scale=0.35, left=3, right=1, block_q=4, block_k=4))
    yield "float-mask-stats", (q, k, v, None, bias, None, *options(scale=0.35, with_stats=True))
    packed = torch.randn(1, 4, 18, 8, generator=gen), torch.randn(1, 2, 22, 8, generator=gen), torch.randn(1, 2, 22, 5, generator=gen)
    spans = torch.tensor([[0, 5, 0, 7], [5, 18, 7, 22]])  # (q0, q1, k0, k1) of two sequences
    yield "packed", (*packed, None, None, spans, *options(scale=0.35, causal=True, with_stats=True))
    # 16-bit q, k, v (float32 outputs; out in their format with round_out, its gradient then
    # taken in float32), both ways the kernel takes them: multiplied as they are (half_products,
    # with oneMKL; brgemm for bfloat16 from AVX-512 on) and as float32 tiles.
    for products16 in (True, False):
        way = "products" if products16 else "tiles"
        for round_out in (False, True):
            rounded = "-rounded" if round_out else ""
            sixteen = dict(half_products=products16, round_out=round_out)
            yield f"bf16-softcap-causal-stats-{way}{rounded}", (
                q.bfloat16(), k.bfloat16(), v.bfloat16(), None, None, None, *options(scale=0.35, softcap=5.0, causal=True, q_offset=2, with_stats=True, **sixteen)
            )
            yield f"fp16-packed-{way}{rounded}", (*(t.half() for t in packed), None, None, spans, *options(scale=0.35, causal=True, **sixteen))


@needs_kernel
@pytest.mark.parametrize("name, args", list(op_cases()), ids=[name for name, _ in op_cases()])
def test_the_forward_op_passes_opcheck(name, args):
    q, k, v, *rest = args
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.attnscale.fused_forward.default, (*leaves, *rest))


@needs_kernel
@pytest.mark.parametrize("name, args", list(op_cases()), ids=[name for name, _ in op_cases()])
def test_the_backward_op_passes_opcheck(name, args):
    q, k, v, alibi, mask, spans, *rest = args
    options = ops.KernelOptions(*rest)
    out, lse, m, l, *_ = torch.ops.attnscale.fused_forward(q, k, v, alibi, mask, spans, *options._replace(with_stats=False, round_out=False))
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1)
    for slope_grad in (False, True) if alibi is not None else (False,):
        torch.library.opcheck(torch.ops.attnscale.fused_backward.default, (q, k, v, dout, delta, m, l, alibi, mask, spans, slope_grad, *options.backward_args()))


@needs_kernel
def test_the_ops_fake_rule_gives_every_output_shape_and_dtype():
    for with_stats in (False, True):
        gen = torch.Generator().manual_seed(1)
        q, k, v = torch.randn(2, 4, 9, 8, generator=gen), torch.randn(2, 2, 11, 8, generator=gen), torch.randn(2, 2, 11, 5, generator=gen)
        for dtype, round_out in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)):
            args = (None, None, None, *ops.KernelOptions(scale=0.35, softcap=5.0, causal=True, with_stats=with_stats, round_out=round_out))
            x = [t.to(dtype) for t in (q, k, v)]
            real = torch.ops.attnscale.fused_forward(*x, *args)
            fake = torch.ops.attnscale.fused_forward(*(t.to("meta") for t in x), *args)
            assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]
            assert real[0].dtype == (dtype if round_out else torch.float32)


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_feature_compiles_to_one_graph_equal_to_eager(feature):
    model = Block(**FEATURES[feature])
    x = inputs()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    assert_same_forward_and_backward(model, torch.compile(model, fullgraph=True, backend="aot_eager"), x)


# Dynamo instantiates the autograd Function while it traces it (torch 2.13), and torch warns of that.
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated:DeprecationWarning")
def test_the_tiled_kernel_compiles_to_one_graph_equal_to_eager():
    """Without the compiled kernel too: backend="tiled" (and auto, where it has no kernel) asks
    whether a vmap is active, which dynamo cannot trace; under torch.compile it must not ask."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 9, 8, generator=gen)

    def f(x):
        return attnscale.scaled_dot_product_attention(x, x, x, softcap=5.0, is_causal=True, backend="tiled")

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(q)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q), f(q), rtol=0, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", ["0", "1"])
def test_16_bit_inputs_compile_to_one_graph_on_either_path(monkeypatch, dtype, native):
    """Which way the kernel takes 16-bit inputs (ops.half_products) is decided while tracing, as a
    constant: no graph break, on either path, and the compiled forward and backward equal eager's."""
    if native == "1" and not attnscale.kernels.load().half_gemm(1):
        pytest.skip("this torch has no oneMKL 16-bit products")
    monkeypatch.setenv("ATTNSCALE_HALF_PRODUCTS", native)
    model = Block(softcap=5.0, is_causal=True).to(dtype)
    x = inputs().to(dtype)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    want, got = model(leaves[0]), compiled(leaves[1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same kernel on the same inputs
    (grad_want,), (grad_got,) = (torch.autograd.grad(y.float().square().sum(), [leaf]) for y, leaf in ((want, leaves[0]), (got, leaves[1])))
    torch.testing.assert_close(grad_got, grad_want, rtol=0, atol=0)


@needs_kernel
def test_16_bit_decoding_and_longer_calls_under_dynamic_shapes_equal_eager(monkeypatch):
    """Unforced, the 16-bit path depends on the query length (float32 tiles up to FEW_ROWS rows
    without grouped heads): under dynamic shapes that is a guard, so decoding steps and longer
    calls each compile once (no graph break) and equal eager's outputs bit for bit."""
    monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS", raising=False)
    model = Block(softcap=5.0).to(torch.bfloat16)
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad():
        for L in (3, 5, 40, 64, 7):
            x = inputs(L).to(torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    assert counter.frame_count <= 2


@needs_kernel
def test_packed_sequences_compile_to_one_graph_equal_to_eager():
    model, x, cu = Packed(), torch.randn(30, H * D, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 4, 21, 30], dtype=torch.int32)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, cu)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    assert_same_forward_and_backward(model, torch.compile(model, fullgraph=True, backend="aot_eager"), x, cu)


@needs_kernel
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inside inductor itself
def test_inductor_compiles_softcap_with_statistics_equal_to_eager():
    """The default backend (inductor, which generates and compiles C++ for the surrounding ops)."""
    model = Block(softcap=5.0, is_causal=True, return_stats=True)
    torch._dynamo.reset()
    assert_same_forward_and_backward(model, torch.compile(model, fullgraph=True), inputs())


@needs_kernel
@pytest.mark.parametrize("feature", ["softcap", "causal"])
def test_dynamic_shapes_compile_at_most_twice_over_nine_lengths(feature):
    model = Block(**FEATURES[feature])
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad():
        for L in (5, 17, 33, 64, 100, 128, 257, 300, 513):
            x = inputs(L)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2


# --------------------------------------------------------------------------------------------
# torch.export, FakeTensor, meta
# --------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_with_softcap_sinks_and_a_window_equals_eager(strict):
    model = Block(**FEATURES["softcap-sinks-window"])
    program = torch.export.export(model, (inputs(),), strict=strict)
    assert any("attnscale.fused_forward" in str(node.target) for node in program.graph.nodes)
    x = inputs(40, B=2) * 0.5
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x), rtol=1e-6, atol=1e-6)


@needs_kernel
def test_a_traced_call_passes_the_build_that_traced_it():
    program = torch.export.export(Block(**FEATURES["softcap-sinks-window"]), (inputs(),))
    calls = [node for node in program.graph.nodes if "attnscale.fused_forward" in str(node.target)]
    assert calls and all(node.args[-1] == ops.BUILD for node in calls)


def test_the_build_follows_every_source_of_the_ops(tmp_path):
    names = {path.name for path in ops._BUILD_SOURCES}
    assert {"ops.py", "_autograd.py", "fused.cpp", "forward.h", "backward.h"} <= names
    assert ops.BUILD == ops._build_id()
    copies = []
    for i, path in enumerate(ops._BUILD_SOURCES):
        copy = tmp_path / f"{i}_{path.name}"
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    assert ops._build_id(tuple(copies)) == ops.BUILD
    for copy in copies:
        text = copy.read_bytes()
        copy.write_bytes(text + b" ")
        assert ops._build_id(tuple(copies)) != ops.BUILD, copy.name
        copy.write_bytes(text)


_CACHE_PROBE = """
import sys, torch, attnscale
from attnscale.kernels import ops
from torch._dynamo.utils import counters
ops.BUILD = int(sys.argv[1])
f = torch.compile(lambda q, k, v: attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0))
q, k, v = (torch.randn(1, 2, 8, 16).requires_grad_() for _ in range(3))
f(q, k, v).sum().backward()
print(sorted(name for name in counters["aot_autograd"] if name in ("autograd_cache_hit", "autograd_cache_miss")))
"""


@needs_kernel
def test_a_graph_traced_by_another_build_is_not_replayed_from_the_compile_cache(tmp_path):
    # torch.compile's caches on disk key a graph by its code, which names the op and its arguments
    # but not what the op does: without the build among them, a graph traced against an attnscale
    # whose op had another schema or autograd rule was replayed (and failed, or computed the old rule).
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    seen = []
    for build in (1, 1, 2):
        done = subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(build)], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        seen.append(done.stdout.strip().splitlines()[-1])
    assert seen == ["['autograd_cache_miss']", "['autograd_cache_hit']", "['autograd_cache_miss']"]


def _shapes(result) -> list[tuple[int, ...]]:
    if isinstance(result, tuple):
        out, stats = result
        return [tuple(out.shape), tuple(stats.lse.shape), tuple(stats.entropy.shape), tuple(stats.visible_keys.shape)]
    return [tuple(result.shape)]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_fake_and_meta_tensors_give_the_shapes_of_a_real_call(feature):
    options = FEATURES[feature]
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, H, 9, D, generator=gen), torch.randn(2, H, 11, D, generator=gen), torch.randn(2, H, 11, 7, generator=gen)
    want = _shapes(attnscale.scaled_dot_product_attention(q, k, v, **options))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, k, v)]
        fake_options = {name: mode.from_tensor(o) if isinstance(o, torch.Tensor) else o for name, o in options.items()}
        assert _shapes(attnscale.scaled_dot_product_attention(*fake, **fake_options)) == want
    meta_options = {name: o.to("meta") if isinstance(o, torch.Tensor) else o for name, o in options.items()}
    assert _shapes(attnscale.scaled_dot_product_attention(q.to("meta"), k.to("meta"), v.to("meta"), **meta_options)) == want


def test_traced_packed_calls_check_what_needs_no_values():
    """While tracing, varlen_attention reads no tensor values, but still checks every option and
    the type of each argument: meta tensors, as torch.export and FakeTensor see them."""
    q = torch.randn(10, H, D, device="meta")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match=r"^max_seqlen_q: expected None or an int, got 'x'"):
        attnscale.varlen_attention(q, q, q, cu, cu, "x")
    with pytest.raises(ValueError, match=r"^softcap: expected a finite positive float"):
        attnscale.varlen_attention(q, q, q, cu, cu, softcap=-1.0)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: expected B \+ 1 = 3 entries"):
        attnscale.varlen_attention(q, q, q, cu, cu[:2])


# --------------------------------------------------------------------------------------------
# torch.func
# --------------------------------------------------------------------------------------------


# A plain causal call runs torch's SDPA, whose CPU flash kernel has no batching rule in torch 2.13:
# torch loops over the batch and warns about the speed (the result is right).
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule:UserWarning")
@pytest.mark.parametrize("feature", ["softcap", "stats", "sinks", "causal"])
def test_vmap_over_a_batch_equals_the_loop(feature):
    options = FEATURES[feature]
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(3, 2, H, 9, D, generator=gen), torch.randn(3, 2, H, 11, D, generator=gen)

    def f(q, k):
        result = attnscale.scaled_dot_product_attention(q, k, k, **options)
        return result[0] + result[1].entropy.unsqueeze(-1) if isinstance(result, tuple) else result

    want = torch.stack([f(q[i], k[i]) for i in range(3)])
    # Without the compiled kernel a feature runs the tiled kernel in the loop and the math backend
    # under vmap (the tiled kernel has no batching rule): 1.2e-6 apart with statistics.
    atol = 1e-6 if NO_KERNEL is None or feature == "causal" else 2e-6
    torch.testing.assert_close(torch.func.vmap(f)(q, k), want, rtol=0, atol=atol)
    torch.testing.assert_close(torch.func.vmap(f, in_dims=(0, None))(q, k[0]), torch.stack([f(q[i], k[0]) for i in range(3)]), rtol=0, atol=atol)


@needs_kernel
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=["bool", "float"])
def test_vmap_over_per_sample_masks_equals_the_loop(mask_dtype):
    """A mask mapped with the batch reaches the op's vmap rule with its own mapped dim, which the
    rule folds into the kernel's batch like q, k and v (dropping it raised instead of matching).
    A mask mapped alone (q and k shared) was not seen as traced: the kernel was handed vmap's
    wrapper ("Cannot access data pointer"), or a float mask's values were read under vmap."""
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(3, 2, H, 9, D, generator=gen), torch.randn(3, 2, H, 11, D, generator=gen)
    keep = torch.rand(3, 2, H, 9, 11, generator=gen) > 0.3
    keep[..., 0] = True  # every row sees a key
    mask = keep if mask_dtype == torch.bool else torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + torch.randn(keep.shape, generator=gen)

    def f(q, k, mask):
        return attnscale.scaled_dot_product_attention(q, k, k, mask, softcap=5.0, backend="fused")

    want = torch.stack([f(q[i], k[i], mask[i]) for i in range(3)])
    torch.testing.assert_close(torch.func.vmap(f)(q, k, mask), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.func.vmap(f, in_dims=(None, None, 0))(q[0], k[0], mask), torch.stack([f(q[0], k[0], m) for m in mask]), rtol=0, atol=1e-6)


def test_tiled_kernel_under_vmap_is_refused_and_auto_takes_a_backend_with_a_batching_rule():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, H, 9, D, generator=gen)
    with pytest.raises(ValueError, match=r"^backend: expected a backend with a batching rule under torch\.func\.vmap"):
        torch.func.vmap(lambda x: attnscale.scaled_dot_product_attention(x, x, x, softcap=5.0, backend="tiled"))(q)
    # (Traced calls record no backend.) Without the kernel, auto's tiled kernel once raised torch's
    # "does not have vmap support" here.
    out = torch.func.vmap(lambda x: attnscale.scaled_dot_product_attention(x, x, x, softcap=5.0))(q)
    want = torch.stack([attnscale.scaled_dot_product_attention(x, x, x, softcap=5.0, backend="math") for x in q])
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", ["auto", "tiled", "math"] + (["fused"] if NO_KERNEL is None else []))
def test_func_grad_equals_autograd(backend):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, H, 9, D, generator=gen, dtype=torch.float64) for _ in range(3))

    def loss(q):
        return attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, is_causal=True, backend=backend).square().sum()

    leaf = q.clone().requires_grad_()
    loss(leaf).backward()
    torch.testing.assert_close(torch.func.grad(loss)(q), leaf.grad, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Nothing silently wrong: double backward, torch.jit.trace
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tiled"] + (["fused"] if NO_KERNEL is None else []))
def test_double_backward_on_a_kernel_without_one_is_refused_by_name(backend):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, H, 9, D, generator=gen).requires_grad_() for _ in range(3))
    out = attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, backend=backend)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)  # first order: as without create_graph
    (plain,) = torch.autograd.grad(attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, backend=backend).square().sum(), q)
    torch.testing.assert_close(dq, plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=rf"^attnscale's {backend} backend has no double backward .*Fix: backend='math'"):
        dq.square().sum().backward()


def test_double_backward_on_the_math_backend_is_autograds_own():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))

    def penalty(q, k, v):
        out = attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, backend="math")
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return dq.square().sum()

    assert torch.autograd.gradcheck(penalty, (q, k, v))


def test_jit_trace_is_refused_with_the_fix():
    model = Block(softcap=5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.trace itself
        with pytest.raises(RuntimeError, match=r"^attnscale.scaled_dot_product_attention: torch.jit.trace is not supported .*Fix: torch.compile or torch.export"):
            torch.jit.trace(model, (inputs(),))


def test_default_blocks_follow_the_rule_of_the_kernels_tiles():
    assert ops.default_blocks(True, False, 512, None) == (ops.BLOCK_Q // 2, ops.BLOCK_K)
    assert ops.default_blocks(False, False, 512, None) == (ops.BLOCK_Q, ops.BLOCK_K)
    assert ops.default_blocks(False, True, 4096, None) == (ops.BLOCK_Q, ops.BLOCK_K)
    assert ops.default_blocks(False, False, 1, None) == (ops.BLOCK_Q, ops.BLOCK_K_FEW_ROWS)
    spans = torch.tensor([[0, 3000, 0, 3000], [3000, 3010, 3000, 3010]])  # packed: by the longest sequence
    assert ops.default_blocks(True, False, 3010, spans) == (ops.BLOCK_Q, ops.BLOCK_K)


@pytest.mark.parametrize(
    "options",
    [{}, {"is_causal": True}, {"mask": True}, {"gqa": True}, {"backend": "torch", "gqa": True}],
    ids=["plain", "causal", "bool-mask", "gqa", "torch-gqa"],
)
def test_fullgraph_dynamic_compile_of_everyday_calls_equals_eager(options):
    """``torch.compile(fullgraph=True, dynamic=True)``, the common way to compile attention, on the
    calls torch's own kernel serves: GQA's ``enable_gqa`` reaches torch's SDPA as a bool, not a
    SymBool (which it refused, failing the compile), at two lengths without a graph break."""
    options = dict(options)
    gqa, with_mask = options.pop("gqa", False), options.pop("mask", False)
    torch._dynamo.reset()

    def f(q, k, v, mask):
        return attnscale.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, **options)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for L in (9, 23):
        gen = torch.Generator().manual_seed(L)
        q = torch.randn(2, 4, L, 8, generator=gen)
        k, v = (torch.randn(2, 2 if gqa else 4, L, 8, generator=gen) for _ in range(2))
        mask = torch.rand(L, L, generator=gen) > 0.2 if with_mask else None
        torch.testing.assert_close(compiled(q, k, v, mask), f(q, k, v, mask), rtol=0, atol=1e-6)


@needs_kernel  # packed sequences trace only through the compiled kernel's op
def test_packed_sequences_with_per_head_slopes_compile_with_dynamic_shapes():
    """varlen_attention with ALiBi slopes of shape (H,) under ``dynamic=True``: the slopes' shape is
    checked size by size (a tuple of symbolic sizes against (H,) failed for some)."""
    torch._dynamo.reset()
    cu = torch.tensor([0, 5, 16])
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(16, 4, 8, generator=gen) for _ in range(3))

    def f(q, k, v, slopes, cu):
        return attnscale.varlen_attention(q, k, v, cu, cu, alibi_slopes=slopes, is_causal=True)

    slopes = attnscale.alibi_slopes(4)
    torch.testing.assert_close(torch.compile(f, dynamic=True)(q, k, v, slopes, cu), f(q, k, v, slopes, cu), rtol=0, atol=1e-6)


def _bad_forward_calls():
    """(what is wrong, the op's arguments, a word the error names), from the valid plain case."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 2, 8, 8, generator=gen), torch.randn(2, 2, 8, 8, generator=gen)
    def call(q=q, k=k, v=v, alibi=None, mask=None, spans=None, block_q=0, block_k=0):
        return (q, k, v, alibi, mask, spans, *ops.KernelOptions(scale=0.35, block_q=block_q, block_k=block_k))

    yield "more key heads than query heads", call(k=torch.randn(2, 8, 8, 8), v=torch.randn(2, 8, 8, 8)), "key/value heads"
    yield "zero key heads", call(k=torch.randn(2, 0, 8, 8), v=torch.randn(2, 0, 8, 8)), "key/value heads"
    yield "query heads not a multiple", call(k=torch.randn(2, 3, 8, 8), v=torch.randn(2, 3, 8, 8)), "key/value heads"
    yield "smaller key batch", call(k=k[:1], v=v[:1]), "batch"
    yield "smaller key head dim", call(k=k[..., :4]), "head dim"
    yield "values shorter than keys", call(v=v[:, :, :5]), "key count"
    yield "a (1, 1) ALiBi table", call(alibi=torch.ones(1, 1)), "alibi"
    yield "a 2x2 mask for 8x8 scores", call(mask=torch.ones(2, 4, 2, 2, dtype=torch.bool)), "mask"
    yield "keys on the meta device", call(k=k.to("meta")), "device"
    yield "a mask on the meta device", call(mask=torch.ones(2, 4, 8, 8, dtype=torch.bool, device="meta")), "mask"
    yield "a negative block_q", call(block_q=-8), "block_q"
    yield "block_k = -1", call(block_k=-1), "block_k"
    yield "an empty span table", call(q=q[:1], k=k[:1], v=v[:1], spans=torch.zeros(0, 4, dtype=torch.int64)), "spans"
    yield "a span past the keys", call(q=q[:1], k=k[:1], v=v[:1], spans=torch.tensor([[0, 8, 0, 9]])), "spans"
    yield "mixed dtypes", call(v=v.double()), "dtype"
    yield "v with more heads than k", call(k=torch.randn(2, 2, 8, 8), v=torch.randn(2, 4, 8, 8)), "key/value heads"
    yield "q with a strided last dim", call(q=torch.randn(2, 4, 8, 16)[..., ::2]), "contiguous last dim"
    yield "keys that overlap (row stride 0)", call(k=torch.randn(2, 2, 1, 8).expand(2, 2, 8, 8)), "rows apart"

    def option(**given):
        return (q, k, v, None, None, None, *ops.KernelOptions(scale=0.35)._replace(**given))

    yield "a NaN scale", option(scale=float("nan")), "scale"
    yield "an infinite scale", option(scale=float("inf")), "scale"
    yield "a scale beyond float32", option(scale=1e39), "scale, softcap: expected values that fit Float"
    yield "a NaN softcap", option(softcap=float("nan")), "softcap"
    yield "an infinite softcap", option(softcap=float("inf")), "softcap"
    yield "a negative softcap", option(softcap=-1.0), "softcap"
    yield "a window side of -5", option(left=-5), "left, right"
    yield "a window side of -7", option(right=-7), "left, right"
    yield "a negative k_start", option(k_start=-1), "q_start, k_start"
    yield "a k_start past 2**61", option(k_start=2**61 + 1), "q_start, k_start"
    yield "a q_offset near 2**63", option(causal=True, q_offset=2**63 - 4), "q_offset"


@needs_kernel
@pytest.mark.parametrize("name, args, word", list(_bad_forward_calls()), ids=[name for name, _, _ in _bad_forward_calls()])
def test_the_ops_refuse_inconsistent_arguments_with_a_clear_error(name, args, word):
    """The public ops read what they are given without bounds checks of their own: each of these
    killed the process (SIGFPE), looped forever, or returned finite garbage with the row check
    saying fine. Now each raises a ValueError naming the argument, before the kernel runs."""
    with pytest.raises(ValueError, match=rf"torch.ops.attnscale: .*{word}"):
        torch.ops.attnscale.fused_forward(*args)


@needs_kernel
@pytest.mark.parametrize("name, args, word", list(_bad_forward_calls()), ids=[name for name, _, _ in _bad_forward_calls()])
def test_the_kernel_binding_refuses_what_the_op_refuses(name, args, word):
    """The compiled binding itself (``kernels.load().forward``) runs the same checks as the op
    (one place, csrc/checks.h); block sizes reach it resolved, so 0 is refused there too."""
    q, k, v, alibi, mask, spans, *options = args
    given = ops.KernelOptions(*options)
    given = given._replace(block_q=given.block_q or 4, block_k=given.block_k or 4)
    with pytest.raises(ValueError, match=rf"torch.ops.attnscale: .*{word}"):
        kernels.load().forward(q=q, k=k, v=v, alibi=alibi, mask=mask, spans=spans, **given._asdict())


@needs_kernel
@pytest.mark.parametrize("blocks", [(0, 4), (4, 0), (4, -2), (-1, 4)], ids=["block_q=0", "block_k=0", "block_k=-2", "block_q=-1"])
def test_the_kernel_binding_refuses_block_sizes_that_crashed_or_hung_it(blocks):
    """block_q 0 killed the process (SIGFPE), block_k 0 or -2 looped forever, block_q -1 returned
    rows never written with rows_ok true."""
    q = k = v = torch.randn(1, 2, 8, 8)
    options = ops.KernelOptions(scale=0.35, block_q=blocks[0], block_k=blocks[1])._asdict()
    with pytest.raises(ValueError, match="torch.ops.attnscale: block_q, block_k: expected positive block sizes"):
        kernels.load().forward(q=q, k=k, v=v, alibi=None, mask=None, spans=None, **options)


@needs_kernel
@pytest.mark.parametrize(
    "given, sees",
    [
        pytest.param({"k_start": 2**61}, lambda i, j: j >= 0, id="keys-at-2**61-no-mask"),
        pytest.param({"q_start": 2**61, "k_start": 2**61 - 3, "causal": True}, lambda i, j: j <= i + 3, id="causal-near-2**61"),
        pytest.param({"q_offset": 2**61, "causal": True}, lambda i, j: j >= 0, id="causal-offset-2**61"),
        pytest.param({"q_offset": -(2**61), "causal": True}, lambda i, j: j < 0, id="causal-offset-minus-2**61"),
        pytest.param({"q_start": 2**61, "k_start": 2**61, "left": 2, "right": 2**61}, lambda i, j: j >= i - 2, id="window-2**61"),
        pytest.param({"q_start": 2**61, "left": 2**63 - 1, "right": 2**63 - 1}, lambda i, j: j >= 0, id="window-sides-of-int64-max"),
        pytest.param({"q_offset": -(2**61), "k_start": 2**61, "causal": True, "left": 2**63 - 1}, lambda i, j: j < 0, id="causal-before-every-key-int64-max-left"),
    ],
)
def test_positions_up_to_2_to_the_61_are_exact(given, sees):
    """Keys at 2**61 and no mask gave all zeros; causal offsets near 2**63 overflowed. Within the
    op's range every key a row sees is the one the positions say: query row i at q_start + i +
    q_offset sees key j at k_start + j up to it (causal) and within the window's sides."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = torch.ops.attnscale.fused_forward(q, k, v, None, None, None, *ops.KernelOptions(scale=0.35)._replace(**given))[0]
    keep = sees(torch.arange(4)[:, None], torch.arange(4)[None, :])  # (L, S), worked out by hand from the positions
    want = torch.from_numpy(reference.attention(q.numpy(), k.numpy(), v.numpy(), scale=0.35, attn_mask=keep.numpy()))
    torch.testing.assert_close(out, torch.nan_to_num(want), rtol=0, atol=1e-12)


@needs_kernel
def test_the_backward_op_refuses_a_gradient_of_the_wrong_shape():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 4)
    out, lse, m, l, *_ = torch.ops.attnscale.fused_forward(q, k, v, None, None, None, *ops.KernelOptions(scale=0.35))
    rest = (None, None, None, False, *ops.KernelOptions(scale=0.35).backward_args())
    dq, dk, dv, dslope = torch.ops.attnscale.fused_backward(q, k, v, torch.ones_like(out), torch.zeros_like(lse), m, l, *rest)
    assert dq.shape == q.shape and dv.shape == v.shape and dslope.shape == (0, 0)  # no slopes: no gradient of theirs
    slopes = torch.tensor([[0.5, 0.25]])
    options = ops.KernelOptions(scale=0.35).backward_args()
    for slope_grad, shape in ((False, (0, 0)), (True, (1, 2))):  # fixed slopes: none computed; learned: one per (batch, head)
        grads = torch.ops.attnscale.fused_backward(q, k, v, torch.ones_like(out), torch.zeros_like(lse), m, l, slopes, None, None, slope_grad, *options)
        assert grads[3].shape == shape
    with pytest.raises(ValueError, match="slope_grad asks for the gradient of ALiBi slopes, but the call has none"):
        torch.ops.attnscale.fused_backward(q, k, v, torch.ones_like(out), torch.zeros_like(lse), m, l, None, None, None, True, *options)
    with pytest.raises(ValueError, match="torch.ops.attnscale: dout: expected the output's shape"):
        torch.ops.attnscale.fused_backward(q, k, v, torch.ones(1, 2, 6, 8), torch.zeros_like(lse), m, l, *rest)
    with pytest.raises(ValueError, match="torch.ops.attnscale: delta"):
        torch.ops.attnscale.fused_backward(q, k, v, torch.ones_like(out), torch.zeros(1, 2, 5), m, l, *rest)


def test_import_attnscale_leaves_the_compiler_unimported_and_marks_constants_as_torch_does():
    """``import attnscale`` took about 2.2 s against torch's 1.0 s, most of it torch._dynamo pulled
    in by ``torch.compiler.assume_constant_result`` at import. The mark is now set without it: the
    same attribute that torch's own function sets, and no torch._dynamo after the import."""
    import subprocess
    import sys

    from attnscale._tracing import constant_result

    def ours():
        return 1

    def theirs():
        return 1

    constant_result(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}
    code = "import sys, attnscale; print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@needs_kernel
@pytest.mark.parametrize("in_dim", [0, 2], ids=["mapped-dim-0", "mapped-dim-2"])
def test_per_sample_gradients_through_the_kernel_equal_the_loop(in_dim):
    """torch.func.vmap of torch.func.grad through backend="fused" (per-sample gradients) runs the
    backward op's vmap rule, and a mapped dim other than 0 its movedim: each sample's dq, dk, dv
    against autograd on that sample alone. q, k and v have one shape, so outputs in the wrong
    order are caught by value."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 2, H, 10, D, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.randn(2, H, 10, D, generator=gen, dtype=torch.float64)

    def loss(q, k, v):
        return (attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, is_causal=True, backend="fused") * w).sum()

    want = []
    for i in range(3):
        leaves = [t[i].clone().requires_grad_() for t in (q, k, v)]
        want.append(torch.autograd.grad(loss(*leaves), leaves))
    moved = [t.movedim(0, in_dim) for t in (q, k, v)]
    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)), in_dims=(in_dim, in_dim, in_dim))(*moved)
    for which, g in enumerate(got):
        torch.testing.assert_close(g, torch.stack([w_[which] for w_ in want]), rtol=0, atol=1e-12, msg=f"gradient {which}")


def test_the_options_record_names_the_ops_arguments_in_their_order():
    """ops.KernelOptions is the one list of the kernel's options: its fields are the forward op's
    arguments after q, k, v, alibi, mask, spans (the forward's build after them), and
    BACKWARD_FIELDS the backward op's after its ten tensors, name for name, with the record's types."""
    forward = [a.name for a in torch.ops.attnscale.fused_forward.default._schema.arguments]
    backward = [a.name for a in torch.ops.attnscale.fused_backward.default._schema.arguments]
    assert forward[:6] == ["q", "k", "v", "alibi", "mask", "spans"]
    assert forward[6:-1] == list(ops.KernelOptions._fields) and forward[-1] == "build"
    assert backward[:11] == ["q", "k", "v", "dout", "delta", "m", "l", "alibi", "mask", "spans", "slope_grad"]
    assert backward[11:] == list(ops.BACKWARD_FIELDS)
    assert ops.KernelOutputs._fields[-1] == "rows_ok" and len(ops.KernelOutputs._fields) == len(torch.ops.attnscale.fused_forward.default._schema.returns)
    types = {a.name: str(a.type) for a in torch.ops.attnscale.fused_forward.default._schema.arguments}
    assert [types[name] for name in ("scale", "causal", "q_offset")] == ["float", "bool", "int"]


@needs_kernel
def test_the_compiled_kernel_takes_the_options_records_fields_by_name_and_no_other():
    """The C++ kernel's Options struct lists the record's fields in its order; a call that leaves
    one out or names one it does not know fails with the name, never taking a default."""
    kernel = kernels.load()
    assert kernel.option_names() == list(ops.KernelOptions._fields)
    q = torch.randn(1, 1, 3, 4)
    given = ops.KernelOptions(scale=0.5, block_q=64, block_k=64)._asdict()
    out = kernel.forward(q=q, k=q, v=q, alibi=None, mask=None, spans=None, **given)[0]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.5))
    missing = dict(given)
    del missing["round_out"]
    with pytest.raises(RuntimeError, match="options missing: round_out"):
        kernel.forward(q=q, k=q, v=q, alibi=None, mask=None, spans=None, **missing)
    with pytest.raises(RuntimeError, match="unknown options: softcapp"):
        kernel.forward(q=q, k=q, v=q, alibi=None, mask=None, spans=None, softcapp=1.0, **given)


@needs_kernel
def test_the_kernels_ordered_entry_takes_the_whole_record_in_its_order_and_checks_that_order_at_load(monkeypatch):
    """forward_ordered (run_forward's entry: no keyword looked up per option) reads the record by
    position: the same output as by keyword, a tuple of another length refused with both counts,
    and a kernel whose options are in another order refused when it loads (attention then falls
    back to the tiled kernel, saying why)."""
    kernel = kernels.load()
    q = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(2))
    given = ops.KernelOptions(scale=0.5, causal=True, q_offset=1, block_q=64, block_k=64)
    by_name = kernel.forward(q=q, k=q, v=q, alibi=None, mask=None, spans=None, **given._asdict())
    ordered = kernel.forward_ordered(q, q, q, None, None, None, given)
    for a, b in zip(by_name, ordered):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="expected a tuple of 13 .* got 12"):
        kernel.forward_ordered(q, q, q, None, None, None, tuple(given)[:-1])

    class Reordered:
        @staticmethod
        def option_names():
            names = list(ops.KernelOptions._fields)
            names[0], names[1] = names[1], names[0]
            return names

    with pytest.raises(RuntimeError, match="are not KernelOptions'"):
        kernels._check_option_order(Reordered)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "build", lambda **_: Reordered)
    assert kernels.load() is None and "are not KernelOptions'" in kernels.unavailable_reason()
