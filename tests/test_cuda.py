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
