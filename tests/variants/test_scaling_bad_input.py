"""Bad input to length scaling, learned temperature and QK-Norm: clear errors before any compute."""

import pytest
import torch

from attnscale.variants import LearnedTemperature, QKNorm, ScalableSoftmax, ssmax_qk, temperature_qk, visible_key_counts

_g = torch.Generator().manual_seed(0)
Q, K = torch.randn(2, 4, 5, 8, generator=_g), torch.randn(2, 2, 5, 8, generator=_g)


# --- length scaling, temperature, QK-Norm ---------------------------------------------------------------


def test_length_scaling_is_checked():
    n = torch.full((5,), 3)
    with pytest.raises(TypeError, match="^s: expected a float or a float tensor"):
        ssmax_qk(Q, K, True, n=n)
    with pytest.raises(ValueError, match=r"^n: expected visible key counts \(L,\) or broadcastable to \(\.\.\., H, L\)"):
        ssmax_qk(Q, K, 1.0, n=torch.full((3, 7, 5), 3))
    with pytest.raises(TypeError, match="^n: "):
        ssmax_qk(Q, K, 1.0, n=[3] * 5)
    with pytest.raises(ValueError, match="^n: expected the query's device"):
        ssmax_qk(Q, K, 1.0, n=n.to("meta"))
    with pytest.raises(TypeError, match="^key: "):
        ssmax_qk(Q, [1.0], 1.0, n=n)
    with pytest.raises(ValueError, match=r"^attn_mask: expected last two dims broadcastable to \(L, S\) = \(3, 3\)"):
        visible_key_counts(3, 3, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="^attn_mask: "):
        visible_key_counts(3, 3, attn_mask=torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="^device: "):
        visible_key_counts(3, 3, device="nowhere")
    with pytest.raises(TypeError, match="^learnable: "):
        ScalableSoftmax(4, 8, n_train=8, learnable=1)
    with pytest.raises(ValueError, match=r"^query: expected \(\.\.\., H = num_heads = 3, L, D = head_dim = 8\)"):
        ScalableSoftmax(3, 8, n_train=8)(Q, K)
    torch.testing.assert_close(ssmax_qk(Q, K, 2, n=n)[0], Q * 2 * torch.log(torch.tensor(3.0)), rtol=1e-6, atol=0)  # an int s is a number too


def test_temperature_and_qknorm_are_checked():
    with pytest.raises(ValueError, match="^log_scale: expected the query's device"):
        temperature_qk(Q, K, torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=r"^log_scale: expected a float tensor of shape \(H,\) = \(4,\), got dtype torch.int64"):
        temperature_qk(Q, K, torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="^key: "):
        temperature_qk(Q, [1.0], torch.zeros(4))
    with pytest.raises(ValueError, match=r"^query: expected \(\.\.\., H = num_heads = 3, L, D = head_dim = 8\)"):
        LearnedTemperature(3, 8)(Q, K)
    with pytest.raises(ValueError, match="^query: expected the module's device cpu, got device meta"):
        QKNorm(8)(Q.to("meta"), K.to("meta"))
