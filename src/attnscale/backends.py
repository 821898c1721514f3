"""The backends of :func:`attnscale.scaled_dot_product_attention`, as data.

Each :class:`Implementation` says in one place what it computes (``cannot``: None, or why not,
with the refusal a caller who forces it gets), how it runs (``run``), and what the guard may
trust of its output (:mod:`attnscale.guard`). ``backend="auto"`` is the ordered walk of
:data:`AUTO` over them; a forced backend is the same question, answered with a refusal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import torch
from torch import Tensor

from . import flex
from ._tracing import under_vmap
from ._validate import AttentionCall, Backend, fail, remember
from .dense import accumulation_dtype, dense_attention
from .kernels import fused as fused_kernel
from .kernels.fused import fused_attention_checked
from .kernels.fused import supports as fused_supports
from .masks import add_bias, alibi_bias, slopes_learned
from .stats import AttentionStats
from .tiled import tiled_attention

__all__ = ["AUTO", "IMPLEMENTATIONS", "MATH_MAX_SCORES", "SDPA", "Call", "Implementation", "Refusal", "Result", "Spans", "Walk", "Why", "choose", "kernel_plan"]

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
"""torch's own SDPA, bound once at import (``torch.nn.functional.scaled_dot_product_attention``
is this object until someone replaces it): the ``"torch"`` backend calls it, so that replacing
torch's function with attnscale's (:func:`attnscale.patch_torch`) never sends attnscale back
into itself."""

MATH_MAX_SCORES = 2**26
"""``backend="auto"`` avoids the math backend above this many scores ``prod(batch) * H * L * S``:
it holds several (..., H, L, S) tensors (256 MiB each in float32 at this size)."""


class Spans(NamedTuple):
    """A packed call's sequences (:func:`attnscale.varlen_attention`): ``table`` (B, 4) int64, one
    row ``(q0, q1, k0, k1)`` per sequence, its query rows [q0, q1) and key rows [k0, k1); ``rows``,
    the same on the host (None while tracing, when no tensor value is read)."""

    table: Tensor
    rows: list[tuple[int, int, int, int]] | None


class Call(NamedTuple):
    """A validated call and its tensors: everything a backend reads (a tuple: made on every call).
    A packed call's q, k, v are (total, heads, d), its sequences in ``spans``."""

    spec: AttentionCall
    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None
    alibi_slopes: Tensor | None
    sinks: Tensor | None
    spans: Spans | None = None

    @property
    def slopes_need_grad(self) -> bool:
        return slopes_learned(self.alibi_slopes)

    def sequences(self, chosen: list[int]) -> Call:
        """A packed call of the sequences ``chosen`` only (indices into ``spans.rows``, which must
        be known), with their rows of per-sequence (B, H) slopes; (H,) slopes as they are."""
        assert self.spans is not None and self.spans.rows is not None
        rows = [self.spans.rows[b] for b in chosen]
        slopes = self.alibi_slopes[chosen] if self.alibi_slopes is not None and self.alibi_slopes.ndim == 2 else self.alibi_slopes
        return self._replace(spans=Spans(torch.tensor(rows, dtype=torch.int64).reshape(-1, 4), rows), alibi_slopes=slopes)


class Result(NamedTuple):
    out: Tensor
    stats: AttentionStats | None
    rows_ok: Tensor | bool | None
    """The backend's own verdict on its rows (a 0-d bool tensor, or a bool from an eager call of the
    compiled kernel: each finite and not all zeros); None: the guard reads the rows itself."""


class Refusal(NamedTuple):
    """Why an implementation cannot compute a call: ``reason`` for the log of ``auto``, the rest
    for the error a caller who forced it gets (see :func:`attnscale._validate.fail`)."""

    reason: str
    argument: str
    expected: str
    got: str
    fix: str

    def raise_(self) -> NoReturn:
        fail(self.argument, self.expected, self.got, self.fix)


_Run = Callable[[Call, Tensor, Tensor, Tensor], Result]


@dataclass(frozen=True)
class Implementation:
    """One backend: what it computes, how it runs, and what its output's check may trust."""

    backend: Backend
    cannot: Callable[[Call], Refusal | None]
    """None where it computes exactly this call, else why not."""
    run: _Run
    """The backend on (query, key, value), every other option from the call."""
    checks_rows: bool = False
    """Returns its rows' verdict, and makes a logit from an infinite product NaN (so only the
    gradients of a non-finite k need the guard's look)."""
    floors_exp: bool = False
    """Gives a row whose logits all overflow to -inf finite weights: a finite row may be wrong."""
    float64: bool = True
    """Runs the float64 recompute itself (else attnscale's own kernel does)."""


def _dropout_refusal(c: Call, backend: Backend) -> Refusal | None:
    """The compiled and tiled kernels' refusal of dropout."""
    if c.spec.dropout_p > 0.0:
        name = backend.value
        return Refusal(
            f"dropout (the {name} kernel has none)",
            "dropout_p",
            f"0.0 with backend={name!r} (the {name} kernel has no dropout)",
            repr(c.spec.dropout_p),
            "use backend='math' (or 'auto') for dropout",
        )
    return None


def _torch_cannot(c: Call) -> Refusal | None:
    reason = "softcap" if c.spec.path.softcap is not None else "return_stats" if c.spec.return_stats else None
    if reason is None:
        return None
    return Refusal(reason, "backend", f"a backend that implements {reason}", "'torch'", "use backend='auto' or backend='math'; torch's SDPA has no such option")


def learned_slopes_refusal(c: Call, backend: Backend) -> Refusal | None:
    """The tiled kernel's refusal of ALiBi slopes that require grad (it takes slopes as constants;
    the compiled kernel's backward returns their gradient)."""
    if not c.slopes_need_grad:
        return None
    name = backend.value
    return Refusal(
        f"alibi_slopes that require grad (the {name} kernel takes them as constants)",
        "alibi_slopes",
        f"constant slopes on the {name} backend",
        "a tensor that requires grad",
        "pass alibi_slopes.detach(), or backend='math' (or 'fused', where the compiled kernel runs) to learn the slopes",
    )


def _fused_cannot(c: Call) -> Refusal | None:
    refusal = _dropout_refusal(c, Backend.FUSED)
    if refusal is not None:
        return refusal
    reason = fused_supports(c.query, c.attn_mask)
    if reason is None:
        return None
    return Refusal(reason, "backend", "a call the compiled kernel can run", f"'fused' with {reason}", "use backend='tiled' (same semantics, eager) or 'auto'")


def _tiled_cannot(c: Call) -> Refusal | None:
    refusal = _dropout_refusal(c, Backend.TILED) or learned_slopes_refusal(c, Backend.TILED)
    if refusal is None and under_vmap():
        return Refusal(
            "under vmap, where the tiled kernel has no batching rule",
            "backend",
            "a backend with a batching rule under torch.func.vmap",
            "'tiled' (an autograd Function without one)",
            "use backend='auto' or 'math' (or 'fused' where the compiled kernel runs) inside vmap",
        )
    return refusal


def flex_refusal(reason: str) -> Refusal:
    """The refusal of ``backend="flex"`` for ``reason`` (also :func:`attnscale.varlen_attention`'s)."""
    return Refusal(reason, "backend", "a call FlexAttention can run", f"'flex' with {reason}", "use backend='tiled' (same semantics, eager) or 'auto'")


def _flex_cannot(c: Call) -> Refusal | None:
    reason = flex.cannot(
        device=c.query.device, dropout_p=c.spec.dropout_p, attn_mask=c.attn_mask, alibi_slopes=c.alibi_slopes, sinks=c.sinks, tensors=(c.query, c.key, c.value)
    )
    return None if reason is None else flex_refusal(reason)


def _streamed(kernel: Callable[..., tuple[Tensor, AttentionStats | None]]) -> _Run:
    def run(c: Call, query: Tensor, key: Tensor, value: Tensor) -> Result:
        out, stats = kernel(
            query, key, value, path=c.spec.path, attn_mask=c.attn_mask, alibi_slopes=c.alibi_slopes, sinks=c.sinks, return_stats=c.spec.return_stats
        )
        return Result(out, stats, None)

    return run


_PLANS: dict[int, tuple[AttentionCall, fused_kernel.Plan | None]] = {}
"""The compiled kernel's plan per validated call (by identity, the spec held, as in
:data:`_CHOSEN`): what its signature fixes of the kernel call, derived once (None: the call has a
mask, or its tensors have not the kernel's shapes, so it takes the general route every time; a
call whose tensors are not :func:`~attnscale.kernels.fused.direct` takes it that time)."""


def _run_fused(c: Call, query: Tensor, key: Tensor, value: Tensor) -> Result:
    spec = c.spec
    memo = _PLANS.get(id(spec))
    planned = memo is not None and memo[0] is spec and memo[1] is not None and c.attn_mask is None
    if planned and not c.slopes_need_grad and fused_kernel.direct(query, key, value, memo[1].dtype):  # (learned slopes: through autograd)
        return Result(*fused_kernel.run_planned(memo[1], query, key, value, c.alibi_slopes, c.sinks))
    result = Result(
        *fused_attention_checked(query, key, value, path=spec.path, attn_mask=c.attn_mask, alibi_slopes=c.alibi_slopes, sinks=c.sinks, return_stats=spec.return_stats)
    )
    if memo is None and not torch.compiler.is_compiling():
        plan = None if c.attn_mask is not None else fused_kernel.plan(query, key, value, path=spec.path, sinks=c.sinks is not None, return_stats=spec.return_stats)
        _remember(_PLANS, spec, plan)
    return result


def kernel_plan(c: Call) -> fused_kernel.ops.KernelOptions | None:
    """The compiled kernel's planned options for a call it has computed by its plan, for the
    compiled kernel's memory of answers (:func:`attnscale._remembered.remember`): a call with a
    feature torch lacks (so that ``auto`` takes the compiled kernel at every key length), no mask,
    and no sinks where a gradient is asked (their merge is torch ops then); else None. For 16-bit
    inputs the product path is the one a call made now takes (:meth:`fused_kernel.Plan.now`)."""
    memo = _PLANS.get(id(c.spec))
    if memo is None or memo[0] is not c.spec or memo[1] is None or c.attn_mask is not None or kernel_feature(c.spec) is None:
        return None
    if c.sinks is not None and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (c.query, c.key, c.value, c.alibi_slopes, c.sinks)):
        return None
    return memo[1].now()


def _remember(memo: dict, spec: AttentionCall, value: object) -> None:
    """Keep ``value`` for the validated call ``spec``, by identity, the spec held so that no other
    object takes its id (:func:`attnscale._validate.remember`'s bounded memo)."""
    remember(memo, id(spec), (spec, value))


def _run_math(c: Call, query: Tensor, key: Tensor, value: Tensor) -> Result:
    out, stats = dense_attention(
        query,
        key,
        value,
        path=c.spec.path,
        attn_mask=c.attn_mask,
        alibi_slopes=c.alibi_slopes,
        dropout_p=c.spec.dropout_p,
        sinks=c.sinks,
        return_stats=c.spec.return_stats,
    )
    return Result(out, stats, None)


class _TorchArgs(NamedTuple):
    """torch's own arguments for a call its kernel takes as it is (the mask passed as given)."""

    masked: bool
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    defaults: bool
    """Whether ``scale`` is torch's own default (1/sqrt(D), the same double) and there is no GQA:
    then the two are left out of the call, whose keywords cost torch's argument parser a few
    tenths of a microsecond."""


_TORCH_CALLS: dict[int, tuple[AttentionCall, _TorchArgs | None]] = {}
"""torch's own arguments per validated call (by identity, as :data:`_CHOSEN`), for a call torch's
kernel takes as it is (4-d tensors of one batch; no ALiBi, sinks or window; causal top-left and
no mask, or a bool mask or one of the query's dtype and no causal), else None."""


def torch_arguments(spec: AttentionCall, mask: Tensor | None) -> _TorchArgs | None:
    """torch's own arguments for a call of ``spec`` (and ``mask``) that its kernel takes as it is,
    once one such call has run; else None."""
    memo, owner = _TORCH_CALLS.get(id(spec)), spec
    if memo is None:
        family = spec.same_along_s()  # a step over a growing cache: torch's arguments do not turn on S
        if family is not None:
            memo, owner = _TORCH_CALLS.get(id(family)), family
    if memo is not None and memo[0] is owner and memo[1] is not None and memo[1].masked is (mask is not None):
        return memo[1]
    return None


def _run_torch(c: Call, query: Tensor, key: Tensor, value: Tensor) -> Result:
    spec, mask = c.spec, c.attn_mask
    args = torch_arguments(spec, mask)
    if args is not None:
        if args.defaults:
            return Result(TORCH_SDPA(query, key, value, mask, args.dropout_p, args.is_causal), None, None)
        return Result(TORCH_SDPA(query, key, value, mask, args.dropout_p, args.is_causal, scale=args.scale, enable_gqa=args.enable_gqa), None, None)
    out = torch_attention(query, key, value, spec, mask, c.alibi_slopes, c.sinks)
    if _TORCH_CALLS.get(id(spec)) is None and not torch.compiler.is_compiling():
        path = spec.path
        as_is = mask is None or (not path.causal and (mask.dtype is torch.bool or mask.dtype is query.dtype))
        plain = as_is and not spec.alibi and not spec.sinks and path.window is None and (not path.causal or path.q_offset == 0)
        as_given = query.ndim == 4 and query.shape[0] == key.shape[0] == value.shape[0]
        gqa = spec.H != spec.Hkv
        defaults = not gqa and spec.D > 0 and path.scale == 1.0 / math.sqrt(spec.D)  # (torch's default, computed as torch does)
        args = _TorchArgs(mask is not None, spec.dropout_p, path.causal, path.scale, gqa, defaults)
        _remember(_TORCH_CALLS, spec, args if plain and as_given else None)
    return Result(out, None, None)


TORCH = Implementation(Backend.TORCH, _torch_cannot, _run_torch, float64=False)
MATH = Implementation(Backend.MATH, lambda c: None, _run_math)
TILED = Implementation(Backend.TILED, _tiled_cannot, _streamed(tiled_attention), floors_exp=True)
FUSED = Implementation(Backend.FUSED, _fused_cannot, _run_fused, checks_rows=True)
FLEX = Implementation(Backend.FLEX, _flex_cannot, _streamed(flex.flex_attention), float64=False)
IMPLEMENTATIONS = {i.backend: i for i in (TORCH, MATH, TILED, FUSED, FLEX)}


def kernel_feature(spec: AttentionCall) -> str | None:
    """A feature of the score path that torch's fused kernel lacks and the kernels stream (None if none)."""
    path = spec.path
    if path.softcap is not None:
        return "softcap"
    if spec.return_stats:
        return "return_stats"
    if spec.alibi:
        return "alibi_slopes"
    if spec.sinks:
        return "sinks"
    if path.window is not None:
        return "window"
    if path.causal and path.q_offset != 0:
        return "bottom_right causal alignment with L != S"
    return None


def torch_lacks(spec: AttentionCall) -> str | None:
    """What of this call torch's fused kernel does not compute exactly (None: it computes it all)."""
    feature = kernel_feature(spec)
    if feature is not None:
        return feature
    if spec.D != spec.Dv:
        return "value head dim differs from query head dim"
    if spec.dropout_p > 0.0:
        return "dropout (torch's fused CPU kernel has none)"
    if spec.L == 0 or spec.S == 0:
        return "empty length"
    return None


def _math_first(c: Call) -> str | None:
    """None where auto takes the math backend before the kernels: for dropout (which the kernels
    lack), for learned ALiBi slopes where the compiled kernel cannot run (the tiled kernel takes
    them as constants), and for calls without a kernel feature up to :data:`MATH_MAX_SCORES` scores."""
    spec = c.spec
    if spec.dropout_p > 0.0 or (c.slopes_need_grad and _fused_cannot(c) is not None):
        return None
    feature = kernel_feature(spec)
    if feature is not None:
        return feature
    scores = math.prod(spec.batch) * spec.H * spec.L * spec.S
    return f"{scores} scores > MATH_MAX_SCORES" if scores > MATH_MAX_SCORES else None


class Step(NamedTuple):
    """One step of ``auto``'s walk: the implementation, taken when it can compute the call and
    ``passes`` (why auto passes it over here, cheap and asked first) gives None."""

    implementation: Implementation
    passes: Callable[[Call], str | None]


AUTO = (
    Step(TORCH, lambda c: torch_lacks(c.spec)),
    Step(FLEX, lambda c: None if c.query.is_cuda else "not a CUDA tensor"),
    Step(MATH, _math_first),
    Step(FUSED, lambda c: None),
    Step(TILED, lambda c: None),
    Step(MATH, lambda c: None),  # where no kernel can: under vmap without the compiled kernel
)
"""``backend="auto"``: the first step that takes the call computes it."""


class Walk(NamedTuple):
    """What :func:`choose` asks for one kind of call: ``auto``'s steps, and the implementation
    each forced backend names."""

    auto: tuple[Step, ...]
    forced: Mapping[Backend, Implementation]


SDPA = Walk(AUTO, IMPLEMENTATIONS)
"""The walk of :func:`attnscale.scaled_dot_product_attention`'s calls."""


class Why:
    """Why :func:`choose` took its implementation, formatted only when read (a call's log line
    at DEBUG level): "requested", "auto", or "auto, passed over NAME: REASON; ..."."""

    __slots__ = ("passed",)

    def __init__(self, passed: tuple[tuple[str, str], ...] | None) -> None:
        self.passed = passed  # None: requested

    def __str__(self) -> str:
        if self.passed is None:
            return "requested"
        return "auto" + (", passed over " + "; ".join(f"{name}: {reason}" for name, reason in self.passed) if self.passed else "")


_REQUESTED = Why(None)


_CHOSEN: dict[int, tuple[AttentionCall, tuple[Implementation, Why]]] = {}
"""``auto``'s answer per validated call (by identity, the spec held so that no other object takes
its id), where it gave torch's kernel or the compiled one: those steps read the spec, what its
signature fixes (device, dtype) and whether a mask or slopes require grad, so a call whose mask
and slopes do not asks the walk once per signature (validation hands a signature's spec back
unchanged). Not while compiling: a traced call's spec is new each time."""


def choose(c: Call, walk: Walk = SDPA) -> tuple[Implementation, Why]:
    """The implementation that computes the call, and why: ``auto``'s walk over ``walk.auto``, or
    the forced backend, refused with its reason where it cannot compute exactly this call (also
    where no step of auto's walk can: the last step's refusal)."""
    memo = _CHOSEN.get(id(c.spec))
    if memo is not None and memo[0] is c.spec and _remembered_answer_holds(memo[1][0], c) and not torch.compiler.is_compiling():
        return memo[1]
    family = c.spec.same_along_s()  # a step over a growing cache: its family's choice of torch's kernel holds
    memo = _CHOSEN.get(id(family)) if family is not None else None
    if memo is not None and memo[0] is family and memo[1][0] is TORCH and _constant_inputs(c) and not torch.compiler.is_compiling():
        return memo[1]
    if c.spec.backend is not Backend.AUTO:
        implementation = walk.forced[c.spec.backend]
        refusal = implementation.cannot(c)
        if refusal is not None:
            refusal.raise_()
        return implementation, _REQUESTED
    passed: list[tuple[str, str]] = []
    refusal = None
    for implementation, passes in walk.auto:
        reason = passes(c)
        if reason is None:
            refusal = implementation.cannot(c)
            if refusal is None:
                chosen = implementation, Why(tuple(passed))
                if (implementation is TORCH or implementation is FUSED) and _remembered_answer_holds(implementation, c) and not torch.compiler.is_compiling():
                    _remember(_CHOSEN, c.spec, chosen)
                return chosen
            reason = refusal.reason
        passed.append((implementation.backend.value, reason))
    assert refusal is not None, "the last step of a walk takes every call it does not refuse"
    refusal.raise_()


def _remembered_answer_holds(implementation: Implementation, c: Call) -> bool:
    """Whether ``auto``'s answer for the call's signature is the answer for this call: where its
    inputs are constants (:func:`_constant_inputs`), and for the compiled kernel also where the
    slopes are learned (it takes them either way; a mask that requires grad it does not)."""
    return _constant_inputs(c, slopes=implementation is not FUSED)


def _constant_inputs(c: Call, *, slopes: bool = True) -> bool:
    """Whether neither the mask nor (with ``slopes``) the slopes require grad (what auto's answer
    may turn on besides the signature)."""
    mask = c.attn_mask
    return (mask is None or not mask.requires_grad) and not (slopes and c.alibi_slopes is not None and c.alibi_slopes.requires_grad)


def torch_attention(
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
    # (B, H, L, D) inputs of one batch, eager (int sizes: no guard on a symbolic one), are torch's
    # layout already: no views to make on the way in or out
    B = batch[0] if len(batch) == 1 else math.prod(batch)  # explicit, not -1: reshape cannot infer a dim of an empty tensor
    n_q, n_k, n_v = query.shape[0], key.shape[0], value.shape[0]
    as_given = query.ndim == 4 and type(n_q) is int and type(n_k) is int and type(n_v) is int and n_q == n_k == n_v == B
    if as_given:
        q, k, v = query, key, value
    else:
        q = query.expand(*batch, H, L, call.D).reshape(B, H, L, call.D)  # (B, H, L, D)
        k = key.expand(*batch, call.Hkv, S, call.D).reshape(B, call.Hkv, S, call.D)  # (B, Hkv, S, D)
        v = value.expand(*batch, call.Hkv, S, call.Dv).reshape(B, call.Hkv, S, call.Dv)  # (B, Hkv, S, Dv)
    gqa = True if H != call.Hkv else False  # noqa: SIM210 - a branch, so that dynamic shapes guard on it: a SymBool is no bool to torch's SDPA
    if attn_mask is None and alibi_slopes is None and sinks is None and path.window is None and (not path.causal or path.q_offset == 0):
        # torch's own call, its causal flag included (the common case, with no mask to build)
        out = TORCH_SDPA(q, k, v, None, call.dropout_p, path.causal, scale=path.scale, enable_gqa=gqa)
        return out if as_given else out.reshape(*batch, H, L, call.Dv)
    mask = _explicit_mask(query, call, attn_mask, alibi_slopes)
    if sinks is not None:
        mask = _with_sink_column(mask, sinks, (*batch, H, L, S), query.dtype)  # (..., H, L, S + 1)
        k = torch.cat([k, k.new_zeros(B, call.Hkv, 1, call.D)], dim=-2)  # (B, Hkv, S + 1, D)
        v = torch.cat([v, v.new_zeros(B, call.Hkv, 1, call.Dv)], dim=-2)  # (B, Hkv, S + 1, Dv)
    if mask is not None and not as_given:  # (torch broadcasts a mask to its (B, H, L, S) itself)
        mask = mask.reshape((1,) * (len(batch) + 3 - mask.ndim) + tuple(mask.shape))
        mh, ml, ms = mask.shape[-3:]
        if all(type(n) is int and n == 1 for n in mask.shape[:-3]):  # a symbolic size (tracing) takes the expand: no guard on it
            mask = mask.reshape(1, mh, ml, ms)  # (1, H or 1, L or 1, S or 1)
        else:
            mask = mask.expand(*batch, mh, ml, ms).reshape(B, mh, ml, ms)  # (B, H or 1, L or 1, S or 1)
    out = TORCH_SDPA(q, k, v, mask, call.dropout_p, False, scale=path.scale, enable_gqa=gqa)
    return out if as_given else out.reshape(*batch, H, L, call.Dv)


def _explicit_mask(query: Tensor, call: AttentionCall, attn_mask: Tensor | None, alibi_slopes: Tensor | None) -> Tensor | None:
    """The call's mask for torch's kernel: ``attn_mask`` with causal and window visibility and
    the ALiBi bias folded in, in the query's dtype where it is a float mask (None: no mask)."""
    path, L, S = call.path, call.L, call.S
    mask = attn_mask
    if path.causal or path.window is not None or alibi_slopes is not None:
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
    return mask


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
