"""Masks and positional biases: causal (both alignments), sliding windows, padding, ALiBi.

Every mask here is boolean with **True = attend** (the polarity of PyTorch's ``attn_mask``).

Positions. Query row ``i`` of an ``(L, S)`` score matrix sits at the *aligned* position
``i' = i + q_offset`` on the key axis, where ``q_offset`` is ``0`` for top-left alignment and
``S - L`` for bottom-right alignment (see :class:`CausalAlignment`). Causal masks, windows and
ALiBi distances are all functions of ``(i', j)``, so the same code serves a whole matrix, one
block of it (the tiled kernel), or a shard of a longer sequence (context parallelism).
"""

from __future__ import annotations

import math
from enum import StrEnum

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # torch.nn.attention.bias imports torch's compiler (a second at import): only where a bias was made
    from torch.nn.attention.bias import CausalBias

__all__ = [
    "CausalAlignment",
    "add_bias",
    "alibi_bias",
    "alibi_slopes",
    "causal_mask",
    "from_causal_bias",
    "padding_mask",
    "query_offset",
    "sliding_window_mask",
    "visible",
]


class CausalAlignment(StrEnum):
    """Where the causal diagonal sits when the query length L differs from the key length S.

    Drawn for L = 2, S = 5 (``x`` = attend, ``.`` = masked)::

        TOP_LEFT (PyTorch is_causal)      BOTTOM_RIGHT (FlashAttention, KV-cache decoding)
            keys 0 1 2 3 4                    keys 0 1 2 3 4
        q0       x . . . .                q0       x x x x .
        q1       x x . . .                q1       x x x x x

    TOP_LEFT: query i sees keys 0..i. BOTTOM_RIGHT: query i sees keys 0..i + S - L, so the last
    query sees every key, as when L new tokens are appended to S - L cached ones.
    With L > S, BOTTOM_RIGHT leaves the first L - S rows with no visible key: they return zeros.
    """

    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"


def from_causal_bias(bias: CausalBias, is_causal: object, alignment: object, query: object, key: object) -> tuple[None, bool, CausalAlignment]:
    """torch's ``attn_mask=torch.nn.attention.bias.causal_upper_left(L, S)`` (or
    ``causal_lower_right``) as what it means: no mask, ``is_causal=True`` and the variant's
    alignment (UPPER_LEFT: TOP_LEFT, LOWER_RIGHT: BOTTOM_RIGHT), exactly. Refused with
    ``is_causal=True`` (as torch refuses it), with another ``causal_alignment`` than the variant's,
    and with lengths other than the call's."""
    from torch.nn.attention.bias import CausalVariant

    from ._validate import fail

    variant = CausalAlignment.BOTTOM_RIGHT if bias.variant == CausalVariant.LOWER_RIGHT else CausalAlignment.TOP_LEFT
    if is_causal is True:
        fail("attn_mask", "a CausalBias without is_causal=True (CausalBias should not be used with causal=True)", "both", "drop is_causal=True: the bias is causal already")
    if alignment is not CausalAlignment.TOP_LEFT and alignment != variant.value:
        fail("causal_alignment", f"{variant.value!r}, the alignment of the CausalBias given", repr(alignment), "drop causal_alignment: the bias sets it")
    if isinstance(query, Tensor) and isinstance(key, Tensor) and query.ndim >= 2 and key.ndim >= 2:
        lengths = (query.shape[-2], key.shape[-2])
        if (bias.seq_len_q, bias.seq_len_kv) != lengths:
            fail("attn_mask", f"a CausalBias of the call's lengths (L, S) = {lengths}", f"one of {(bias.seq_len_q, bias.seq_len_kv)}", f"make it causal_upper_left{lengths} or causal_lower_right{lengths}")
    return None, True, variant


def query_offset(L: int, S: int, alignment: CausalAlignment | str) -> int:
    """Aligned key-axis position of query row 0: ``0`` (top-left) or ``S - L`` (bottom-right)."""
    return S - L if CausalAlignment(alignment) is CausalAlignment.BOTTOM_RIGHT else 0


def visible(
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
) -> Tensor | None:
    """Positional visibility of keys ``k_pos`` to aligned query positions ``q_pos``.

    ``q_pos`` has shape (L, 1) and ``k_pos`` (1, S); the result is a bool (L, S) tensor, or
    ``None`` when nothing is hidden. Key j is visible to query i' iff ``j <= i'`` (causal) and
    ``i' - left <= j <= i' + right`` (window; ``None`` means unlimited on that side).
    """
    conditions = []
    if causal:
        conditions.append(k_pos <= q_pos)
    if window is not None:
        left, right = window
        if left is not None:
            conditions.append(k_pos >= q_pos - left)
        if right is not None:
            conditions.append(k_pos <= q_pos + right)
    if not conditions:
        return None
    out = conditions[0]
    for cond in conditions[1:]:
        out = out & cond
    return out


def _positions(L: int, S: int, q_offset: int, device: torch.device | str | None) -> tuple[Tensor, Tensor]:
    q_pos = torch.arange(L, device=device).unsqueeze(-1) + q_offset  # (L, 1)
    k_pos = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
    return q_pos, k_pos


def causal_mask(
    L: int,
    S: int,
    *,
    alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
    device: torch.device | str | None = None,
) -> Tensor:
    """Bool (L, S) causal mask, True = attend, aligned as :class:`CausalAlignment` draws it.

    >>> causal_mask(2, 5, alignment="bottom_right").int()
    tensor([[1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1]], dtype=torch.int32)
    """
    q_pos, k_pos = _positions(L, S, query_offset(L, S, alignment), device)
    return k_pos <= q_pos


def sliding_window_mask(
    L: int,
    S: int,
    window: tuple[int | None, int | None],
    *,
    alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
    device: torch.device | str | None = None,
) -> Tensor:
    """Bool (L, S) mask of keys within ``(left, right)`` positions of each aligned query.

    ``None`` or ``-1`` on a side means unlimited, as in ``scaled_dot_product_attention``.

    >>> sliding_window_mask(3, 3, (1, 0)).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """
    left, right = (None if side == -1 else side for side in window)
    q_pos, k_pos = _positions(L, S, query_offset(L, S, alignment), device)
    mask = visible(q_pos, k_pos, window=(left, right))
    return torch.ones(L, S, dtype=torch.bool, device=device) if mask is None else mask


def padding_mask(lengths: Tensor, S: int) -> Tensor:
    """Key padding mask (B, 1, 1, S) from per-sequence valid lengths (B,): True = real token."""
    return (torch.arange(S, device=lengths.device) < lengths.unsqueeze(-1))[:, None, None, :]


def alibi_slopes(num_heads: int) -> Tensor:
    """Press et al. (2021) ALiBi slopes, float32 of shape (num_heads,).

    For a power of two n the slopes are ``2 ** (-8 * h / n)``, h = 1..n. Otherwise the slopes of
    the closest smaller power of two are followed by every other slope of the next power of two,
    as in the authors' reference code.

    >>> alibi_slopes(4)
    tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads: expected a positive int, got {num_heads!r}. Fix: pass the number of query heads.")
    if num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}. Fix: pass the number of query heads.")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if num_heads & (num_heads - 1) == 0:
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def slopes_learned(slopes: Tensor | None) -> bool:
    """Whether ALiBi ``slopes`` are learned in this call: they require grad and grad mode is on.
    Only the math backend differentiates them; the kernels take slopes as constants (the one rule
    every backend asks)."""
    return slopes is not None and slopes.requires_grad and torch.is_grad_enabled()


def alibi_bias(
    slopes: Tensor,
    L: int,
    S: int,
    *,
    alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
) -> Tensor:
    """Additive ALiBi bias ``-slope * |i' - j|`` of shape (..., H, L, S) for slopes (..., H).

    Under a causal mask only ``j <= i'`` survives, where this is the usual ``-slope * (i' - j)``.
    attnscale adds it *after* the 1/sqrt(D) scale: the slopes are logit units, never scaled.
    """
    q_pos, k_pos = _positions(L, S, query_offset(L, S, alignment), slopes.device)
    distance = (q_pos - k_pos).abs().to(slopes.dtype)  # (L, S)
    return -slopes[..., None, None] * distance


def add_bias(mask: Tensor | None, bias: Tensor) -> Tensor:
    """One float mask from an attention mask (None, bool True = attend, or float) and a bias.

    Hidden keys of a bool mask become -inf; a float mask is added to the bias.
    """
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask
