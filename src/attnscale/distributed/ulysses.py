"""Ulysses (DeepSpeed-Ulysses) attention: trade sequence shards for head shards and back.

With ``N`` ranks, each holding every head of ``L / N`` positions::

    q, k, v (*batch, H, L/N, D)  --all-to-all-->  (*batch, H/N, L, D)    whole sequence, H/N heads
    out = attnscale.scaled_dot_product_attention(...)                    unchanged local attention
    out (*batch, H/N, L, Dv)     --all-to-all-->  (*batch, H, L/N, Dv)   back to sequence shards

Both all-to-alls are autograd functions whose backward is the opposite all-to-all, so the local
attention keeps its own backward. The head count must be a multiple of ``N``; key/value heads
that are not (GQA with ``Hkv`` not divisible by ``N``) are repeated to ``lcm(Hkv, N)`` first.
Zigzag shards are put back in natural order after the first all-to-all and restored before the
last one. Attention sinks: each rank merges the sinks of its ``H/N`` heads into its whole-sequence
rows (:func:`~attnscale.tiled.merge_sinks` on the local ``out`` and ``lse``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..dense import accumulation_dtype
from ..functional import scaled_dot_product_attention
from ..stats import AttentionStats
from ..tiled import merge_sinks
from .layout import Layout, zigzag_order
from .merge import merge_sink_stats

__all__ = ["UlyssesPlan", "ulysses_attention"]


@dataclass(frozen=True)
class UlyssesPlan:
    """The group, the layout and the options of the local attention call."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    layout: Layout
    is_causal: bool
    causal_alignment: str
    scale: float
    softcap: float | None
    window: tuple[int | None, int | None] | None
    return_stats: bool


def _all_to_all(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """x (N, ...) -> y (N, ...) with y[j] = rank j's x[this rank]."""
    x = x.contiguous()
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, group=group)
    return y


def seq_to_heads(x: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    """(*batch, H, Ls, E) sequence shard -> (*batch, H/N, N * Ls, E) head shard, rank-ordered rows."""
    *batch, H, Ls, E = x.shape
    x = x.reshape(*batch, size, H // size, Ls, E).movedim(-4, 0)  # (N, *batch, H/N, Ls, E)
    y = _all_to_all(x, group).movedim(0, -3)  # (*batch, H/N, N, Ls, E)
    return y.reshape(*batch, H // size, size * Ls, E)


def heads_to_seq(y: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    """(*batch, H/N, N * Ls, E) head shard -> (*batch, H, Ls, E) sequence shard."""
    *batch, Hn, L, E = y.shape
    y = y.reshape(*batch, Hn, size, L // size, E).movedim(-3, 0)  # (N, *batch, H/N, Ls, E)
    x = _all_to_all(y, group).movedim(0, -4)  # (*batch, N, H/N, Ls, E)
    return x.reshape(*batch, size * Hn, L // size, E)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):  # type: ignore[override]
        ctx.group, ctx.size = group, size
        return seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return heads_to_seq(grad, ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, size):  # type: ignore[override]
        ctx.group, ctx.size = group, size
        return heads_to_seq(y, group, size)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return seq_to_heads(grad, ctx.group, ctx.size), None, None


def ulysses_attention(
    query: Tensor, key: Tensor, value: Tensor, plan: UlyssesPlan, alibi_slopes: Tensor | None, sinks: Tensor | None = None
) -> tuple[Tensor, AttentionStats | None]:
    """This rank's output rows (and statistics); query (*batch, H, Lq/N, D), key/value
    (*batch, Hkv, S/N, D / Dv) with the batch dims already broadcast and ``H % N == 0``.

    ``sinks`` (H,): this rank's ``H/N`` of them join its heads' rows once, after the local
    attention over the whole sequence; their gradient is this rank's heads' only."""
    group, N = plan.group, plan.size
    H, Hkv = query.shape[-3], key.shape[-3]
    if Hkv % N != 0:
        # lcm(Hkv, N) divides H (H is a multiple of both): the fewest extra key/value heads.
        repeat = N // math.gcd(Hkv, N)
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    q = _SeqToHeads.apply(query, group, N)  # (*batch, H/N, L, D)
    k = _SeqToHeads.apply(key, group, N)  # (*batch, Hkv'/N, S, D)
    v = _SeqToHeads.apply(value, group, N)  # (*batch, Hkv'/N, S, Dv)
    q_order = k_order = None
    if plan.layout is Layout.ZIGZAG:
        q_order = zigzag_order(q.shape[-2], N, device=q.device)
        k_order = zigzag_order(k.shape[-2], N, device=k.device)
        q = q.index_select(-2, torch.argsort(q_order))  # natural order of positions
        k = k.index_select(-2, torch.argsort(k_order))
        v = v.index_select(-2, torch.argsort(k_order))
    heads = slice(plan.rank * (H // N), (plan.rank + 1) * (H // N))  # this rank's heads
    slopes = alibi_slopes
    if slopes is not None and slopes.shape[-1] == H:
        slopes = slopes[..., heads]
    with_lse = plan.return_stats or sinks is not None  # the sinks merge through lse
    result = scaled_dot_product_attention(
        q, k, v,
        is_causal=plan.is_causal,
        scale=plan.scale,
        enable_gqa=q.shape[-3] != k.shape[-3],
        causal_alignment=plan.causal_alignment,
        softcap=plan.softcap,
        alibi_slopes=slopes,
        window=plan.window,
        return_stats=with_lse,
    )
    out, stats = result if with_lse else (result, None)
    if sinks is not None:
        assert stats is not None
        mine = sinks[heads]
        out, lse = merge_sinks(out.to(accumulation_dtype(out.dtype)), stats.lse, mine)
        out = out.to(q.dtype)
        stats = merge_sink_stats(stats, mine, lse) if plan.return_stats else None

    def back(x: Tensor) -> Tensor:
        if q_order is not None:
            x = x.index_select(-2, q_order)  # rank order of the zigzag shards
        return _HeadsToSeq.apply(x, group, N)

    out = back(out)  # (*batch, H, Lq/N, Dv)
    if stats is None:
        return out, None
    names = ("lse", "max_logit", "max_prob", "entropy", "visible_keys") + (() if stats.sink_share is None else ("sink_share",))
    rows = {name: back(getattr(stats, name).unsqueeze(-1)).squeeze(-1) for name in names}
    return out, AttentionStats(**rows)
