"""``scaled_dot_product_attention``: the torch entry point. Validates, then picks a backend."""

from __future__ import annotations

import logging
import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from ._validate import AttentionCall, Backend, check_attention_call, fail
from .dense import accumulation_dtype, dense_attention
from .masks import CausalAlignment, add_bias, alibi_bias
from .stats import AttentionStats
from .tiled import tiled_attention

__all__ = ["Backend", "last_backend", "scaled_dot_product_attention"]

log = logging.getLogger("attnscale")
_state = threading.local()


def last_backend() -> str | None:
    """Name of the backend that computed this thread's most recent attention call ("torch", "math", "tiled").

    Also logged at DEBUG level on the ``attnscale`` logger for every call.
    """
    return getattr(_state, "backend", None)


def _record(backend: Backend, why: str) -> None:
    _state.backend = backend.value
    log.debug("attnscale attention ran backend=%s (%s)", backend.value, why)


def _torch_cannot(call: AttentionCall) -> str | None:
    """Why torch's SDPA cannot compute this call at all (None if it can, maybe via an explicit mask)."""
    if call.path.softcap is not None:
        return "softcap"
    if call.return_stats:
        return "return_stats"
    return None


def _fused_cannot(call: AttentionCall) -> str | None:
    """Why torch's fused kernel would not compute exactly this call (None if it would)."""
    reason = _torch_cannot(call)
    if reason:
        return reason
    if call.alibi:
        return "alibi_slopes"
    if call.sinks:
        return "sinks"
    if call.path.window is not None:
        return "window"
    if call.path.causal and call.path.q_offset != 0:
        return "bottom_right causal alignment with L != S"
    if call.D != call.Dv:
        return "value head dim differs from query head dim"
    if call.dropout_p > 0.0:
        return "dropout (torch's fused CPU kernel has none)"
    if call.L == 0 or call.S == 0:
        return "empty length"
    return None


MATH_MAX_SCORES = 2**26
"""``backend="auto"`` avoids the math backend above this many scores ``prod(batch) * H * L * S``:
it holds several (..., H, L, S) tensors (256 MiB each in float32 at this size)."""


def _tiled_feature(call: AttentionCall) -> str | None:
    """A score-path feature that torch's fused kernel lacks and the tiled kernel has (None if none)."""
    path = call.path
    if path.softcap is not None:
        return "softcap"
    if call.return_stats:
        return "return_stats"
    if call.alibi:
        return "alibi_slopes"
    if call.sinks:
        return "sinks"
    if path.window is not None:
        return "window"
    if path.causal and path.q_offset != 0:
        return "bottom_right causal alignment with L != S"
    return None


def _choose(call: AttentionCall, *, slopes_need_grad: bool = False) -> tuple[Backend, str]:
    if call.backend is Backend.AUTO:
        reason = _fused_cannot(call)
        if reason is None:
            return Backend.TORCH, "auto: torch's fused kernel computes these semantics"
        if call.dropout_p > 0.0:
            return Backend.MATH, f"auto: {reason}; dropout (the tiled kernel has none)"
        if slopes_need_grad:
            return Backend.MATH, f"auto: {reason}; alibi_slopes require grad (tiled treats them as constants)"
        feature = _tiled_feature(call)
        if feature is not None:
            return Backend.TILED, f"auto: {feature}"
        scores = math.prod(call.batch) * call.H * call.L * call.S
        if scores > MATH_MAX_SCORES:
            return Backend.TILED, f"auto: {reason}; {scores} scores > MATH_MAX_SCORES"
        return Backend.MATH, f"auto: {reason}"
    if call.backend is Backend.TILED and call.dropout_p > 0.0:
        fail(
            "dropout_p",
            "0.0 with backend='tiled' (the tiled kernel has no dropout)",
            repr(call.dropout_p),
            "use backend='math' (or 'auto') for dropout",
        )
    if call.backend is Backend.TORCH:
        reason = _torch_cannot(call)
        if reason is not None:
            fail(
                "backend",
                f"a backend that implements {reason}",
                "'torch'",
                "use backend='auto' or backend='math'; torch's SDPA has no such option",
            )
    return call.backend, "requested"


def _torch_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    call: AttentionCall,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """torch's SDPA on (B, H, L, D) views; positional masks and ALiBi become an explicit mask.

    Sinks become one more key with zero key and value vectors, whose logit the mask sets to the
    head's sink: it joins every row's denominator and adds nothing to the output.
    """
    batch, H, L, S, path = call.batch, call.H, call.L, call.S, call.path
    B = math.prod(batch)  # explicit, not -1: reshape cannot infer a dim of an empty tensor
    q = query.expand(*batch, H, L, call.D).reshape(B, H, L, call.D)  # (B, H, L, D)
    k = key.expand(*batch, call.Hkv, S, call.D).reshape(B, call.Hkv, S, call.D)  # (B, Hkv, S, D)
    v = value.expand(*batch, call.Hkv, S, call.Dv).reshape(B, call.Hkv, S, call.Dv)  # (B, Hkv, S, Dv)

    native_causal = (
        path.causal and path.q_offset == 0 and path.window is None and attn_mask is None and alibi_slopes is None and sinks is None
    )
    mask = attn_mask
    if not native_causal and (path.causal or path.window is not None or alibi_slopes is not None):
        q_pos, k_pos = path.positions(0, L, 0, S, query.device)
        keep = path.visibility(q_pos, k_pos)  # (L, S) or None
        if alibi_slopes is not None:
            bias = alibi_bias(alibi_slopes.to(accumulation_dtype(query.dtype)), L, S, alignment=call.alignment)  # (..., H, L, S)
            mask = add_bias(mask, bias)
        if keep is not None:
            if mask is None:
                mask = keep
            elif mask.dtype == torch.bool:
                mask = mask & keep
            else:
                mask = mask.masked_fill(~keep, float("-inf"))
    if mask is not None:
        mask = mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))  # 0-d and (S,) masks
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            # torch wants the query's dtype; when that is narrower, clamp first so that a finite
            # value stays finite (-1e9 would become -inf in float16 and hide keys the other backends keep).
            finfo = torch.finfo(query.dtype)
            if finfo.max < torch.finfo(mask.dtype).max:
                mask = mask.clamp(finfo.min, finfo.max).masked_fill(mask == float("-inf"), float("-inf"))
            mask = mask.to(query.dtype)
    if sinks is not None:
        mask = _with_sink_column(mask, sinks, (*batch, H, L, S), query.dtype)  # (..., H, L, S + 1)
        k = torch.cat([k, k.new_zeros(B, call.Hkv, 1, call.D)], dim=-2)  # (B, Hkv, S + 1, D)
        v = torch.cat([v, v.new_zeros(B, call.Hkv, 1, call.Dv)], dim=-2)  # (B, Hkv, S + 1, Dv)
    if mask is not None:
        mask = mask.reshape((1,) * (len(batch) + 3 - mask.ndim) + tuple(mask.shape))
        mh, ml, ms = mask.shape[-3:]
        if all(n == 1 for n in mask.shape[:-3]):
            mask = mask.reshape(1, mh, ml, ms)  # (1, H or 1, L or 1, S or 1)
        else:
            mask = mask.expand(*batch, mh, ml, ms).reshape(B, mh, ml, ms)  # (B, H or 1, L or 1, S or 1)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=call.dropout_p,
        is_causal=native_causal,
        scale=path.scale,
        enable_gqa=call.H != call.Hkv,
    )
    return out.reshape(*batch, H, L, call.Dv)


def _with_sink_column(mask: Tensor | None, sinks: Tensor, target: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A float mask over S + 1 keys: ``mask`` as logits to add (-inf hides) and the sink's logit last."""
    *batch, H, L, S = target
    if mask is None:
        mask = torch.zeros((), dtype=dtype, device=sinks.device)
    elif mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    mask = mask.reshape((1,) * (len(target) - mask.ndim) + tuple(mask.shape))
    rows = torch.broadcast_shapes(mask.shape[:-1], (1,) * len(batch) + (H, 1))
    keys = mask.expand(*rows, S)
    sink = sinks.to(dtype).view(H, 1, 1).expand(*rows, 1)
    return torch.cat([keys, sink], dim=-1)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
    backend: Backend | str = Backend.AUTO,
) -> Tensor | tuple[Tensor, AttentionStats]:
    r"""Scaled dot-product attention, a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Computes ``softmax(Q K^T * scale + bias) V`` per head, where ``scale`` defaults to ``1/sqrt(D)``
    with ``D = query.size(-1)``, the **per-head** query/key dimension (the d_k of Vaswani et al.),
    never the model width.

    Shapes (one legend across attnscale)::

        query (..., H,   L, D)     B.. batch dims (any number, broadcast between q, k, v)
        key   (..., Hkv, S, D)     H query heads, Hkv key/value heads, G = H // Hkv
        value (..., Hkv, S, Dv)    L query length, S key length
        out   (..., H,   L, Dv)    D query/key head dim, Dv value head dim (may differ from D)

    Order of the score path (the same in every backend)::

        logits = softcap(scale * q.k) + alibi + float attn_mask ; hide masked / causal / windowed keys ; softmax

    Args:
        attn_mask: bool (**True = attend**) or float (added to the logits; ``-inf`` hides a key),
            broadcastable to (..., H, L, S). May be combined with ``is_causal``: both apply
            (PyTorch raises an error for that combination).
        dropout_p: dropout on the attention weights, reproducible under ``torch.manual_seed``.
        is_causal: hide keys after each query's aligned position; see ``causal_alignment``.
        scale: finite positive multiplier of q.k; ``None`` means ``1/sqrt(D)``.
        enable_gqa: allow H != Hkv; query head h reads key/value head ``h // G``.
        causal_alignment: where the diagonal sits when L != S, drawn for L = 2, S = 5::

            "top_left" (PyTorch)      "bottom_right" (FlashAttention)
                x . . . .                 x x x x .
                x x . . .                 x x x x x

        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2), after the
            scale and before bias and masks; hidden keys still get exactly zero weight.
        alibi_slopes: (H,) or (B, H); adds ``-slope * |i' - j|`` after scale and softcap (never
            scaled), ``i'`` the aligned query position. See ``attnscale.alibi_slopes``.
        window: ``(left, right)``; key j is visible to aligned query i' iff
            ``i' - left <= j <= i' + right``. ``None`` or ``-1`` on a side means unlimited.
        sinks: (H,), one logit per query head (gpt-oss's attention sinks) that joins every row's
            softmax denominator and has no value: ``p_ij = exp(s_ij) / (sum_j' exp(s_ij') +
            exp(sink_h))`` with ``s`` the finished logits (the sink is not scaled, capped or
            biased), so a row's key weights sum to one minus the sink's share. Differentiable;
            ``-inf`` means no sink for that head. A row with no visible key gives zeros.
        return_stats: also return :class:`AttentionStats` (per-row lse, max logit, max
            probability, entropy in nats; with sinks also the sink's share, see
            :mod:`attnscale.stats`) as ``(out, stats)``.
        backend: ``"auto"`` picks, in this order: torch's fused kernel whenever it computes exactly
            these semantics; ``"math"`` for dropout (or ALiBi slopes that require grad);
            ``"tiled"`` when the call uses a feature torch lacks (softcap, return_stats, ALiBi,
            sinks, window, bottom-right causal alignment with L != S) or has more than
            ``MATH_MAX_SCORES = 2**26`` scores ``prod(batch) * H * L * S``; ``"math"`` otherwise.
            ``"torch"`` forces ``torch.nn.functional.scaled_dot_product_attention`` (ALiBi, windows
            and bottom-right alignment become an explicit mask, sinks one more key with a zero
            value; softcap and return_stats raise);
            ``"math"`` forces attnscale's dense implementation, O(L * S) memory; ``"tiled"`` forces
            the online-softmax kernel of :mod:`attnscale.tiled`, O(L + S) memory, no dropout,
            statistics other than lse carry no gradient. :func:`last_backend` says which one ran.

    Softmax and accumulation run in float32 (float64 for float64 inputs) whatever the input dtype,
    so fp16 products above 65504 stay finite; the output has the input dtype. A row with no visible
    key returns zeros, with zero gradients, never NaN.

    Equivalent to (no dropout, no GQA, for brevity):

    >>> import torch, attnscale
    >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 3)
    >>> mask = torch.rand(5, 7) > 0.3
    >>> logits = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    >>> logits = logits.masked_fill(~mask, float("-inf"))
    >>> weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # empty rows -> 0
    >>> out = attnscale.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    >>> torch.allclose(out, weights @ v, atol=1e-6)
    True
    """
    call = check_attention_call(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_alignment=causal_alignment,
        backend=backend,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        window=window,
        return_stats=return_stats,
        sinks=sinks,
    )
    slopes_need_grad = alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled()
    chosen, why = _choose(call, slopes_need_grad=slopes_need_grad)
    if chosen is Backend.TORCH:
        out = _torch_attention(query, key, value, call, attn_mask, alibi_slopes, sinks)
        stats = None
    elif chosen is Backend.TILED:
        out, stats = tiled_attention(
            query,
            key,
            value,
            path=call.path,
            attn_mask=attn_mask,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            return_stats=call.return_stats,
        )
    else:
        out, stats = dense_attention(
            query,
            key,
            value,
            path=call.path,
            attn_mask=attn_mask,
            alibi_slopes=alibi_slopes,
            dropout_p=call.dropout_p,
            sinks=sinks,
            return_stats=call.return_stats,
        )
    _record(chosen, why)
    if call.return_stats:
        assert stats is not None
        return out, stats
    return out
