"""The Python face of the fused CPU kernel: ``backend="fused"`` of ``scaled_dot_product_attention``.

Same semantics as :mod:`attnscale.tiled` (the score path of :mod:`attnscale.score`, empty rows give
zeros and ``lse = -inf``, statistics streamed exactly), computed by ``fused.cpp``: per tile one
BLAS product, one fused pass over the score path and the online softmax, one BLAS product; work
parallel over batch, heads and query blocks on every core. float32 and float64 run natively;
float16 and bfloat16 accumulate in float32 (as every attnscale backend does) and the output is
rounded back (by the kernel as it writes the rows, where no gradient and no sink needs the float32
output: :func:`_round_out`): where the CPU multiplies them natively (:func:`ops.half_products`: AMX, AVX512-BF16/FP16)
the products take the 16-bit inputs as they are, as torch's CPU kernel does; elsewhere the kernel
converts each tile to float32 as it goes (no copy of the inputs). Sinks enter through :func:`attnscale.tiled.sink_scaled` on the kernel's
``(out, lse)``, as in the tiled kernel. ALiBi slopes may be learned (the kernel's backward returns
their gradient); a float mask that requires grad is refused (``backend="auto"`` sends it to the
tiled kernel).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._tracing import _functorch_wrapped, _is_wrapped, _transforms_active, constant_result, tracing
from ..dense import accumulation_dtype, head_groups
from ..score import ScorePath
from ..stats import AttentionStats, with_sinks
from ..tiled import partial_backward as tiled_partial_backward
from ..tiled import partial_forward as tiled_partial_forward
from ..tiled import sink_scaled, tiled_attention
from . import load, ops

__all__ = [
    "Plan", "direct", "fused_attention", "fused_attention_checked", "fused_varlen_attention", "int8_attention", "packed_plan", "partial_backward",
    "partial_forward", "partials_cannot", "plan", "run_planned", "supports",
]  # fmt: skip
# The default tiles and the rule that picks them live in ``ops`` (BLOCK_Q, BLOCK_K, default_blocks),
# read inside the op at call time.


class _Spec(NamedTuple):
    """Everything but the tensors: the score path and the tiling, as the kernel reads them (a
    NamedTuple: made on every call, and a frozen dataclass costs several times as much to make)."""

    path: ScorePath
    batch: tuple[int, ...]
    H: int
    Hkv: int
    q_start: int
    k_start: int
    with_stats: bool
    block_q: int
    block_k: int

    def options(self, half_products: bool, round_out: bool) -> ops.KernelOptions:
        path = self.path
        left, right = path.window if path.window is not None else (None, None)
        return ops.KernelOptions(
            scale=path.scale,
            softcap=0.0 if path.softcap is None else path.softcap,
            causal=path.causal,
            q_offset=path.q_offset,
            left=-1 if left is None else left,
            right=-1 if right is None else right,
            q_start=self.q_start,
            k_start=self.k_start,
            with_stats=self.with_stats,
            block_q=self.block_q,
            block_k=self.block_k,
            half_products=half_products,
            round_out=round_out,
        )


def supports(query: Tensor, attn_mask: Tensor | None) -> str | None:
    """Why the fused kernel cannot take this call (None if it can)."""
    if not (query.is_cpu or query.is_meta):  # meta: shapes only, from the op's fake rule
        return "not a CPU tensor"
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        return "a float attn_mask that requires grad"
    if not _loaded():
        return "the compiled kernel is unavailable"
    return None


@constant_result
def _loaded() -> bool:
    """Whether the kernel loads (building it on first use): a constant to torch.compile, which
    would otherwise trace into the build and its lock."""
    return load() is not None


def _check_runnable(query: Tensor, attn_mask: Tensor | None) -> None:
    """RuntimeError where the kernel cannot run (see :func:`supports`)."""
    reason = supports(query, attn_mask)
    if reason is not None:
        raise RuntimeError(f"backend='fused' cannot run this call: {reason}")


def _blas_rows(x: Tensor) -> bool:
    """Whether BLAS can read x's (n, d) matrices as they lie: a contiguous last dim and rows that
    do not overlap (row stride >= d). Rows expanded along n (stride 0) or cut by ``unfold``
    overlap; BLAS refuses such a leading dimension and leaves its product unwritten, and with
    d = 1 a stride-0 view would be read past its storage."""
    strides = x.stride()  # (one call for both: this runs on every planned call)
    return strides[-1] == 1 and strides[-2] >= (x.shape[-1] or 1)


def _flat(x: Tensor, spec: _Spec, dtype: torch.dtype) -> Tensor:
    """(*batch, heads, n, d) in ``dtype`` as (B, heads, n, d) rows BLAS can read (:func:`_blas_rows`)."""
    if x.dtype == dtype and x.ndim == 4 and x.shape[0] == spec.batch[0] and len(spec.batch) == 1 and _blas_rows(x):
        return x  # already the kernel's layout (the common case: no copy, no views to build)
    x = x.to(dtype).expand(*spec.batch, *x.shape[-3:])
    x = x.reshape(math.prod(spec.batch), *x.shape[-3:])
    return x if _blas_rows(x) else x.contiguous()


def _flat_mask(mask: Tensor | None, spec: _Spec, L: int, S: int, dtype: torch.dtype) -> Tensor | None:
    """The mask as a strided (B, H, L, S) view (broadcast dims get stride 0), in ``dtype`` if float."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask.to(dtype)
    mask = mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))
    mask = mask.expand(*spec.batch, spec.H, L, S)
    return mask.flatten(0, len(spec.batch) - 1) if len(spec.batch) != 1 else mask


def _flat_slopes(alibi: Tensor | None, spec: _Spec, dtype: torch.dtype) -> Tensor | None:
    if alibi is None:
        return None
    slopes = alibi.to(dtype).expand(*spec.batch, spec.H)  # learned slopes: their gradient through the op, cast and expand
    return slopes.flatten(0, len(spec.batch) - 1) if len(spec.batch) != 1 else slopes


def _round_out(query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None) -> bool:
    """Whether the kernel may write a 16-bit call's output in its format (``round_out``) rather than
    in float32 for a pass after it: the same bits, one pass fewer. Not where the float32 rows have a
    use: the sinks merge rescales them, and a backward's D_i = rowsum(dO * O) takes them unrounded
    (a gradient may be asked for, or a torch.func transform holds the tensors)."""
    if query.dtype not in ops.HALF or sinks is not None:
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return torch.compiler.is_compiling() or not any(_functorch_wrapped(t) for t in (query, key, value))


def _forward(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, alibi: Tensor | None, spec: _Spec, round_out: bool) -> tuple[list[Tensor], Tensor]:
    """The kernel's forward through ``torch.ops.attnscale.fused_forward``: ([out, lse, *stats] in
    the caller's batch shape, and the 0-d rows_ok verdict). Differentiable in q, k, v (the op's
    autograd rule; the layout changes here are plain torch ops)."""
    acc = accumulation_dtype(query.dtype)
    L, S = query.shape[-2], key.shape[-2]
    q, k, v = (_flat(t, spec, query.dtype) for t in (query, key, value))  # 16-bit ones as they are
    m4, slopes = _flat_mask(mask, spec, L, S, acc), _flat_slopes(alibi, spec, acc)
    products16 = ops.half_products(query.dtype, L, head_groups(spec.H, spec.Hkv))
    out, lse, _, _, *stats, rows_ok = ops.forward(q, k, v, slopes, m4, None, spec.options(products16, round_out))
    stats = stats if spec.with_stats else []
    if len(spec.batch) == 1:  # the kernel's (B, H, L, .) is the caller's shape already
        return [out, lse, *stats], rows_ok
    shape = (*spec.batch, spec.H, L)
    return [out.view(*shape, v.shape[-1]), lse.view(shape), *(t.view(shape) for t in stats)], rows_ok


def fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    path: ScorePath,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
    q_start: int = 0,
    k_start: int = 0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, AttentionStats | None]:
    """Fused attention on validated CPU inputs: query (..., H, L, D), key (..., Hkv, S, D),
    value (..., Hkv, S, Dv), H a multiple of Hkv (L = 0 or S = 0 give the tiled kernel's empty or
    zero results). Returns (out (..., H, L, Dv), stats
    or None). Raises RuntimeError when the compiled kernel is unavailable (see :func:`supports`)."""
    out, stats, _ = fused_attention_checked(
        query,
        key,
        value,
        path=path,
        attn_mask=attn_mask,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        return_stats=return_stats,
        q_start=q_start,
        k_start=k_start,
        block_q=block_q,
        block_k=block_k,
    )
    return out, stats


def _sinks_applied(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """:func:`attnscale.tiled.sink_scaled` of the kernel's rows: in one pass of the kernel's
    ``sink_scale`` where the rows are plain eager CPU tensors that no gradient flows through (a
    decoding step's case), else by its torch ops (differentiable, traceable)."""
    eager = type(out) is Tensor and not torch.compiler.is_compiling() and not _functorch_wrapped(out) and not _functorch_wrapped(sinks)
    no_grad = not torch.is_grad_enabled() or not (out.requires_grad or lse.requires_grad or sinks.requires_grad)
    if eager and no_grad and out.is_cpu and sinks.is_cpu and out.is_contiguous() and lse.is_contiguous() and out.dtype in (torch.float32, torch.float64):
        load().sink_scale(out, lse, sinks)  # in place: the kernel's own fresh output
        return out
    return sink_scaled(out, lse, sinks)


def fused_attention_checked(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    path: ScorePath,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
    q_start: int = 0,
    k_start: int = 0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, AttentionStats | None, Tensor | None]:
    """:func:`fused_attention`, and whether every row of the returned output is finite and not all
    zeros, as the kernel saw while writing it (Dv = 0: True), as a 0-d bool tensor: the check
    :func:`attnscale.scaled_dot_product_attention` makes of every output, without passes of its
    own (for 16-bit inputs, of the output rounded to their format; with sinks, of the rows before
    their share scales them, see :func:`_finished`). None where no kernel ran: the caller checks
    the output itself."""
    _check_runnable(query, attn_mask)
    if query.shape[-2] == 0 or key.shape[-2] == 0:  # nothing to tile: the eager kernel's empty results
        out, stats = tiled_attention(
            query, key, value, path=path, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=return_stats
        )
        return out, stats, None
    if query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        batch = tuple(query.shape[:-3]) or (1,)
    else:
        batch = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])) or (1,)
    spec = _Spec(
        path=path,
        batch=batch,
        H=query.shape[-3],
        Hkv=key.shape[-3],
        q_start=q_start,
        k_start=k_start,
        with_stats=return_stats,
        block_q=block_q or 0,  # 0: the op picks (from the actual sizes, so traces do not depend on them)
        block_k=block_k or 0,
    )
    squeeze = query.ndim == 3 and key.ndim == 3
    if squeeze:  # no batch dims: the kernel's batch of one
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    (out, lse, *rest), verdict = _forward(query, key, value, attn_mask, alibi_slopes, spec, _round_out(query, key, value, sinks))
    if squeeze:
        out, lse, rest = out.squeeze(0), lse.squeeze(0), [t.squeeze(0) for t in rest]
    return _finished(query.dtype, out, lse, rest, verdict, sinks, return_stats)


def _finished(
    dtype: torch.dtype, out: Tensor, lse: Tensor, rest: list[Tensor], verdict: Tensor | bool, sinks: Tensor | None, return_stats: bool,
    merged: bool = False,
) -> tuple[Tensor, AttentionStats | None, Tensor | bool]:
    """The kernel's rows as the caller gets them: the sinks merged (unless the kernel ``merged``
    them), in the inputs' ``dtype``, the statistics named, and the rows' verdict where it holds of
    the returned rows."""
    # For 16-bit inputs the kernel checks each row against the format's range too, so its verdict
    # holds of the rounded output. The sinks merge scales each row by its share, in [0, 1]: a
    # finite row stays finite (and within the values' range, so within their format), and a row
    # it takes to zero is right (the sink holds all of the mass), so the verdict still says what
    # the guard asks of the rows.
    rows_ok = verdict
    if sinks is not None and not merged:
        out = _sinks_applied(out, lse, sinks)
    if out.dtype != dtype:
        out = out.to(dtype)
    if not return_stats:
        return out, None, rows_ok
    max_logit, max_prob, entropy, visible_keys = rest
    stats = AttentionStats._of(lse=lse, max_logit=max_logit, max_prob=max_prob, entropy=entropy, visible_keys=visible_keys)
    return out, stats if sinks is None else with_sinks(stats, sinks), rows_ok


class Plan(NamedTuple):
    """What a call's signature fixes of its kernel call (:func:`plan`): the options with the tiles
    and the product path resolved, and what the 16-bit product path is asked again from."""

    options: ops.KernelOptions
    dtype: torch.dtype
    L: int
    group: int

    def now(self) -> ops.KernelOptions:
        """The options for a call made now: the 16-bit product path asked again (the plan may be
        older than ATTNSCALE_HALF_PRODUCTS's present value)."""
        if self.dtype not in ops.HALF:
            return self.options
        return self.options._replace(half_products=ops.half_products(self.dtype, self.L, self.group))


def plan(query: Tensor, key: Tensor, value: Tensor, *, path: ScorePath, sinks: bool, return_stats: bool) -> Plan | None:
    """The plan of a call without a mask whose q, k and v have the kernel's shapes ((B, H, L, D),
    (B, Hkv, S, D), (B, Hkv, S, Dv), every size >= 1), for :func:`run_planned` on its signature's
    (shapes, dtype, device, options) calls whose tensors are :func:`direct`; None for any other."""
    if not (query.ndim == 4 and key.ndim == 4 and value.ndim == 4 and query.shape[0] == key.shape[0] == value.shape[0]):
        return None
    if min(*query.shape, *key.shape, value.shape[-1]) == 0:
        return None
    B, H, L = query.shape[:3]
    spec = _Spec(path=path, batch=(B,), H=H, Hkv=key.shape[1], q_start=0, k_start=0, with_stats=return_stats, block_q=0, block_k=0)
    round_out = query.dtype in ops.HALF and not sinks  # as _round_out gives it where no gradient is asked (direct)
    options = spec.options(ops.half_products(query.dtype, L, head_groups(H, spec.Hkv)), round_out)
    block_q, block_k = ops.default_blocks(options.causal, options.left >= 0 or options.right >= 0, L, None)
    return Plan(options._replace(block_q=block_q, block_k=block_k), query.dtype, L, head_groups(H, spec.Hkv))


def direct(query: Tensor, key: Tensor, value: Tensor, dtype: torch.dtype) -> bool:
    """Whether a planned call may go straight to the kernel: plain eager CPU tensors of ``dtype``
    (of type Tensor, not traced or wrapped by torch.func) that no gradient is asked of, whose rows
    BLAS reads as they lie."""
    if type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor or query.dtype is not dtype:
        return False
    if (query.requires_grad or key.requires_grad or value.requires_grad) and torch.is_grad_enabled():
        return False
    if (_transforms_active() and (_is_wrapped(query) or _is_wrapped(key) or _is_wrapped(value))) or torch.compiler.is_compiling():
        return False
    return _blas_rows(query) and _blas_rows(key) and _blas_rows(value)


def run_planned(
    plan: Plan, query: Tensor, key: Tensor, value: Tensor, alibi_slopes: Tensor | None, sinks: Tensor | None
) -> tuple[Tensor, AttentionStats | None, Tensor | bool]:
    """:func:`fused_attention_checked` of a call whose :func:`plan` is ``plan``, with ``direct``
    inputs: the kernel itself, called with the planned options (no layout to make, no option but
    the 16-bit product path to derive again)."""
    options = plan.now()
    # The slopes read as given and the sinks merged by the kernel (plan: no rounded 16-bit rows
    # with sinks), but sinks a gradient is asked of, which its torch ops merge.
    merge = sinks is not None and not (sinks.requires_grad and torch.is_grad_enabled())
    out, lse, *rest, verdict = ops.run_direct(query, key, value, alibi_slopes, sinks if merge else None, options)
    return _finished(plan.dtype, out, lse, rest, verdict, sinks, options.with_stats, merged=merge)


def _packed(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(total, heads, d) in ``dtype`` as the kernel's (1, heads, total, d) view, rows BLAS can read."""
    x = (x if x.dtype is dtype else x.to(dtype)).transpose(0, 1).unsqueeze(0)
    return x if _blas_rows(x) else x.contiguous()


def _packed_options(path: ScorePath, *, with_stats: bool, half_products: bool, round_out: bool) -> ops.KernelOptions:
    # q_offset is each sequence's own (S_b - L_b, bottom-right), set by the kernel; starts are 0.
    left, right = path.window if path.window is not None else (None, None)
    return ops.KernelOptions(
        scale=path.scale,
        softcap=0.0 if path.softcap is None else path.softcap,
        causal=path.causal,
        left=-1 if left is None else left,
        right=-1 if right is None else right,
        with_stats=with_stats,
        half_products=half_products,
        round_out=round_out,
    )


def packed_plan(
    query: Tensor, key: Tensor, value: Tensor, *, path: ScorePath, sinks: Tensor | None, return_stats: bool, longest: int | None
) -> ops.KernelOptions:
    """The options of :func:`fused_varlen_attention`'s kernel call: the tiles chosen from
    ``longest`` (the most query rows of a sequence) where it is given, else by the op."""
    round_out = _round_out(query, key, value, sinks)
    options = _packed_options(path, with_stats=return_stats, half_products=ops.half_products(query.dtype), round_out=round_out)
    if longest is None:
        return options
    block_q, block_k = ops.default_blocks(options.causal, options.left >= 0 or options.right >= 0, longest, None, packed=True)
    return options._replace(block_q=block_q, block_k=block_k)


def fused_varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    spans: Tensor,
    *,
    path: ScorePath,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
    longest: int | None = None,
) -> tuple[Tensor, AttentionStats | None, Tensor | None]:
    """:func:`attnscale.varlen_attention` on validated CPU inputs in one kernel call, parallel over
    heads and every sequence's query blocks: query (total_q, H, D), key (total_k, Hkv, D), value
    (total_k, Hkv, Dv); ``spans`` (nseq, 4) int64, the sequences, ``(q0, q1, k0, k1)`` each, their
    query rows [q0, q1) and key rows [k0, k1) (disjoint; rows that no span names come back as rows
    without keys: zeros, ``lse = -inf``); ``alibi_slopes`` (H,), or (nseq, H) one row per span. Returns (out (total_q, H, Dv), stats
    with (H, total_q) tensors, or None, and the rows' verdict as :func:`fused_attention_checked`
    gives it). ``path.q_offset`` is ignored: each sequence is aligned bottom-right. ``longest``:
    the most query rows of a span where the caller knows it (the tiles are chosen from it here,
    not from the table inside the op). Raises RuntimeError when the compiled kernel is unavailable
    (see :func:`supports`)."""
    _check_runnable(query, None)
    B, H = spans.shape[0], query.shape[1]
    table = spans.contiguous()
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(accumulation_dtype(query.dtype)).expand(B, H)  # (learned: the gradient flows back)
    q, k, v = (_packed(t, query.dtype) for t in (query, key, value))  # (1, heads, total, d) views
    options = packed_plan(query, key, value, path=path, sinks=sinks, return_stats=return_stats, longest=longest)
    out, lse, _, _, *rest, verdict = ops.forward(q, k, v, slopes, None, table, options)
    out, lse = out[0].transpose(0, 1), lse[0]  # (total_q, H, Dv), (H, total_q)
    if sinks is not None:
        # sink_scaled takes (..., H, L, Dv) and (..., H, L): the packed rows as L.
        out = sink_scaled(out.transpose(0, 1), lse, sinks).transpose(0, 1)
    out = out.to(query.dtype)
    rows_ok = verdict  # (with sinks too: see _finished)
    if not return_stats:
        return out, None, rows_ok
    max_logit, max_prob, entropy, visible_keys = (t[0] for t in rest)
    stats = AttentionStats._of(lse=lse, max_logit=max_logit, max_prob=max_prob, entropy=entropy, visible_keys=visible_keys)
    return out, stats if sinks is None else with_sinks(stats, sinks), rows_ok


def partials_cannot(query: Tensor) -> str | None:
    """Why :func:`partial_forward` and :func:`partial_backward` cannot take a shard pair of these
    inputs (None if they can): :func:`supports`' reasons, 16-bit inputs (the backward rounds each
    pair's gradients to their format, which the ring's float32 sums must not take), and tracing
    (the ring's autograd Function traces the tiled kernel's partials)."""
    if query.dtype not in (torch.float32, torch.float64):
        return f"{query.dtype} inputs (each shard pair's gradients would be rounded to them)"
    if tracing(query):
        return "tracing"
    return supports(query, None)


def _pair_spec(query: Tensor, key: Tensor, value: Tensor, path: ScorePath, q_start: int, k_start: int, with_stats: bool) -> tuple[_Spec, tuple[int, ...]]:
    shape = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3]))
    spec = _Spec(path=path, batch=shape or (1,), H=query.shape[-3], Hkv=key.shape[-3], q_start=q_start, k_start=k_start, with_stats=with_stats, block_q=0, block_k=0)
    return spec, shape


def partial_forward(
    query: Tensor, key: Tensor, value: Tensor, *, path: ScorePath, q_start: int = 0, k_start: int = 0, alibi_slopes: Tensor | None = None,
    with_stats: bool = False,
) -> tuple[Tensor, Tensor, AttentionStats | None]:
    """:func:`attnscale.tiled.partial_forward` on the compiled kernel (inputs :func:`partials_cannot`
    takes): ``(out, lse, stats)`` of a query shard against a key shard at global positions, in
    the inputs' dtype and the broadcast batch shape, without autograd; ``stats`` (or None) of this
    shard pair alone. :func:`partial_backward` is its gradient."""
    if query.shape[-2] == 0 or key.shape[-2] == 0:  # nothing to tile: the tiled kernel's empty results
        return tiled_partial_forward(query, key, value, path=path, q_start=q_start, k_start=k_start, alibi_slopes=alibi_slopes, with_stats=with_stats)
    spec, shape = _pair_spec(query, key, value, path, q_start, k_start, with_stats)
    dtype = query.dtype
    with torch.no_grad():
        q, k, v = (_flat(t, spec, dtype) for t in (query, key, value))
        r = ops.forward(q, k, v, alibi=_flat_slopes(alibi_slopes, spec, dtype), mask=None, spans=None, options=spec.options(False, False))
    rows = (*shape, spec.H, query.shape[-2])
    out, lse = r.out.view(*rows, value.shape[-1]), r.lse.view(rows)
    if not with_stats:
        return out, lse, None
    return out, lse, AttentionStats._of(
        lse=lse, max_logit=r.max_logit.view(rows), max_prob=r.max_prob.view(rows), entropy=r.entropy.view(rows), visible_keys=r.visible_keys.view(rows)
    )


def partial_backward(
    query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None = None, *, path: ScorePath,
    q_start: int = 0, k_start: int = 0, alibi_slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attnscale.tiled.partial_backward` on the compiled kernel: the gradients ``(dq, dk,
    dv)`` one shard pair contributes, given the rows' *final* ``out`` and ``lse`` over every key
    shard and their gradients, in the inputs' dtype and the broadcast batch shape (dk, dv with
    Hkv heads). The kernel's backward takes the final lse as its row normaliser (m = lse, l = 1:
    p = exp(s - lse), the true probability; a row no key of any shard is visible to, lse = -inf,
    as the forward leaves such a row, m = 0, l = 1, where every product is hidden)."""
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return tiled_partial_backward(query, key, value, out, lse, dout, dlse, path=path, q_start=q_start, k_start=k_start, alibi_slopes=alibi_slopes)
    spec, shape = _pair_spec(query, key, value, path, q_start, k_start, False)
    dtype = query.dtype
    with torch.no_grad():
        q, k, v = (_flat(t, spec, dtype) for t in (query, key, value))
        B, L = q.shape[0], q.shape[2]
        rows = lambda t: t.to(dtype).expand(*spec.batch, spec.H, L).reshape(B, spec.H, L)  # noqa: E731
        lse = rows(lse)
        delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
        delta = rows(delta if dlse is None else delta - dlse.to(dtype))  # D_i = rowsum(dO * O) - dlse_i
        dout = dout.to(dtype).expand(*spec.batch, spec.H, L, value.shape[-1]).reshape(B, spec.H, L, value.shape[-1])
        m = lse.masked_fill(lse == -math.inf, 0.0)
        # (the op's schema is positional: its tensors, then the options in BACKWARD_FIELDS' order)
        slopes, l = _flat_slopes(alibi_slopes, spec, dtype), torch.ones_like(m)  # noqa: E741
        dq, dk, dv, _ = ops.fused_backward(q, k, v, dout, delta, m, l, slopes, None, None, False, *spec.options(False, False).backward_args())
    return dq.view(*shape, *dq.shape[1:]), dk.view(*shape, *dk.shape[1:]), dv.view(*shape, *dv.shape[1:])


def _head_rows(x: Tensor) -> bool:
    """Whether x (B, heads, n, d) lies as the int8 kernel reads it: each head's rows one after
    another (views of a longer cache's first n rows among them)."""
    n, d = x.shape[2:]
    strides = x.stride()
    return (strides[3] == 1 or d <= 1) and (strides[2] == d or n <= 1) and min(strides) >= 0


INT8_PACK_ROWS = 64
"""Query rows a key head at most (query heads times L) whose bfloat16 queries still take the codes
in float32 (:func:`int8_attention`); more take them dequantized into bfloat16 packs."""
INT8_BLOCK_K = 256
"""Keys a tile of :func:`int8_attention` at most: the few rows of a decoding step multiply the codes
straight from memory, and 256 keys' codes (64 KiB at D = Dv = 128) stay in the core's caches
between the two products (2048, the float kernel's tile for few rows, is eight times that)."""


def int8_attention(
    query: Tensor,
    codes: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
    *,
    path: ScorePath,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
) -> tuple[Tensor, AttentionStats | None, Tensor]:
    """Attention of a validated query (B, H, L, D) over int8 keys and values in one kernel call:
    ``codes`` = (k, k_scale, k_mean, v, v_scale) of an :class:`attnscale.QuantizedKV`. The query in
    float32, the query heads of a key head taking each of its tiles together: the codes multiplied
    in registers for a decoding step's few rows (q.k in integers over q's rows rounded to int16
    where the query is 16-bit: ``q_int16``), else each tile dequantized into float32 scratch
    (csrc/quantized.h). A bfloat16 query with more than INT8_PACK_ROWS rows a key head, where
    brgemm runs: the codes dequantized into bfloat16 packs and the bfloat16 kernel's products
    (what torch's bfloat16 attention computes over the dequantized K and V rounded to bfloat16).
    Returns (out (B, H, L, Dv) in the query's dtype, stats or None, rows_ok as
    :func:`fused_attention_checked` gives it). Every size >= 1; no gradient flows (the caller sends
    those calls elsewhere)."""
    _check_runnable(query, attn_mask)
    k, k_scale, k_mean, v, v_scale = (t if _head_rows(t) else t.contiguous() for t in codes)
    B, H, L = query.shape[:3]
    G = H // k.shape[1]
    spec = _Spec(path=path, batch=(B,), H=H, Hkv=k.shape[1], q_start=0, k_start=0, with_stats=return_stats, block_q=0, block_k=0)
    options = spec.options(False, False)
    windowed = options.left >= 0 or options.right >= 0
    if query.dtype is torch.bfloat16 and G * L > INT8_PACK_ROWS and query.shape[-1] % 2 == 0 and load().brgemm_runs():
        # Prefill in bfloat16: the codes dequantized into brgemm's bfloat16 packs, the bfloat16
        # kernel's tiles, the rows rounded to bfloat16 as they are written (unless sinks rescale them).
        q = query.contiguous()
        block_q, block_k = ops.default_blocks(options.causal, windowed, L, None)
        options = options._replace(round_out=sinks is None)
    else:
        # The kernel's rows are a key head's query heads one after another (G L of them): tiles for
        # those; a key tile of few rows stays at INT8_BLOCK_K keys, whose codes stay in the core's caches.
        q = query.to(torch.float32).contiguous()
        block_q, block_k = ops.default_blocks(options.causal, windowed, G * L, None)
        block_k = min(block_k, INT8_BLOCK_K)
    options = options._replace(block_q=block_q, block_k=block_k)
    mask, slopes = _flat_mask(attn_mask, spec, L, k.shape[2], torch.float32), _flat_slopes(alibi_slopes, spec, torch.float32)
    # A 16-bit query's output is rounded to 16 bits: decoding's q.k products may take q in int16 codes.
    q_int16 = query.dtype in (torch.bfloat16, torch.float16) and q.dtype is torch.float32
    got = ops.KernelOutputs(*load().forward_int8(q, k, k_scale, k_mean, v, v_scale, slopes, mask, q_int16=q_int16, **options._asdict()))
    stats = [got.max_logit, got.max_prob, got.entropy, got.visible_keys]
    return _finished(query.dtype, got.out, got.lse, stats, got.rows_ok, sinks, return_stats)
