"""attnscale as transformers' attention on tiny random models: attention sinks (gpt-oss), packed
sequences (Llama, gpt-oss), and the keywords the registered attention function implements, accepts
as bookkeeping, or refuses."""

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnscale[hf]')")

from attnscale.diagnostics import hf  # noqa: E402

# Max |diff| of the logits (values up to ~0.7) against eager attention, measured: 1.8e-7.
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def gpt_oss():
    """A tiny random gpt-oss: a sliding-window layer (W = 8) and a full one, sinks drawn N(0, 2)."""
    hf.register()
    config = transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    for layer in model.model.layers:
        layer.self_attn.sinks.data.normal_(0.0, 2.0)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))  # longer than the window
    padding = torch.ones(2, 20, dtype=torch.long)
    padding[1, :5] = 0  # left padding, as generate() expects
    return model, ids, padding


def logits(model, implementation, ids, mask):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_matches_eager_with_its_sinks(gpt_oss, padded):
    model, ids, padding = gpt_oss
    mask = padding if padded else None
    want = logits(model, "eager", ids, mask)
    got = logits(model, hf.NAME, ids, mask)
    rows = padding.bool() if padded else slice(None)
    assert (got - want)[rows].abs().max().item() < LOGITS_ATOL
    # The sinks matter at this size: without them the logits move far beyond the tolerance.
    saved = [layer.self_attn.sinks.data.clone() for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(float("-inf"))
        assert (logits(model, hf.NAME, ids, mask) - want)[rows].abs().max().item() > 100 * LOGITS_ATOL
    finally:
        for layer, s in zip(model.model.layers, saved):
            layer.self_attn.sinks.data.copy_(s)


def test_gpt_oss_greedy_generation_is_identical(gpt_oss):
    model, ids, padding = gpt_oss
    tokens = {}
    for implementation in ("eager", hf.NAME):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(ids, attention_mask=padding, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens["eager"], tokens[hf.NAME])


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


DOCUMENTS = [[int(t) for t in torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 1, 17, 12)]


@pytest.mark.parametrize("arch", ["llama", "gpt-oss"])
def test_packed_documents_attend_only_to_themselves(arch, gpt_oss):
    """DataCollatorWithFlattening's cu_seq_lens reach varlen attention: the packed row's logits and
    gradients are those of each document run alone through eager attention."""
    model = tiny_llama() if arch == "llama" else gpt_oss[0]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in DOCUMENTS])
    batch.pop("labels")
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 6, 23, 35]
    weight = torch.randn(35, 128, generator=torch.Generator().manual_seed(2))
    results = {}
    for implementation in ("eager", hf.NAME):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        if implementation == "eager":
            out = torch.cat([model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in DOCUMENTS])
        else:
            out = model(**batch, use_cache=False).logits[0]
        (out * weight).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results[implementation] = out.detach(), grads
    (want, want_grads), (got, got_grads) = results["eager"], results[hf.NAME]
    assert (got - want).abs().max().item() < LOGITS_ATOL
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_packed_keywords_are_checked():
    cu = torch.tensor([0, 4, 12])
    with pytest.raises(ValueError, match="cu_seq_lens_q: expected cu_seq_lens_q and cu_seq_lens_k together"):
        call(cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="dropout: expected 0.0 for packed sequences"):
        call(cu_seq_lens_q=cu, cu_seq_lens_k=cu, dropout=0.1)
    q, k, v, out = call(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    for a, b in ((0, 4), (4, 12)):  # each document alone, causal
        n = b - a
        logits = q[..., a:b, :] @ k[..., a:b, :].repeat_interleave(2, dim=1).mT / 8**0.5
        weights = torch.softmax(logits.masked_fill(~causal[:n, :n], float("-inf")), -1)
        want = (weights @ v[..., a:b, :].repeat_interleave(2, dim=1)).transpose(1, 2)
        torch.testing.assert_close(out[:, a:b], want, rtol=0, atol=1e-6)


class _Layer(nn.Module):
    is_causal = True


def call(**kwargs):
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    out, weights = hf.attnscale_attention_forward(_Layer(), q, k, v, None, **kwargs)
    return q, k, v, out


def test_sliding_window_without_a_mask_keeps_the_last_w_keys():
    q, k, v, out = call(sliding_window=4)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    keep = (j <= i) & (j > i - 4)  # transformers: i - W < j <= i
    logits = (q @ k.repeat_interleave(2, dim=1).mT / 8**0.5).masked_fill(~keep, float("-inf"))
    want = (torch.softmax(logits, -1) @ v.repeat_interleave(2, dim=1)).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


def test_bookkeeping_keywords_are_accepted():
    call(position_ids=torch.arange(12)[None], cache_position=torch.arange(12), use_cache=True, output_attentions=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"output_attentions": True}, "output_attentions: expected False"),
        ({"head_mask": torch.ones(4)}, r"head_mask: expected only keywords .* head_mask=a tensor of shape \(4,\) from _Layer"),
        ({"s_aux": torch.zeros(4), "sinks": torch.zeros(4)}, "s_aux: expected attention sinks given once"),
        ({"s_aux": [0.0] * 4}, "s_aux: expected a tensor"),
        ({"s_aux": torch.zeros(3)}, r"sinks: expected shape \(H,\) = \(4,\)"),
    ],
)
def test_keywords_that_would_change_the_result_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(**kwargs)


def test_sliding_window_in_a_non_causal_call_without_a_mask_is_refused():
    with pytest.raises(ValueError, match="sliding_window: expected a mask that carries the window"):
        call(sliding_window=4, is_causal=False)
