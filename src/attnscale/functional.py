"""``scaled_dot_product_attention``: the torch entry point.

Static checks (:mod:`attnscale._validate`) -> choose a backend (:mod:`attnscale.backends`) -> run
it -> check its output (:mod:`attnscale.guard`, eager calls only). A call whose answer was torch's
kernel as it is, or the compiled kernel's plan, is remembered by its signature in the compiled
kernel; a later one of that signature is that call, the checks of values and the guard's first
check, made there (:mod:`attnscale._remembered`)."""

from __future__ import annotations

import logging
import sys
import threading
from typing import NamedTuple

import torch
from torch import Tensor

from . import _remembered as memory
from . import backends, guard
from ._tracing import refuse_jit_trace, tracing
from ._validate import Backend, as_input_error, check_attention_call
from .backends import MATH_MAX_SCORES
from .guard import abs_max, may_overflow
from .kernels import CHECKS_MAX
from .masks import CausalAlignment, from_causal_bias
from .stats import AttentionStats

__all__ = ["MATH_MAX_SCORES", "Backend", "abs_max", "last_backend", "may_overflow", "record_backend", "scaled_dot_product_attention"]

log = logging.getLogger("attnscale")
_state = threading.local()
_AUTO, _TOP_LEFT = Backend.AUTO, CausalAlignment.TOP_LEFT


def last_backend() -> str | None:
    """Name of the backend that computed this thread's most recent attention call ("torch", "math",
    "tiled", "fused", "flex").

    Also logged at DEBUG level on the ``attnscale`` logger for every call. Calls traced by
    torch.compile or torch.export neither set it nor log.
    """
    backend = getattr(_state, "backend", None)
    return None if backend is None else backend.value


def record_backend(backend: Backend, why: object) -> None:
    """Make ``backend`` this thread's :func:`last_backend` and log why it ran (``why`` is formatted
    with str() only when the line is logged); for entry points that run a backend themselves
    (:func:`attnscale.varlen_attention`'s one kernel call)."""
    _state.backend = backend  # (a str: Backend is a StrEnum; its .value is read only when asked)
    if log.isEnabledFor(logging.DEBUG):  # (one call, where log.debug makes two, on every attention call)
        log.debug("attnscale attention ran backend=%s (%s)", backend, why)


def _is_causal_bias(mask: object) -> bool:
    """Whether ``mask`` is torch's ``CausalBias`` (whose module, which imports torch's compiler, is
    loaded once one has been made: attnscale does not import it)."""
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(mask, bias.CausalBias)


class _Recomputed(NamedTuple):
    """Why the float64 recompute's backend ran (formatted only when the line is logged)."""

    chosen: Backend
    why: object
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"float64 recompute: {self.chosen.value} ({self.why}) gave {self.dtype} rows that overflowed or may have"


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
            these semantics; ``"math"`` for dropout (or ALiBi slopes that require grad where the
            compiled kernel cannot run: its backward differentiates them, the tiled kernel's does not);
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
    # A call of a signature whose answer was torch's kernel as it is, or the compiled kernel's plan:
    # that call again, the checks of values and the guard's first check, in one compiled call (None:
    # the pipeline below runs, as on any call); arguments in the signature's order, no keywords.
    remembered = memory.call
    if remembered is not None and memory.may_take(dropout_p, backend):
        if (hit := remembered(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, softcap, alibi_slopes, window, sinks, return_stats, CHECKS_MAX)) is not None:
            if len(hit) == 3 and not log.isEnabledFor(logging.DEBUG):  # (record_backend's work, without its calls: the common answer)
                out, _state.backend, _why = hit  # (out, backend, why)
                return out
            return memory.answer(hit, sinks, record_backend)
    # Static checks -> choose -> call the backend; then, in eager mode only, the checks of the
    # output that need values (see attnscale._tracing): none of it while tracing.
    try:
        refuse_jit_trace("scaled_dot_product_attention")
        if attn_mask is not None and _is_causal_bias(attn_mask):  # torch's causal bias objects: what they mean
            attn_mask, is_causal, causal_alignment = from_causal_bias(attn_mask, is_causal, causal_alignment, query, key)
        traced = tracing(query, key, value, attn_mask, alibi_slopes, sinks)  # a mask mapped by vmap alone counts
        call = check_attention_call(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            causal_alignment=causal_alignment, backend=backend, softcap=softcap, alibi_slopes=alibi_slopes, window=window,
            return_stats=return_stats, sinks=sinks, values=not traced,
        )  # fmt: skip
        if attn_mask is not None and attn_mask.ndim < 2:
            attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.ndim) + tuple(attn_mask.shape))  # (S,) -> (1, S), as torch broadcasts
        c = backends.Call(call, query, key, value, attn_mask, alibi_slopes, sinks)
        implementation, why = backends.choose(c)
        result = implementation.run(c, query, key, value)
        if traced:
            out, stats = result.out, result.stats
        else:
            out, stats, recomputed_by = guard.check(implementation, c, result)
            if recomputed_by is None:
                record_backend(implementation.backend, why)
                if memory.may_take(dropout_p, backend):
                    memory.remember(c, implementation, memory.Passed(
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, alignment=causal_alignment, softcap=softcap, window=window, return_stats=return_stats
                    ), why)
            else:  # what computed the returned output, and why
                record_backend(recomputed_by, _Recomputed(implementation.backend, why, query.dtype))
        return (out, stats) if call.return_stats else out
    except (ValueError, TypeError) as exc:  # also RuntimeError, as torch raises for these (InputError)
        raise as_input_error(exc) from None


def transposed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None,
    window: tuple[int | None, int | None] | None,
    sinks: Tensor | None,
) -> Tensor:
    """``scaled_dot_product_attention(...).transpose(1, 2).contiguous()`` for 4-D inputs: out as
    (B, L, H, Dv), what HuggingFace's attention functions return (:mod:`attnscale.diagnostics.hf`).

    The same pipeline; a remembered call (``remembered_transposed_call`` in ``kernels/fused.cpp``)
    checks the rows of torch's output while it copies them into that layout, one read of them
    where the check and the copy made two."""
    remembered = memory.transposed_call
    if remembered is not None and memory.may_take(dropout_p, _AUTO):
        hit = remembered(query, key, value, attn_mask, is_causal, scale, enable_gqa, _TOP_LEFT, softcap, None, window, sinks, CHECKS_MAX)
        if hit is not None:
            out, _state.backend, why = hit  # (record_backend's work, as the common answer above)
            if log.isEnabledFor(logging.DEBUG):
                record_backend(_state.backend, why)
            return out
    out = scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, softcap=softcap,
        window=window, sinks=sinks,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous()
