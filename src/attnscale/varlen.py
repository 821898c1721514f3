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
on CUDA FlexAttention does, with a document mask; otherwise (another backend asked for, no kernel)
each sequence is one ``scaled_dot_product_attention`` call on views (no copy), and so is each
sequence the guard does not let the one call vouch for (non-finite inputs, logits that overflow).

A packed call takes the pipeline of every call: validation (``_validate.check_packed_call``),
``backends.choose`` over ``PACKED`` (its implementations below), in eager mode the guard's rules
for packed rows (``guard.trusted_spans``, ``guard.wrong_spans``), and the compiled kernel's memory
of its answers (:mod:`attnscale._remembered`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _remembered as memory
from . import backends, flex, guard
from ._tracing import refuse_jit_trace, tracing
from ._validate import Backend, check_packed_call
from .backends import FUSED, Call, Implementation, Refusal, Result, Spans, Step, Walk, flex_refusal
from .functional import record_backend, scaled_dot_product_attention
from .kernels.fused import fused_varlen_attention
from .kernels.fused import supports as fused_supports
from .masks import CausalAlignment
from .stats import AttentionStats, join_rows, rows_of

__all__ = ["varlen_attention"]


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
            kernel where it runs (CPU tensors, kernel built; under ``"auto"`` a sequence with a
            non-finite input row, where gradients are wanted, or one whose rows the kernel does
            not vouch for, such as logits that overflow float32, takes the per-sequence path,
            which handles those); ``"flex"``, and ``"auto"`` on CUDA tensors where FlexAttention can run
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
    # A remembered answer (attnscale._remembered), else static checks -> choose (backends.choose over PACKED) -> run; in
    # eager mode the guard says which sequences one packed call may run and vouches for its rows, the others run one by one.
    if memory.packed_call is not None and memory.may_take(0.0, backend):
        hit = memory.packed_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, softcap, alibi_slopes, window, sinks, return_stats)
        if hit is not None:
            return memory.answer(hit, None, record_backend)
    refuse_jit_trace("varlen_attention")
    traced = tracing(q, k, v)
    spec, rows, table = check_packed_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, traced=traced, scale=scale, is_causal=is_causal, softcap=softcap,
        alibi_slopes=alibi_slopes, window=window, sinks=sinks, return_stats=return_stats, backend=backend,
    )  # fmt: skip
    c = Call(spec, q, k, v, None, alibi_slopes, sinks, Spans(table, rows))
    implementation, why = backends.choose(c, PACKED)
    if traced:
        out, stats, _ = implementation.run(c, q, k, v)
    elif implementation is PER_SEQUENCE:
        out, stats = _per_sequence(c, [])
    else:
        out, stats, whole = _checked(implementation, why, c)
        if whole and implementation is PACKED_FUSED and memory.may_take(0.0, backend):  # (the answer's log line: every sequence in one call)
            given = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, is_causal=is_causal)
            memory.remember_packed(c, memory.PackedPassed(**given, scale=scale, softcap=softcap, window=window, return_stats=return_stats), _Packed((len(rows), len(rows), why)))  # type: ignore[arg-type]
    return (out, stats) if c.spec.return_stats else out


def _checked(implementation: Implementation, why: object, c: Call) -> tuple[Tensor, AttentionStats | None, bool]:
    """An eager packed call by the guard's rules, and whether one call computed all of it: one call
    of ``implementation`` runs the sequences :func:`guard.trusted_spans` trusts (the compiled kernel
    named: all of them) and keeps the rows :func:`guard.wrong_spans` finds right; every other
    sequence runs alone."""
    assert c.spans is not None and c.spans.rows is not None
    every = list(range(len(c.spans.rows)))
    auto = c.spec.backend is Backend.AUTO
    grad = torch.is_grad_enabled() and (c.query.requires_grad or c.key.requires_grad or c.value.requires_grad)
    if not implementation.checks_rows:  # FlexAttention: every sequence in one call, or none
        ran = every if guard.trusted_spans(c, bound=True) == every else []
    else:  # the compiled kernel vouches for its rows; with gradients, non-finite rows stay out of it
        ran = guard.trusted_spans(c, bound=False) if auto and grad else every
    if not ran:
        return (*_per_sequence(c, []), False)
    sub = c if ran == every else c.sequences(ran)
    result = implementation.run(sub, c.query, c.key, c.value)
    if auto and implementation.checks_rows:
        wrong = guard.wrong_spans(c, result.out, result.rows_ok, ran)
        if wrong:  # with gradients the kernel's wrong rows would reach its backward: none of its rows is kept
            ran = [] if grad else [b for b in ran if b not in wrong]
    if ran:
        record_backend(implementation.backend, _Packed((len(ran), len(every), why)))
    return (result.out, result.stats, True) if ran == every else (*_per_sequence(c, ran, result), False)


class _Packed(tuple):
    """Why a packed call ran as it did: (ran, of, why), formatted only when the line is logged."""

    def __str__(self) -> str:
        return "varlen: {} of {} sequences in one call; {}".format(*self)


def _per_sequence(c: Call, ran: list[int], packed: Result | None = None) -> tuple[Tensor, AttentionStats | None]:
    """Every sequence not in ``ran`` as one :func:`scaled_dot_product_attention` call on views (no
    copy), with the packed call's options; the rows of ``ran`` from ``packed``; joined in order."""
    assert c.spans is not None and c.spans.rows is not None
    q, k, v, spec = c.query, c.key, c.value, c.spec
    rows = c.spans.rows or [(0, 0, 0, 0)]  # no sequence: one empty call gives outputs of the right dtype and layout
    outs, parts = [], []
    done = set(ran)
    for b, (q0, q1, k0, k1) in enumerate(rows):
        if b in done:
            assert packed is not None
            outs.append(packed.out[q0:q1])
            if packed.stats is not None:
                parts.append(rows_of(packed.stats, q0, q1))
            continue
        slopes = c.alibi_slopes[b] if c.alibi_slopes is not None and c.alibi_slopes.ndim == 2 else c.alibi_slopes
        result = scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1).unsqueeze(0),  # (1, H, L_b, D), a view
            k[k0:k1].transpose(0, 1).unsqueeze(0),  # (1, Hkv, S_b, D)
            v[k0:k1].transpose(0, 1).unsqueeze(0),  # (1, Hkv, S_b, Dv)
            is_causal=spec.path.causal,
            scale=spec.path.scale,
            enable_gqa=True if spec.H != spec.Hkv else False,  # noqa: SIM210 - a bool under dynamic shapes too
            causal_alignment=CausalAlignment.BOTTOM_RIGHT,
            softcap=spec.path.softcap,
            alibi_slopes=slopes,
            window=spec.path.window,
            sinks=c.sinks,
            return_stats=spec.return_stats,
            backend=spec.backend,
        )
        out_b, stats_b = result if spec.return_stats else (result, None)
        outs.append(out_b[0].transpose(0, 1))  # (L_b, H, Dv)
        if stats_b is not None:
            parts.append(stats_b)
    return torch.cat(outs), join_rows(parts) if spec.return_stats else None  # (total_q, H, Dv)


# --- the implementations of packed calls ---------------------------------------------------------


def _run_kernel(c: Call, q: Tensor, k: Tensor, v: Tensor) -> Result:
    assert c.spans is not None
    spec = c.spec
    longest = None if c.spans.rows is None else max((q1 - q0 for q0, q1, _, _ in c.spans.rows), default=0)  # (while tracing, the op's)
    out, stats, rows_ok = fused_varlen_attention(
        q, k, v, c.spans.table, path=spec.path, alibi_slopes=c.alibi_slopes, sinks=c.sinks, return_stats=spec.return_stats, longest=longest
    )
    return Result(out, stats, rows_ok)


def _flex_cannot(c: Call) -> Refusal | None:
    if tracing(c.query, c.key, c.value):
        return _traced_refusal(c)
    views = tuple(t.transpose(0, 1) for t in (c.query, c.key, c.value))  # (heads, total, d): heads, then rows, as flex reads them
    why = flex.cannot(device=c.query.device, dropout_p=0.0, attn_mask=None, alibi_slopes=c.alibi_slopes, sinks=c.sinks, tensors=views)
    return None if why is None else flex_refusal(why)


def _run_flex(c: Call, q: Tensor, k: Tensor, v: Tensor) -> Result:
    assert c.spans is not None and c.spans.rows is not None
    rows = c.spans.rows
    if not (q.shape[0] and k.shape[0]):  # no rows or no keys at all: the per-sequence path's empty results
        return Result(*_per_sequence(c, []), None)
    cu_q = torch.tensor([0, *(q1 for _, q1, _, _ in rows)], dtype=torch.int64, device=q.device)
    cu_k = torch.tensor([0, *(k1 for _, _, _, k1 in rows)], dtype=torch.int64, device=q.device)
    out, stats = flex.flex_varlen_attention(q, k, v, cu_q, cu_k, path=c.spec.path, alibi_slopes=c.alibi_slopes, sinks=c.sinks, return_stats=c.spec.return_stats)
    return Result(out, stats, None)


def _per_sequence_cannot(c: Call) -> Refusal | None:
    return _traced_refusal(c) if c.spans is None or c.spans.rows is None else None


def _traced_refusal(c: Call) -> Refusal:
    """While tracing only the compiled kernel's op runs a packed call (the others need the lengths' values)."""
    why = fused_supports(c.query, None)
    got = repr(c.spec.backend.value) + (f" ({why})" if why is not None else "")
    fix = "use backend='auto' on CPU with the kernel built, or call varlen_attention outside the traced region"
    return Refusal("traced", "backend", "the compiled kernel while tracing (torch.compile, torch.export, FakeTensor, torch.func)", got, fix)


def _run_per_sequence(c: Call, q: Tensor, k: Tensor, v: Tensor) -> Result:
    return Result(*_per_sequence(c._replace(query=q, key=k, value=v), []), None)


PACKED_FUSED = Implementation(Backend.FUSED, FUSED.cannot, _run_kernel, checks_rows=True)
PACKED_FLEX = Implementation(Backend.FLEX, _flex_cannot, _run_flex, float64=False)
PER_SEQUENCE = Implementation(Backend.AUTO, _per_sequence_cannot, _run_per_sequence)
"""Each sequence alone through scaled_dot_product_attention (whose calls record their backends)."""
PACKED = Walk(
    (
        Step(PACKED_FLEX, lambda c: None if c.query.is_cuda else "not a CUDA tensor"),
        Step(PACKED_FUSED, lambda c: None),
        Step(PER_SEQUENCE, lambda c: None),
    ),
    {b: PACKED_FUSED if b is Backend.FUSED else PACKED_FLEX if b is Backend.FLEX else PER_SEQUENCE for b in Backend},
)
"""``backends.choose``'s walk of packed calls: one FlexAttention call on CUDA, one compiled-kernel
call on CPU, else one call per sequence (any other backend named runs per sequence)."""
