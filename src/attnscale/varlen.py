"""Packed variable-length sequences: :func:`varlen_attention`, FlashAttention's varlen layout.

B sequences of different lengths are packed end to end along one token axis, with no padding;
``cu_seqlens`` (cumulative sequence lengths, B + 1 entries starting at 0) says where each one
starts. Sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows
``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``, and attends only to its own keys::

    cu_seqlens_q = [0, 2, 2, 5]                   cu_seqlens_k = [0, 3, 4, 6]
    q rows  | a0 a1 | (empty) | c0 c1 c2 |        k rows  | a0 a1 a2 | b0 | c0 c1 |

Every sequence means what :func:`attnscale.scaled_dot_product_attention` computes on its views of
the packed tensors, so every score-path feature means exactly what it means there. On CPU the
compiled kernel runs all of them in one call, parallel over heads and every sequence's query blocks;
on CUDA FlexAttention does, with a document mask; otherwise (another backend asked for, no kernel,
or inputs whose logits could overflow float32) each sequence is one ``scaled_dot_product_attention``
call on views (no copy).
"""

from __future__ import annotations

import math
from dataclasses import fields
from numbers import Integral

import torch
from torch import Tensor

from ._tracing import refuse_jit_trace, tracing
from ._validate import (
    FLOAT_DTYPES,
    Backend,
    check_alibi_values,
    check_bool,
    check_choice,
    check_finite,
    check_positive_finite,
    check_sinks,
    check_window,
    fail,
)
from . import flex
from .dense import accumulation_dtype
from .backends import flex_refusal
from .functional import record_backend, scaled_dot_product_attention
from .guard import abs_max, may_overflow
from .kernels.fused import fused_varlen_attention
from .kernels.fused import supports as fused_supports
from .masks import CausalAlignment
from .score import ScorePath
from .stats import AttentionStats

__all__ = ["varlen_attention"]

_Span = tuple[int, int]


def _shape(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}"


def _check_packed(q: object, k: object, v: object) -> tuple[int, int, int, int]:
    """Checks q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); returns H, Hkv, D, Dv."""
    legend = {"q": "(total_q, H, D)", "k": "(total_k, Hkv, D)", "v": "(total_k, Hkv, Dv)"}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            fail(name, "a torch.Tensor", type(t).__name__, f"convert with torch.as_tensor({name})", exc=TypeError)
        if t.dtype not in FLOAT_DTYPES:
            fail(name, "a floating dtype (float16, bfloat16, float32 or float64)", f"dtype {t.dtype}", f"cast it, e.g. {name}.float()", exc=TypeError)
        if t.ndim != 3:
            fail(name, f"3 dims {legend[name]}, sequences packed along dim 0", _shape(t), f"pack (B, L, heads, dim) as {name}.flatten(0, 1) and drop the padding rows")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(name, f"q's dtype {q.dtype}", f"dtype {t.dtype}", f"cast it: {name}.to(q.dtype)", exc=TypeError)
        if t.device != q.device:
            fail(name, f"q's device {q.device}", f"device {t.device}", f"move it: {name}.to(q.device)")
    _, H, D = q.shape
    total_k, Hkv, Dk = k.shape
    if D == 0:
        fail("q", "head_dim D >= 1 (dim 2)", _shape(q), "D = 0 has no dot product; check the head split")
    if Dk != D:
        fail("k", f"head dim D = {D} (dim 2) like q's", _shape(k), "q and k must share the head dim D")
    if Hkv == 0:
        fail("k", "at least one head (dim 1)", _shape(k), "give k and v Hkv >= 1 heads; check the head split")
    if v.shape[0] != total_k:
        fail("v", f"total_k = {total_k} rows (dim 0) like k's", _shape(v), "k and v must hold the same packed key positions")
    if v.shape[1] != Hkv:
        fail("v", f"{Hkv} heads (dim 1) like k's", _shape(v), "k and v must have the same number of heads")
    if H % Hkv != 0:
        fail("k", f"a number of heads (dim 1) that divides q's H = {H}", f"{Hkv} heads", "use Hkv in the divisors of H (Hkv = H for multi-head, 1 for multi-query)")
    return H, Hkv, D, v.shape[2]


_CU_FIX = "build it as torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32) from the per-sequence lengths"


def _check_cu_static(name: str, cu: object, device: torch.device) -> Tensor:
    """What can be checked of cumulative lengths without their values: type, dtype, shape, device."""
    if not isinstance(cu, Tensor):
        fail(name, "a 1-d int32 or int64 torch.Tensor", type(cu).__name__, _CU_FIX, exc=TypeError)
    if cu.dtype not in (torch.int32, torch.int64):
        fail(name, "dtype int32 or int64", f"dtype {cu.dtype}", f"cast it: {name}.to(torch.int32)", exc=TypeError)
    if cu.ndim != 1 or cu.numel() == 0:
        fail(name, "a 1-d tensor of B + 1 cumulative lengths", _shape(cu), _CU_FIX)
    if cu.device != device:
        fail(name, f"q's device {device}", f"device {cu.device}", f"move it: {name}.to(q.device)")
    return cu


def _check_cu_seqlens(name: str, cu: object, packed: str, total: int, device: torch.device) -> list[int]:
    """Checks cumulative lengths ``[0, ..., total]`` of the rows of ``packed``; returns them as ints."""
    fix = _CU_FIX
    values = _check_cu_static(name, cu, device).tolist()
    if values[0] != 0:
        fail(name, "a first entry of 0", f"{values[0]} (in {values})", fix)
    drops = [b for b in range(len(values) - 1) if values[b + 1] < values[b]]
    if drops:
        b = drops[0]
        fail(name, "non-decreasing entries (sequence lengths >= 0)", f"{values[b]} then {values[b + 1]} at index {b}", fix)
    if values[-1] != total:
        fail(name, f"a last entry equal to total_{packed} = {packed}.shape[0] = {total}", f"{values[-1]}", f"give lengths that sum to {packed}'s {total} packed rows")
    return values


def _check_max_seqlen_type(name: str, hint: object) -> None:
    if hint is not None and (isinstance(hint, bool) or not isinstance(hint, Integral)):
        fail(name, "None or an int", repr(hint), "pass the longest length as an int, or None to leave it out", exc=TypeError)


def _check_max_seqlen(name: str, hint: object, longest: int, cu_name: str) -> None:
    _check_max_seqlen_type(name, hint)
    if hint is None:
        return
    if hint < longest:
        fail(name, f"at least the longest sequence in {cu_name}, {longest}", repr(int(hint)), f"pass {name}={longest} or None")


def _check_options(
    H: int, B: int, device: torch.device, is_causal: object, scale: object, softcap: object, window: object,
    return_stats: object, backend: object, alibi_slopes: object,
) -> tuple[bool, float | None, float | None, tuple[int | None, int | None] | None, bool, Backend]:
    """The options every path checks the same way (static: no tensor values read)."""
    checked = (
        check_bool("is_causal", is_causal),
        check_finite("scale", scale),
        check_positive_finite("softcap", softcap),
        check_window(window),
        check_bool("return_stats", return_stats),
        check_choice("backend", backend, Backend),
    )
    if alibi_slopes is not None:
        _check_alibi_slopes(alibi_slopes, H, B, device)
    return checked


def _check_alibi_slopes(slopes: object, H: int, B: int, device: torch.device) -> None:
    shapes = f"(H,) = ({H},) or (B, H) = ({B}, {H})"
    if not isinstance(slopes, Tensor) or slopes.dtype not in FLOAT_DTYPES:
        fail("alibi_slopes", f"a float tensor of shape {shapes}", repr(slopes)[:60], "use attnscale.alibi_slopes(H)", exc=TypeError)
    # size by size, not tuple against tuple: under dynamic shapes the sizes are symbolic
    if not ((slopes.ndim == 1 and slopes.shape[0] == H) or (slopes.ndim == 2 and slopes.shape[0] == B and slopes.shape[1] == H)):
        fail("alibi_slopes", f"shape {shapes}", _shape(slopes), "use attnscale.alibi_slopes(H), or stack one row per sequence")
    if slopes.device != device:
        fail("alibi_slopes", f"q's device {device}", f"device {slopes.device}", "move it: alibi_slopes.to(q.device)")


def _spans(cu_q: list[int], cu_k: list[int]) -> list[tuple[_Span, _Span]]:
    return [((cu_q[b], cu_q[b + 1]), (cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def _slice_stats(stats: AttentionStats, q0: int, q1: int) -> AttentionStats:
    """Rows q0:q1 of packed (H, total_q) statistics, in the per-sequence (1, H, L_b) layout."""
    return AttentionStats(**{f.name: None if getattr(stats, f.name) is None else getattr(stats, f.name)[None, :, q0:q1] for f in fields(AttentionStats)})


def _cat_stats(parts: list[AttentionStats]) -> AttentionStats:
    """Per-sequence statistics (1, H, L_b) joined along the rows: (H, total_q)."""
    joined = {}
    for f in fields(AttentionStats):
        tensors = [getattr(s, f.name) for s in parts]
        joined[f.name] = None if tensors[0] is None else torch.cat([t[0] for t in tensors], dim=-1)
    return AttentionStats(**joined)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
    backend: Backend | str = Backend.AUTO,
) -> Tensor | tuple[Tensor, AttentionStats]:
    r"""Attention over B packed sequences of different lengths (``flash_attn_varlen_func``'s layout).

    Shapes (B sequences; sequence b has ``L_b`` queries and ``S_b`` keys)::

        q            (total_q, H,   D)    total_q = sum_b L_b, sequences end to end along dim 0
        k            (total_k, Hkv, D)    total_k = sum_b S_b; H a multiple of Hkv (G = H // Hkv)
        v            (total_k, Hkv, Dv)
        cu_seqlens_q (B + 1,) int32/int64 [0, L_0, L_0 + L_1, ..., total_q]
        cu_seqlens_k (B + 1,) int32/int64 [0, S_0, S_0 + S_1, ..., total_k]
        out          (total_q, H,   Dv)   row t belongs to the same sequence as q's row t

    Sequence b computes ``scaled_dot_product_attention`` of its own queries
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` against its own keys and values, with the same
    options: nothing crosses a sequence boundary. Lengths may be 0: a sequence with no queries
    contributes no rows, and a query row with no visible key (no keys at all, or all hidden by
    ``is_causal`` or ``window``) gives zeros, with zero gradients.

    Causal alignment is per sequence and bottom-right (FlashAttention's): query i of a sequence
    with L queries and S keys sees keys ``j <= i + S - L``. Drawn for L = 2, S = 5::

            keys 0 1 2 3 4
        q0       x x x x .
        q1       x x x x x

    With L > S the first L - S rows of that sequence see no key and return zeros.

    Args:
        max_seqlen_q: optional hint (FlashAttention sizes its grid with it); when given, at least
            the longest query length, else a ValueError.
        max_seqlen_k: the same for the longest key length.
        scale: multiplier of q.k; ``None`` means ``1/sqrt(D)``, D the per-head dim.
        is_causal: hide keys after each query's bottom-right-aligned position (drawn above).
        softcap: logits become ``softcap * tanh(logits / softcap)``, after the scale.
        alibi_slopes: (H,), or (B, H) for one row of slopes per sequence; adds
            ``-slope * |i + S - L - j|`` after scale and softcap, at positions within the sequence.
        window: ``(left, right)``: key j is visible to query i iff
            ``i + S - L - left <= j <= i + S - L + right``; ``None`` or ``-1`` means unlimited.
        sinks: (H,), one logit per query head added to each row's softmax denominator (not
            multiplied by the scale): ``p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sink_h))``.
        return_stats: also return :class:`~attnscale.AttentionStats` as ``(out, stats)``. Its
            tensors are **(H, total_q)**: the ``(..., H, L)`` layout of every ``AttentionStats``,
            with the packed query rows as L, in the order of ``out``'s rows (``stats.lse[h, t]``
            belongs to ``out[t, h]``), so :func:`~attnscale.summarize` and the other reductions
            apply unchanged. This is also FlashAttention's ``softmax_lse`` layout.
        backend: ``"auto"`` and ``"fused"`` run every sequence in one call of the compiled CPU
            kernel where it runs (CPU tensors, kernel built; ``"auto"`` also needs finite inputs
            whose logits cannot overflow float32, else it takes the per-sequence path, which
            handles those); ``"flex"``, and ``"auto"`` on CUDA tensors where FlexAttention can run
            the call, run them in one FlexAttention call with a document mask (the same
            condition on the inputs, else one flex call per sequence); any other backend runs as
            in :func:`~attnscale.scaled_dot_product_attention`, one call per sequence.

    Memory: the packed tensors are never padded or copied (each sequence runs on views of them)
    and GQA never repeats K/V, so memory is O(total tokens) plus one sequence's working set
    (O(L_b + S_b) on the tiled kernel; ``"auto"`` takes the O(L_b S_b) math backend only below
    ``MATH_MAX_SCORES`` scores).
    The inputs are checked before any compute; bad input raises ValueError or TypeError.

    Equivalent to a loop over the sequences:

    >>> import torch, attnscale
    >>> q, k, v = torch.randn(9, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 3)
    >>> cu_q, cu_k = torch.tensor([0, 2, 2, 9]), torch.tensor([0, 5, 6, 11])
    >>> out = attnscale.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    >>> rows = []
    >>> for b in range(3):
    ...     qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]  # (1, H, L_b, D)
    ...     kb = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None]  # (1, Hkv, S_b, D)
    ...     vb = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None]  # (1, Hkv, S_b, Dv)
    ...     ob = attnscale.scaled_dot_product_attention(
    ...         qb, kb, vb, is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
    ...     rows.append(ob[0].transpose(0, 1))  # (L_b, H, Dv)
    >>> torch.allclose(out, torch.cat(rows), atol=1e-6)
    True
    """
    refuse_jit_trace("varlen_attention")
    H, Hkv, D, Dv = _check_packed(q, k, v)
    if tracing(q, k, v):
        return _traced(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, H, scale, is_causal, softcap, alibi_slopes, window, sinks, return_stats, backend)
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "q", q.shape[0], q.device)
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "k", k.shape[0], q.device)
    if len(cu_q) != len(cu_k):
        fail(
            "cu_seqlens_k",
            f"B + 1 = {len(cu_q)} entries like cu_seqlens_q (one per sequence, plus the 0)",
            f"{len(cu_k)} entries",
            "give every sequence a query and a key length (0 is allowed)",
        )
    spans = _spans(cu_q, cu_k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, max((b - a for (a, b), _ in spans), default=0), "cu_seqlens_q")
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, max((b - a for _, (a, b) in spans), default=0), "cu_seqlens_k")
    is_causal, scale, softcap, window, return_stats, backend = _check_options(
        H, len(spans), q.device, is_causal, scale, softcap, window, return_stats, backend, alibi_slopes
    )
    if alibi_slopes is not None:
        check_alibi_values(alibi_slopes, q.dtype)  # the same rule as scaled_dot_product_attention's
    check_sinks(sinks, H, q.device, dtype=q.dtype)
    if _takes_flex(backend, q, k, v, sinks, alibi_slopes):
        if q.shape[0] and k.shape[0] and q.shape[-1] and len(_clean_spans(q, k, v, spans, scale, softcap, alibi_slopes)) == len(spans):
            path = ScorePath(scale=q.shape[-1] ** -0.5 if scale is None else scale, softcap=softcap, causal=is_causal, window=window)
            cu_q_t, cu_k_t = (torch.tensor(cu, dtype=torch.int64, device=q.device) for cu in (cu_q, cu_k))
            out, stats = flex.flex_varlen_attention(q, k, v, cu_q_t, cu_k_t, path=path, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=return_stats)
            record_backend(Backend.FLEX, f"varlen: {len(spans)} sequences in one FlexAttention call")
            return (out, stats) if return_stats else out
        # otherwise one call per sequence below, whose checks handle non-finite and overflowing inputs
    clean = _packed_kernel_spans(backend, q, k, v, spans, scale, softcap, alibi_slopes)
    if clean:
        path = ScorePath(scale=q.shape[-1] ** -0.5 if scale is None else scale, softcap=softcap, causal=is_causal, window=window)
        slopes = alibi_slopes[clean] if alibi_slopes is not None and alibi_slopes.ndim == 2 else alibi_slopes
        table = torch.tensor([[q0, q1, k0, k1] for (q0, q1), (k0, k1) in (spans[b] for b in clean)], dtype=torch.int64).reshape(len(clean), 4)
        out_k, stats_k = fused_varlen_attention(q, k, v, table, path=path, alibi_slopes=slopes, sinks=sinks, return_stats=return_stats)
        record_backend(Backend.FUSED, f"varlen: {len(clean)} of {len(spans)} sequences in one call")
        if len(clean) == len(spans):
            return (out_k, stats_k) if return_stats else out_k
    else:
        out_k = stats_k = None
    # No sequence at all: one empty call still returns outputs of the right dtype and layout.
    spans = spans or [((0, 0), (0, 0))]

    outs, parts = [], []
    done = set(clean)
    for b, ((q0, q1), (k0, k1)) in enumerate(spans):
        if b in done:  # the compiled kernel's rows for this sequence
            outs.append(out_k[q0:q1])
            if stats_k is not None:
                parts.append(_slice_stats(stats_k, q0, q1))
            continue
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.ndim == 2 else alibi_slopes
        result = scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1).unsqueeze(0),  # (1, H, L_b, D), a view
            k[k0:k1].transpose(0, 1).unsqueeze(0),  # (1, Hkv, S_b, D)
            v[k0:k1].transpose(0, 1).unsqueeze(0),  # (1, Hkv, S_b, Dv)
            is_causal=is_causal,
            scale=scale,
            enable_gqa=True if H != Hkv else False,  # noqa: SIM210 - a bool under dynamic shapes too
            causal_alignment=CausalAlignment.BOTTOM_RIGHT,
            softcap=softcap,
            alibi_slopes=slopes,
            window=window,
            sinks=sinks,
            return_stats=return_stats,
            backend=backend,
        )
        out_b, stats_b = result if return_stats else (result, None)
        outs.append(out_b[0].transpose(0, 1))  # (L_b, H, Dv)
        if stats_b is not None:
            parts.append(stats_b)
    out = torch.cat(outs)  # (total_q, H, Dv)
    if return_stats:
        return out, _cat_stats(parts)
    return out


def _traced(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    H: int,
    scale: object,
    is_causal: object,
    softcap: object,
    alibi_slopes: Tensor | None,
    window: object,
    sinks: Tensor | None,
    return_stats: object,
    backend: object,
) -> Tensor | tuple[Tensor, AttentionStats]:
    """:func:`varlen_attention` while tracing (see :mod:`attnscale._tracing`): the static checks,
    then every sequence in one call of the compiled kernel's op, with the spans built from the
    cumulative lengths as tensors. Their values (a first 0, non-decreasing, the packed totals),
    whether ``max_seqlen_*`` covers the longest sequence (only their type is checked) and the NaN
    rule go unchecked; the op itself refuses spans outside the packed tensors."""
    cu_q = _check_cu_static("cu_seqlens_q", cu_seqlens_q, q.device)
    cu_k = _check_cu_static("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_q.shape != cu_k.shape:
        fail("cu_seqlens_k", f"B + 1 = {cu_q.shape[0]} entries like cu_seqlens_q", f"{cu_k.shape[0]} entries", "give every sequence a query and a key length (0 is allowed)")
    _check_max_seqlen_type("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen_type("max_seqlen_k", max_seqlen_k)
    is_causal, scale, softcap, window, return_stats, backend = _check_options(
        H, cu_q.shape[0] - 1, q.device, is_causal, scale, softcap, window, return_stats, backend, alibi_slopes
    )
    check_sinks(sinks, H, q.device, values=False)
    why = fused_supports(q, None)
    if backend not in (Backend.AUTO, Backend.FUSED) or why is not None:
        fail(
            "backend",
            "the compiled kernel while tracing (torch.compile, torch.export, FakeTensor, torch.func)",
            f"{backend.value!r}" + (f" ({why})" if why is not None else ""),
            "use backend='auto' on CPU with the kernel built, or call varlen_attention outside the traced region",
        )
    table = torch.stack([cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]], dim=1).to(torch.int64)  # (B, 4)
    path = ScorePath(scale=q.shape[-1] ** -0.5 if scale is None else scale, softcap=softcap, causal=is_causal, window=window)
    out, stats = fused_varlen_attention(q, k, v, table, path=path, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=return_stats)
    return (out, stats) if return_stats else out


def _takes_flex(backend: Backend, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether the call runs on FlexAttention: ``backend="flex"`` (refused with the reason where
    it cannot run), or ``"auto"`` on CUDA tensors where it can."""
    if backend not in (Backend.FLEX, Backend.AUTO) or (backend is Backend.AUTO and q.device.type != "cuda"):
        return False
    views = tuple(t.transpose(0, 1) for t in (q, k, v))  # (H or Hkv, total, D or Dv): heads, then rows, as flex reads them
    why_not = flex.cannot(device=q.device, dropout_p=0.0, attn_mask=None, alibi_slopes=alibi_slopes, sinks=sinks, tensors=views)
    if why_not is not None and backend is Backend.FLEX:
        flex_refusal(why_not).raise_()
    return why_not is None


def _finite_abs_max(x: Tensor) -> float:
    """max |x| over x's finite entries (0 if none)."""
    x = x.detach().abs()
    x = torch.where(torch.isfinite(x), x, 0.0)
    return float(x.max()) if x.numel() else 0.0


def _bad_rows(x: Tensor) -> list[int]:
    """Running count of rows (dim 0) holding a non-finite entry: entry t counts rows < t."""
    bad = ~torch.isfinite(x.detach()).flatten(1).all(1) if x.numel() else torch.zeros(x.shape[0], dtype=torch.bool)
    return [0, *torch.cumsum(bad.to(torch.int64), 0).tolist()]


def _packed_kernel_spans(
    backend: Backend,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: list[tuple[_Span, _Span]],
    scale: float | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
) -> list[int]:
    """The sequences the compiled kernel runs in one call: all of them for ``backend="fused"``;
    for ``"auto"`` on a CPU kernel those whose q, k and v rows are all finite, when neither the raw
    products (|q.k| <= D max|q| max|k| over finite entries) nor the logits (that times the scale, or
    the softcap, plus the largest ALiBi bias) may overflow the accumulation dtype. The others (and every sequence for other
    backends) take one scaled_dot_product_attention call each, whose checks handle non-finite
    inputs and overflowing products; a sequence's result never depends on the path its neighbours take."""
    if backend is Backend.FUSED:
        return list(range(len(spans)))  # the kernel call itself says why, where it cannot run
    if backend is not Backend.AUTO or not spans or fused_supports(q, None) is not None:
        return []
    return _clean_spans(q, k, v, spans, scale, softcap, alibi_slopes)


def _clean_spans(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: list[tuple[_Span, _Span]],
    scale: float | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
) -> list[int]:
    """The sequences a packed call may run without the per-sequence checks: those whose q, k and
    v rows are all finite, when neither the raw products nor the logits may overflow (see
    :func:`_packed_kernel_spans`), and none while ALiBi slopes require grad."""
    if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
        return []  # learned slopes: the per-sequence path sends them to a backend that differentiates them
    D = q.shape[-1]
    peaks = [abs_max(t) for t in (q, k, v)]  # one pass each; NaN or inf: some entry is not finite
    finite = all(math.isfinite(p) for p in peaks)
    q_max, k_max = peaks[:2] if finite else (_finite_abs_max(q), _finite_abs_max(k))
    raw = D * q_max * k_max  # |q.k| before the scale, as the kernel's products accumulate it
    bound = (D**-0.5 if scale is None else scale) * raw if softcap is None else softcap
    if alibi_slopes is not None:
        longest = max(max(q1 - q0, k1 - k0) for (q0, q1), (k0, k1) in spans)
        bound += _finite_abs_max(alibi_slopes) * longest
    if may_overflow(max(raw, bound), accumulation_dtype(q.dtype)):
        return []
    if finite:
        return list(range(len(spans)))
    bad_q, bad_k, bad_v = _bad_rows(q), _bad_rows(k), _bad_rows(v)
    return [
        b
        for b, ((q0, q1), (k0, k1)) in enumerate(spans)
        if bad_q[q1] == bad_q[q0] and bad_k[k1] == bad_k[k0] and bad_v[k1] == bad_v[k0]
    ]
