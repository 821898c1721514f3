"""The compiled kernel as torch.library custom ops: ``torch.ops.attnscale.fused_forward`` and
``torch.ops.attnscale.fused_backward``.

torch.compile, torch.export, FakeTensor / meta tensors, ``torch.func`` and ``torch.jit.trace`` see
one op per call: a fake rule gives every output's shape and dtype (statistics included) without
the kernel, an autograd rule runs the kernel's backward, and a vmap rule folds the mapped dim into
the kernel's batch. The ops take the kernel's own layout (``fused.py`` makes it with plain torch
ops, which trace as they are):

    q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)   one dtype, rows BLAS can read: float32,
                                                           float64, bfloat16 or float16
    alibi (B, H) strided, mask (B, H, L, S) strided        None where absent
    spans (nseq, 4) int64                                  packed sequences (B = 1), else None

``fused_forward`` returns ``out (B, H, L, Dv), lse, m, l (B, H, L)``, the statistics
``max_logit, max_prob, entropy, visible_keys`` (B, H, L) (float32 for 16-bit inputs; out too, but
with ``round_out``: then in their format, rounded as its rows are written), or empty tensors without
``with_stats``, and ``rows_ok``, a 0-d bool tensor: whether every output row is finite and not
all zeros (the check :func:`attnscale.scaled_dot_product_attention` makes of its outputs in eager
mode). Only ``out`` and ``lse`` carry gradients. ``block_q``/``block_k`` of 0 take the defaults,
chosen inside the op from the actual sizes, so a traced graph does not depend on them.
``half_products`` (16-bit inputs; :func:`half_products` gives it): multiply the 16-bit tiles as
they are, or convert each tile to float32 inside the kernel (the backward then takes float32
copies); either way the softmax, statistics and output are float32.
``fused_backward`` returns ``dq, dk, dv`` in the inputs' dtype, with dk, dv per key head.

The backward has no derivative of its own: first-order gradients work everywhere (also under
``create_graph=True`` and torch.func.grad), and differentiating them again raises a RuntimeError
that names ``backend="math"``, which computes it (:mod:`attnscale._autograd`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import typing
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch._C._functorch import unwrap_if_dead as _unwrap_if_dead

from .. import _autograd
from .._autograd import first_order
from .._tracing import _functorch_wrapped, constant_result, tracing
from . import _HEADERS, _SOURCE, load

__all__ = ["BLOCK_K", "BLOCK_K_FEW_ROWS", "BLOCK_Q", "FEW_ROWS", "HALF", "SHORT", "FusedForward", "KernelOptions", "KernelOutputs", "backward_forward", "default_blocks", "forward", "half_products", "run_forward", "setup_forward"]

# 256 query rows x 512 keys per tile, as torch's CPU flash kernel: each K/V tile, which BLAS packs
# anew for every product, serves twice the rows of a 128 x 512 tile; `benchmarks/bench_fused.py
# --blocks` compares the shapes.
BLOCK_Q = 256
# Under causality (or a window) a query block also multiplies the keys its rows cannot see, up to
# the block's diagonal: a share of about BLOCK_Q / L of the work. Below SHORT query rows such
# calls take blocks of BLOCK_Q // 2 rows (`benchmarks/bench_monitor.py --train` times L = 512).
SHORT = 2048
BLOCK_K = 512
# With few query rows (decoding) each tile's products are matrix-vector ones: wider key tiles
# mean fewer BLAS calls per row.
BLOCK_K_FEW_ROWS = 2048
FEW_ROWS = 16

class KernelOptions(NamedTuple):
    """Everything the kernel takes besides its tensors, by name: the ops' arguments after ``q, k,
    v, alibi, mask, spans``, in this order (a custom op's schema is positional), and the compiled
    kernel's keyword arguments of the same names. The backward takes all but ``with_stats`` and
    ``round_out``. Callers build one by name, so a swapped int or bool cannot pass silently."""

    scale: float
    softcap: float = 0.0  # 0: none
    causal: bool = False
    q_offset: int = 0  # query row i sits at key position i + q_offset
    left: int = -1  # window sides; -1: unbounded
    right: int = -1
    q_start: int = 0  # global positions of the first query row and key (context parallelism)
    k_start: int = 0
    with_stats: bool = False
    block_q: int = 0  # 0: the defaults, from the actual sizes (default_blocks)
    block_k: int = 0
    half_products: bool = False  # 16-bit inputs: multiply them as they are (else float32 tiles)
    round_out: bool = False  # 16-bit inputs: write out rounded to their format

    def backward_args(self) -> tuple[object, ...]:
        """The backward op's arguments after its tensors (:data:`BACKWARD_FIELDS`)."""
        return tuple(getattr(self, name) for name in BACKWARD_FIELDS)


BACKWARD_FIELDS = tuple(name for name in KernelOptions._fields if name not in ("with_stats", "round_out"))
"""The options ``fused_backward`` takes after its tensors, in its order."""


class KernelOutputs(NamedTuple):
    """The forward's outputs: ``out`` (B, H, L, Dv), ``lse``, ``m``, ``l`` (B, H, L), the
    statistics (B, H, L), empty without ``with_stats``, and ``rows_ok`` (0-d bool)."""

    out: Tensor
    lse: Tensor
    m: Tensor
    l: Tensor  # noqa: E741 - the softmax normaliser, as FlashAttention names it
    max_logit: Tensor
    max_prob: Tensor
    entropy: Tensor
    visible_keys: Tensor
    rows_ok: Tensor


_OUTPUTS = len(KernelOutputs._fields)

HALF = (torch.bfloat16, torch.float16)
_HALF_KIND = {torch.bfloat16: 1, torch.float16: 2}  # fused.cpp's Half16
_HALF_ENV = "ATTNSCALE_HALF_PRODUCTS"


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def _half_hardware(dtype: torch.dtype) -> bool:
    """Whether the CPU multiplies ``dtype`` tiles natively (bfloat16: AVX512-BF16 or AMX; float16:
    AVX512-FP16 or AMX-FP16). Elsewhere oneMKL's 16-bit products emulate and the kernel converts
    each tile to float32 instead."""
    flags = _cpu_flags()
    if dtype == torch.bfloat16:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    return bool({"avx512_fp16", "amx_fp16"} & flags)


def half_products(dtype: torch.dtype, rows: int | None = None, group: int = 1) -> bool:
    """Whether the kernel takes ``dtype`` q, k, v as they are, multiplying them in that format with
    float32 accumulation (bfloat16 with an even head dim through torch's brgemm where it runs,
    from AVX-512 on; otherwise oneMKL), rather than as float32 tiles converted in the kernel. Both give
    float32 softmax, statistics and output; the 16-bit path also rounds the weights to ``dtype``
    for the second product, as torch's CPU kernel does. A call of at most ``FEW_ROWS`` query
    ``rows`` with one query head per key head (``group``) takes float32 tiles: there each key and
    value row serves a few products, and converting it in the kernel costs less than packing it
    for the 16-bit products. With grouped heads the 16-bit path stays: the tiles convert each
    key and value row once per query head. ``ATTNSCALE_HALF_PRODUCTS=1`` (or ``0``) forces the
    choice on any CPU and call, e.g. to test both paths. A constant to torch.compile: a traced
    graph keeps the choice it was traced with (under dynamic shapes, a guard on the rows)."""
    if dtype not in HALF:
        return False
    if rows is not None and group == 1 and rows <= FEW_ROWS:  # of symbolic sizes: a guard
        return _half_products(dtype, True)
    return _half_products(dtype, False)


@constant_result
def _half_products(dtype: torch.dtype, few_rows: bool) -> bool:  # dtype in HALF
    forced = os.environ.get(_HALF_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{_HALF_ENV}: expected 0 or 1 (or unset: chosen from the CPU), got {forced!r}. Fix: unset it or pass 0 or 1")
    kernel = load()
    if kernel is None or not kernel.half_gemm(_HALF_KIND[dtype]):
        if forced == "1":  # asked for, and not to be had: never silent float32 tiles
            raise RuntimeError(
                f"{_HALF_ENV}=1: expected 16-bit products, got "
                f"{'no compiled kernel' if kernel is None else 'a torch without oneMKL 16-bit products'}. "
                f"Fix: unset {_HALF_ENV} (or set it to 0) to take float32 tiles"
            )
        return False
    if forced:
        return forced == "1"
    return not few_rows and _half_hardware(dtype)


def default_blocks(causal: bool, windowed: bool, L: int, spans: Tensor | None, *, packed: bool = False) -> tuple[int, int]:
    """(block_q, block_k) for a call with L query rows (packed: its longest sequence's, read from
    ``spans``, or given as L with ``packed``; a table that is not (nseq, 4) is left for the kernel
    to refuse)."""
    rows = L
    if spans is not None and spans.ndim == 2 and spans.shape[1] == 4:
        rows = int((spans[:, 1] - spans[:, 0]).max()) if spans.numel() else 0
    block_q = BLOCK_Q // 2 if (causal or windowed) and rows < SHORT else BLOCK_Q
    block_k = BLOCK_K_FEW_ROWS if spans is None and not packed and L <= FEW_ROWS else BLOCK_K
    return block_q, block_k


def _blocks(block_q: int, block_k: int, causal: bool, left: int, right: int, L: int, spans: Tensor | None) -> tuple[int, int]:
    default_q, default_k = default_blocks(causal, left >= 0 or right >= 0, L, spans)
    return block_q or default_q, block_k or default_k


def _bad(arg: str, expected: str, got: object) -> ValueError:
    return ValueError(f"torch.ops.attnscale: {arg}: expected {expected}, got {got}. Fix: pass the kernel's layout and options (see attnscale.kernels.ops)")


def _kernel():
    kernel = load()
    if kernel is None:
        from . import unavailable_reason

        raise RuntimeError(f"torch.ops.attnscale: the compiled kernel is unavailable ({unavailable_reason()}); use backend='tiled'")
    return kernel


def _schema(tensors: str, fields: tuple[str, ...], returns: int, tail: str = "") -> str:
    """A custom op's schema: its tensors, then the named options with their types (from
    :class:`KernelOptions`), so the ops' signatures follow the record and never restate it; then
    ``tail``, if any."""
    kinds = {float: "float", bool: "bool", int: "int"}
    hints = typing.get_type_hints(KernelOptions)
    options = ", ".join([*(f"{kinds[hints[name]]} {name}" for name in fields), *([tail] if tail else [])])
    return f"({tensors}, {options}) -> ({', '.join(['Tensor'] * returns)})"


_BUILD_SOURCES = (Path(__file__), Path(_autograd.__file__), _SOURCE, *sorted(_HEADERS.glob("*.h")))
"""Every source of the ops' behaviour: the Python of their fake and autograd rules (this module,
``attnscale._autograd``) and the kernel's C++."""


def _build_id(sources: tuple[Path, ...] = _BUILD_SOURCES) -> int:
    """A number (60 bits) that changes with any of ``sources``."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    return int(digest.hexdigest()[:15], 16)


BUILD = _build_id()
"""The ``build`` a traced call passes ``fused_forward``: torch.compile's caches key a graph by its
code, which names a custom op and its arguments but not what the op does, so a graph traced
against another attnscale (an op of another schema, or autograd rule) would be replayed from the
cache on disk. The op reads nothing of it."""


def _options(options: tuple) -> KernelOptions:
    """The options of a ``fused_forward`` call (``build`` after them, where passed, left out)."""
    return KernelOptions(*options[: len(KernelOptions._fields)])


@torch.library.custom_op(
    "attnscale::fused_forward",
    mutates_args=(),
    schema=_schema("Tensor q, Tensor k, Tensor v, Tensor? alibi, Tensor? mask, Tensor? spans", KernelOptions._fields, _OUTPUTS, "int build=0"),
)
def fused_forward(q: Tensor, k: Tensor, v: Tensor, alibi: Optional[Tensor], mask: Optional[Tensor], spans: Optional[Tensor], *options) -> tuple[Tensor, ...]:
    """The kernel's forward as an op: the options positionally, in :class:`KernelOptions`' order,
    then (optional) ``build``, :data:`BUILD` in a traced call, which the op does not read."""
    return tuple(run_forward(q, k, v, alibi, mask, spans, _options(options)))


def run_forward(q: Tensor, k: Tensor, v: Tensor, alibi: Tensor | None, mask: Tensor | None, spans: Tensor | None, options: KernelOptions) -> KernelOutputs:
    """What ``fused_forward`` computes, on real CPU tensors: the kernel's forward itself. The kernel
    checks its arguments (csrc/checks.h, one place for the ops and the binding): an inconsistent
    call raises a ValueError that names the argument before anything is read."""
    if not (options.block_q and options.block_k):  # (a planned call's are resolved already)
        block_q, block_k = _blocks(options.block_q, options.block_k, options.causal, options.left, options.right, q.shape[2], spans)
        options = options._replace(block_q=block_q, block_k=block_k)
    # The kernel makes every output, the empty statistics and the verdict too (see fused.cpp); it
    # reads the options by position, in KernelOptions' order (checked when it loads).
    return KernelOutputs(*_kernel().forward_ordered(q, k, v, alibi, mask, spans, options))


def run_direct(q: Tensor, k: Tensor, v: Tensor, alibi: Tensor | None, sinks: Tensor | None, options: KernelOptions) -> tuple:
    """:func:`run_forward` of a planned eager call that no gradient is asked of (no mask, no spans,
    tiles resolved), with only what its caller reads: ``(out, lse, rows_ok)``, or with statistics
    ``(out, lse, max_logit, max_prob, entropy, visible_keys, rows_ok)``; ``rows_ok`` a bool.
    ``alibi``: validated slopes, (H,) or (B, H) of any float dtype (the kernel reads them as they
    are, converted to the accumulation dtype where they are not in it); ``sinks`` (H,) are merged
    into ``out`` as ``sink_scale`` merges them (for 16-bit inputs ``options.round_out`` must then
    be off: the rows stay float32)."""
    return _kernel().forward_direct(q, k, v, alibi, sinks, options)


def _same_device(q: Tensor, **others: Tensor | None) -> None:
    """One device for every tensor (a meta tensor among CPU ones sends the op to its fake rule)."""
    for name, t in others.items():
        if t is not None and t.device != q.device:
            raise _bad(name, f"q's device {q.device}", f"device {t.device}")


@fused_forward.register_fake
def _(q, k, v, alibi, mask, spans, *options):
    _same_device(q, k=k, v=v, alibi=alibi, mask=mask, spans=spans)
    given = _options(options)
    with_stats, round_out = given.with_stats, given.round_out
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    rows = (B, H, L)
    stat = rows if with_stats else (0,)
    dt = torch.float32 if q.dtype in HALF else q.dtype  # 16-bit inputs: float32 outputs (out: with round_out, theirs)
    return (
        q.new_empty(B, H, L, v.shape[3], dtype=q.dtype if round_out else dt),
        q.new_empty(rows, dtype=dt),
        q.new_empty(rows, dtype=dt),
        q.new_empty(rows, dtype=dt),
        q.new_empty(stat, dtype=dt),
        q.new_empty(stat, dtype=dt),
        q.new_empty(stat, dtype=dt),
        q.new_empty(stat, dtype=torch.int64),
        q.new_empty((), dtype=torch.bool),
    )


@torch.library.custom_op(
    "attnscale::fused_backward",
    mutates_args=(),
    schema=_schema("Tensor q, Tensor k, Tensor v, Tensor dout, Tensor delta, Tensor m, Tensor l, Tensor? alibi, Tensor? mask, Tensor? spans, bool slope_grad", BACKWARD_FIELDS, 4),
)
def fused_backward(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, delta: Tensor, m: Tensor, l: Tensor, alibi: Optional[Tensor], mask: Optional[Tensor], spans: Optional[Tensor], slope_grad: bool, *options) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernel's backward as an op: the options positionally, in :data:`BACKWARD_FIELDS`' order.
    Returns dq, dk, dv in the inputs' dtype, and with ``slope_grad`` (learned slopes) the gradient
    of ``alibi`` in its shape (B, H) or (sequences, H) in the kernel's compute dtype; without it an
    empty (0, 0) tensor, and the backward computes none (fixed slopes pay nothing for it)."""
    given = KernelOptions(**dict(zip(BACKWARD_FIELDS, options)))  # with_stats and round_out: their defaults
    block_q, block_k = _blocks(given.block_q, given.block_k, given.causal, given.left, given.right, q.shape[2], spans)
    dtype = q.dtype
    if dtype in HALF and not given.half_products:  # the forward's float32 tiles: the same values, as whole copies
        q, k, v = q.float(), k.float(), v.float()
    kwargs = given._replace(block_q=block_q, block_k=block_k, half_products=True)._asdict()  # 16-bit here: multiplied as they are
    dq, dk, dv, dslope = _kernel().backward(
        q=q, k=k, v=v, dout=dout.contiguous(), delta=delta.contiguous(), m=m.contiguous(), l=l.contiguous(), alibi=alibi, mask=mask, spans=spans, slope_grad=slope_grad, **kwargs
    )
    B, H, Hkv, S = q.shape[0], q.shape[1], k.shape[1], k.shape[2]
    if dk.shape[1] != Hkv:  # per query head: a group's heads share k
        dk, dv = (t.view(B, Hkv, H // Hkv, S, t.shape[-1]).sum(2) for t in (dk, dv))
    if dtype in HALF:  # computed in float32 from 16-bit inputs: rounded once, to the inputs' format
        dq, dk, dv = dq.to(dtype), dk.to(dtype), dv.to(dtype)
    return dq, dk, dv, dslope


@fused_backward.register_fake
def _(q, k, v, dout, delta, m, l, alibi, mask, spans, slope_grad, *options):
    _same_device(q, k=k, v=v, dout=dout, delta=delta, m=m, l=l, alibi=alibi, mask=mask, spans=spans)
    slopes = (0, 0) if alibi is None or not slope_grad else (spans.shape[0] if spans is not None else q.shape[0], q.shape[1])
    dslope = q.new_empty(slopes, dtype=torch.float32 if q.dtype in HALF else q.dtype)
    return torch.empty_like(q, memory_format=torch.contiguous_format), k.new_empty(k.shape), v.new_empty(v.shape), dslope


def setup_forward(ctx, inputs, output) -> None:
    """The forward's autograd context: inputs, out and the normaliser (m, l) saved."""
    q, k, v, alibi, mask, spans, *options = inputs
    out, _, m, l, *rest = output
    ctx.save_for_backward(q, k, v, alibi, mask, spans, out, m, l)
    ctx.options, ctx.inputs = _options(options), len(inputs)
    ctx.mark_non_differentiable(m, l, *rest)  # only out and lse carry gradients


def backward_forward(ctx, dout, dlse, *unused):
    """Gradients of q, k, v and of learned ALiBi slopes through ``fused_backward`` (None for every
    other input)."""
    q, k, v, alibi, mask, spans, out, m, l = ctx.saved_tensors
    options: KernelOptions = ctx.options
    with torch.no_grad():  # the backward has no derivative: see first_order
        if out.dtype != l.dtype:  # a rounded out (round_out): D_i and the kernel's dout in float32
            out, dout = out.float(), dout.float()
        # D_i = rowsum(dO * O) - dlse_i (FlashAttention-2; a gradient on lse adds p dlse to dS)
        delta = (dout * out).sum(-1) - dlse
        learned = alibi is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dslope = fused_backward(q, k, v, dout, delta, m, l, alibi, mask, spans, learned, *options.backward_args())
    dslope = dslope.to(alibi.dtype) if learned else None  # (B, H): the caller's expand and cast take it to its slopes
    return first_order("fused", (q, k, v, alibi), dq, dk, dv, dslope) + (None,) * (ctx.inputs - 4)


fused_forward.register_autograd(backward_forward, setup_context=setup_forward)


def _fold(x: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """A vmapped (B, ...) argument as the kernel's (size * B, ...) batch (the mapped dim first)."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(x: Tensor, size: int) -> Tensor:
    return x.view(size, x.shape[0] // size, *x.shape[1:]) if x.numel() else x.new_empty(size, *x.shape)


@fused_forward.register_vmap
def _(info, in_dims, q, k, v, alibi, mask, spans, *options):
    if spans is not None:
        raise NotImplementedError("torch.func.vmap over attnscale's packed sequences: call varlen_attention once per batch entry")
    n = info.batch_size
    args = [_fold(x, d, n) for x, d in zip((q, k, v, alibi, mask), in_dims[:5])]
    outputs = fused_forward(*args, None, *options)
    return tuple(_unfold(t, n) for t in outputs[:-1]) + (outputs[-1],), (0,) * (_OUTPUTS - 1) + (None,)


@fused_backward.register_vmap
def _(info, in_dims, q, k, v, dout, delta, m, l, alibi, mask, spans, slope_grad, *options):
    if spans is not None:
        raise NotImplementedError("torch.func.vmap over attnscale's packed sequences: call varlen_attention once per batch entry")
    n = info.batch_size
    args = [_fold(x, d, n) for x, d in zip((q, k, v, dout, delta, m, l, alibi, mask), in_dims[:9])]
    grads = fused_backward(*args, None, slope_grad, *options)
    return tuple(_unfold(t, n) for t in grads), (0, 0, 0, 0)


class FusedForward(torch.autograd.Function):
    """``fused_forward`` with the op's own autograd rule, as an autograd.Function that has a
    ``setup_context``: torch.func.grad and vjp transform it (in torch 2.13 they refuse the
    autograd rule of a custom op), vmap through the op's vmap rule; in eager autograd it runs
    the kernel without the op's dispatch (:func:`forward` says when)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, alibi, mask, spans, *options):  # type: ignore[override]
        if tracing(q, k, v, alibi, mask):
            return fused_forward(q, k, v, alibi, mask, spans, *options, BUILD)
        return tuple(run_forward(q, k, v, alibi, mask, spans, KernelOptions(*options)))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        setup_forward(ctx, inputs, output)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return backward_forward(ctx, *grads)


def _eager_apply(*args: object) -> tuple[Tensor, ...]:
    """``FusedForward.apply(*args)`` in eager mode, without the per-call ``inspect.signature``
    binding that ``autograd.Function.apply`` does for a Function with a ``setup_context`` (in torch
    2.13 the largest Python cost of a small call that a gradient is asked of: bench_overhead.py's
    learned-slopes case): FusedForward's forward takes every argument positionally and has no
    defaults, so that binding returns ``args`` unchanged. The rest is what ``apply`` does: dead
    functorch wrappers unwrapped, then the C++ Function's apply; with functorch transforms active,
    ``apply`` itself."""
    if torch._C._are_functorch_transforms_active():
        return FusedForward.apply(*args)
    tensors = tuple(_unwrap_if_dead(a) if a is not None else a for a in args[:6])  # q, k, v, alibi, mask, spans; then the options
    return super(torch.autograd.Function, FusedForward).apply(*tensors, *args[6:])


def forward(q: Tensor, k: Tensor, v: Tensor, alibi: Tensor | None, mask: Tensor | None, spans: Tensor | None, options: KernelOptions) -> KernelOutputs:
    """``fused_forward`` on its arguments, by the cheapest route that keeps its semantics: the op
    while tracing (one node for torch.compile and torch.export; its fake rule for FakeTensor and
    meta tensors), :class:`FusedForward` under torch.func transforms and wherever a gradient may
    be asked for, else the kernel itself (dispatching a Python custom op is a visible share of a
    decoding step: bench_fused.py's decoding case). The one route into the kernel for every caller."""
    if not tracing(q, k, v, alibi, mask):  # eager (the common case first: each check it passes costs)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (alibi is not None and alibi.requires_grad)):
            return KernelOutputs(*_eager_apply(q, k, v, alibi, mask, spans, *options))
        return run_forward(q, k, v, alibi, mask, spans, options)
    if not torch.compiler.is_compiling() and any(_functorch_wrapped(t) for t in (q, k, v, alibi, mask) if t is not None):
        return KernelOutputs(*FusedForward.apply(q, k, v, alibi, mask, spans, *options))
    return KernelOutputs(*fused_forward(q, k, v, alibi, mask, spans, *options, BUILD))  # compiling, or fake / meta tensors
