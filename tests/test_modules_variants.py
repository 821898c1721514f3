"""MultiHeadAttention with an AttentionConfig against independent float64 compositions.

Each oracle projects by hand, applies the variant function (or its formula) and attends with
``attnscale.reference.attention`` or the plain formula; the module must agree to rounding.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnscale
from attnscale import AttentionConfig, KVCache, MultiHeadAttention, reference
from attnscale.config import Int8Options, LengthScaleOptions, LinearOptions, PerformerOptions, QKNormOptions, RopeOptions, TemperatureOptions
from attnscale.variants import apply_rope, favor_attention, gaussian_features, int8_attention, normalize_qk, rope_qk

F64 = torch.float64
E, H, HKV, D, B, L = 32, 4, 2, 8, 2, 9
ATOL = 1e-12  # float64 compositions in a different order; measured max error 8.9e-16


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def build(config: AttentionConfig | None = None, *, seed: int = 0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(E, H, num_kv_heads=HKV, config=config, dtype=F64, **kwargs)


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.unflatten(-1, (n, D)).transpose(1, 2)  # (B, n, L, D)


def project(m: MultiHeadAttention, x: torch.Tensor, mem: torch.Tensor | None = None):
    mem = x if mem is None else mem
    q = heads(x @ m.q_proj.weight.T + m.q_proj.bias, H)  # (B, H, L, D)
    k = heads(mem @ m.k_proj.weight.T + m.k_proj.bias, HKV)  # (B, Hkv, S, D)
    v = heads(mem @ m.v_proj.weight.T + m.v_proj.bias, HKV)  # (B, Hkv, S, D)
    return q, k, v


def merge(m: MultiHeadAttention, o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2).flatten(-2) @ m.out_proj.weight.T + m.out_proj.bias  # (B, H, L, D) -> (B, L, E)


def ref(q, k, v, **kwargs) -> torch.Tensor:
    kwargs = {key: val.numpy() if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}
    return torch.from_numpy(reference.attention(q.numpy(), k.numpy(), v.numpy(), **kwargs))


def perturb(module: torch.nn.Module, seed: int = 1) -> None:
    """Move learned parameters off their init, so that the test sees whether they are used."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.add_(0.3 * randn(*p.shape, seed=seed + i))


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


# --- the default config is the existing module ------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True, "need_weights": True, "return_stats": True}])
def test_default_config_is_bit_for_bit_the_plain_module(kwargs):
    x = randn(B, L, E, seed=2)
    plain, configured = build(), build(AttentionConfig())
    assert plain.state_dict().keys() == configured.state_dict().keys()
    a, b = plain(x, **kwargs), configured(x, **kwargs)
    for got, want in ([(a, b)] if isinstance(a, torch.Tensor) else [(a.output, b.output), (a.weights, b.weights), (a.stats.lse, b.stats.lse)]):
        assert torch.equal(got, want)
    with torch.no_grad():
        q, k, v = project(plain, x)
        check(plain(x), merge(plain, ref(q, k, v)))


# --- each choice against its composition --------------------------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [RopeOptions(), RopeOptions(layout="interleaved", base=500.0), RopeOptions(rotary_dim=4), RopeOptions(layout="interleaved", rotary_dim=2)],
    ids=["half", "interleaved-base", "partial", "interleaved-partial"],
)
def test_rope_equals_rotate_then_attend(rope):
    m = build(AttentionConfig(positional="rope", rope=rope))
    x = randn(B, L, E, seed=3)
    with torch.no_grad():
        q, k, v = project(m, x)
        q, k = rope_qk(q, k, base=rope.base, rotary_dim=rope.rotary_dim, layout=rope.layout)
        want = merge(m, ref(q, k, v, is_causal=True))
    check(m(x, is_causal=True), want)


def test_rope_cross_attention_puts_bottom_right_queries_at_their_aligned_positions():
    m = build(AttentionConfig(positional="rope"))
    x, mem = randn(B, 3, E, seed=4), randn(B, 7, E, seed=5)
    with torch.no_grad():
        q, k, v = project(m, x, mem)
        q, k = apply_rope(q, offset=7 - 3), apply_rope(k)
        want = merge(m, ref(q, k, v, is_causal=True, causal_alignment="bottom_right"))
    check(m(x, mem, mem, is_causal=True, causal_alignment="bottom_right"), want)


def test_alibi_equals_reference_with_slopes():
    m = build(AttentionConfig(positional="alibi"))
    x = randn(B, L, E, seed=6)
    with torch.no_grad():
        q, k, v = project(m, x)
        want = merge(m, ref(q, k, v, is_causal=True, alibi_slopes=attnscale.alibi_slopes(H).double()))
    check(m(x, is_causal=True), want)
    got = m(x, is_causal=True, need_weights=True)  # the weights carry the bias too
    check(got.output, want)
    check(merge(m, got.weights @ v.repeat_interleave(H // HKV, 1)), want)


@pytest.mark.parametrize("kind", ["rms", "layer", "l2"])
def test_qk_norm_equals_normalize_then_gain_then_attend(kind):
    scale = {"l2": "none"}.get(kind, "inverse_sqrt")  # l2 with 1/sqrt(D) is the double shrink
    m = build(AttentionConfig(qk_norm=kind, scale=scale))
    perturb(m.variant)
    x = randn(B, L, E, seed=7)
    with torch.no_grad():
        q, k, v = project(m, x)
        q, k = normalize_qk(q, k, kind=kind)
        norm = m.variant.qk_norm
        if kind != "l2":
            q, k = q * norm.q_weight, k * norm.k_weight
        if kind == "layer":
            q, k = q + norm.q_bias, k + norm.k_bias
        want = merge(m, ref(q, k, v, is_causal=True, scale=1.0 if kind == "l2" else D**-0.5))
    check(m(x, is_causal=True), want)


@pytest.mark.parametrize("kind, options", [("l2", QKNormOptions(learned_scale=True, seq_len=64)), ("rms", QKNormOptions(learned_scale=True, scale_init=0.5))])
def test_qk_norm_learned_g_multiplies_the_normalised_logits(kind, options):
    m = build(AttentionConfig(qk_norm=kind, qk_norm_options=options, scale="none"))
    g = m.variant.qk_norm.logit_scale
    assert g.item() == (math.log2(64 * 63) if kind == "l2" else 0.5)
    x = randn(B, L, E, seed=8)
    with torch.no_grad():
        q, k, v = project(m, x)
        q, k = normalize_qk(q, k, kind=kind)
        want = merge(m, ref(q, k, v, is_causal=True, scale=g.item()))
    check(m(x, is_causal=True), want)


@pytest.mark.parametrize("scale, value", [("none", 1.0), ("fixed", 1 / math.sqrt(E)), ("fixed", 0.7)])
def test_fixed_and_no_scale(scale, value):
    m = build(AttentionConfig(scale=scale, fixed_scale=value if scale == "fixed" else None))
    x = randn(B, L, E, seed=9)
    with torch.no_grad():
        q, k, v = project(m, x)
        want = merge(m, ref(q, k, v, scale=value))
    check(m(x), want)


@pytest.mark.parametrize("per_head", [True, False])
def test_learned_temperature_multiplies_each_head(per_head):
    m = build(AttentionConfig(scale="learned", temperature=TemperatureOptions(per_head=per_head, init=0.2)))
    log_scale = m.variant.temperature.log_scale
    assert log_scale.shape == ((H,) if per_head else (1,))
    torch.testing.assert_close(log_scale, torch.full_like(log_scale, math.log(0.2)), rtol=0, atol=0)
    perturb(m.variant)
    x = randn(B, L, E, seed=10)
    with torch.no_grad():
        q, k, v = project(m, x)
        factor = log_scale.exp().expand(H)[:, None, None]  # (H, 1, 1)
        want = merge(m, ref(q * factor, k, v, is_causal=True, scale=1.0))
    check(m(x, is_causal=True), want)


def test_learned_temperature_starts_at_standard_attention():
    x = randn(B, L, E, seed=11)
    torch.testing.assert_close(build(AttentionConfig(scale="learned"))(x), build()(x), rtol=0, atol=ATOL)


@pytest.mark.parametrize("learnable", [True, False])
def test_length_scaling_multiplies_rows_by_s_log_visible_keys(learnable):
    m = build(AttentionConfig(scale="length_scaled", length_scaled=LengthScaleOptions(n_train=16, learnable=learnable)))
    with torch.no_grad():
        m.variant.length_scale.s.copy_(torch.linspace(0.2, 0.6, H, dtype=F64))
    x = randn(B, L, E, seed=12)
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, :3] = False  # left padding
    with torch.no_grad():
        q, k, v = project(m, x)
        visible = keep[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()  # (B, 1, L, S)
        n = visible.sum(-1).clamp_min(1)  # (B, 1, L)
        factor = m.variant.length_scale.s[:, None] * n.double().log()  # (B, H, L)
        want = merge(m, ref(q * factor[..., None], k, v, attn_mask=visible))
    check(m(x, is_causal=True, key_mask=keep), want)


def test_softcap_and_window_match_the_reference():
    m = build(AttentionConfig(softcap=2.0, window=(3, 0)))
    x = 3 * randn(B, L, E, seed=13)  # large logits, so the cap bites
    with torch.no_grad():
        q, k, v = project(m, x)
        want = merge(m, ref(q, k, v, is_causal=True, softcap=2.0, window=(3, 0)))
        uncapped = merge(m, ref(q, k, v, is_causal=True, window=(3, 0)))
    assert (want - uncapped).abs().max() > 1e-2
    got = m(x, is_causal=True, need_weights=True)
    check(got.output, want)
    assert (got.weights.tril(-4) == 0).all() and (got.weights.triu(1) == 0).all()


def test_qwen_like_stack_norm_then_rope_then_window_and_softcap():
    cfg = AttentionConfig(qk_norm="rms", positional="rope", rope=RopeOptions(rotary_dim=4, base=1e6), window=(4, 0), softcap=20.0)
    m = build(cfg)
    perturb(m.variant)
    x = randn(B, L, E, seed=14)
    with torch.no_grad():
        q, k, v = project(m, x)
        q, k = normalize_qk(q, k, kind="rms")
        q, k = q * m.variant.qk_norm.q_weight, k * m.variant.qk_norm.k_weight
        q, k = rope_qk(q, k, rotary_dim=4, base=1e6)
        want = merge(m, ref(q, k, v, is_causal=True, window=(4, 0), softcap=20.0))
    check(m(x, is_causal=True), want)


def linear_formula(q, k, v, *, feature_map, is_causal, eps=1e-6):
    phi = (lambda t: F.elu(t) + 1) if feature_map == "elu" else F.relu
    kk, vv = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)  # (B, H, S, D)
    w = phi(q) @ phi(kk).transpose(-1, -2)  # (B, H, L, S)
    if is_causal:
        w = w.tril()
    return (w @ vv) / (w.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("scale, value", [("inverse_sqrt", D**-0.5), ("none", 1.0), ("fixed", 2.0)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_kernel_scales_q_before_the_feature_map(feature_map, scale, value, is_causal):
    cfg = AttentionConfig(kernel="linear", linear=LinearOptions(feature_map=feature_map), scale=scale, fixed_scale=value if scale == "fixed" else None)
    m = build(cfg)
    x = randn(B, 70, E, seed=15)  # more than one chunk of the causal kernel
    with torch.no_grad():
        q, k, v = project(m, x)
        want = merge(m, linear_formula(q * value, k, v, feature_map=feature_map, is_causal=is_causal))
    check(m(x, is_causal=is_causal), want)


@pytest.mark.parametrize("scale", ["inverse_sqrt", "learned"])
def test_performer_kernel_uses_the_seeded_projection(scale):
    m = build(AttentionConfig(kernel="performer", performer=PerformerOptions(num_features=32, seed=5), positional="rope", scale=scale))
    if scale == "learned":
        perturb(m.variant)
    x = 0.3 * randn(B, L, E, seed=16)
    with torch.no_grad():
        q, k, v = project(m, x)
        q, k = rope_qk(q, k)
        if scale == "learned":
            q = q * m.variant.temperature.log_scale.exp()[:, None, None]
        projection = gaussian_features(32, D, generator=torch.Generator().manual_seed(5))
        want = merge(m, favor_attention(q, k, v, projection, is_causal=True, scale=D**-0.5 if scale == "inverse_sqrt" else 1.0))
    check(m(x, is_causal=True), want)


@pytest.mark.parametrize("options", [Int8Options(), Int8Options(block_q=4, block_k=3, smooth_k=False)])
def test_int8_kernel_equals_int8_attention(options):
    m = build(AttentionConfig(kernel="int8", int8=options, qk_norm="rms"))
    x = randn(B, L, E, seed=17)
    with torch.no_grad():
        q, k, v = project(m, x)
        q, k = normalize_qk(q, k, kind="rms")
        heads_out = int8_attention(q, k, v, is_causal=True, block_q=options.block_q, block_k=options.block_k, smooth_k=options.smooth_k)
        want = merge(m, heads_out)
        exact = merge(m, ref(q, k, v, is_causal=True))
    got = m(x, is_causal=True)
    check(got, want)
    assert (got - exact).abs().max() < 0.05  # INT8 error against exact attention stays small


# --- KV cache ----------------------------------------------------------------------------------------

CACHED = {
    "rope+rms": AttentionConfig(positional="rope", qk_norm="rms", rope=RopeOptions(rotary_dim=6)),
    "rope-interleaved": AttentionConfig(positional="rope", rope=RopeOptions(layout="interleaved")),
    "window": AttentionConfig(window=(2, 0)),
    "rope+window+softcap": AttentionConfig(positional="rope", window=(3, 0), softcap=5.0),
    "alibi": AttentionConfig(positional="alibi"),
    "learned": AttentionConfig(scale="learned"),
    "length_scaled": AttentionConfig(scale="length_scaled", length_scaled=LengthScaleOptions(n_train=4)),
}


@pytest.mark.parametrize("chunks", [[1] * 9, [3, 1, 4, 1]], ids=["token-by-token", "chunks"])
@pytest.mark.parametrize("name", list(CACHED))
def test_cached_decoding_equals_full_causal(name, chunks):
    m = build(CACHED[name])
    perturb(m.variant)
    x = randn(B, sum(chunks), E, seed=18)
    full = m(x, is_causal=True, need_weights=True)
    cache = KVCache()
    start = 0
    with torch.no_grad():
        for n in chunks:
            step = m(x[:, start : start + n], is_causal=True, cache=cache, need_weights=True)
            start += n
            check(step.output, full.output[:, start - n : start])
            check(step.weights, full.weights[:, :, start - n : start, :start])
    if CACHED[name].positional == "rope":  # the cache holds keys rotated at their absolute positions
        with torch.no_grad():
            _, k, _ = project(m, x)
            if m.variant.qk_norm is not None:
                k = normalize_qk(k, k, kind="rms")[1] * m.variant.qk_norm.k_weight
            rope = CACHED[name].rope
            check(cache.keys, apply_rope(k, base=rope.base, rotary_dim=rope.rotary_dim, layout=rope.layout))


def test_window_with_cache_hides_keys_left_of_the_window():
    m = build(AttentionConfig(window=(2, 0)))
    x = randn(1, 6, E, seed=19)
    cache = KVCache()
    m(x[:, :5], is_causal=True, cache=cache)
    weights = m(x[:, 5:], is_causal=True, cache=cache, need_weights=True).weights  # (1, H, 1, 6)
    assert torch.equal(weights[0, :, 0] > 0, torch.tensor([False, False, False, True, True, True]).expand(H, 6))


def test_int8_with_cache_attends_bottom_right_over_all_keys():
    m = build(AttentionConfig(kernel="int8", positional="rope"))
    x = randn(B, 7, E, seed=20)
    cache = KVCache()
    with torch.no_grad():
        m(x[:, :5], is_causal=True, cache=cache)
        got = m(x[:, 5:], is_causal=True, cache=cache)
        q, k, v = project(m, x)
        q, k = rope_qk(q, k)
        heads_out = int8_attention(q[:, :, 5:], k, v, is_causal=True, causal_alignment="bottom_right")
    check(got, merge(m, heads_out))


# --- training ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        AttentionConfig(qk_norm="layer", scale="learned", positional="rope"),
        AttentionConfig(qk_norm="l2", qk_norm_options=QKNormOptions(learned_scale=True, seq_len=16), scale="none", positional="alibi"),
        AttentionConfig(qk_norm="rms", scale="length_scaled", length_scaled=LengthScaleOptions(n_train=8), softcap=10.0, window=(3, 0)),
        AttentionConfig(scale="learned", temperature=TemperatureOptions(per_head=False), kernel="performer"),
        AttentionConfig(scale="learned", kernel="linear"),
        AttentionConfig(scale="learned", kernel="int8"),
    ],
    ids=["layer+learned+rope", "l2-g+alibi", "rms+length+softcap+window", "scalar-temp+performer", "linear", "int8"],
)
def test_learned_parameters_receive_gradients(cfg):
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, num_kv_heads=2, config=cfg)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(21)).requires_grad_()
    m(x, is_causal=True).square().sum().backward()
    names = [name for name, _ in m.named_parameters()]
    assert any(name.startswith("variant.") for name in names)
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_float32_module_casts_variant_parameters():
    m = MultiHeadAttention(16, 4, config=AttentionConfig(qk_norm="rms", scale="learned", kernel="performer"), dtype=torch.float32)
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    out = m(torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0)), is_causal=True)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_rope_decoding_at_a_long_offset_matches_the_oracle():
    # RoPE angles are float64 and rows start at their aligned position: no drift at large offsets.
    m = build(AttentionConfig(positional="rope"))
    cache = KVCache()
    cache.keys, cache.values = randn(B, HKV, 4096, D, seed=22), randn(B, HKV, 4096, D, seed=23)
    x = randn(B, 1, E, seed=24)
    with torch.no_grad():
        got = m(x, is_causal=True, cache=cache)
        q, k, v = project(m, x)
        q, k = apply_rope(q, offset=4096), apply_rope(k, offset=4096)
        keys, values = torch.cat([randn(B, HKV, 4096, D, seed=22), k], 2), torch.cat([randn(B, HKV, 4096, D, seed=23), v], 2)
        want = merge(m, ref(q, keys, values))
    check(got, want)
    assert np.isfinite(got.numpy()).all()


def test_alibi_slopes_stay_float32_in_a_bfloat16_module():
    # With 16 heads the slopes are 2 ** (-h / 2): bfloat16 would round the odd ones.
    torch.manual_seed(0)
    m64 = MultiHeadAttention(E, 16, config=AttentionConfig(positional="alibi"), dtype=F64)
    m16 = MultiHeadAttention(E, 16, config=AttentionConfig(positional="alibi"), dtype=F64).to(torch.bfloat16)
    m16.load_state_dict(m64.state_dict())
    assert torch.equal(m16.variant.slopes(torch.device("cpu")), attnscale.alibi_slopes(16))
    x = randn(B, 40, E, seed=25)
    err = (m16(x.to(torch.bfloat16), is_causal=True).double() - m64(x, is_causal=True)).abs().max()
    assert err < 2e-2, err  # bfloat16's own rounding (measured 4e-3 for the plain module)


@pytest.mark.parametrize("kernel", ["softmax", "performer", "int8", "linear"])
def test_the_scale_attribute_is_read_at_forward_time(kernel):
    # The lab swaps ``attn.scale`` on a trained module to compare divisors.
    x = randn(B, L, E, seed=26)
    m = build(AttentionConfig(kernel=kernel))
    m.scale = 0.5
    torch.testing.assert_close(m(x), build(AttentionConfig(kernel=kernel), scale=0.5)(x), rtol=0, atol=0)
