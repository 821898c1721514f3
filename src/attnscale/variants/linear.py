r"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): a kernel replaces softmax.

::

    out_i = phi(q_i) . sum_j phi(k_j) v_j^T  /  (phi(q_i) . sum_j phi(k_j) + eps)      (j <= i if causal)

Sums over keys are formed once (non-causal) or as chunked prefix sums (causal), so time is
O(L D Dv) and memory O(L) for a fixed chunk: no (L, S) matrix exists. Feature maps:
``"elu"`` is ``elu(x) + 1`` (the paper's), ``"relu"`` is ``max(x, 0)``.

Where the scale goes: there is no softmax to saturate, so ``1/sqrt(D)`` is **optional**
(``scale_queries=True`` multiplies q by it before the feature map), and whether it matters
depends on the feature map:

* ``relu`` is positively homogeneous, ``relu(c q) = c relu(q)`` for ``c > 0``, so the numerator
  and denominator both scale by c and the scale cancels (up to ``eps``): it does nothing.
* ``elu + 1`` is not homogeneous (``elu(c x) + 1 != c (elu(x) + 1)``): shrinking q moves every
  ``phi(q)`` towards the all-ones vector and the weights towards uniform, so the scale changes
  the output.

``eps`` keeps the denominator away from 0 (``relu`` features can all vanish).
GQA: query head h reads key/value head ``h // (H // Hkv)``.

>>> import torch
>>> from attnscale.variants import linear_attention
>>> q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 3)
>>> linear_attention(q, k, v, is_causal=True).shape
torch.Size([2, 4, 10, 3])
"""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validate import check_bool, check_choice, fail
from ..dense import accumulation_dtype
from ._checks import check_float, check_int, check_qkv

__all__ = ["FeatureMap", "kernel_attention", "linear_attention"]


class FeatureMap(StrEnum):
    """Non-negative feature maps of linear attention."""

    ELU = "elu"
    RELU = "relu"


def _features(x: Tensor, feature_map: FeatureMap) -> Tensor:
    return F.elu(x) + 1.0 if feature_map is FeatureMap.ELU else F.relu(x)


def kernel_attention(
    phi_q: Tensor, phi_k: Tensor, value: Tensor, *, is_causal: bool = False, eps: float = 1e-6, chunk_size: int = 64
) -> Tensor:
    """Attention with kernel weights ``phi_q . phi_k``, for features already computed.

    phi_q (..., H, L, F), phi_k (..., Hkv, S, F), value (..., Hkv, S, Dv), all of one dtype and
    device, batch dims broadcastable; returns (..., H, L, Dv). Causal needs L == S and runs in
    chunks of ``chunk_size`` queries: exact weights inside a chunk, running sums
    ``sum phi(k) v^T`` and ``sum phi(k)`` across chunks. With no keys (S = 0) every row is 0, as
    a fully masked row of ``scaled_dot_product_attention``; with L = 0 the output is empty.
    Shared by :func:`linear_attention` and Performer's FAVOR+.
    """
    check_qkv(phi_q, phi_k, value, names=("phi_q", "phi_k", "value"))
    is_causal = check_bool("is_causal", is_causal)
    eps = check_float("eps", eps, positive=False)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    if is_causal and phi_q.shape[-2] != phi_k.shape[-2]:
        fail("phi_k", f"length S = L = {phi_q.shape[-2]} when causal", f"S = {phi_k.shape[-2]}", "pass equal lengths, or is_causal=False")
    return _kernel_attention(phi_q, phi_k, value, is_causal=is_causal, eps=eps, chunk_size=chunk_size)


def _kernel_attention(phi_q: Tensor, phi_k: Tensor, value: Tensor, *, is_causal: bool, eps: float, chunk_size: int) -> Tensor:
    Hkv = phi_k.shape[-3]
    G = phi_q.shape[-3] // Hkv
    fq = phi_q.unflatten(-3, (Hkv, G))  # (..., Hkv, G, L, F)
    fk = phi_k.unsqueeze(-3)  # (..., Hkv, 1, S, F)
    v = value.unsqueeze(-3)  # (..., Hkv, 1, S, Dv)
    if fk.shape[-2] == 0:
        # No keys: the empty sum, zeros that keep the graph (the general path gives 0 / eps, NaN at eps = 0).
        return (fq @ fk.transpose(-1, -2) @ v).flatten(-4, -3)  # (..., H, L, Dv)
    if not is_causal:
        kv = fk.transpose(-1, -2) @ v  # (..., Hkv, 1, F, Dv)
        z = fk.sum(dim=-2).unsqueeze(-1)  # (..., Hkv, 1, F, 1)
        out = (fq @ kv) / (fq @ z + eps)  # (..., Hkv, G, L, Dv)
        return out.flatten(-4, -3)  # (..., H, L, Dv)

    kv = torch.zeros(fk.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device)  # (F, Dv), grows by broadcast
    z = torch.zeros(fk.shape[-1], 1, dtype=v.dtype, device=v.device)  # (F, 1)
    outs = []
    for a in range(0, phi_q.shape[-2], chunk_size):
        qc, kc, vc = fq[..., a : a + chunk_size, :], fk[..., a : a + chunk_size, :], v[..., a : a + chunk_size, :]
        w = (qc @ kc.transpose(-1, -2)).tril()  # (..., Hkv, G, C, C): keys j <= i inside the chunk
        num = qc @ kv + w @ vc  # (..., Hkv, G, C, Dv)
        den = qc @ z + w.sum(dim=-1, keepdim=True)  # (..., Hkv, G, C, 1)
        outs.append(num / (den + eps))
        kv = kv + kc.transpose(-1, -2) @ vc  # (..., Hkv, 1, F, Dv)
        z = z + kc.sum(dim=-2).unsqueeze(-1)  # (..., Hkv, 1, F, 1)
    return torch.cat(outs, dim=-2).flatten(-4, -3)  # (..., H, L, Dv)


def linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    feature_map: FeatureMap | str = FeatureMap.ELU,
    is_causal: bool = False,
    scale_queries: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 64,
) -> Tensor:
    """Linear attention: query (..., H, L, D), key (..., Hkv, S, D), value (..., Hkv, S, Dv) -> (..., H, L, Dv).

    ``scale_queries`` multiplies q by ``1/sqrt(D)`` before the feature map (see the module doc).
    Causal needs L == S (query i sees keys 0..i). Computed in float32 (float64 for float64).
    Inputs are checked as in ``scaled_dot_product_attention`` (one dtype and device, batch dims
    broadcastable, D >= 1, Hkv dividing H). With no keys (S = 0) every row is 0, as a fully masked
    row of softmax attention; L = 0 gives an empty output. NaN or inf inputs propagate.
    """
    check_qkv(query, key, value)
    feature_map = check_choice("feature_map", feature_map, FeatureMap)
    is_causal = check_bool("is_causal", is_causal)
    scale_queries = check_bool("scale_queries", scale_queries)
    eps = check_float("eps", eps, positive=False)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    L, S = query.shape[-2], key.shape[-2]
    if is_causal and L != S:
        fail("key", f"length S = L = {L} for causal linear attention", f"S = {S}", "pass equal lengths, or is_causal=False")

    acc = accumulation_dtype(query.dtype)
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if scale_queries:
        q = q * q.shape[-1] ** -0.5
    out = _kernel_attention(_features(q, feature_map), _features(k, feature_map), v, is_causal=is_causal, eps=eps, chunk_size=chunk_size)
    return out.to(query.dtype)
