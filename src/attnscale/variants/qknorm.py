r"""QK-Norm: normalise q and k per head over the head dim before the dot product.

Where the scale goes: **after** the norm, and its right value depends on the norm.

* ``kind="l2"`` (Henry et al. 2020, "Query-Key Normalization for Transformers"): q and k become
  unit vectors, so ``q . k`` is a cosine in [-1, 1]. Multiplying by ``1/sqrt(D)`` as well shrinks
  twice: every logit lies in ``[-1/sqrt(D), 1/sqrt(D)]``, the largest gap between two logits of a
  row is ``2/sqrt(D)`` (0.18 for D = 128) and softmax is nearly uniform whatever the data.
  Henry et al. multiply by a learned scalar ``g`` instead, initialised at ``g0 = log2(L^2 - L)``
  with L the training sequence length (their 97.5th-percentile length). This pairing emits a
  :class:`DoubleShrinkWarning`.
* ``kind="rms"`` (Qwen3 Technical Report 2025) and ``kind="layer"`` (Dehghani et al. 2023,
  "Scaling Vision Transformers to 22 Billion Parameters"): the normalised vectors have norm
  ``sqrt(D)`` (times a learnable per-dim gain, initialised at 1), so ``q . k`` has the usual
  spread and the usual ``1/sqrt(D)`` stays. The norm bounds the logits and stops their growth
  during training, which is what these papers use it for.

Scale modes (:class:`QKScale`): ``"inverse_sqrt"`` passes ``1/sqrt(D)``; ``"none"`` passes 1;
``"learned"`` multiplies q by a learnable scalar ``g`` and passes 1. ``g`` is initialised at
``scale_init`` if given, else at Henry et al.'s ``log2(L^2 - L)`` for ``l2`` (``seq_len=L``
required) and at ``1/sqrt(D)`` for ``rms`` and ``layer`` (training starts from the standard scale).

Use :attr:`QKNorm.effective_scale` as the ``scale`` of ``scaled_dot_product_attention``:

>>> import torch, attnscale
>>> from attnscale.variants import QKNorm
>>> norm = QKNorm(16, kind="rms")
>>> q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
>>> qn, kn = norm(q, k)
>>> out = attnscale.scaled_dot_product_attention(qn, kn, v, scale=norm.effective_scale, enable_gqa=True)
>>> norm.effective_scale
0.25
"""

from __future__ import annotations

import math
import warnings
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validate import check_choice, fail
from ..dense import accumulation_dtype
from ._checks import check_float, check_float_tensor, check_int, check_same_device

__all__ = ["DoubleShrinkWarning", "QKNorm", "QKNormKind", "QKScale", "normalize_qk"]


class QKNormKind(StrEnum):
    """How q and k are normalised over the head dim."""

    L2 = "l2"
    RMS = "rms"
    LAYER = "layer"


class QKScale(StrEnum):
    """What multiplies the normalised ``q . k``."""

    INVERSE_SQRT = "inverse_sqrt"
    NONE = "none"
    LEARNED = "learned"


class DoubleShrinkWarning(UserWarning):
    """Unit-length q and k combined with ``1/sqrt(D)``: logits confined to ``[-1/sqrt(D), 1/sqrt(D)]``."""


def normalize_qk(query: Tensor, key: Tensor, *, kind: QKNormKind | str, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Normalise query (..., H, L, D) and key (..., Hkv, S, D) over D, without gains.

    ``l2``: ``x / max(|x|, eps)``; ``rms``: ``x / sqrt(mean(x^2) + eps)``; ``layer``: zero mean,
    then rms. Computed in float32 (float64 for float64) and returned in the input dtype.
    """
    kind = check_choice("kind", kind, QKNormKind)
    eps = check_float("eps", eps)
    return _normalize(check_float_tensor("query", query), kind, eps), _normalize(check_float_tensor("key", key), kind, eps)


def _normalize(x: Tensor, kind: QKNormKind, eps: float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    acc = x.to(accumulation_dtype(x.dtype))
    if kind is QKNormKind.L2:
        y = F.normalize(acc, dim=-1, eps=eps)
    elif kind is QKNormKind.RMS:
        y = acc * torch.rsqrt(acc.pow(2).mean(dim=-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(acc, acc.shape[-1:], eps=eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


class QKNorm(nn.Module):
    """Normalise q and k per head, then apply the chosen scale mode.

    ``forward(q, k) -> (q, k)``; pass :attr:`effective_scale` as ``scale`` to attention.
    Parameters: for ``rms`` a gain (D,) for q and one for k (init 1); for ``layer`` a gain and a
    bias (D,) each, as ``nn.LayerNorm``; for ``l2`` none; plus the scalar ``logit_scale`` in
    ``"learned"`` mode. Gains are shared across heads, as in Qwen3.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        kind: QKNormKind | str = QKNormKind.RMS,
        scale: QKScale | str = QKScale.INVERSE_SQRT,
        seq_len: int | None = None,
        scale_init: float | None = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.kind = check_choice("kind", kind, QKNormKind)
        self.scale_mode = check_choice("scale", scale, QKScale)
        self.eps = check_float("eps", eps)
        if self.kind is QKNormKind.L2 and self.scale_mode is QKScale.INVERSE_SQRT:
            warnings.warn(
                DoubleShrinkWarning(
                    f"kind='l2' makes q and k unit vectors, so q.k is already in [-1, 1]; scale='inverse_sqrt' "
                    f"shrinks it again: every logit lies in [-{self.head_dim ** -0.5:.3g}, {self.head_dim ** -0.5:.3g}] "
                    f"and the largest logit gap is 2/sqrt(D) = {2 * self.head_dim ** -0.5:.3g}, so softmax stays "
                    "nearly uniform. Use scale='learned' (Henry et al. 2020) or kind='rms'."
                ),
                stacklevel=2,
            )
        D = self.head_dim
        if self.kind is QKNormKind.L2:
            self.q_weight = self.k_weight = self.q_bias = self.k_bias = None
        else:
            self.q_weight = nn.Parameter(torch.ones(D))
            self.k_weight = nn.Parameter(torch.ones(D))
            layer = self.kind is QKNormKind.LAYER
            self.q_bias = nn.Parameter(torch.zeros(D)) if layer else None
            self.k_bias = nn.Parameter(torch.zeros(D)) if layer else None
        if self.scale_mode is QKScale.LEARNED:
            self.logit_scale = nn.Parameter(torch.tensor(self._initial_scale(seq_len, scale_init)))
        else:
            if scale_init is not None:
                fail("scale_init", "None unless scale='learned'", repr(scale_init), "drop scale_init, or pass scale='learned'")
            self.logit_scale = None

    def _initial_scale(self, seq_len: int | None, scale_init: float | None) -> float:
        if scale_init is not None:
            return check_float("scale_init", scale_init)
        if self.kind is not QKNormKind.L2:
            return self.head_dim**-0.5
        if seq_len is None:
            fail("seq_len", "the training sequence length L >= 2 for Henry et al.'s init log2(L^2 - L)", "None", "pass seq_len=L or an explicit scale_init")
        L = check_int("seq_len", seq_len, minimum=2)
        return math.log2(L * L - L)

    @property
    def effective_scale(self) -> float:
        """The ``scale`` to pass to attention: ``1/sqrt(D)``, or 1 when the scale is none or learned (folded into q)."""
        return self.head_dim**-0.5 if self.scale_mode is QKScale.INVERSE_SQRT else 1.0

    def forward(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """query (..., H, L, D), key (..., Hkv, S, D) -> normalised (and, if learned, q times ``g``)."""
        for name, t in (("query", query), ("key", key)):
            check_float_tensor(name, t)
            if t.shape[-1] != self.head_dim:
                fail(name, f"last dim head_dim = {self.head_dim}", f"shape {tuple(t.shape)}", "build QKNorm with the per-head dim")
            for p in self.parameters():
                check_same_device(name, t, p.device, owner="the module's")
        q = _normalize(query, self.kind, self.eps, self.q_weight, self.q_bias)
        k = _normalize(key, self.kind, self.eps, self.k_weight, self.k_bias)
        if self.logit_scale is not None:
            q = q * self.logit_scale.to(q.dtype)
        return q, k

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, kind={self.kind.value}, scale={self.scale_mode.value}"
