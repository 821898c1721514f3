r"""INT8 attention, SageAttention-style (Zhang et al. 2024, "SageAttention: Accurate 8-Bit Attention
for Plug-and-play Inference Acceleration"): INT8 ``q . k``, float32 softmax and ``P V``.

Where the scale goes: **folded into q before quantisation**. ``q * scale`` is quantised, so the
per-block quantisation scale of q absorbs ``1/sqrt(D)`` and the dequantised integer product
already is the logit; no extra multiply over the (L, S) matrix. For a power-of-two scale
(``D = 64``: 1/8; ``D = 256``: 1/16) the folding is exact: the INT8 values are identical and only
the block scale changes, by exactly that power of two. Otherwise rounding may move a value by
one step, an error of the same size as quantisation itself.

Steps, per (batch, head)::

    k  <- k - mean_j(k_j)                  optional smoothing: shifts every logit of row i by
                                           q_i . mean(k), a constant per row: softmax is unchanged
    q8, sq <- int8(q * scale)  per block of ``block_q`` query rows   x ~ s * round(x / s),
    k8, sk <- int8(k)          per block of ``block_k`` key rows     s = max|block| / 127
    logits = (q8 @ k8^T in int32) * sq_i * sk_j                      exact integer accumulation
    p = softmax(logits) in float32 (attnscale's masked softmax), out = p @ v in float32

Why smooth: keys often share a large per-channel mean (an outlier channel); it inflates each
block's ``max|k|`` and so the step of every other value, while carrying no information softmax
can use. Subtracting it is free in exact arithmetic and shrinks the INT8 error.

``|q8 . k8| <= 127^2 D`` fits int32 for D <= 133,152; the integer product is exact. A GPU kernel
would run an INT8 GEMM with int32 accumulators (``torch._int_mm``); here int8 values are widened
to int32 and multiplied with torch's integer matmul, which gives the same integers.
Gradients: rounding has none, so backward uses the straight-through estimator: the logits are
``float_logits + (int8_logits - float_logits).detach()``, whose gradient is float32 attention's.

>>> import torch, attnscale
>>> from attnscale.variants import int8_attention
>>> g = torch.Generator().manual_seed(0)
>>> q, k, v = (torch.randn(1, h, 70, 64, generator=g) for h in (4, 2, 2))
>>> out = int8_attention(q, k, v, is_causal=True)
>>> exact = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
>>> bool((out - exact).abs().max() < 0.05)
True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validate import check_bool, check_choice, check_positive_finite, fail
from ..dense import accumulation_dtype, masked_softmax
from ..masks import CausalAlignment, causal_mask
from ._checks import check_float_tensor, check_int, check_qkv, check_same_device

__all__ = ["INT8_MAX", "dequantize_int8", "int8_attention", "int8_logits", "quantize_int8", "smooth_keys"]

INT8_MAX = 127
_MAX_HEAD_DIM = (2**31 - 1) // INT8_MAX**2  # largest D whose int8 dot products fit int32


def quantize_int8(x: Tensor, *, block_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric INT8 per block of ``block_size`` rows: x (..., N, D) -> (int8 (..., N, D), scales (..., ceil(N / block_size))).

    Each block uses ``s = max|x_block| / 127`` (1 for an all-zero block) and ``round(x / s)``,
    so ``x ~ values * s`` with error at most ``s / 2`` per entry. INT8 has no NaN or inf, and one
    such entry would set its whole block's scale: non-finite x is refused.
    """
    check_float_tensor("x", x, min_ndim=2)
    bs = check_int("block_size", block_size, minimum=1)
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        fail("x", "finite values (INT8 has no NaN or inf)", f"{bad} non-finite entries", "find where they come from, or replace them: torch.nan_to_num(x)")
    return _quantize(x, bs)


def _quantize(x: Tensor, bs: int) -> tuple[Tensor, Tensor]:
    N = x.shape[-2]
    nb = math.ceil(N / bs)
    padded = F.pad(x, (0, 0, 0, nb * bs - N))  # (..., nb * bs, D), zero rows do not change a max
    blocks = padded.unflatten(-2, (nb, bs))  # (..., nb, bs, D)
    amax = blocks.abs().amax(dim=(-2, -1))  # (..., nb)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    values = torch.round(blocks / scales[..., None, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values.flatten(-3, -2)[..., :N, :], scales


def dequantize_int8(values: Tensor, scales: Tensor, *, block_size: int) -> Tensor:
    """Inverse of :func:`quantize_int8` up to rounding: int8 (..., N, D) and scales (..., ceil(N / block_size)) -> (..., N, D) float32."""
    if not isinstance(values, Tensor) or values.dtype != torch.int8 or values.ndim < 2:
        got = f"dtype {values.dtype}, shape {tuple(values.shape)}" if isinstance(values, Tensor) else type(values).__name__
        fail("values", "an int8 tensor (..., N, D)", got, "pass the values returned by quantize_int8", exc=TypeError)
    bs = check_int("block_size", block_size, minimum=1)
    check_float_tensor("scales", scales, min_ndim=1)
    want = (*values.shape[:-2], math.ceil(values.shape[-2] / bs))
    if scales.shape != want:
        fail("scales", f"shape {want}: one scale per block of {bs} rows", f"shape {tuple(scales.shape)}", "pass the scales quantize_int8 returned, with the same block_size")
    check_same_device("scales", scales, values.device, owner="the values'")
    return values.float() * _row_scales(scales, bs, values.shape[-2])[..., None]


def _row_scales(scales: Tensor, block_size: int, N: int) -> Tensor:
    return scales.repeat_interleave(block_size, dim=-1)[..., :N]  # (..., N)


def smooth_keys(key: Tensor) -> Tensor:
    """``key - mean over keys`` per channel, key (..., Hkv, S, D): leaves softmax(q . k) unchanged."""
    return key - check_float_tensor("key", key).mean(dim=-2, keepdim=True)


def int8_logits(
    query: Tensor,
    key: Tensor,
    *,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 64,
    smooth_k: bool = True,
) -> Tensor:
    """Dequantised INT8 logits ``scale * q . k`` (..., H, L, S), float32 (float64 for float64 inputs).

    With ``smooth_k`` each row is shifted by the constant ``scale * q_i . mean(k)``: the logits
    differ, their softmax does not. Straight-through gradients (see the module doc). Inputs are
    checked as in ``scaled_dot_product_attention``. INT8 has no NaN or inf: a query row (key row)
    holding one gets NaN logits in its whole row (column), so NaN reaches every output that the
    float logits' NaN or inf would reach, and the other rows are quantised without it (smoothing
    uses the mean of the finite keys).
    """
    shapes = check_qkv(query, key)
    H, Hkv, D = shapes.H, shapes.Hkv, shapes.D
    if D > _MAX_HEAD_DIM:
        fail("query", f"head dim D <= {_MAX_HEAD_DIM} (so 127^2 D fits int32)", f"D = {D}", "split the head dim")
    scale = check_positive_finite("scale", scale)
    scale = D**-0.5 if scale is None else scale
    block_q, block_k = check_int("block_q", block_q, minimum=1), check_int("block_k", block_k, minimum=1)
    smooth_k = check_bool("smooth_k", smooth_k)

    acc = accumulation_dtype(query.dtype)
    q = query.to(acc) * scale  # the softmax scale rides in q's quantisation scale
    k = key.to(acc)
    bad_q = ~torch.isfinite(q).all(dim=-1, keepdim=True)  # (..., H, L, 1): rows INT8 cannot hold
    bad_k = ~torch.isfinite(k).all(dim=-1, keepdim=True)  # (..., Hkv, S, 1)
    q, k = q.masked_fill(bad_q, 0.0), k.masked_fill(bad_k, 0.0)
    if smooth_k:
        finite = (~bad_k).sum(dim=-2, keepdim=True).clamp_min(1)  # (..., Hkv, 1, 1)
        k = (k - k.sum(dim=-2, keepdim=True) / finite).masked_fill(bad_k, 0.0)  # any per-channel shift leaves softmax unchanged
    q8, sq = _quantize(q.detach(), block_q)  # (..., H, L, D) int8, (..., H, nbq)
    k8, sk = _quantize(k.detach(), block_k)  # (..., Hkv, S, D) int8, (..., Hkv, nbk)
    qi = q8.to(torch.int32).unflatten(-3, (Hkv, H // Hkv))  # (..., Hkv, G, L, D)
    ki = k8.to(torch.int32).unsqueeze(-3)  # (..., Hkv, 1, S, D)
    qk = (qi @ ki.transpose(-1, -2)).flatten(-4, -3)  # (..., H, L, S) int32, exact
    row = _row_scales(sq, block_q, q.shape[-2]).to(acc)  # (..., H, L)
    col = _row_scales(sk, block_k, k.shape[-2]).to(acc).repeat_interleave(H // Hkv, dim=-2)  # (..., H, S)
    quantised = qk.to(acc) * row[..., :, None] * col[..., None, :]  # (..., H, L, S)
    bad_col = bad_k.squeeze(-1).repeat_interleave(H // Hkv, dim=-2)[..., None, :]  # (..., H, 1, S)
    quantised = quantised.masked_fill(bad_q | bad_col, float("nan"))
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return quantised
    exact = (q.unflatten(-3, (Hkv, H // Hkv)) @ k.unsqueeze(-3).transpose(-1, -2)).flatten(-4, -3)  # (..., H, L, S)
    return exact + (quantised - exact).detach()


def int8_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    causal_alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 64,
    smooth_k: bool = True,
) -> Tensor:
    """INT8 ``q . k``, float32 softmax and ``P V``: query (..., H, L, D), key (..., Hkv, S, D),
    value (..., Hkv, S, Dv) -> (..., H, L, Dv) in the query's dtype.

    ``scale`` defaults to ``1/sqrt(D)``; causal masking as in ``scaled_dot_product_attention``
    (a row with no visible key returns zeros: all of them when S = 0; L = 0 gives an empty
    output). Inputs are checked as in ``scaled_dot_product_attention``. NaN or inf in q or k
    gives NaN in every output row that sees it, NaN in v as in float attention (see
    :func:`int8_logits`).
    """
    shapes = check_qkv(query, key, value)
    H, Hkv = shapes.H, shapes.Hkv
    is_causal = check_bool("is_causal", is_causal)
    alignment = check_choice("causal_alignment", causal_alignment, CausalAlignment)
    logits = int8_logits(query, key, scale=scale, block_q=block_q, block_k=block_k, smooth_k=smooth_k)
    L, S = logits.shape[-2], logits.shape[-1]
    keep = causal_mask(L, S, alignment=alignment, device=query.device) if is_causal else None  # (L, S)
    p, _ = masked_softmax(logits, keep, with_stats=False)  # (..., H, L, S)
    v = value.to(p.dtype).unsqueeze(-3)  # (..., Hkv, 1, S, Dv)
    out = (p.unflatten(-3, (Hkv, H // Hkv)) @ v).flatten(-4, -3)  # (..., H, L, Dv)
    return out.to(query.dtype)
