"""MultiHeadAttention with learned attention sinks (``AttentionConfig(sinks=True)``)."""

import pytest
import torch

import attnscale
from attnscale import AttentionConfig, KVCache, MultiHeadAttention


def module(E=24, H=4, Hkv=2, seed=0):
    torch.manual_seed(seed)
    m = MultiHeadAttention(E, H, num_kv_heads=Hkv, config=AttentionConfig(sinks=True), dtype=torch.float64)
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([1.5, -0.5, 0.0, 3.0]))
    return m


def by_hand(m, x, causal):
    """The formula on the module's own projections: softmax over keys and the head's sink."""
    B, L, _ = x.shape
    q = m.q_proj(x).unflatten(-1, (m.num_heads, m.head_dim)).transpose(1, 2)  # (B, H, L, D)
    k = m.k_proj(x).unflatten(-1, (m.num_kv_heads, m.head_dim)).transpose(1, 2).repeat_interleave(2, 1)  # (B, H, L, D)
    v = m.v_proj(x).unflatten(-1, (m.num_kv_heads, m.head_dim)).transpose(1, 2).repeat_interleave(2, 1)
    logits = q @ k.mT * m.head_dim**-0.5  # (B, H, L, L)
    if causal:
        logits = logits.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    sink = m.sinks[:, None, None].expand(B, -1, L, 1)
    weights = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]  # the sink's column dropped
    return m.out_proj((weights @ v).transpose(1, 2).flatten(-2)), weights


@pytest.mark.parametrize("causal", [False, True])
def test_output_weights_and_gradients_follow_the_formula(causal):
    m = module()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    got = m(x, is_causal=causal, need_weights=True, return_stats=True)
    want, weights = by_hand(m, x, causal)
    torch.testing.assert_close(got.output, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(got.weights, weights, rtol=0, atol=1e-14)
    torch.testing.assert_close(got.weights.sum(-1) + got.stats.sink_share, torch.ones(2, 4, 7, dtype=torch.float64), rtol=0, atol=1e-14)
    (grad,) = torch.autograd.grad(m(x, is_causal=causal).square().sum(), m.sinks)
    (want_grad,) = torch.autograd.grad(want.square().sum(), m.sinks)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)
    assert (grad != 0).all()


def test_the_sinks_are_a_parameter_only_when_asked_for():
    assert "sinks" in dict(module().named_parameters())
    plain = MultiHeadAttention(24, 4)
    assert plain.sinks is None and "sinks" not in dict(plain.named_parameters())
    torch.testing.assert_close(MultiHeadAttention(24, 4, config=AttentionConfig(sinks=True)).sinks, torch.zeros(4))


def test_kv_cache_decoding_with_sinks_equals_the_full_causal_pass():
    m = module(Hkv=1)
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    full = m(x, is_causal=True)
    cache = KVCache()
    steps = [m(x[:, i : i + 1], is_causal=True, cache=cache) for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-14)


def test_config_round_trips_and_refuses_sinks_without_softmax():
    cfg = AttentionConfig(sinks=True, window=(4, 0))
    assert AttentionConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["sinks"] is True
    assert AttentionConfig.from_dict({"schema": "attnscale.attention_config/1"}).sinks is False
    with pytest.raises(ValueError, match="sinks: expected False with kernel='linear'"):
        AttentionConfig(sinks=True, kernel="linear")
    with pytest.raises(TypeError, match="sinks: expected a bool"):
        AttentionConfig(sinks=1)


def test_auto_runs_an_online_softmax_kernel_for_a_module_with_sinks():
    m = module()
    m(torch.randn(1, 5, 24, dtype=torch.float64))
    assert attnscale.last_backend() == ("fused" if attnscale.kernels.available() else "tiled")
