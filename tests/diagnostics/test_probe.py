import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnscale
from attnscale.diagnostics import diagnose_scale, fit_logit_scale, probe_attention, probe_module

D, H = 64, 4


def _softmax_attention(divisor):
    return lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / divisor, dim=-1) @ v


@pytest.mark.parametrize(
    ("fn", "expected_scale", "diagnosis"),
    [
        (attnscale.scaled_dot_product_attention, 1 / math.sqrt(D), "1/sqrt(head_dim)"),
        (F.scaled_dot_product_attention, 1 / math.sqrt(D), "1/sqrt(head_dim)"),
        (_softmax_attention(1.0), 1.0, "no scale"),
        (_softmax_attention(math.sqrt(D * H)), 1 / math.sqrt(D * H), "1/sqrt(d_model) (uses the model width)"),
        (_softmax_attention(D), 1 / D, "1/head_dim (scale applied twice, or muP)"),
        (_softmax_attention(3.7), 1 / 3.7, "learned or unusual scale"),
    ],
)
def test_probe_recovers_the_scale_and_names_it(fn, expected_scale, diagnosis):
    fit = probe_attention(fn, head_dim=D, num_heads=H)
    assert fit.mean_scale == pytest.approx(expected_scale, rel=1e-5)
    assert fit.min_r2 > 0.999999
    assert diagnose_scale(fit.mean_scale, D, H) == diagnosis


def test_fit_is_per_head_and_handles_masks_and_gqa():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 16, generator=gen, dtype=torch.float64)
    scales = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    logits = (q * scales[:, None, None]) @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    logits = logits.masked_fill(~attnscale.causal_mask(6, 9, alignment="bottom_right"), float("-inf"))
    fit = fit_logit_scale(q, k, torch.softmax(logits, dim=-1))
    assert fit.scale == pytest.approx(scales.tolist(), rel=1e-9)


def test_a_position_bias_lowers_r2():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 8, 16, generator=gen), torch.randn(1, 1, 8, 16, generator=gen)
    bias = attnscale.alibi_bias(torch.tensor([1.0]), 8, 8)
    weights = torch.softmax(q @ k.transpose(-1, -2) / 4 + bias, dim=-1)
    assert fit_logit_scale(q, k, weights).min_r2 < 0.9


def test_bad_inputs_name_the_argument():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="weights"):
        fit_logit_scale(q, q, torch.rand(1, 2, 3, 5))
    with pytest.raises(ValueError, match="fn"):
        probe_attention(lambda q, k, v: (q, k))


def test_llama_style_projection_names_are_found_and_a_miss_names_what_was_tried():
    """q_proj/k_proj/v_proj/o_proj (Llama-family layers) are probed without --projections; where no
    name set fits, the error lists the sets it tried (it said "none of q_proj/k_proj/v_proj" of a
    module that has them, beside o_proj)."""
    torch.manual_seed(0)

    class LlamaStyle(nn.Module):
        def __init__(self, E=32, H=4):
            super().__init__()
            self.num_heads, self.head_dim = H, E // H
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E, bias=False) for _ in range(4))

        def forward(self, x):
            B, L, E = x.shape
            q, k, v = (p(x).view(B, L, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(B, L, E))

    found = probe_module(LlamaStyle())
    assert found.diagnosis == "1/sqrt(head_dim)"

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    with pytest.raises(ValueError, match=r"got a module with none of the name sets q_proj/k_proj/v_proj/out_proj; q_proj/k_proj/v_proj/o_proj; query/key/value"):
        probe_module(Odd())
