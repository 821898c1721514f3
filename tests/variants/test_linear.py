import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from attnscale.variants import kernel_attention, linear_attention


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def linear_oracle(q, k, v, feature_map, causal, eps, scale_queries=False):
    """The quadratic form in float64: weights phi(q_i) . phi(k_j), normalised per row, then times v."""
    if scale_queries:
        q = q / np.sqrt(q.shape[-1])
    phi = (lambda x: np.where(x > 0, x + 1.0, np.exp(x))) if feature_map == "elu" else (lambda x: np.maximum(x, 0.0))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    w = phi(q) @ np.swapaxes(phi(k), -1, -2)  # (..., H, L, S)
    if causal:
        w = np.tril(w)
    return (w @ v) / (w.sum(-1, keepdims=True) + eps)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (6, 2), (3, 1)])
def test_oracle(feature_map, causal, H, Hkv):
    L, D, Dv = 37, 13, 5
    q, k, v = randn(2, H, L, D), randn(2, Hkv, L, D, seed=1), randn(2, Hkv, L, Dv, seed=2)
    for chunk in (8, 64):
        got = linear_attention(q, k, v, feature_map=feature_map, is_causal=causal, chunk_size=chunk)
        want = linear_oracle(q.numpy(), k.numpy(), v.numpy(), feature_map, causal, 1e-6)
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-11)


def test_noncausal_lengths_may_differ_and_float32():
    q, k, v = randn(1, 2, 5, 8, dtype=torch.float32), randn(1, 2, 11, 8, seed=1, dtype=torch.float32), randn(1, 2, 11, 3, seed=2, dtype=torch.float32)
    got = linear_attention(q, k, v, scale_queries=True)
    want = linear_oracle(q.double().numpy(), k.double().numpy(), v.double().numpy(), "elu", False, 1e-6, scale_queries=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_scale_cancels_for_relu_but_not_for_elu(causal):
    q, k, v = randn(2, 4, 33, 16), randn(2, 2, 33, 16, seed=1), randn(2, 2, 33, 8, seed=2)
    relu = [linear_attention(q, k, v, feature_map="relu", is_causal=causal, eps=0.0, scale_queries=s) for s in (False, True)]
    torch.testing.assert_close(relu[0], relu[1], rtol=0, atol=1e-12)
    elu = [linear_attention(q, k, v, feature_map="elu", is_causal=causal, scale_queries=s) for s in (False, True)]
    assert (elu[0] - elu[1]).abs().max() > 0.05


class LargestTensor(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_causal_never_builds_an_l_by_l_tensor():
    L = 1024
    q, k, v = randn(1, 1, L, 4, dtype=torch.float32), randn(1, 1, L, 4, seed=1, dtype=torch.float32), randn(1, 1, L, 4, seed=2, dtype=torch.float32)
    with LargestTensor() as probe:
        linear_attention(q, k, v, is_causal=True, chunk_size=32)
    assert probe.largest <= 4 * L  # (L, D) inputs and outputs; chunks are (32, 32)


def test_gradients():
    q, k, v = (randn(1, 2, 6, 3, seed=s).requires_grad_() for s in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, is_causal=True, chunk_size=4), (q, k, v))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(is_causal=True), ValueError, "key"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(feature_map="softplus"), ValueError, "feature_map"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(scale_queries=1), TypeError, "scale_queries"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        linear_attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), **kwargs)


def test_kernel_attention_checks_causal_lengths():
    with pytest.raises(ValueError, match="phi_k"):
        kernel_attention(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 5, 4), torch.ones(1, 1, 5, 2), is_causal=True)
