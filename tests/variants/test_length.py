import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale.variants import ScalableSoftmax, log_length_qk, ssmax_qk, visible_key_counts


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def counts_oracle(L, S, offset, causal, window):
    out = []
    for i in range(L):
        n = 0
        for j in range(S):
            ok = (not causal or j <= i + offset) and (window is None or i + offset - window[0] <= j <= i + offset + window[1])
            n += ok
        out.append(n)
    return out


def ssmax_oracle(q, k, v, s, offset, causal):
    """Row by row in float64: logits s_h log(n_i) q.k / sqrt(D) over the row's visible keys."""
    H, L, D = q.shape[-3:]
    Hkv, S = k.shape[-3], k.shape[-2]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for h in range(H):
        for i in range(L):
            n = min(S, i + offset + 1) if causal else S
            if n <= 0:
                continue
            logits = s[h] * math.log(n) * (k[..., h // (H // Hkv), :n, :] @ q[..., h, i, :, None])[..., 0] / math.sqrt(D)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            out[..., h, i, :] = (w[..., None] * v[..., h // (H // Hkv), :n, :]).sum(-2) / w.sum(-1)[..., None]
    return out


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (3, 0)), (False, (2, 1))])
def test_visible_key_counts(alignment, causal, window):
    L, S = 5, 9
    offset = S - L if alignment == "bottom_right" else 0
    got = visible_key_counts(L, S, is_causal=causal, causal_alignment=alignment, window=window)
    assert got.tolist() == counts_oracle(L, S, offset, causal, window)


def test_visible_key_counts_with_padding_mask():
    mask = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    mask[1, ..., 4:] = False  # second sequence has 4 real keys
    got = visible_key_counts(4, 6, is_causal=True, causal_alignment="bottom_right", attn_mask=mask)
    assert got.tolist() == [[[3, 4, 5, 6]], [[3, 4, 4, 4]]]


@pytest.mark.parametrize("L, S, alignment", [(7, 7, "top_left"), (3, 10, "bottom_right"), (6, 4, "bottom_right")])
def test_ssmax_oracle_causal_gqa(L, S, alignment):
    H, Hkv, D = 4, 2, 12
    ssmax = ScalableSoftmax(H, D, s_init=0.5).double()
    with torch.no_grad():
        ssmax.s.copy_(torch.tensor([0.2, 0.5, 1.0, 1.7], dtype=torch.float64))
    q, k, v = randn(2, H, L, D), randn(2, Hkv, S, D, seed=1), randn(2, Hkv, S, 3, seed=2)
    qs, ks = ssmax(q, k, is_causal=True, causal_alignment=alignment)
    out = attnscale.scaled_dot_product_attention(qs, ks, v, is_causal=True, causal_alignment=alignment, enable_gqa=True, scale=ssmax.effective_scale)
    offset = S - L if alignment == "bottom_right" else 0
    want = ssmax_oracle(q.numpy(), k.numpy(), v.numpy(), [0.2, 0.5, 1.0, 1.7], offset, causal=True)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=0, atol=1e-12)
    out.sum().backward()
    assert ssmax.s.grad is not None and torch.isfinite(ssmax.s.grad).all()


def test_fixed_variant_is_identity_at_training_length_and_default_init():
    q, k = randn(1, 2, 16, 8), randn(1, 2, 16, 8, seed=1)
    n = visible_key_counts(16, 16)
    qs, _ = log_length_qk(q, k, n_train=16, n=n)
    torch.testing.assert_close(qs, q, rtol=1e-15, atol=0)
    fixed = ScalableSoftmax(2, 8, n_train=16, learnable=False).double()
    assert not list(fixed.parameters())
    torch.testing.assert_close(fixed(q, k, is_causal=True)[0], log_length_qk(q, k, n_train=16, n=visible_key_counts(16, 16, is_causal=True))[0])


def test_subtracting_log_n_does_nothing_multiplying_does():
    q, k, v = randn(1, 1, 6, 8), randn(1, 1, 6, 8, seed=1), randn(1, 1, 6, 8, seed=2)
    n = visible_key_counts(6, 6, is_causal=True).double()
    shift = -(0.7 * n.log())[:, None].expand(6, 6)  # (L, S) float mask: subtract s log n per row
    plain = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True)
    subtracted = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, attn_mask=shift)
    torch.testing.assert_close(subtracted, plain, rtol=0, atol=1e-14)
    multiplied = attnscale.scaled_dot_product_attention(ssmax_qk(q, k, 0.7, n=n)[0], k, v, is_causal=True)
    assert (multiplied - plain).abs().max() > 1e-2


def test_peak_survives_long_contexts():
    """One key beats n - 1 others by delta: plain softmax's peak decays like 1/n, SSMax's does not (s delta > 1)."""
    D, delta = 4, 3.0
    peaks = {"plain": [], "ssmax": []}
    for S in (16, 256, 4096):
        q = torch.zeros(1, 1, 1, D, dtype=torch.float64)
        q[..., 0] = delta * math.sqrt(D)
        k = torch.zeros(1, 1, S, D, dtype=torch.float64)
        k[..., 0, 0] = 1.0
        for name, qq in (("plain", q), ("ssmax", ssmax_qk(q, k, 0.5, n=visible_key_counts(1, S))[0])):
            logits = (qq @ k.transpose(-1, -2)) / math.sqrt(D)
            peaks[name].append(float(torch.softmax(logits, -1).max()))
    assert peaks["plain"][-1] < 0.01 < 0.5 < peaks["ssmax"][0] < peaks["ssmax"][-1]


def test_bad_input():
    with pytest.raises(ValueError, match="n_train"):
        ScalableSoftmax(2, 8)
    with pytest.raises(ValueError, match="n_train"):
        log_length_qk(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), n_train=1, n=torch.ones(2))
    with pytest.raises(ValueError, match="n:"):
        ssmax_qk(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 1.0, n=torch.ones(3))
    with pytest.raises(ValueError, match="s:"):
        ssmax_qk(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), torch.ones(3), n=torch.ones(2))
