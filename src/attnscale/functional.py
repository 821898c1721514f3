"""``scaled_dot_product_attention``: the torch entry point. Validates, then picks a backend."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor

from ._tracing import _functorch_wrapped, refuse_jit_trace, tracing, under_vmap
from ._validate import _SCORE_MAX, AttentionCall, Backend, check_attention_call, fail
from .dense import accumulation_dtype, dense_attention
from .masks import CausalAlignment, add_bias, alibi_bias
from .stats import AttentionStats, with_nan_rows
from . import flex
from .kernels.fused import fused_attention, fused_attention_checked
from .kernels.fused import _blas_rows
from .kernels.fused import supports as fused_supports
from .kernels import ops as kernel_ops
from .tiled import tiled_attention

__all__ = ["Backend", "abs_max", "last_backend", "may_overflow", "record_backend", "scaled_dot_product_attention"]

log = logging.getLogger("attnscale")
_state = threading.local()


def last_backend() -> str | None:
    """Name of the backend that computed this thread's most recent attention call ("torch", "math",
    "tiled", "fused", "flex").

    Also logged at DEBUG level on the ``attnscale`` logger for every call. Calls traced by
    torch.compile or torch.export neither set it nor log.
    """
    return getattr(_state, "backend", None)


def record_backend(backend: Backend, why: str) -> None:
    """Make ``backend`` this thread's :func:`last_backend` and log why it ran; for entry points that
    run a backend themselves (:func:`attnscale.varlen_attention`'s one kernel call)."""
    _state.backend = backend.value
    log.debug("attnscale attention ran backend=%s (%s)", backend.value, why)


_record = record_backend


def _torch_cannot(call: AttentionCall) -> str | None:
    """Why torch's SDPA cannot compute this call at all (None if it can, maybe via an explicit mask)."""
    if call.path.softcap is not None:
        return "softcap"
    if call.return_stats:
        return "return_stats"
    return None


def _plain_softcapped(
    query: object, key: object, value: object, attn_mask: object, dropout_p: object, is_causal: object, scale: object,
    enable_gqa: object, causal_alignment: object, softcap: object, alibi_slopes: object, window: object, sinks: object,
    return_stats: object, backend: object,
) -> Tensor | None:
    """The output of a plain softcapped call, the common decoding step of softcapped models, by the
    shortest route; None for any other call, which then takes the full path.

    Plain: CPU tensors of one dtype the compiled kernel takes (float32, float64, bfloat16,
    float16; of type Tensor, none traced, wrapped or requiring a gradient) of shapes (B, H, L, D),
    (B, Hkv, S, D), (B, Hkv, S, Dv) with every size >= 1, Hkv = H (or, with ``enable_gqa=True``, a
    divisor of H) and rows BLAS reads as they lie; a float softcap and scale (or None) within the
    scores' range; every other option at its default and ``backend`` "auto". There the full path
    validates the same things, chooses the compiled kernel and calls it with the same arguments,
    so this is its output, bit for bit (``tests/test_functional.py``); it skips the Python that
    costs most right after the kernel has streamed k and v through the caches. A row the kernel
    does not vouch for (NaN, inf or zero) sends the call down the full path, which diagnoses it."""
    if torch.compiler.is_compiling():
        return None
    if (type(softcap) is not float or attn_mask is not None or alibi_slopes is not None or window is not None or sinks is not None
            or return_stats is not False or is_causal is not False or type(enable_gqa) is not bool or type(dropout_p) is not float
            or dropout_p != 0.0 or not (scale is None or type(scale) is float)
            or not (backend is Backend.AUTO or (type(backend) is str and backend == "auto"))
            or not (causal_alignment is CausalAlignment.TOP_LEFT or (type(causal_alignment) is str and causal_alignment == "top_left"))):
        return None
    if type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor:
        return None
    dtype = query.dtype
    if dtype not in _SCORE_MAX or key.dtype is not dtype or value.dtype is not dtype:
        return None
    top = _SCORE_MAX[dtype]
    if not 0.0 < softcap <= top or not (scale is None or 0.0 < scale <= top):  # NaN fails both
        return None
    if not (query.is_cpu and key.is_cpu and value.is_cpu) or query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return None
    B, H, L, D = query.shape
    Bk, Hk, S, Dk = key.shape
    Bv, Hv, Sv, Dv = value.shape
    if not (B == Bk == Bv and Hk == Hv and D == Dk and S == Sv and min(B, H, L, D, S, Dv) > 0):
        return None
    if Hk != H and not (enable_gqa and H % Hk == 0):  # (one key head without enable_gqa broadcasts: the full path)
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    if _functorch_wrapped(query) or _functorch_wrapped(key) or _functorch_wrapped(value):
        return None
    if not (_blas_rows(query) and _blas_rows(key) and _blas_rows(value)) or fused_supports(query, None) is not None:
        return None
    path_scale = scale if scale is not None else 1.0 / math.sqrt(D)  # as check_attention_call makes it
    # The arguments fused_attention_checked passes for this call: no stats, the kernel's own blocks.
    half = kernel_ops.half_products(dtype, L, H // Hk)
    # No gradient and no sinks here: a 16-bit output comes rounded from the kernel (round_out).
    result = kernel_ops.run_forward(query, key, value, None, None, None, kernel_ops.KernelOptions(scale=path_scale, softcap=softcap, half_products=half, round_out=True))
    if not bool(result.rows_ok):  # for 16-bit inputs, of the output rounded to their format
        return None
    _record(Backend.FUSED, "auto: softcap; compiled kernel")
    out = result.out
    return out if out.dtype is dtype else out.to(dtype)


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


def _kernel(call: AttentionCall, query: Tensor, attn_mask: Tensor | None) -> tuple[Backend, str]:
    """The compiled kernel where it can run this call, else the eager tiled kernel (and why)."""
    reason = fused_supports(query, attn_mask)
    return (Backend.FUSED, "compiled kernel") if reason is None else (Backend.TILED, reason)


def _flex_cannot(
    query: Tensor, key: Tensor, value: Tensor, call: AttentionCall, attn_mask: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None
) -> str | None:
    return flex.cannot(
        device=query.device, dropout_p=call.dropout_p, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, tensors=(query, key, value)
    )


def _choose(
    call: AttentionCall,
    query: Tensor,
    attn_mask: Tensor | None,
    *,
    slopes_need_grad: bool = False,
    flex_cannot: Callable[[], str | None],
) -> tuple[Backend, str]:
    if call.backend is Backend.AUTO:
        reason = _fused_cannot(call)
        if reason is None:
            return Backend.TORCH, "auto: torch's fused kernel computes these semantics"
        if query.device.type == "cuda":
            why_not = flex_cannot()
            if why_not is None:
                return Backend.FLEX, f"auto: {reason}; FlexAttention on CUDA"
            reason = f"{reason}; not flex: {why_not}"
        if call.dropout_p > 0.0:
            return Backend.MATH, f"auto: {reason}; dropout (the tiled kernel has none)"
        if slopes_need_grad:
            return Backend.MATH, f"auto: {reason}; alibi_slopes require grad (tiled treats them as constants)"
        feature = _tiled_feature(call)
        scores = math.prod(call.batch) * call.H * call.L * call.S
        if feature is None and scores <= MATH_MAX_SCORES:
            return Backend.MATH, f"auto: {reason}"
        why = feature if feature is not None else f"{reason}; {scores} scores > MATH_MAX_SCORES"
        kernel, how = _kernel(call, query, attn_mask)
        if kernel is Backend.TILED and under_vmap():
            return Backend.MATH, f"auto: {why}; {how}; under vmap, where the tiled kernel has no batching rule"
        return kernel, f"auto: {why}; {how}"
    if call.backend in (Backend.TILED, Backend.FUSED) and call.dropout_p > 0.0:
        fail(
            "dropout_p",
            f"0.0 with backend={call.backend.value!r} (the {call.backend.value} kernel has no dropout)",
            repr(call.dropout_p),
            "use backend='math' (or 'auto') for dropout",
        )
    if call.backend is Backend.TILED and under_vmap():
        fail(
            "backend",
            "a backend with a batching rule under torch.func.vmap",
            "'tiled' (an autograd Function without one)",
            "use backend='auto' or 'math' (or 'fused' where the compiled kernel runs) inside vmap",
        )
    if call.backend is Backend.FLEX:
        why_not = flex_cannot()
        if why_not is not None:
            fail("backend", "a call FlexAttention can run", f"'flex' with {why_not}", "use backend='tiled' (same semantics, eager) or 'auto'")
    if call.backend is Backend.FUSED:
        kernel, how = _kernel(call, query, attn_mask)
        if kernel is not Backend.FUSED:
            fail("backend", "a call the compiled kernel can run", f"'fused' with {how}", "use backend='tiled' (same semantics, eager) or 'auto'")
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
        enable_gqa=True if call.H != call.Hkv else False,  # noqa: SIM210 - a branch, so that dynamic shapes guard on it: a SymBool is no bool to torch's SDPA
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


_Run = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, AttentionStats | None]]


def _run_backend(
    chosen: Backend,
    call: AttentionCall,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
) -> _Run:
    """The chosen backend as a function of (query, key, value), every other option fixed."""

    def run(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, AttentionStats | None]:
        if chosen is Backend.TORCH:
            return _torch_attention(query, key, value, call, attn_mask, alibi_slopes, sinks), None
        if chosen is Backend.FUSED:
            return fused_attention(
                query, key, value, path=call.path, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=call.return_stats
            )
        if chosen is Backend.FLEX:
            return flex.flex_attention(
                query, key, value, path=call.path, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=call.return_stats
            )
        if chosen is Backend.TILED:
            return tiled_attention(
                query, key, value, path=call.path, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=call.return_stats
            )
        return dense_attention(
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

    return run


def _row_peaks(out: Tensor) -> Tensor:
    """max |out| per row (..., H, L), NaN in a row with a NaN; 1 for rows of Dv = 0 (nothing to check)."""
    if out.shape[-1] == 0:
        return out.new_ones(out.shape[:-1])
    # max(amax, -amin): two reductions without a copy of the output (abs().amax() makes one), and
    # several times faster on CPU than linalg.vector_norm(out, inf), which is not vectorised there.
    # amax and amin propagate NaN; maximum keeps it.
    detached = out.detach()
    return torch.maximum(detached.amax(dim=-1), detached.amin(dim=-1).neg())


def _rows_look_right(peaks: Tensor) -> bool:
    """Whether every output row is finite and not all zeros, from :func:`_row_peaks`: the fast
    path's check of the output, O(L * Dv) (:func:`_rows_may_hide_trouble` looks at k).

    A NaN or inf row comes from non-finite inputs or from products that overflowed. A zero row is
    often right (no visible key, zero values) but not always: torch's kernel returns zeros for a row
    whose logits are all NaN, and logits that all overflow to -inf look like a row with no key.
    """
    if peaks.numel() == 0:
        return True
    # Two scalar reductions, not a boolean mask: at decode sizes every extra op is a visible cost.
    return 0.0 < float(peaks.amin()) and float(peaks.amax()) < math.inf  # NaN fails both


def _nan_rows(chosen: Backend, call: AttentionCall, bad_q: Tensor, bad_kv: Tensor, attn_mask: Tensor | None) -> Tensor:
    """The rows (..., H, L) that the semantics make NaN: a non-finite query row that has a visible
    key, or a visible key with a non-finite k or v; ``bad_q`` (..., H, L), ``bad_kv`` (..., Hkv, S).

    Visibility comes from the chosen backend itself, run on indicators: with q = k = 0 every visible
    key of a row has weight 1 / (its visible keys), so ``v = [bad key, 1]`` gives an output whose
    column 0 is positive iff the row sees a bad key and column 1 iff it sees any key. A float mask
    becomes the bool mask of its -inf entries: its finite values cannot hide a key, but could
    underflow the indicator's weights.
    """
    keep = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask != -math.inf
    q = torch.zeros(*bad_q.shape, 2, device=bad_q.device)  # (..., H, L, 2)
    k = torch.zeros(*bad_kv.shape, 2, device=bad_kv.device)  # (..., Hkv, S, 2)
    v = torch.stack([bad_kv.float(), torch.ones_like(bad_kv, dtype=torch.float32)], dim=-1)  # (..., Hkv, S, 2)
    path = dataclasses.replace(call.path, scale=1.0, softcap=None)
    plain = dataclasses.replace(call, D=2, Dv=2, path=path, dropout_p=0.0, alibi=False, sinks=False, return_stats=False)
    # FlexAttention shares the tiled kernel's visibility; the indicators' D = 2 is below what its GPU kernels take.
    seen, _ = _run_backend(Backend.TILED if chosen is Backend.FLEX else chosen, plain, keep, None, None)(q, k, v)  # (..., H, L, 2)
    return ((seen[..., 1] > 0) & bad_q) | (seen[..., 0] > 0)


def abs_max(x: Tensor) -> float:
    """max |x| as a Python float, NaN if x holds a NaN, 0 if it is empty: one pass, no temporary."""
    if x.numel() == 0:
        return 0.0
    lo, hi = (float(t) for t in torch.aminmax(x.detach()))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


def _logit_bound(
    call: AttentionCall, q_max: float, k_max: float, attn_mask: Tensor | None, alibi_slopes: Tensor | None, amax: Callable[[Tensor], float] = abs_max
) -> float:
    """An upper bound on |logit| over every (query, key) pair, from the largest entries |q| <= q_max
    and |k| <= k_max (NaN gives NaN): ``|q.k| <= D q_max k_max`` times the scale (or the softcap),
    plus the largest ALiBi bias and the largest finite float-mask value. With softcap, also on the
    products the cap is taken of: a product that overflowed is capped to a finite logit (tanh(inf)
    = 1) of the wrong size or sign, a row no output check can tell from a right one. ``amax`` reads
    max |x| (:func:`abs_max`, or the values :class:`_OneRead` fetched)."""
    if math.isnan(q_max) or math.isnan(k_max):  # max() below would drop a NaN it gets second
        return math.nan
    softcap = call.path.softcap
    bound = call.path.scale * call.D * q_max * k_max if softcap is None else softcap
    if alibi_slopes is not None:
        bound += amax(alibi_slopes) * max(call.L, call.S)  # |i' - j| < max(L, S)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        peak = amax(attn_mask)
        if peak == math.inf:  # -inf hides a key, it is no logit
            peak = amax(attn_mask, finite_part=True) if isinstance(amax, _OneRead) else abs_max(attn_mask.detach().nan_to_num(neginf=0.0))
        bound += peak
    if softcap is not None:
        # Before the cap, whichever order a backend multiplies in: q.k, then the scale (and
        # 1 / softcap, folded into it), or q times the scale first.
        bound = max(bound, call.D * q_max * k_max * max(1.0, call.path.scale, call.path.scale / softcap))
    return bound


def _finite_sum(x: Tensor) -> bool:
    """Whether x holds no NaN or inf, by one reduction (about 0.6 times aminmax's time on CPU): a
    finite sum says so; a sum that overflows says no, which only sends a call down the careful
    path, right either way."""
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    return math.isfinite(float(x.detach().sum(dtype=wide)))


class _OneRead:
    """The guard's numbers for tensors on an accelerator, read back in one transfer: the row peaks'
    range and max |x| of q, k, the slopes and a float mask (also with its -inf entries as 0), each a
    reduction queued behind the attention. Reading them one by one waits for the device once per
    number, and the host's work between the waits leaves the device idle. Called with a tensor it
    read, it gives that max |x| (:func:`abs_max` for any other)."""

    def __init__(self, peaks: Tensor, tensors: tuple[Tensor | None, ...], mask: Tensor | None) -> None:
        parts: list[Tensor] = [peaks.amin(), peaks.amax()] if peaks.numel() else []
        self._at: dict[tuple[int, bool], int] = {}
        float_mask = mask if mask is not None and mask.dtype != torch.bool else None
        for t, finite_part in [(t, False) for t in (*tensors, float_mask)] + [(float_mask, True)]:
            if t is not None and (id(t), finite_part) not in self._at:
                self._at[id(t), finite_part] = len(parts)
                parts.append(_abs_peak(t.detach().nan_to_num(neginf=0.0) if finite_part else t.detach()))
        self._values = torch.stack([p.double() for p in parts]).tolist() if parts else []  # the one wait
        self.peaks = (self._values[0], self._values[1]) if peaks.numel() else (1.0, 1.0)

    def rows_look_right(self) -> bool:
        """:func:`_rows_look_right` on the fetched peaks."""
        lo, hi = self.peaks
        return 0.0 < lo and hi < math.inf  # NaN fails both

    def __call__(self, t: Tensor, *, finite_part: bool = False) -> float:
        at = self._at.get((id(t), finite_part))
        if at is None:
            return abs_max(t.detach().nan_to_num(neginf=0.0) if finite_part else t)
        return self._values[at]

    def finite(self, t: Tensor) -> bool:
        """Whether t holds no NaN or inf (:func:`_finite_sum`'s question)."""
        return math.isfinite(self(t))


def _abs_peak(x: Tensor) -> Tensor:
    """max |x| as a 0-dim tensor on x's device (NaN if x holds one; 0 if empty), no host wait."""
    if x.numel() == 0:
        return x.new_zeros(())
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg())  # maximum propagates NaN


def _rows_may_hide_trouble(
    chosen: Backend,
    call: AttentionCall,
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    read: _OneRead | None = None,
) -> bool:
    """Whether finite, non-zero output rows may still be wrong, from a bound on the logits:
    O((L + S) * D), small next to the call's O(L * S * D).

    The tiled kernel turns a row whose logits all overflow to -inf into a finite one; a softcap
    turns an infinite product (from overflow, or from an inf in q or k) into a finite logit. Under
    a softcap a NaN bound (a NaN in q or k) counts too, as the cap hides an inf beside it. Without
    either, only a non-finite k leaves finite rows that need the careful path: where an inf's
    products with a query row are -inf, the key gets weight 0, yet it is a visible key with a
    non-finite k, so the row is NaN; and a NaN or inf at a key a mask hides from every row leaves
    the output right but the gradients NaN (0 times NaN in dS k). (An inf in q cannot: its row's
    products are all -inf, a zero row, or one is NaN or +inf.) The compiled kernel makes an
    infinite product's logit NaN, which its own row check reports, so only its gradients need
    the look at k. ``read``: the numbers fetched in one transfer (tensors on an accelerator).
    """
    finite, amax = (_finite_sum, abs_max) if read is None else (read.finite, read)
    if chosen is Backend.FUSED:
        return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad) and not finite(key)
    if chosen is not Backend.TILED and call.path.softcap is None:
        return not finite(key)
    bound = _logit_bound(call, amax(query), amax(key), attn_mask, alibi_slopes, amax)
    if not math.isfinite(bound):  # NaN: a NaN in q or k (inf: may_overflow says so too)
        return True
    return may_overflow(bound, accumulation_dtype(query.dtype))


def _cast_stats(stats: AttentionStats | None, dtype: torch.dtype) -> AttentionStats | None:
    if stats is None:
        return None
    return dataclasses.replace(
        stats, **{f.name: getattr(stats, f.name).to(dtype) for f in dataclasses.fields(stats) if f.name != "visible_keys" and getattr(stats, f.name) is not None}
    )


def _careful(
    run: _Run,
    chosen: Backend,
    call: AttentionCall,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    fast: tuple[Tensor, AttentionStats | None],
    peaks: Tensor,
    sinks: Tensor | None,
) -> tuple[Tensor, AttentionStats | None]:
    """The result of a call whose fast output has a NaN, inf or zero row (or, from the tiled
    kernel, logits that may overflow), by the documented rules.

    Non-finite inputs: the NaN rows come from :func:`_nan_rows` and every other row from inputs
    whose non-finite entries are 0 (they sit only where they cannot matter: in a NaN row's query or
    at keys hidden from the row). Then a row that :func:`_misfit` finds suspect is recomputed in
    float64 when the input dtype is narrower, differentiably, or refused.
    """
    acc = accumulation_dtype(query.dtype)
    out, stats = fast
    nan_rows = None
    q_max, k_max, v_max = (abs_max(x) for x in (query, key, value))
    if not all(math.isfinite(m) for m in (q_max, k_max, v_max)):  # a cheap pass before the per-row test
        with torch.no_grad():
            bad_q = ~torch.isfinite(query).all(dim=-1)  # (..., H, L)
            bad_kv = ~torch.isfinite(key).all(dim=-1) | ~torch.isfinite(value).all(dim=-1)  # (..., Hkv, S)
            nan_rows = _nan_rows(chosen, call, bad_q, bad_kv, attn_mask)
        query, key, value = (torch.where(torch.isfinite(x), x, 0.0) for x in (query, key, value))
        out, stats = run(query, key, value)
        peaks = _row_peaks(out)
        q_max, k_max = abs_max(query), abs_max(key)
    bound = functools.cache(lambda: _logit_bound(call, q_max, k_max, attn_mask, alibi_slopes))  # only when needed, once
    # Finite rows are right unless the logits may overflow where that leaves them finite: the
    # tiled kernel's exp floor, and any softcap (it caps an overflowed product to a finite logit).
    trust_finite = chosen is not Backend.TILED and call.path.softcap is None
    if _misfit(peaks, nan_rows, lambda: may_overflow(bound(), acc), trust_finite):
        if acc == torch.float64:
            _refuse_overflow(call, query, key, value, acc, bound())
        out, stats = _wide_run(run, chosen, call, query, attn_mask, alibi_slopes, sinks)(query.double(), key.double(), value.double())
        if _misfit(_row_peaks(out), nan_rows, lambda: may_overflow(bound(), torch.float64), trust_finite):
            _refuse_overflow(call, query, key, value, acc, bound())
        # A convex combination of values (weights summing to at most 1) fits the values' dtype.
        out, stats = out.to(query.dtype), _cast_stats(stats, acc)
    if nan_rows is not None:
        out = out.masked_fill(nan_rows[..., None], math.nan)
        if stats is not None:
            stats = with_nan_rows(stats, nan_rows)
    return out, stats


def _wide_run(
    run: _Run, chosen: Backend, call: AttentionCall, query: Tensor, attn_mask: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None
) -> _Run:
    """The backend of the float64 recompute: the chosen one, except torch's SDPA, whose float64
    backward returns NaN gradients for logits near 1e60 (torch 2.13 on CPU, e.g. B=2 H=4 L=S=64
    D=32 with |q|, |k| ~ 1e30; tests/test_hostile.py), and FlexAttention, whose compiled kernels
    take no float64 on CPU: attnscale's own kernel computes those (the math backend for dropout
    or learned ALiBi slopes, which the kernels lack)."""
    if chosen not in (Backend.TORCH, Backend.FLEX):
        return run
    learned = alibi_slopes is not None and alibi_slopes.requires_grad
    own = Backend.MATH if call.dropout_p > 0.0 or learned else _kernel(call, query, attn_mask)[0]
    return _run_backend(own, call, attn_mask, alibi_slopes, sinks)


def may_overflow(bound: float, dtype: torch.dtype) -> bool:
    """Whether logits bounded by ``bound`` may leave the range of ``dtype`` (with room for rounding)."""
    return bound >= torch.finfo(dtype).max / 2


def _misfit(peaks: Tensor, nan_rows: Tensor | None, may_overflow: Callable[[], bool], trust_finite: bool) -> bool:
    """Whether, by its row peaks (:func:`_row_peaks`), an output row that is not to be NaN is
    non-finite, or may be wrong because logits may have overflowed (``may_overflow()``, asked only
    then): a zero row may be one whose logits all became -inf, and without ``trust_finite`` (the
    tiled kernel, whose exp floor gives such a row uniform weights) any row may be."""
    if nan_rows is not None:
        peaks = peaks.masked_fill(nan_rows, 1.0)
    if not bool(torch.isfinite(peaks).all()):
        return True
    return (not trust_finite or bool((peaks == 0).any())) and may_overflow()


def _refuse_overflow(call: AttentionCall, query: Tensor, key: Tensor, value: Tensor, acc: torch.dtype, bound: float) -> NoReturn:
    """Refuse finite inputs whose result does not fit even float64: blame the logits if their
    bound exceeds float64's range, else the values."""
    if bound < torch.finfo(torch.float64).max / 2:
        fail(
            "value",
            "values whose weighted sums fit float64",
            f"{value.dtype} values up to |v| = {abs_max(value):.3g}",
            "rescale value before attention (and the output after it)",
        )
    fail(
        "query/key",
        f"products q.k * scale (plus ALiBi and float-mask values) that fit {acc}, or float64 after a recompute",
        f"{query.dtype} inputs with entries up to |q| = {abs_max(query):.3g}, |k| = {abs_max(key):.3g}, scale = {call.path.scale:.3g}",
        "rescale query or key (e.g. normalise them, as QK-norm does) or pass a smaller scale",
    )


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
            broadcastable to (..., H, L, S); a 0-d or (S,) mask broadcasts as in torch. May be
            combined with ``is_causal``: both apply. (torch 2.13 on CPU applies both in its fused
            kernel and raises a RuntimeError wherever it falls back to its math kernel: with
            dropout, ``Dv != D``, inputs of other than 4 dims, a mask that requires grad, or one
            key/value head without ``enable_gqa``. It never ignores one of the two.)
        dropout_p: dropout on the attention weights, reproducible under ``torch.manual_seed``.
        is_causal: hide keys after each query's aligned position; see ``causal_alignment``.
        scale: finite positive multiplier of q.k that fits the accumulation dtype (at most
            3.4e38 unless the inputs are float64); ``None`` means ``1/sqrt(D)``.
        enable_gqa: allow H != Hkv; query head h reads key/value head ``h // G``. Without it a
            single key/value head (Hkv = 1) still broadcasts to every query head, as in torch;
            any other Hkv != H raises.
        causal_alignment: where the diagonal sits when L != S, drawn for L = 2, S = 5::

            "top_left" (PyTorch)      "bottom_right" (FlashAttention)
                x . . . .                 x x x x .
                x x . . .                 x x x x x

        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2), after the
            scale and before bias and masks; hidden keys still get exactly zero weight. Finite,
            positive, and within the accumulation dtype like ``scale``.
        alibi_slopes: (H,) or (B, H), finite; adds ``-slope * |i' - j|`` after scale and softcap
            (never scaled), ``i'`` the aligned query position. See ``attnscale.alibi_slopes``.
        window: ``(left, right)``; key j is visible to aligned query i' iff
            ``i' - left <= j <= i' + right``. ``None`` or ``-1`` on a side means unlimited; a
            finite side is at most ``2**62 - 1`` (larger ones raise).
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
            On CUDA tensors ``"flex"`` comes before ``"math"`` and ``"tiled"`` wherever it can run.
            ``"torch"`` forces ``torch.nn.functional.scaled_dot_product_attention`` (ALiBi, windows
            and bottom-right alignment become an explicit mask, sinks one more key with a zero
            value; softcap and return_stats raise);
            ``"math"`` forces attnscale's dense implementation, O(L * S) memory; ``"tiled"`` forces
            the online-softmax kernel of :mod:`attnscale.tiled`, O(L + S) memory, no dropout,
            statistics other than lse carry no gradient; ``"flex"`` runs the same score path on
            torch's FlexAttention (:mod:`attnscale.flex`; compiled on CUDA, forward only on CPU),
            no dropout, ALiBi slopes and float masks as constants, statistics as on ``"tiled"``.
            :func:`last_backend` says which one ran.

    Softmax and accumulation run in float32 (float64 for float64 inputs) whatever the input dtype,
    so fp16 products above 65504 stay finite; the output has the input dtype. A row with no visible
    key returns zeros, with zero gradients, never NaN.

    Logits beyond the accumulation dtype (finite inputs with ``|q| |k| scale`` above 3.4e38 in
    float32) are computed again in float64 when the inputs are narrower, so the result is the
    float64 one; where float64 overflows too, a ValueError says so.

    NaN or infinite entries in q, k or v mark a vector missing, on every backend as in
    :func:`attnscale.reference.attention`: an output row is NaN iff its query row has such an entry
    and the row has at least one visible key, or a key visible to the row has one in k or v. Keys
    hidden from a row (mask, causal, window, ``-inf`` in a float mask) never affect it, and a row
    with no visible key is zeros. NaN rows have NaN statistics (``visible_keys`` excepted), and
    gradients stay finite: NaN rows pass none back. Both cases cost the fast path one check of
    the output, O(L * Dv), and one sum over k, O(S * D) (the compiled kernel: only when gradients
    are wanted, as it reports an infinite logit itself; the tiled kernel: a bound on the logits,
    O((L + S) * D), instead): an inf in k whose products with a row are all -inf gives that key
    weight 0 and the row a finite output. Only when a row is NaN, inf or zero, or k holds a NaN
    or inf, is the call diagnosed further.

    Under torch.compile and torch.export, and for FakeTensor, meta or torch.func-wrapped inputs,
    the call traces as one graph (the compiled kernel is ``torch.ops.attnscale.fused_forward``)
    and every check that needs values is skipped: finite slopes, sinks and float-mask values, the
    NaN-row rule and the float64 recompute (docs: torch.compile, export and torch.func).
    ``torch.jit.trace`` is refused.

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
    # Static checks -> choose -> call the backend; then, in eager mode only, the checks of the
    # output that need values (see attnscale._tracing): none of it while tracing.
    refuse_jit_trace("scaled_dot_product_attention")
    out = _plain_softcapped(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, softcap, alibi_slopes, window, sinks,
        return_stats, backend,
    )  # fmt: skip
    if out is not None:
        return out
    traced = tracing(query, key, value)
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
        values=not traced,
    )
    if attn_mask is not None and attn_mask.ndim < 2:
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.ndim) + tuple(attn_mask.shape))  # (S,) -> (1, S), as torch broadcasts
    slopes_need_grad = alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled()
    chosen, why = _choose(
        call,
        query,
        attn_mask,
        slopes_need_grad=slopes_need_grad,
        flex_cannot=lambda: _flex_cannot(query, key, value, call, attn_mask, alibi_slopes, sinks),
    )
    run = _run_backend(chosen, call, attn_mask, alibi_slopes, sinks)
    rows_ok: Tensor | None = None
    if chosen is Backend.FUSED:  # the kernel checks its rows as it writes them
        out, stats, rows_ok = fused_attention_checked(
            query, key, value, path=call.path, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=call.return_stats
        )
    else:
        out, stats = run(query, key, value)
    if not traced:
        peaks = _row_peaks(out) if rows_ok is None else None
        read = None if peaks is None or query.is_cpu else _OneRead(peaks, (query, key, alibi_slopes), attn_mask)
        if read is not None:
            suspect = not read.rows_look_right() or _rows_may_hide_trouble(chosen, call, query, key, attn_mask, alibi_slopes, read)
        else:
            suspect = not (_rows_look_right(peaks) if rows_ok is None else bool(rows_ok)) or _rows_may_hide_trouble(chosen, call, query, key, attn_mask, alibi_slopes)
        if suspect:
            peaks = _row_peaks(out) if peaks is None else peaks
            out, stats = _careful(run, chosen, call, query, key, value, attn_mask, alibi_slopes, (out, stats), peaks, sinks)
        _record(chosen, why)
    if call.return_stats:
        assert stats is not None
        return out, stats
    return out
