"""``context_parallel_attention``: attention over a sequence sharded across a process group."""

from __future__ import annotations

import math
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import Tensor

from .. import backends, guard
from .._tracing import tracing
from .._validate import FLOAT_DTYPES, AttentionCall, check_attention_call, check_choice, fail
from ..backends import Call
from ..functional import record_backend
from ..masks import CausalAlignment, query_offset
from ..score import ScorePath
from ..stats import AttentionStats
from .agreement import Field, check_agreement, digest, float_bits, from_bits, gather_rows, text_code, text_of
from .layout import Layout, check_zigzag_length, segments
from .ring import RingPlan, ring_walk
from .ulysses import UlyssesPlan, ulysses_attention

__all__ = ["Method", "context_parallel_attention"]


class Method(StrEnum):
    """How the ranks share the work (see ``docs/distributed.md`` for the trade-off)."""

    RING = "ring"
    ULYSSES = "ulysses"


def _group_info(group: object) -> tuple[int, int, list[int]]:
    """This process's rank in ``group``, the group size, and the global rank of every group rank."""
    if not (dist.is_available() and dist.is_initialized()):
        fail(
            "group",
            "an initialised torch.distributed process group",
            "no default process group",
            "call torch.distributed.init_process_group(...) first (torchrun sets the environment)",
            exc=RuntimeError,
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        fail("group", "None (the default group) or a torch.distributed.ProcessGroup", type(group).__name__, "pass dist.new_group(...)", exc=TypeError)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        fail("group", "a group that contains this process", "a group without it", "call only from the group's members")
    peers = list(range(size)) if group is None else [dist.get_global_rank(group, r) for r in range(size)]
    return rank, size, peers


_BATCH_SLOTS = 6  # batch dims per tensor in the agreement row: a fixed length on every rank
_SHARD_FIX = "shard only the sequence axis (dim -2): every other dim must be the same on every rank"
_GRAD_FIX = "make it require grad on every rank or on none (the backward is collective too)"


def _same(arg: str) -> str:
    return f"pass the same {arg} on every rank: the call is collective"


def _one(show):
    return lambda v: show(v[0])


def _tensor(v: tuple[int, ...]) -> str:
    return "None" if not v[0] else f"a tensor with checksum {v[1] & (2**64 - 1):016x}"


def _batch(v: tuple[int, ...]) -> str:
    return str(tuple(n for n in v if n >= 0))


def _window(v: tuple[int, ...]) -> str:
    return "None" if v == (-1, -1) else str(tuple(None if n < 0 else n for n in v))


# Every argument the ranks must agree on, in the order the checks report them: dtype, device and
# shapes first, since a scale that differs only because D differs should be reported as D.
_FIELDS = (
    Field("query", "dtype", 1, "cast query, key and value to one dtype on every rank", _one(lambda c: str(FLOAT_DTYPES[c]).removeprefix("torch."))),
    Field("query", "device type", 1, "put every rank's tensors on the same kind of device", _one(text_of)),
    Field("query", "number of dims", 1, _SHARD_FIX, _one(str)),
    Field("query", "number of heads H (dim -3)", 1, _SHARD_FIX, _one(str)),
    Field("key", "number of key/value heads Hkv (dim -3)", 1, _SHARD_FIX, _one(str)),
    Field("query", "head dim D (dim -1)", 1, _SHARD_FIX, _one(str)),
    Field("value", "value head dim Dv (dim -1)", 1, _SHARD_FIX, _one(str)),
    Field("query", "batch shape (the dims before -3)", _BATCH_SLOTS, _SHARD_FIX, _batch),
    Field("key", "batch shape (the dims before -3)", _BATCH_SLOTS, _SHARD_FIX, _batch),
    Field("value", "batch shape (the dims before -3)", _BATCH_SLOTS, _SHARD_FIX, _batch),
    Field("alibi_slopes", "slopes", 2, _same("alibi_slopes"), _tensor),
    Field("sinks", "sink logits", 2, _same("sinks") + " (one parameter, replicated)", _tensor),
    Field("method", "method", 1, _same("method"), _one(lambda c: repr(tuple(Method)[c].value))),
    Field("layout", "layout", 1, _same("layout"), _one(lambda c: repr(tuple(Layout)[c].value))),
    Field("is_causal", "is_causal", 1, _same("is_causal"), _one(lambda b: str(bool(b)))),
    Field("causal_alignment", "causal_alignment", 1, _same("causal_alignment"), _one(lambda c: repr(tuple(CausalAlignment)[c].value))),
    Field("scale", "scale (after the 1/sqrt(D) default)", 1, _same("scale"), _one(lambda b: repr(from_bits(b)))),
    Field("softcap", "softcap", 2, _same("softcap"), lambda v: repr(from_bits(v[1])) if v[0] else "None"),
    Field("window", "window", 2, _same("window"), _window),
    Field("return_stats", "return_stats", 1, _same("return_stats"), _one(lambda b: str(bool(b)))),
    *(
        Field(arg, "requires_grad (with grad mode on)", 1, _GRAD_FIX, _one(lambda b: "requires grad" if b else "no grad"))
        for arg in ("query", "key", "value", "sinks")
    ),
    Field("query", "shard lengths (Lr, Sr)", 2, "", must_agree=False),
    Field("query", "inputs' summary (q, k, v finite; largest finite |q|, |k|)", 3, "", must_agree=False),
)


def _summary(method: Method, query: Tensor, key: Tensor, value: Tensor) -> tuple[int, int, int]:
    """What the ring's guard decides by (:func:`attnscale.guard.check_sharded`), gathered with the
    arguments so that every rank decides alike: whether this rank's q, k and v are all finite, and
    its largest finite |q| and |k| (as float bits). Ulysses' local calls have their own guard;
    tensors without values to read (meta, fake) have none."""
    if method is not Method.RING or tracing(query, key, value):
        return (1, 0, 0)
    finite = all(math.isfinite(guard.abs_max(t)) for t in (query, key, value))
    q_max, k_max = (guard.abs_max(t) if finite else guard.finite_abs_max(t) for t in (query, key))
    return (int(finite), float_bits(q_max), float_bits(k_max))


def _row(
    query: Tensor, key: Tensor, value: Tensor, call: AttentionCall, method: Method, layout: Layout,
    alibi_slopes: Tensor | None, sinks: Tensor | None, summary: tuple[int, int, int],
) -> list[tuple[int, ...]]:
    """This rank's call as the int64 values of :data:`_FIELDS`, in order."""
    path, grad = call.path, torch.is_grad_enabled()

    def batch(t: Tensor) -> tuple[int, ...]:
        dims = tuple(t.shape[:-3])
        return dims + (-1,) * (_BATCH_SLOTS - len(dims))

    def tensor(t: Tensor | None) -> tuple[int, int]:
        return (0, 0) if t is None else (1, digest(t))

    def needs_grad(t: Tensor | None) -> tuple[int]:
        return (int(grad and t is not None and t.requires_grad),)

    left, right = path.window if path.window is not None else (None, None)
    return [
        (FLOAT_DTYPES.index(query.dtype),),
        (text_code(query.device.type),),
        (query.ndim,),
        (call.H,), (call.Hkv,), (call.D,), (call.Dv,),
        batch(query), batch(key), batch(value),
        tensor(alibi_slopes), tensor(sinks),
        (tuple(Method).index(method),),
        (tuple(Layout).index(layout),),
        (int(path.causal),),
        (tuple(CausalAlignment).index(call.alignment),),
        (float_bits(path.scale),),
        (0, 0) if path.softcap is None else (1, float_bits(path.softcap)),
        (-1 if left is None else left, -1 if right is None else right),
        (int(call.return_stats),),
        needs_grad(query), needs_grad(key), needs_grad(value), needs_grad(sinks),
        (query.shape[-2], key.shape[-2]),
        summary,
    ]


def _check_shards(method: Method, layout: Layout, shards: list[tuple[int, ...]], H: int, size: int) -> None:
    """Checks of every rank's shard lengths ``(Lr, Sr)``; every rank sees the same gathered
    lengths, so all raise together."""
    for arg, column in (("query", 0), ("key", 1)):
        lengths = [s[column] for s in shards]
        if layout is Layout.ZIGZAG:
            if len(set(lengths)) != 1:
                fail(arg, "equal shard lengths on every rank for layout='zigzag'", f"lengths {lengths}", "shard with shard_sequence(x, rank, world_size, 'zigzag')")
            check_zigzag_length(arg, sum(lengths), size)
        elif method is Method.ULYSSES and len(set(lengths)) != 1:
            fail(
                arg,
                f"equal shard lengths for method='ulysses' (a sequence length divisible by the group size {size})",
                f"lengths {lengths}",
                "pad the sequence to a multiple of the group size, or use method='ring' (uneven shards allowed)",
            )
    if method is Method.ULYSSES and H % size != 0:
        fail("query", f"a number of heads divisible by the group size {size} for method='ulysses'", f"{H} heads", "use method='ring', or a group size that divides the head count")


def _check_call(
    query: Tensor, key: Tensor, value: Tensor, *, method: object, layout: object, is_causal: object,
    causal_alignment: object, scale: object, softcap: object, alibi_slopes: object, window: object,
    sinks: object, return_stats: object,
) -> tuple[Method, Layout, AttentionCall]:
    """The checks one rank can make alone."""
    method = check_choice("method", method, Method)
    layout = check_choice("layout", layout, Layout)
    call = check_attention_call(
        query, key, value,
        attn_mask=None, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=True,
        causal_alignment=causal_alignment, backend="auto", softcap=softcap,
        alibi_slopes=alibi_slopes, window=window, return_stats=return_stats, sinks=sinks,
    )
    if isinstance(alibi_slopes, Tensor) and alibi_slopes.requires_grad and torch.is_grad_enabled():
        fail("alibi_slopes", "constant slopes (no gradient flows to them across shards)", "a tensor that requires grad", "pass alibi_slopes.detach()")
    if query.ndim - 3 > _BATCH_SLOTS:
        fail("query", f"at most {_BATCH_SLOTS} batch dims before (H, Lr, D)", f"shape {tuple(query.shape)}", "merge batch dims with reshape before the call")
    return method, layout, call


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    method: Method | str = Method.RING,
    layout: Layout | str = Layout.CONTIGUOUS,
    is_causal: bool = False,
    causal_alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, AttentionStats]:
    """Attention over a sequence sharded across the ranks of ``group``: each rank passes its shard
    and gets its shard of the output, equal to :func:`attnscale.scaled_dot_product_attention` on
    the whole sequence (same semantics, GQA allowed whenever ``H`` is a multiple of ``Hkv``).

    Shapes on each rank (the attnscale legend, ``N`` the group size)::

        query (..., H,   Lr, D)    Lr this rank's query rows, sum over ranks = L
        key   (..., Hkv, Sr, D)    Sr this rank's key rows, sum over ranks = S
        value (..., Hkv, Sr, Dv)
        out   (..., H,   Lr, Dv)   this rank's rows of the whole output

    Which rows a rank holds is ``layout`` (:func:`shard_sequence` cuts them)::

        "contiguous"  rank r holds one run, in rank order; any lengths with method="ring"
        "zigzag"      rank r holds chunks r and 2N-1-r of 2N equal chunks (L, S divisible by 2N):
                      balanced work under causal masks

    ``method="ring"`` passes key/value shards round the ring (any head count, uneven contiguous
    shards); ``method="ulysses"`` trades sequence shards for head shards with two all-to-alls
    (``H`` divisible by ``N``, equal shards). Both are exact: partial results merge through their
    natural-log log-sum-exp. Causal alignment, windows and ALiBi use global positions, so
    ``causal_alignment`` means what it means for the whole (L, S) problem.

    Args:
        group: the process group (default: the default group); group ranks order the shards.
        method: ``"ring"`` or ``"ulysses"`` (see ``docs/distributed.md`` for which to pick).
        layout: ``"contiguous"`` or ``"zigzag"``, the same for query and key/value shards.
        is_causal, causal_alignment, scale, softcap, alibi_slopes, window, return_stats: as in
            :func:`attnscale.scaled_dot_product_attention`; ALiBi slopes are constants.
        sinks: (H,), one logit per query head, the same on every rank: it joins each row's softmax
            denominator once, after every key shard is merged, and has no value (as in
            :func:`attnscale.scaled_dot_product_attention`; not scaled, ``-inf`` = no sink; a row
            with no visible key gives zeros). Its gradient on each rank is that rank's share (ring:
            its query rows; ulysses: its heads); the sum over the group's ranks is the gradient of
            the whole, so all-reduce it (sum) over the group like any replicated parameter.

    Forward and backward are collective: every rank of the group must call with the same options.
    One ``all_gather`` of a fixed-length int64 row, before any other communication, checks that
    they do: dtype, device type, every dim but the sequence axis, every option (floats exactly),
    the ALiBi slopes' and sinks' values, and which inputs require grad. On a disagreement every
    rank raises the same ``ValueError`` naming the argument and what each rank passed; a rank
    whose own checks fail raises its error and the others a ``ValueError`` naming that rank. With ``return_stats=True`` the result is ``(out, stats)``, ``stats`` this
    rank's rows of :class:`~attnscale.AttentionStats`, merged exactly over every key shard (with
    sinks, of the softmax that includes the sink: ``lse`` includes it, ``sink_share`` is set);
    ``stats.lse`` is differentiable, the other fields are not.

    NaN and inf entries and logits beyond the accumulation dtype follow the rules of
    :func:`attnscale.scaled_dot_product_attention` (NaN rows, the float64 recompute). The ring
    decides them from what the same gather carries (whether every shard is finite, the largest
    finite ``|q|`` and ``|k|``), so every rank takes the same steps; where the logits' bound passes
    float64's range, every rank raises the same ``ValueError``.

    Equivalent to ``shard_sequence(scaled_dot_product_attention(q, k, v, ...), rank, N, layout)``
    on the whole q, k, v; shown here on a group of one process (torchrun starts N):

    >>> import torch, torch.distributed as dist, attnscale
    >>> from attnscale.distributed import shard_sequence
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    >>> rank, N = dist.get_rank(), dist.get_world_size()
    >>> shards = [shard_sequence(t, rank, N, "zigzag") for t in (q, k, v)]
    >>> out = context_parallel_attention(*shards, layout="zigzag", is_causal=True)
    >>> full = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> torch.allclose(out, shard_sequence(full, rank, N, "zigzag"), atol=1e-6)
    True
    >>> dist.destroy_process_group()
    """
    rank, size, peers = _group_info(group)
    try:
        method, layout, call = _check_call(
            query, key, value, method=method, layout=layout, is_causal=is_causal, causal_alignment=causal_alignment,
            scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, window=window, sinks=sinks, return_stats=return_stats,
        )
        row = _row(query, key, value, call, method, layout, alibi_slopes, sinks, _summary(method, query, key, value))
    except (TypeError, ValueError):
        gather_rows(_FIELDS, None, group, size)  # join the one collective, so that the others raise too
        raise
    per_rank = check_agreement(_FIELDS, gather_rows(_FIELDS, row, group, size))
    shards, summaries = [values[-2] for values in per_rank], [values[-1] for values in per_rank]
    _check_shards(method, layout, shards, call.H, size)
    L, S = sum(s[0] for s in shards), sum(s[1] for s in shards)
    batch = call.batch
    query = query.expand(*batch, *query.shape[-3:])  # (*batch, H, Lr, D)
    key = key.expand(*batch, *key.shape[-3:])  # (*batch, Hkv, Sr, D)
    value = value.expand(*batch, *value.shape[-3:])  # (*batch, Hkv, Sr, Dv)
    if method is Method.ULYSSES:
        plan = UlyssesPlan(
            group=group, rank=rank, size=size, layout=layout, is_causal=call.path.causal,
            causal_alignment=call.alignment.value, scale=call.path.scale, softcap=call.path.softcap,
            window=call.path.window, return_stats=call.return_stats,
        )
        out, stats = ulysses_attention(query, key, value, plan, alibi_slopes, sinks)
    else:
        path = ScorePath(
            scale=call.path.scale, softcap=call.path.softcap, causal=call.path.causal,
            window=call.path.window, q_offset=query_offset(L, S, call.alignment),
        )
        geometry = RingPlan(
            group=group, rank=rank, size=size,
            send_to=peers[(rank + 1) % size], recv_from=peers[(rank - 1) % size],
            path=path,
            q_runs=tuple(segments(layout, [s[0] for s in shards], rank)),
            k_runs=tuple(tuple(segments(layout, [s[1] for s in shards], r)) for r in range(size)),
            k_lengths=tuple(s[1] for s in shards),
            kv_dims=((*batch, call.Hkv, call.D), (*batch, call.Hkv, call.Dv)),
            alibi=None,  # (the call's, taken by the ring's run)
            with_stats=call.return_stats,
        )
        c = Call(call._replace(L=L, S=S, path=path), query, key, value, None, alibi_slopes, sinks)  # the whole problem
        ring, why = backends.choose(c, ring_walk(geometry))
        if tracing(query, key, value, alibi_slopes, sinks):
            out, stats, _ = ring.run(c, query, key, value)
        else:
            record_backend(ring.backend, why)
            finite = all(s[0] for s in summaries)
            q_max, k_max = (max(from_bits(s[i]) for s in summaries) for i in (1, 2))
            out, stats, _ = guard.check_sharded(ring, c, finite=finite, q_max=q_max, k_max=k_max)
    if return_stats:
        assert stats is not None
        return out, stats
    return out
