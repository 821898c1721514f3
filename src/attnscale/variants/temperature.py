r"""Learned temperature: a per-head learnable multiplier of the logits.

Where the scale goes: **into q**. Head h multiplies its logits by ``exp(log_scale[h])``,
initialised at ``log(1/sqrt(D))``, so training starts exactly at standard attention and each head
learns how sharp to be. Applying it to q (``q * exp(log_scale)``) and passing ``scale=1.0``
gives the same logits ``exp(log_scale) * q . k`` with any backend, fused kernels included,
since they only accept one float scale. Learning the log keeps the multiplier positive (a
negative temperature would invert the ranking of keys) and makes its updates relative.
Sources: Vaswani et al. 2017 for the ``1/sqrt(D)`` init; a learned logit temperature as in
Henry et al. 2020 (QK-Norm's ``g``) and CLIP's learned ``logit_scale`` (Radford et al. 2021),
here per head.

>>> import torch, attnscale
>>> from attnscale.variants import LearnedTemperature
>>> temp = LearnedTemperature(num_heads=4, head_dim=16)
>>> q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
>>> qs, ks = temp(q, k)
>>> out = attnscale.scaled_dot_product_attention(qs, ks, v, scale=temp.effective_scale, enable_gqa=True)
>>> expected = attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # at init
>>> torch.allclose(out, expected, atol=1e-6)
True
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._validate import FLOAT_DTYPES, fail
from ._checks import check_float_tensor, check_int, check_same_device

__all__ = ["LearnedTemperature", "temperature_qk"]


def temperature_qk(query: Tensor, key: Tensor, log_scale: Tensor) -> tuple[Tensor, Tensor]:
    """``(query * exp(log_scale)[h], key)`` for query (..., H, L, D) and log_scale (H,); use scale=1.0."""
    check_float_tensor("query", query)
    check_float_tensor("key", key)
    H = query.shape[-3]
    if not isinstance(log_scale, Tensor) or log_scale.dtype not in FLOAT_DTYPES or log_scale.shape != (H,):
        got = f"dtype {log_scale.dtype}, shape {tuple(log_scale.shape)}" if isinstance(log_scale, Tensor) else type(log_scale).__name__
        fail("log_scale", f"a float tensor of shape (H,) = ({H},)", got, "pass one log-scale per query head")
    check_same_device("log_scale", log_scale, query.device)
    factor = log_scale.exp().to(query.dtype)[:, None, None]  # (H, 1, 1)
    return query * factor, key


class LearnedTemperature(nn.Module):
    """``forward(q, k) -> (q * exp(log_scale), k)``; ``effective_scale`` is 1.0 (folded into q)."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.log_scale = nn.Parameter(torch.full((num_heads,), math.log(1.0 / math.sqrt(head_dim))))

    @property
    def effective_scale(self) -> float:
        return 1.0

    def forward(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        check_float_tensor("query", query)
        if query.shape[-3] != self.num_heads or query.shape[-1] != self.head_dim:
            fail("query", f"(..., H = num_heads = {self.num_heads}, L, D = head_dim = {self.head_dim})", f"shape {tuple(query.shape)}", "build LearnedTemperature with the query's heads and per-head dim")
        return temperature_qk(query, key, self.log_scale)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"
