"""``context_parallel_attention``: attention over a sequence sharded across a process group."""

from __future__ import annotations

import math
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import Tensor

from .._validate import check_attention_call, check_choice, fail
from ..dense import accumulation_dtype
from ..masks import CausalAlignment, query_offset
from ..score import ScorePath
from ..stats import AttentionStats
from .layout import Layout, check_zigzag_length, segments
from .ring import RingPlan, ring_attention
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


def _gather_shapes(query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup | None, size: int) -> list[list[int]]:
    """Every rank's (query length, key length, query/key/value sizes without the sequence axis)."""
    mine = [query.shape[-2], key.shape[-2], *(math.prod(t.shape[:-2]) * t.shape[-1] for t in (query, key, value))]
    local = torch.tensor(mine, dtype=torch.int64, device=query.device)
    every = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(every, local, group=group)
    return [t.tolist() for t in every]


def _check_shards(method: Method, layout: Layout, shapes: list[list[int]], H: int, size: int) -> None:
    """Cross-rank checks; every rank sees the same gathered shapes, so all raise together."""
    if len({tuple(s[2:]) for s in shapes}) != 1:
        fail("query", "the same batch, head and head-dim sizes on every rank", f"per-rank (L, S, q, k, v sizes) {shapes}", "shard only the sequence axis (dim -2)")
    for arg, column in (("query", 0), ("key", 1)):
        lengths = [s[column] for s in shapes]
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

    Forward and backward are collective: every rank of the group must call with the same options.
    With ``return_stats=True`` the result is ``(out, stats)``, ``stats`` this rank's rows of
    :class:`~attnscale.AttentionStats`, merged exactly over every key shard; ``stats.lse`` is
    differentiable, the other fields are not.

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
    method = check_choice("method", method, Method)
    layout = check_choice("layout", layout, Layout)
    call = check_attention_call(
        query, key, value,
        attn_mask=None, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=True,
        causal_alignment=causal_alignment, backend="auto", softcap=softcap,
        alibi_slopes=alibi_slopes, window=window, return_stats=return_stats,
    )
    if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
        fail("alibi_slopes", "constant slopes (no gradient flows to them across shards)", "a tensor that requires grad", "pass alibi_slopes.detach()")
    shapes = _gather_shapes(query, key, value, group, size)
    _check_shards(method, layout, shapes, call.H, size)
    L, S = sum(s[0] for s in shapes), sum(s[1] for s in shapes)
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
        out, stats = ulysses_attention(query, key, value, plan, alibi_slopes)
    else:
        path = ScorePath(
            scale=call.path.scale, softcap=call.path.softcap, causal=call.path.causal,
            window=call.path.window, q_offset=query_offset(L, S, call.alignment),
        )
        ring = RingPlan(
            group=group, rank=rank, size=size,
            send_to=peers[(rank + 1) % size], recv_from=peers[(rank - 1) % size],
            path=path,
            q_runs=tuple(segments(layout, [s[0] for s in shapes], rank)),
            k_runs=tuple(tuple(segments(layout, [s[1] for s in shapes], r)) for r in range(size)),
            k_lengths=tuple(s[1] for s in shapes),
            kv_dims=((*batch, call.Hkv, call.D), (*batch, call.Hkv, call.Dv)),
            alibi=None if alibi_slopes is None else alibi_slopes.detach().to(accumulation_dtype(query.dtype)),
            with_stats=call.return_stats,
        )
        out, stats = ring_attention(query, key, value, ring)
    if return_stats:
        assert stats is not None
        return out, stats
    return out
