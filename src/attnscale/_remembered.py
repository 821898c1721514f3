"""The compiled kernel's memory of the pipeline's answers.

Once the full pipeline (validation, ``backends.choose``, the guard) has answered a call by torch's
kernel as it is, or by the compiled kernel's plan, the compiled kernel remembers the answer under
the call's signature: every tensor's dtype and sizes (without a mask and with top-left alignment,
keys of any length), whether a mask, slopes or sinks require grad, every option as passed; for a
packed call its lengths' dtype and count and its longest query length, not the packed row counts
nor the lengths' values: each call's sequences are read from its lengths, as the pipeline's checks
read them. A later call of that signature is that same call, the checks of values the pipeline
makes of every call (a float mask below +inf, finite slopes, sinks below +inf, a packed call's
lengths and max_seqlen hints) and the guard's first check of its output, in one compiled call
(``remembered_call``, ``remembered_packed_call`` in ``kernels/fused.cpp``); anything they do not
pass (and anything else: another signature, a tensor subclass, tracing, a torch.func transform or
a torch-function mode, a named backend, dropout) takes the full pipeline. Nothing is answered
that the pipeline did not answer for the same signature, by the same kernel call.

:class:`attnscale.MultiHeadAttention`'s plain self-attention call reads the same memory
(``remembered_module_call``): where its attention's signature is remembered, the module's packed
projection, that call and its output projection run as one compiled call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import backends
from ._validate import Backend
from .kernels import fused
from .kernels import load as load_kernel
from .masks import CausalAlignment
from .stats import AttentionStats, with_sinks

call = None
"""The compiled kernel's ``remembered_call``, once a call has been remembered there."""
transposed_call = None
"""The compiled kernel's ``remembered_transposed_call`` (``remembered_call`` whose output is
``out.transpose(1, 2).contiguous()``: :func:`attnscale.functional.transposed_attention`), as ``call``."""
packed_call = None
"""The compiled kernel's ``remembered_packed_call``, once a packed call has been remembered there."""
module_call = None
"""The compiled kernel's ``remembered_module_call`` (:class:`attnscale.MultiHeadAttention`'s plain
self-attention call, whose attention is a remembered call), once a call has been remembered there."""
_function_mode = torch._C._is_torch_function_mode_enabled
_transforms_active = torch._C._are_functorch_transforms_active
_AUTO = Backend.AUTO


def _plain_dispatch() -> bool:
    """Outside any torch.func transform and torch-function mode (what the compiled calls ask
    themselves: ``plain_dispatch`` in ``kernels/fused.cpp``)."""
    return not _transforms_active() and not _function_mode()


def may_take(dropout_p: object, backend: object) -> bool:
    """Whether a call may take a remembered answer, or leave one: ``backend="auto"`` (as the enum),
    no dropout, and the call not traced by torch.compile. Every other option is part of the
    signature the compiled kernel looks up, and the compiled calls answer None themselves inside a
    torch.func transform or a torch-function mode (``plain_dispatch`` in ``kernels/fused.cpp``;
    :func:`remember` remembers nothing there)."""
    return backend is _AUTO and type(dropout_p) is float and dropout_p == 0.0 and not torch.compiler.is_compiling()


class Passed(NamedTuple):
    """A call's arguments as passed, as the compiled kernel's memory keys them."""

    is_causal: object
    scale: object
    enable_gqa: object
    alignment: object
    softcap: object
    window: object
    return_stats: object

    def torch_form(self, c: backends.Call) -> bool:
        """Whether these are the options a remembered call of torch's kernel takes: torch's own
        options only, attnscale's at their defaults (as objects)."""
        return (
            self.softcap is None and c.alibi_slopes is None and self.window is None and c.sinks is None and self.return_stats is False
            and self.alignment is CausalAlignment.TOP_LEFT
        )  # fmt: skip


def remember(c: backends.Call, implementation: backends.Implementation, passed: Passed, why: object) -> None:
    """Remember the pipeline's answer for this call's signature where it is torch's kernel with
    torch's own arguments (:func:`attnscale.backends.torch_arguments`; not for a mask that
    requires grad) or the compiled kernel's plan (:func:`attnscale.backends.kernel_plan`)."""
    global call, module_call, transposed_call
    kernel, mask = load_kernel(), c.attn_mask
    if kernel is None or not _plain_dispatch():
        return
    if implementation is backends.FUSED:
        plan, args = backends.kernel_plan(c), None
        if plan is None:
            return
    elif implementation is backends.TORCH and passed.torch_form(c):
        plan, args = None, backends.torch_arguments(c.spec, mask)
        if args is None or (mask is not None and mask.requires_grad):
            return
    else:
        return
    kernel.set_alignments(top_left=CausalAlignment.TOP_LEFT, bottom_right=CausalAlignment.BOTTOM_RIGHT)
    given = dict(
        q=c.query, k=c.key, v=c.value, mask=mask, is_causal=passed.is_causal, scale=passed.scale, enable_gqa=passed.enable_gqa,
        alignment=passed.alignment, softcap=passed.softcap, alibi_slopes=c.alibi_slopes, window=passed.window, sinks=c.sinks,
        return_stats=passed.return_stats, backend=implementation.backend, why=why,
    )  # fmt: skip
    if args is not None:
        remembered = kernel.remember_torch_call(**given, torch_causal=args.is_causal, torch_gqa=args.enable_gqa, torch_scale=None if args.defaults else args.scale)
    else:
        remembered = kernel.remember_kernel_call(**given, options=plan)
    if remembered:
        call, module_call, transposed_call = kernel.remembered_call, kernel.remembered_module_call, kernel.remembered_transposed_call


class PackedPassed(NamedTuple):
    """A packed call's arguments as passed (:func:`attnscale.varlen_attention`'s, but its tensors)."""

    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: object
    max_seqlen_k: object
    scale: object
    is_causal: object
    softcap: object
    window: object
    return_stats: object


def remember_packed(c: backends.Call, passed: PackedPassed, why: object) -> None:
    """Remember that one call of the compiled kernel computed this packed call whole, by its plan
    (:func:`attnscale.kernels.fused.packed_plan`, tiles chosen from the longest query length),
    where no gradient was asked and there are no sinks (their merge is torch ops on the packed
    rows). A later call of its signature runs that plan on the sequences its own lengths give,
    wherever the pipeline's checks of lengths pass them: the pipeline's choice and its guard's
    verdict on a whole call (the kernel's own, on its rows) turn on no length but the longest
    query's, which the signature holds."""
    global packed_call
    kernel, spans = load_kernel(), c.spans
    if kernel is None or not _plain_dispatch() or spans is None or spans.rows is None or c.sinks is not None:
        return
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (c.query, c.key, c.value, c.alibi_slopes)):
        return
    longest = max((q1 - q0 for q0, q1, _, _ in spans.rows), default=0)
    options = fused.packed_plan(c.query, c.key, c.value, path=c.spec.path, sinks=None, return_stats=c.spec.return_stats, longest=longest)
    if kernel.remember_packed_call(
        q=c.query, k=c.key, v=c.value, **passed._asdict(), alibi_slopes=c.alibi_slopes, sinks=None, table=spans.table, options=options, backend=Backend.FUSED, why=why
    ):
        packed_call = kernel.remembered_packed_call


def answer(hit: tuple, sinks: Tensor | None, record: Callable[[Backend, object], None]) -> Tensor | tuple[Tensor, AttentionStats]:
    """A remembered call's answer as the pipeline returns it (``hit``: ``remembered_call``'s or
    ``remembered_packed_call``'s), after ``record`` (:func:`attnscale.functional.record_backend`)
    of the backend that answered and why."""
    if len(hit) == 3:  # no statistics
        out, backend, why = hit
        record(backend, why)
        return out
    out, backend, why, lse, max_logit, max_prob, entropy, visible_keys = hit
    record(backend, why)
    found = AttentionStats._of(lse=lse, max_logit=max_logit, max_prob=max_prob, entropy=entropy, visible_keys=visible_keys)
    return out, found if sinks is None else with_sinks(found, sinks)
