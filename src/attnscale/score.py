"""The score path: how raw q.k products become softmax logits, in one fixed order.

::

    logits = softcap(scale * q.k) + alibi_bias + float attn_mask      (then)
    hidden = not bool attn_mask, or a -inf in the float mask, or causal, or outside the window
    p      = softmax(logits over visible keys); a row with no visible key gives p = 0

Every backend (dense, tiled, and the shards of context-parallel attention) builds its logits
through :class:`ScorePath`, so the order scale -> softcap -> bias/mask -> softmax lives here once.
Hidden keys get exactly zero probability whatever softcap does: they are removed after capping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .masks import visible

__all__ = ["ScorePath"]


@dataclass(frozen=True)
class ScorePath:
    """Validated score-path options shared by every backend.

    Attributes:
        scale: multiplies q.k first (default 1/sqrt(D), D the per-head query/key dim).
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` right after the scale.
        causal: hide key j from aligned query i' when j > i'.
        window: ``(left, right)``: keep keys with i' - left <= j <= i' + right (None = unlimited).
        q_offset: aligned key-axis position of query row 0 (0 top-left, S - L bottom-right, or a
            shard's global offset).
    """

    scale: float
    softcap: float | None = None
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    q_offset: int = 0

    def positions(
        self, q_start: int, q_len: int, k_start: int, k_len: int, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """Aligned query positions (q_len, 1) and key positions (1, k_len) of a block."""
        q_pos = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(-1) + self.q_offset
        k_pos = torch.arange(k_start, k_start + k_len, device=device).unsqueeze(0)
        return q_pos, k_pos

    def visibility(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """Bool (Lb, Sb) visibility from causal and window, or None if all visible."""
        return visible(q_pos, k_pos, causal=self.causal, window=self.window)

    def key_span(self, q_first: int, q_last: int) -> tuple[int | None, int | None]:
        """The first and last key position that causal/window leave visible to some row of
        ``q_first..q_last`` (inclusive, before alignment); None where that side is unlimited.

        Called with the rows swapped, ``key_span(q_last, q_first)``, it gives the keys visible to
        every row of the range: the left window edge of the last row, the causal and right edges
        of the first.
        """
        lo, hi = q_first + self.q_offset, q_last + self.q_offset
        first = last = None
        if self.causal:
            last = hi
        if self.window is not None:
            left, right = self.window
            if left is not None:
                first = lo - left
            if right is not None:
                last = hi + right if last is None else min(last, hi + right)
        return first, last

    def block_is_hidden(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """True when causal/window hide every key of the block (rows/cols are inclusive)."""
        first, last = self.key_span(q_first, q_last)
        return (last is not None and k_first > last) or (first is not None and k_last < first)

    def block_is_visible(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """True when causal/window hide no key of the block (rows/cols are inclusive).

        Both constraints are half-planes in (i', j), so a block is fully visible iff its corners are.
        """
        first, last = self.key_span(q_last, q_first)  # the keys every row of the block sees
        return (last is None or k_last <= last) and (first is None or k_first >= first)

    def logits(
        self,
        qk: Tensor,
        *,
        q_pos: Tensor,
        k_pos: Tensor,
        alibi_slopes: Tensor | None = None,
        additive: Tensor | None = None,
    ) -> Tensor:
        """Scale, cap and bias raw products ``qk`` (..., H, Lb, Sb); masking comes afterwards.

        Without autograd (inference, and inside the tiled kernel's own forward and backward)
        ``qk`` is overwritten in place: the score tile is the largest tensor of a step, and each
        out-of-place op would allocate and sweep another one.
        """
        inplace = not torch.is_grad_enabled()
        if self.softcap is not None:  # softcap * tanh(scale * qk / softcap): the scale rides in one pass
            factor = self.scale / self.softcap  # 1 when the caller folded scale / softcap into q
            if factor != 1.0:
                qk = qk.mul_(factor) if inplace else qk * factor
            s = qk.tanh_().mul_(self.softcap) if inplace else torch.tanh(qk) * self.softcap
        elif self.scale != 1.0:
            s = qk.mul_(self.scale) if inplace else qk * self.scale
        else:
            s = qk if inplace else qk * 1.0
        if alibi_slopes is not None:
            distance = (q_pos - k_pos).abs().to(s.dtype)  # (Lb, Sb)
            bias = alibi_slopes.to(s.dtype)[..., None, None] * distance
            s = s.sub_(bias) if inplace and bias.shape == s.shape[-bias.ndim :] else s - bias
        if additive is not None:
            s = s.add_(additive) if inplace and torch.broadcast_shapes(s.shape, additive.shape) == s.shape else s + additive
        return s
