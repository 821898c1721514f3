import math

import numpy as np
import pytest
import torch
from torch import nn

import attnscale
from attnscale import AttentionOutput, KVCache, MultiHeadAttention, reference

F64 = torch.float64


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=dtype)


def module(*args, seed: int = 0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(*args, dtype=kwargs.pop("dtype", F64), **kwargs)


def torch_mha(E: int, H: int, seed: int = 0, **kwargs) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, dtype=F64, **kwargs).eval()
    with torch.no_grad():  # torch zero-initialises biases; random ones test that they are copied
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_()
    return mha


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B, heads, L, D)


# --- parity with torch.nn.MultiheadAttention -------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross-kdim-vdim"])
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "padding+causal", "float"])
@pytest.mark.parametrize("average", [False, True])
def test_from_torch_matches_torch_fp64(batch_first, cross, masks, average):
    E, H, B, L = 24, 4, 3, 7
    S = 9 if cross else L
    kdims = {"kdim": 10, "vdim": 13} if cross else {}
    mha = torch_mha(E, H, batch_first=batch_first, **kdims)
    ours = MultiHeadAttention.from_torch(mha)
    x = randn(B, L, E, seed=1)
    key = randn(B, S, kdims.get("kdim", E), seed=2) if cross else x
    value = randn(B, S, kdims.get("vdim", E), seed=3) if cross else x
    if not batch_first:
        x, key, value = (t.transpose(0, 1) for t in (x, key, value))

    padding = torch.zeros(B, S, dtype=torch.bool)  # torch polarity: True = ignore
    padding[0, S - 3 :] = True
    padding[2, 3:5] = True  # no query row loses every key: torch returns NaN there, attnscale zeros
    ignore = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=1)
    torch_kw: dict = {}
    our_kw: dict = {}
    if "padding" in masks:
        torch_kw["key_padding_mask"], our_kw["key_mask"] = padding, ~padding
    if "causal" in masks:
        torch_kw["attn_mask"], our_kw["is_causal"] = ignore, True
    if masks == "float":
        bias = randn(L, S, seed=4)
        torch_kw["attn_mask"] = our_kw["attn_mask"] = bias  # additive in both: no conversion

    expected, expected_w = mha(x, key, value, need_weights=True, average_attn_weights=average, **torch_kw)
    got = ours(x, None if not cross else key, None if not cross else value, need_weights=True, average_attn_weights=average, **our_kw)
    assert isinstance(got, AttentionOutput) and got.stats is None
    torch.testing.assert_close(got.output, expected, rtol=0, atol=1e-13)
    torch.testing.assert_close(got.weights, expected_w, rtol=0, atol=1e-14)
    fast = ours(x, None if not cross else key, None if not cross else value, **our_kw)
    torch.testing.assert_close(fast, mha(x, key, value, need_weights=False, **torch_kw)[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("H", [1, 4, 6])
def test_from_torch_low_precision_error_is_at_most_twice_torchs(dtype, need_weights, H):
    # Tolerance from measurement: against torch in fp64, ours may err at most twice as much as torch's
    # own module in the same dtype. Measured max abs errors (E=48, H=6, L=37), torch vs ours:
    # fp32 6.3e-7 vs 6.3e-7, bf16 1.5e-2 vs 1.6e-2, fp16 2.2e-3 vs 2.0e-3.
    E, B, L = 48, 2, 37
    mha64 = torch_mha(E, H, batch_first=True)
    low = nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).eval()
    low.load_state_dict({k: v.to(dtype) for k, v in mha64.state_dict().items()})
    ours = MultiHeadAttention.from_torch(low)
    assert ours.q_proj.weight.dtype == dtype
    x = randn(B, L, E, seed=5)
    ignore = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    oracle = mha64(x, x, x, attn_mask=ignore, need_weights=False)[0]
    torch_err = (low(*(x.to(dtype),) * 3, attn_mask=ignore, need_weights=False)[0].double() - oracle).abs().max()
    got = ours(x.to(dtype), is_causal=True, need_weights=need_weights)
    out = got.output if need_weights else got
    assert out.dtype == dtype
    our_err = (out.double() - oracle).abs().max()
    assert our_err <= 2 * torch_err + torch.finfo(dtype).eps, (our_err, torch_err)


def test_from_torch_without_bias_and_in_train_mode():
    mha = nn.MultiheadAttention(16, 2, bias=False, dropout=0.25, dtype=F64)
    ours = MultiHeadAttention.from_torch(mha)
    assert ours.training and ours.dropout == 0.25 and not ours.batch_first
    assert all(p.bias is None for p in (ours.q_proj, ours.k_proj, ours.v_proj, ours.out_proj))
    x = randn(5, 2, 16)
    torch.testing.assert_close(ours.eval()(x), mha.eval()(x, x, x, need_weights=False)[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"add_bias_kv": True}, "add_bias_kv"), ({"add_zero_attn": True}, "add_zero_attn")],
)
def test_from_torch_rejects_unsupported_configs(kwargs, message):
    with pytest.raises(ValueError, match=rf"^mha: .*{message}"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, **kwargs))
    with pytest.raises(TypeError, match=r"^mha: "):
        MultiHeadAttention.from_torch(nn.Linear(8, 8))  # type: ignore[arg-type]


# --- the scale ---------------------------------------------------------------------------------


def identity_qk(m: MultiHeadAttention) -> None:
    """q = k = x (projections set to the identity) so every logit is known in closed form."""
    with torch.no_grad():
        for proj in (m.q_proj, m.k_proj):
            proj.weight.copy_(torch.eye(proj.weight.shape[0], proj.weight.shape[1], dtype=F64))
            proj.bias.zero_()


@pytest.mark.parametrize("d_model, num_heads, head_dim, d_k", [(32, 4, None, 8), (32, 1, None, 32), (12, 4, 5, 5)])
def test_default_scale_is_one_over_sqrt_per_head_dim(d_model, num_heads, head_dim, d_k):
    m = module(d_model, num_heads, head_dim=head_dim)
    assert m.scale == 1 / math.sqrt(d_k)
    if head_dim is None:
        assert m.scale == 1 / math.sqrt(d_model / num_heads)
    if num_heads * d_k > d_model:  # identity projections need H * D <= d_model
        return
    identity_qk(m)
    x = randn(2, 6, d_model, seed=7)
    weights = m(x, need_weights=True).weights  # (B, H, L, S)
    xh = split_heads(x, num_heads)  # (B, H, L, D)
    logits = xh @ xh.transpose(-1, -2) / math.sqrt(d_k)
    torch.testing.assert_close(weights, torch.softmax(logits, dim=-1), rtol=0, atol=1e-14)
    wrong = torch.softmax(xh @ xh.transpose(-1, -2) / math.sqrt(d_model), dim=-1)
    assert (weights - wrong).abs().max() > 1e-2 or num_heads == 1


def test_scale_argument_overrides_and_matters():
    x = randn(2, 5, 32, seed=8)
    default = module(32, 4)(x)
    explicit = module(32, 4, scale=1 / math.sqrt(8))(x)
    torch.testing.assert_close(explicit, default, rtol=0, atol=0)
    for divisor in (1.0, 32.0, math.sqrt(32)):
        other = module(32, 4, scale=1 / divisor)
        assert other.scale == 1 / divisor
        assert (other(x) - default).abs().max() > 1e-3


# --- heads, cross-attention, masks -------------------------------------------------------------


@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_gqa_equals_mha_with_repeated_kv_heads(Hkv):
    H, D, E, B, L = 8, 3, 20, 2, 6
    gqa = module(E, H, num_kv_heads=Hkv, head_dim=D)
    assert gqa.k_proj.weight.shape == gqa.v_proj.weight.shape == (Hkv * D, E)
    assert gqa.q_proj.weight.shape == (H * D, E) and gqa.out_proj.weight.shape == (E, H * D)
    mha = module(E, H, head_dim=D)
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):  # query head h reads key/value head h // (H // Hkv)
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(src.weight.unflatten(0, (Hkv, D)).repeat_interleave(H // Hkv, 0).flatten(0, 1))
            dst.bias.copy_(src.bias.unflatten(0, (Hkv, D)).repeat_interleave(H // Hkv, 0).flatten(0, 1))
    x = randn(B, L, E, seed=9)
    got = gqa(x, is_causal=True, need_weights=True)
    want = mha(x, is_causal=True, need_weights=True)
    assert got.output.shape == (B, L, E) and got.weights.shape == (B, H, L, L)
    torch.testing.assert_close(got.output, want.output, rtol=0, atol=1e-14)
    torch.testing.assert_close(got.weights, want.weights, rtol=0, atol=1e-15)


def test_cross_attention_with_kdim_vdim_matches_reference():
    E, H, Hkv, D, B, L, S = 16, 4, 2, 6, 2, 5, 11
    m = module(E, H, num_kv_heads=Hkv, head_dim=D, kdim=7, vdim=9)
    x, key, value = randn(B, L, E, seed=1), randn(B, S, 7, seed=2), randn(B, S, 9, seed=3)
    out = m(x, key, value)
    assert out.shape == (B, L, E)
    with torch.no_grad():
        q = split_heads(m.q_proj(x), H)  # (B, H, L, D)
        k, v = split_heads(m.k_proj(key), Hkv), split_heads(m.v_proj(value), Hkv)  # (B, Hkv, S, D)
        heads = reference.attention(q.numpy(), k.numpy(), v.numpy())  # (B, H, L, D)
        want = m.out_proj(torch.from_numpy(heads).transpose(1, 2).flatten(-2))
    np.testing.assert_allclose(out.detach().numpy(), want.numpy(), rtol=0, atol=1e-13)


def test_key_mask_true_means_attend():
    m = module(16, 2)
    B, L, S = 2, 4, 6
    x, mem = randn(B, L, 16, seed=1), randn(B, S, 16, seed=2)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, 4:] = False
    keep[1, 0] = False
    got = m(x, mem, mem, key_mask=keep, need_weights=True)
    assert (got.weights.masked_select(~keep[:, None, None, :]) == 0).all()
    assert (got.weights.masked_select(keep[:, None, None, :]) > 0).all()
    # Masked keys are ignored: changing them changes nothing, and dropping them gives the same output.
    changed = mem.clone()
    changed[~keep] = 100.0
    torch.testing.assert_close(m(x, changed, changed, key_mask=keep), got.output, rtol=0, atol=1e-14)
    first = m(x[:1], mem[:1, :4], mem[:1, :4])
    torch.testing.assert_close(got.output[:1], first, rtol=0, atol=1e-14)
    # The same padding as a bool attn_mask (True = attend) gives the same result.
    torch.testing.assert_close(m(x, mem, mem, attn_mask=keep[:, None, None, :]), got.output, rtol=0, atol=1e-14)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_alignment_for_cross_attention(alignment):
    m = module(16, 2)
    x, mem = randn(1, 2, 16, seed=1), randn(1, 5, 16, seed=2)
    weights = m(x, mem, mem, is_causal=True, causal_alignment=alignment, need_weights=True).weights  # (1, H, 2, 5)
    expected = attnscale.causal_mask(2, 5, alignment=alignment)
    assert torch.equal(weights > 0, expected.expand_as(weights))


def test_batch_first_false_is_the_transposed_layout():
    m = module(16, 4)
    x = randn(3, 5, 16, seed=3)
    seq_first = module(16, 4, batch_first=False)
    seq_first.load_state_dict(m.state_dict())
    got = seq_first(x.transpose(0, 1), is_causal=True, need_weights=True)
    want = m(x, is_causal=True, need_weights=True)
    assert got.output.shape == (5, 3, 16)
    torch.testing.assert_close(got.output.transpose(0, 1), want.output, rtol=0, atol=0)
    torch.testing.assert_close(got.weights, want.weights, rtol=0, atol=0)  # (B, H, L, S) in both layouts


# --- weights and statistics --------------------------------------------------------------------


def test_weights_rows_sum_to_one_and_fully_masked_rows_are_zero():
    m = module(16, 4, num_kv_heads=2)
    B, L = 2, 5
    x = randn(B, L, 16, seed=4)
    allowed = torch.ones(B, 1, L, L, dtype=torch.bool)
    allowed[1, 0, 3, :] = False  # query 3 of sequence 1 sees no key
    got = m(x, attn_mask=allowed, is_causal=True, need_weights=True, return_stats=True)
    sums = got.weights.sum(-1)  # (B, H, L)
    empty = torch.zeros(B, 1, L, dtype=torch.bool)
    empty[1, 0, 3] = True
    torch.testing.assert_close(sums, torch.where(empty, 0.0, 1.0).to(F64).expand_as(sums), rtol=0, atol=1e-14)
    assert torch.isfinite(got.output).all()
    torch.testing.assert_close(got.output[1, 3], m.out_proj.bias, rtol=0, atol=0)  # zero attention
    assert (got.stats.max_prob[1, :, 3] == 0).all() and (got.stats.entropy[1, :, 3] == 0).all()
    assert attnscale.last_backend() == "math"


def test_weights_are_what_produced_the_output_and_match_stats():
    H, Hkv, E = 6, 3, 18
    m = module(E, H, num_kv_heads=Hkv)
    x = randn(2, 7, E, seed=5)
    keep = torch.rand(2, 7, generator=gen(1)) > 0.3
    keep[:, 0] = True
    got = m(x, key_mask=keep, is_causal=True, need_weights=True, return_stats=True)
    with torch.no_grad():
        v = split_heads(m.v_proj(x), Hkv).repeat_interleave(H // Hkv, 1)  # (B, H, S, D)
        mixed = (got.weights @ v).transpose(1, 2).flatten(-2)  # (B, L, H * D)
    torch.testing.assert_close(got.output, m.out_proj(mixed), rtol=0, atol=1e-14)
    p = got.weights
    entropy = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)
    torch.testing.assert_close(got.stats.entropy, entropy, rtol=0, atol=1e-13)
    torch.testing.assert_close(got.stats.max_prob, p.amax(-1), rtol=0, atol=1e-14)
    averaged = m(x, key_mask=keep, is_causal=True, need_weights=True, average_attn_weights=True).weights
    torch.testing.assert_close(averaged, p.mean(1), rtol=0, atol=0)
    stats_only = m(x, key_mask=keep, is_causal=True, return_stats=True)
    assert stats_only.weights is None and stats_only.stats.lse.shape == (2, H, 7)
    torch.testing.assert_close(stats_only.output, got.output, rtol=0, atol=1e-14)


def test_plain_call_uses_torch_kernel_and_returns_a_tensor():
    m = module(16, 4)
    out = m(randn(2, 5, 16), is_causal=True)
    assert isinstance(out, torch.Tensor)
    assert attnscale.last_backend() == "torch"


# --- KV cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[1] * 9, [3, 1, 4, 1]], ids=["token-by-token", "chunks"])
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_kv_cache_decoding_equals_full_causal(chunks, Hkv):
    E, H, B = 24, 4, 2
    L = sum(chunks)
    m = module(E, H, num_kv_heads=Hkv)
    x = randn(B, L, E, seed=6)
    full = m(x, is_causal=True, need_weights=True)
    cache = KVCache()
    start = 0
    for n in chunks:
        step = m(x[:, start : start + n], is_causal=True, cache=cache, need_weights=True)
        start += n
        assert len(cache) == start and cache.keys.shape == (B, Hkv, start, E // H)
        torch.testing.assert_close(step.output, full.output[:, start - n : start], rtol=0, atol=1e-14)
        torch.testing.assert_close(step.weights, full.weights[:, :, start - n : start, :start], rtol=0, atol=1e-15)


def test_kv_cache_with_padding_and_fp32():
    # Bottom-right alignment and key_mask over cached + new keys; fp32 decoding vs fp32 full pass.
    E, H, B, L = 32, 4, 2, 8
    m = module(E, H, num_kv_heads=2, dtype=torch.float32)
    x = randn(B, L, E, seed=7, dtype=torch.float32)
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, :3] = False  # left padding of sequence 1
    full = m(x, is_causal=True, key_mask=keep)
    cache = KVCache()
    steps = [m(x[:, i : i + 1], is_causal=True, key_mask=keep[:, : i + 1], cache=cache) for i in range(L)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=2e-6)
    cache.reset()
    assert len(cache) == 0 and cache.keys is None


@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 17, 1, 1, 9, 6]], ids=["token-by-token", "chunks"])
def test_kv_cache_without_gradients_writes_into_room_and_decodes_as_the_full_pass(chunks):
    # No gradient: appends write into room behind the cached positions (doubling when full), not a
    # concatenation; the result is the full causal pass's, and views handed out earlier keep their values.
    E, H, B, Hkv = 24, 4, 2, 2
    m = module(E, H, num_kv_heads=Hkv)
    x = randn(B, sum(chunks), E, seed=8)
    with torch.no_grad():
        full = m(x, is_causal=True)
        cache, start, handed, storages = KVCache(), 0, [], set()
        for n in chunks:
            step = m(x[:, start : start + n], is_causal=True, cache=cache)
            start += n
            torch.testing.assert_close(step, full[:, start - n : start], rtol=0, atol=1e-14)
            handed.append((cache.keys, cache.keys.clone(), cache.values, cache.values.clone()))
            storages.add(cache.keys.untyped_storage().data_ptr())
    assert len(cache) == start and cache.keys.shape == (B, Hkv, start, E // H)
    for keys, keys_then, values, values_then in handed:
        assert torch.equal(keys, keys_then) and torch.equal(values, values_then)
    assert len(storages) <= 2 + math.ceil(math.log2(start)), "the room doubles: few reallocations, not one per append"


def test_kv_cache_room_made_under_inference_mode_takes_appends_outside_it():
    E, H, B = 16, 4, 2
    m = module(E, H)
    x = randn(B, 5, E, seed=11)
    with torch.no_grad():
        full = m(x, is_causal=True)
    cache = KVCache()
    with torch.inference_mode():
        steps = [m(x[:, i : i + 1], is_causal=True, cache=cache) for i in range(3)]
    with torch.no_grad():
        steps += [m(x[:, i : i + 1], is_causal=True, cache=cache) for i in range(3, 5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-14)


def test_kv_cache_keeps_autograd_history_and_assigned_tensors():
    E, H, B = 16, 4, 2
    m = module(E, H)
    x = randn(B, 4, E, seed=9)
    cache = KVCache()
    with torch.no_grad():
        m(x[:, :2], is_causal=True, cache=cache)  # into room
    out = m(x[:, 2:3], is_causal=True, cache=cache)  # grad mode on, the projections' parameters require grad: concatenated
    assert cache.keys.requires_grad and cache.keys.grad_fn is not None
    out.sum().backward()
    assert m.k_proj.weight.grad is not None
    # a shortened view of the room: the positions behind it, handed out before, keep their values
    with torch.no_grad():
        m(x[:, 3:4], is_causal=True, cache=cache)  # into new room (the cached tensors required grad)
        whole = cache.keys
        kept = whole.clone()
        cache.keys, cache.values = whole[..., :2, :], cache.values[..., :2, :]
        m(randn(B, 1, E, seed=10), is_causal=True, cache=cache)  # another token at position 2
    assert torch.equal(whole, kept) and len(cache) == 3
    # a caller's own keys and values: the next append starts from them
    own_keys, own_values = cache.keys.detach().clone(), cache.values.detach().clone()
    own_keys[..., 0, :] = 0.0
    cache.keys, cache.values = own_keys, own_values
    with torch.no_grad():
        m(x[:, 3:4], is_causal=True, cache=cache)
    assert len(cache) == 4 and torch.equal(cache.keys[..., :3, :], own_keys) and torch.equal(cache.values[..., :3, :], own_values)


def test_kv_cache_errors_leave_the_cache_unchanged():
    m = module(16, 4)
    cache = KVCache()
    m(randn(2, 3, 16), cache=cache, is_causal=True)
    with pytest.raises(ValueError, match=r"^key_mask: .*cached"):
        m(randn(2, 1, 16), cache=cache, key_mask=torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^causal_alignment: "):
        m(randn(2, 1, 16), cache=cache, is_causal=True, causal_alignment="top_left")
    with pytest.raises(ValueError, match=r"^cache: "):
        m(randn(1, 1, 16), cache=cache)
    with pytest.raises(ValueError, match=r"^attn_mask: "):
        m(randn(2, 1, 16), cache=cache, attn_mask=torch.ones(1, 3, dtype=torch.bool))
    assert len(cache) == 3
    m(randn(2, 1, 16), cache=cache, attn_mask=torch.ones(1, 4, dtype=torch.bool))
    assert len(cache) == 4


# --- training ----------------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradients_reach_every_parameter(need_weights):
    m = module(16, 4, num_kv_heads=2, kdim=10, vdim=12, dtype=torch.float32)
    x = randn(2, 5, 16, dtype=torch.float32).requires_grad_()
    key, value = randn(2, 6, 10, seed=1, dtype=torch.float32), randn(2, 6, 12, seed=2, dtype=torch.float32)
    got = m(x, key, value, need_weights=need_weights)
    out = got.output if need_weights else got
    (out.square().sum() + (got.weights.square().sum() if need_weights else 0)).backward()
    for name, p in [*m.named_parameters(), ("input", x)]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_dropout_only_in_training():
    m = module(16, 4, dropout=0.5)
    x = randn(2, 6, 16)
    torch.manual_seed(0)
    a = m(x)
    torch.manual_seed(0)
    torch.testing.assert_close(m(x), a, rtol=0, atol=0)  # reproducible under the seed
    m.eval()
    assert (m(x) - a).abs().max() > 1e-3
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)


# --- bad arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, arg, exc",
    [
        ({"d_model": 0}, "d_model", ValueError),
        ({"d_model": 10.0}, "d_model", ValueError),
        ({"num_heads": 3}, "num_heads", ValueError),
        ({"num_heads": True}, "num_heads", ValueError),
        ({"num_kv_heads": 3}, "num_kv_heads", ValueError),
        ({"head_dim": -1}, "head_dim", ValueError),
        ({"bias": 1}, "bias", TypeError),
        ({"dropout": 1.0}, "dropout", ValueError),
        ({"batch_first": None}, "batch_first", TypeError),
        ({"scale": 0.0}, "scale", ValueError),
        ({"scale": "1"}, "scale", TypeError),
        ({"kdim": 0}, "kdim", ValueError),
        ({"vdim": 2.5}, "vdim", ValueError),
        ({"dtype": torch.int32}, "dtype", TypeError),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, arg, exc):
    args = {"d_model": 16, "num_heads": 4, **kwargs}
    with pytest.raises(exc, match=rf"^{arg}: expected .* got .*Fix: "):
        MultiHeadAttention(**args)


@pytest.mark.parametrize(
    "call, arg, exc",
    [
        (lambda m, x: m(x.float()), "query", TypeError),
        (lambda m, x: m(x[0]), "query", ValueError),
        (lambda m, x: m(x[..., :8]), "query", ValueError),
        (lambda m, x: m(x, x), "value", ValueError),
        (lambda m, x: m(x, x[:1], x[:1]), "key", ValueError),
        (lambda m, x: m(x, x, x[:, :2]), "value", ValueError),
        (lambda m, x: m(x, key_mask=torch.ones(2, 5)), "key_mask", TypeError),
        (lambda m, x: m(x, key_mask=torch.ones(2, 4, dtype=torch.bool)), "key_mask", ValueError),
        (lambda m, x: m(x, attn_mask=torch.ones(3, 5, dtype=torch.bool)), "attn_mask", ValueError),
        (lambda m, x: m(x, attn_mask=torch.ones(8, 5, 5, dtype=torch.bool)), "attn_mask", ValueError),
        (lambda m, x: m(x, is_causal=1), "is_causal", TypeError),
        (lambda m, x: m(x, causal_alignment="diagonal"), "causal_alignment", ValueError),
        (lambda m, x: m(x, need_weights="yes"), "need_weights", TypeError),
        (lambda m, x: m(x, cache={}), "cache", TypeError),
    ],
)
def test_forward_errors_name_the_argument(call, arg, exc):
    m = module(16, 4)
    with pytest.raises(exc, match=rf"^{arg}: expected .* got .*Fix: "):
        call(m, randn(2, 5, 16))
