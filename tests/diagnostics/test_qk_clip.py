"""QK-Clip on attnscale.MultiHeadAttention and on HuggingFace BERT, GPT-2, Llama and DeepSeek-V3 (latent)
attention: after a clip the same batch's max logit is at most tau, heads under tau give bit-identical
outputs, and training goes on."""

import pytest
import torch
from torch import nn

import attnscale
from attnscale.diagnostics.qk_clip import qk_clip

# Relative slack of "max logit <= tau" after a clip: float32 rounding of the rescaled weights, of
# q.k and of the recorded max; measured ratios stay below 1 + 3e-7.
ROUNDING = 1e-5


def _per_head_outputs(model, run, out_proj: nn.Module, H: int) -> torch.Tensor:
    """The attention output of every head, (B, L, H, Dv), as the output projection receives it."""
    seen = []
    hook = out_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            run()
    finally:
        hook.remove()
    (x,) = seen
    return x.unflatten(-1, (H, -1))


def _max_logits(model, run):
    with attnscale.monitor(model) as mon, torch.no_grad():
        run()
    report = mon.report()
    assert len(report.layers) == 1
    return report, torch.tensor([h.max_logit for h in report.heads], dtype=torch.float64)


def _check_clip(model, run, out_proj, H):
    """Clip at a tau between the heads' max logits; check the bound and the untouched heads."""
    report, before = _max_logits(model, run)
    tau = before.median().item()
    over = before > tau
    assert 0 < over.sum() < H, "the test needs heads on both sides of tau"
    outputs = _per_head_outputs(model, run, out_proj, H)
    result = qk_clip(model, report, tau)
    assert result.count == int(over.sum())
    (clipped,) = result.clipped.values()
    assert [h for h, _ in clipped] == over.nonzero().flatten().tolist()
    _, after = _max_logits(model, run)
    assert (after <= tau * (1 + ROUNDING)).all()
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=ROUNDING, atol=0.0)
    new_outputs = _per_head_outputs(model, run, out_proj, H)
    for h in range(H):
        same = torch.equal(new_outputs[:, :, h], outputs[:, :, h])
        assert same == (not over[h]), f"head {h}"


def _spread_logits(weight: torch.Tensor, H: int, dim: int = 0) -> None:
    """Multiply head h's query rows by 4 + 4 h, so that heads have clearly different max logits."""
    gains = (4.0 + 4.0 * torch.arange(H, dtype=weight.dtype)).repeat_interleave(weight.shape[dim] // H)
    shape = [1] * weight.ndim
    shape[dim] = -1
    with torch.no_grad():
        weight.mul_(gains.view(shape))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_multihead_attention(num_kv_heads):
    torch.manual_seed(0)
    mha = attnscale.MultiHeadAttention(32, num_heads=4, num_kv_heads=num_kv_heads, config=attnscale.AttentionConfig(positional="rope"))
    _spread_logits(mha.q_proj.weight, 4)
    x = torch.randn(2, 12, 32)
    k_before = [p.detach().clone() for p in mha.k_proj.parameters()]
    _check_clip(mha, lambda: mha(x, is_causal=True), mha.out_proj, 4)
    keys_moved = any(not torch.equal(a, b) for a, b in zip(k_before, mha.k_proj.parameters()))
    assert keys_moved == (num_kv_heads == 4)  # shared key heads stay; the query takes the whole factor


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnscale[hf]')")


def test_bert(transformers):
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    attn = model.encoder.layer[0].attention
    _spread_logits(attn.self.query.weight, 4)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    _check_clip(model, lambda: model(input_ids=ids), attn.output.dense, 4)


def test_gpt2(transformers):
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    attn = model.h[0].attn
    _spread_logits(attn.c_attn.weight[:, :32], 4, dim=1)  # the q columns of the fused projection
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    _check_clip(model, lambda: model(input_ids=ids), attn.c_proj, 4)


def test_llama_with_grouped_keys_and_biases(transformers):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, attention_bias=True, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    attn = model.layers[0].self_attn
    _spread_logits(attn.q_proj.weight, 4)
    with torch.no_grad():
        attn.q_proj.bias.normal_(0.0, 1.0)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    keys = [p.detach().clone() for p in attn.k_proj.parameters()]
    _check_clip(model, lambda: model(input_ids=ids), attn.o_proj, 4)
    assert all(torch.equal(a, b) for a, b in zip(keys, attn.k_proj.parameters()))


def test_training_goes_on_with_a_clip_after_every_step():
    torch.manual_seed(0)
    model = nn.Sequential(attnscale.MultiHeadAttention(32, num_heads=4), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 12, 32, generator=gen)
    y = torch.randint(0, 8, (16, 12), generator=gen)
    tau, losses, clipped = 3.0, [], 0
    mon = attnscale.monitor(model).start()
    try:
        for _ in range(40):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            clipped += qk_clip(model, mon.step(), tau).count
            losses.append(loss.item())
    finally:
        mon.stop()
    assert clipped > 0
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.7 * losses[0]
    assert list(model.parameters()) == params and all(p.requires_grad for p in params)
    with attnscale.monitor(model) as check, torch.no_grad():
        model(x)
    assert max(h.max_logit for h in check.report().heads) <= 2 * tau  # one AdamW step past the last clip


def test_bad_input_is_refused_before_any_weight_changes():
    torch.manual_seed(0)
    mha = attnscale.MultiHeadAttention(16, num_heads=2)
    weights = [p.detach().clone() for p in mha.parameters()]
    with pytest.raises(ValueError, match="tau: expected a finite float > 0"):
        qk_clip(mha, {"MultiHeadAttention": [5.0, 5.0]}, 0.0)
    with pytest.raises(ValueError, match="max_logits: expected 2 per-head values"):
        qk_clip(mha, {"MultiHeadAttention": [5.0]}, 1.0)
    with pytest.raises(ValueError, match="max_logits: expected layer names of this model"):
        qk_clip(mha, {"MultiHeadAttention": [5.0, 5.0], "encoder.0": [5.0]}, 1.0)
    with pytest.raises(TypeError, match="max_logits: expected a StepRecord"):
        qk_clip(mha, [5.0, 5.0], 1.0)
    with pytest.raises(TypeError, match="model: expected attention layers with named q and k projections"):
        qk_clip(nn.Sequential(nn.Linear(4, 4)), {"0": [5.0]}, 1.0)
    normed = attnscale.MultiHeadAttention(16, num_heads=2, config=attnscale.AttentionConfig(qk_norm="rms"))
    with pytest.raises(ValueError, match="model: expected attention layers without QK-Norm"):
        qk_clip(normed, {"MultiHeadAttention": [5.0, 5.0]}, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(weights, mha.parameters()))


@pytest.mark.parametrize("family", ["Qwen3", "Olmo2", "Gemma3Text"])
def test_hf_layers_with_qk_norm_are_refused_and_left_untouched(transformers, family):
    """Qwen3, OLMo 2 and Gemma 3 normalise q and k after the projections: scaling the projections
    does not move the logits (Qwen3's max logit 87.51 -> 87.50 while every head was reported
    clipped), so the clip refuses such layers by name and changes no weight."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    before = [p.detach().clone() for p in model.parameters()]
    layer = next(name for name, m in model.named_modules() if name.endswith("self_attn"))
    with pytest.raises(ValueError, match=r"model: expected attention layers without QK-Norm .*q_norm, k_norm"):
        qk_clip(model, {layer: [50.0] * 4}, 10.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_multi_head_latent_attention(transformers):
    """DeepSeek-V3's latent attention: q_nope and k_nope rows by sqrt(gamma), q_rope rows by gamma, the
    shared rotary key and the values untouched; both parts of each head's logit shrink by gamma."""
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=32, moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, n_group=1, topk_group=1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    attn = model.layers[0].self_attn
    _spread_logits(attn.q_b_proj.weight, 4)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    shared = [p.detach().clone() for p in attn.kv_a_proj_with_mqa.parameters()]
    values = attn.kv_b_proj.weight.detach().unflatten(0, (4, -1))[:, 8:].clone()
    _check_clip(model, lambda: model(input_ids=ids), attn.o_proj, 4)
    assert all(torch.equal(a, b) for a, b in zip(shared, attn.kv_a_proj_with_mqa.parameters()))
    assert torch.equal(attn.kv_b_proj.weight.detach().unflatten(0, (4, -1))[:, 8:], values)
