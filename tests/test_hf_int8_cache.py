"""attnscale.Int8Cache: a transformers cache whose keys and values stay int8, decoded from by the
compiled kernel through attn_implementation="attnscale"; greedy decoding on a tiny random Llama
against the float cache, the cache's bookkeeping, and what it refuses."""

import pytest
import torch

import attnscale
from attnscale import kernels

transformers = pytest.importorskip("transformers")
from attnscale.integrations.hf_cache import Int8Layer, record_of  # noqa: E402

H, HKV, D, PROMPT, NEW = 8, 2, 64, 12, 30


def _llama(initializer_range: float):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=H * D, intermediate_size=2 * H * D, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=HKV,
        max_position_embeddings=256, initializer_range=initializer_range,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="attnscale").eval()


def _generate(model, cache=None):
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache=cache, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, PROMPT:], torch.stack(out.logits)[:, 0]


def test_greedy_decoding_from_the_int8_cache_gives_the_float_caches_tokens():
    """transformers' default init (std 0.02): the same 30 tokens, every step from the int8 record."""
    model = _llama(0.02)
    tokens, _ = _generate(model)
    cache = attnscale.Int8Cache()
    int8_tokens, _ = _generate(model, cache)
    assert torch.equal(tokens, int8_tokens)
    assert cache.get_seq_length() == PROMPT + NEW - 1  # the last token is never fed back
    if kernels.available():
        assert attnscale.last_backend() == "fused"


def test_where_the_int8_cache_decodes_another_token_the_float_logits_were_within_its_error():
    """A larger init (std 0.2) makes the logits' top two close at some step: where the int8
    cache's token first differs, the float cache's margin between its top two logits is at most
    twice the largest logit difference the int8 cache made at that step (on the same prefix), so
    the flip is the quantization's measured error and not a wrong prefix."""
    model = _llama(0.2)
    tokens, logits = _generate(model)
    int8_tokens, int8_logits = _generate(model, attnscale.Int8Cache())
    differ = (tokens != int8_tokens).nonzero()
    if len(differ) == 0:
        return  # (no flip: nothing to explain)
    t = int(differ[0])
    top2 = logits[t].topk(2).values
    assert float(top2[0] - top2[1]) <= 2 * float((int8_logits[t] - logits[t]).abs().max())
    assert torch.equal(tokens[:t], int8_tokens[:t])


def test_a_layer_grows_in_place_and_returns_the_codes_of_its_record():
    layer = Int8Layer()
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 20, 64, generator=gen), torch.randn(1, 2, 20, 32, generator=gen)
    layer.update(k, v)  # capacity 20
    layer.update(torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 32, generator=gen))  # doubled: 40
    grown = layer._buffers[0]
    for step in range(11):  # within it: written in place
        codes, vcodes = layer.update(torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 32, generator=gen))
    assert layer.get_seq_length() == 32 and layer._buffers[0] is grown and grown.shape[2] == 40
    record = record_of(codes)
    assert record is layer.record and record.k.shape == (1, 2, 32, 64) and vcodes is record.v
    assert torch.equal(record.k_mean, k.mean(dim=-2, keepdim=True))  # the first keys' mean, kept for later ones
    k_back, _ = record.dequantize()
    assert float((k_back[:, :, :20] - k).abs().max()) <= float(record.k_scale.max()) / 2 * 1.001
    layer.crop(-5)
    assert layer.get_seq_length() == 27 and record_of(layer.keys).length == 27


def test_beam_search_reorders_the_int8_cache():
    model = _llama(0.02)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False)
        got = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, cache=attnscale.Int8Cache())
    assert torch.equal(want, got)


def test_what_the_int8_cache_refuses_is_named():
    with pytest.raises(ValueError, match="group"):
        attnscale.Int8Cache(group=0)
    layer = Int8Layer()
    layer.update(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64))
    with pytest.raises(ValueError, match="key_states"):
        layer.update(torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64))  # another batch
    with pytest.raises(ValueError, match="k"):
        layer.update(torch.full((1, 2, 1, 64), float("nan")), torch.randn(1, 2, 1, 64))
    model = _llama(0.02)
    model.train()
    model.config.attention_dropout = 0.1
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=attnscale.Int8Cache(), use_cache=True)
