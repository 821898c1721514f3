"""CUDA tensors: the compiled kernel is for CPU tensors; auto routes CUDA inputs to torch's fused
kernels where they are exact and to the eager tiled kernel otherwise, on the tensors' own device."""

import pytest
import torch

import attnscale

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize(
    "opts, backend",
    [({"is_causal": True}, "torch"), ({"softcap": 5.0, "is_causal": True}, "tiled"), ({"return_stats": True}, "tiled"), ({"sinks": "zeros"}, "tiled")],
)
def test_auto_on_cuda_runs_on_the_device_and_matches_the_cpu(opts, backend):
    q, k, v = inputs()
    opts = dict(opts)
    if opts.get("sinks") == "zeros":
        opts["sinks"] = torch.zeros(4, dtype=torch.float64)
    cpu = attnscale.scaled_dot_product_attention(q, k, v, backend="math", **opts)
    gpu_opts = {name: (t.cuda() if isinstance(t, torch.Tensor) else t) for name, t in opts.items()}
    got = attnscale.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), **gpu_opts)
    assert attnscale.last_backend() == backend
    got, want = (got, cpu) if not opts.get("return_stats") else (got[0], cpu[0])
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-10)


def test_forcing_the_compiled_kernel_on_cuda_is_refused():
    q, k, v = (t.cuda() for t in inputs())
    with pytest.raises(ValueError, match="not a CPU tensor"):
        attnscale.scaled_dot_product_attention(q, k, v, softcap=5.0, backend="fused")


@pytest.mark.parametrize(
    "opts, waits",
    [
        ({"is_causal": True, "softcap": 30.0}, 1),
        ({"is_causal": True}, 1),
        ({"window": (64, 0)}, 1),
        ({"alibi": True}, 2),  # and the slopes' value check (finite), before the call runs
        ({"float_mask": True}, 3),  # and the mask's two value checks (no NaN, no +inf)
    ],
    ids=["causal-softcap", "causal", "window", "alibi", "float-mask"],
)
def test_a_flex_call_on_cuda_waits_for_the_device_once(opts, waits):
    """The guard's numbers (row peaks, max |q|, |k|, slopes, mask) come back in one transfer: each
    synchronizing operation attnscale issues in a warm call is listed (with its stack) and
    counted; the value checks of slopes and masks are waits of their own. Waits inside torch's
    create_block_mask (a float mask's BlockMask, built per call) are torch's and not counted.
    Seen on an H200 with torch 2.11: 1, 1, 1, 2 and 5, of which 2 in create_block_mask."""
    import traceback
    import warnings

    q, k, v = (t.cuda().float() for t in inputs())
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = attnscale.alibi_slopes(4).cuda()
    if opts.pop("float_mask", False):
        opts["attn_mask"] = torch.randn(33, 33, device="cuda").masked_fill(torch.rand(33, 33, device="cuda") < 0.2, float("-inf"))
        opts["softcap"] = 20.0
    attnscale.scaled_dot_product_attention(q, k, v, backend="flex", **opts)  # compile, cache the block mask
    torch.cuda.synchronize()
    ours, theirs = [], []

    def seen(message, *_, **__):
        # "called a synchronizing CUDA operation"; not the mode's own notice that it is a prototype
        if "called a synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack() if not f.filename.endswith("warnings.py")][:-1]  # up to the operation
        where = "".join(traceback.format_list(frames[-6:]))
        (ours if "/attnscale/" in frames[-1].filename.replace("\\", "/") else theirs).append(where)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            attnscale.scaled_dot_product_attention(q, k, v, backend="flex", **opts)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert attnscale.last_backend() == "flex"
    assert len(ours) == waits, "\n\n".join(ours)
