"""The "math" backend: attention with the whole (L, S) score matrix in memory.

Plain PyTorch, differentiable by autograd, every feature of the score path. It is the torch-side
oracle for the tiled kernel and what ``backend="math"`` runs. Memory is O(L * S) per head.
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import Tensor

from .score import ScorePath
from .stats import AttentionStats

__all__ = ["accumulation_dtype", "dense_attention", "dense_weights", "masked_softmax"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and accumulation dtype: float64 for float64 inputs, float32 for everything else.

    Half-precision products are formed in float32 too: an fp16 q.k above 65504 would be inf.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_groups(H: int, Hkv: int) -> int:
    """G = H // Hkv, the query heads that read one key/value head; 0 for a query without heads and
    keys without them (H = Hkv = 0, an empty output, as torch gives)."""
    return H // Hkv if Hkv else 0


def masked_softmax(
    logits: Tensor, keep: Tensor | None, *, with_stats: bool, sink: Tensor | None = None
) -> tuple[Tensor, AttentionStats | None]:
    """Softmax over the last axis restricted to ``keep``; rows with no kept entry give p = 0.

    Hidden entries are set to -inf (never a finite "large negative" constant, which fp16 cannot hold
    and which turns a fully masked row into a uniform one). The row max is replaced by 0 on empty
    rows so that ``exp(-inf - 0) = 0``, and their denominator by 1, so values and gradients stay
    finite: an empty row has output 0 and gradient 0.

    ``sink`` (broadcastable to (..., L, 1)): a logit per row that joins the denominator and gets no
    column of ``p``; the row maximum then includes it, and an empty row gives all its mass to it.
    """
    s = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
    if s.shape[-1] == 0:  # S = 0: amax has nothing to reduce; every row is empty
        max_logit = s.new_full((*s.shape[:-1], 1), float("-inf"))
    else:
        max_logit = s.amax(dim=-1, keepdim=True)
    top = max_logit if sink is None else torch.maximum(max_logit, sink)
    has_mass = torch.isfinite(top)
    m = torch.where(has_mass, top, torch.zeros_like(top)).detach()
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        sink_e = torch.exp(sink - m)
        denom = denom + sink_e
    safe_denom = torch.where(has_mass, denom, torch.ones_like(denom))
    p = e / safe_denom
    if not with_stats:
        return p, None
    has_key = torch.isfinite(max_logit)
    lse = torch.where(has_mass, m + torch.log(safe_denom), top)
    # Hidden logits are -inf; zero them before the product so that its gradient is 0, not 0 * inf.
    weighted = (p * torch.where(p > 0, s, torch.zeros_like(s))).sum(dim=-1, keepdim=True)
    sink_share = None
    if sink is not None:
        sink_share = sink_e / safe_denom
        # a -inf sink has share 0: multiply by 0, not by -inf, so that no gradient turns NaN
        weighted = weighted + sink_share * torch.where(torch.isfinite(sink), sink, 0.0)
    entropy = torch.where(has_mass, lse - weighted, torch.zeros_like(lse)).clamp_min(0.0)
    # exp(max_logit - lse), not 1 / denom: the row max is detached in denom, and its gradient counts.
    max_prob = torch.where(has_key, torch.exp(torch.where(has_key, max_logit - lse, 0.0)), 0.0)
    rows = s.shape[:-1]  # a mask may widen the batch beyond the logits'
    if keep is None:
        visible_keys = torch.full(rows, logits.shape[-1], dtype=torch.int64, device=logits.device)
    else:
        visible_keys = keep.sum(dim=-1).expand(rows)
    stats = AttentionStats(
        lse=lse.squeeze(-1),
        max_logit=max_logit.squeeze(-1),
        max_prob=max_prob.squeeze(-1),
        entropy=entropy.squeeze(-1),
        visible_keys=visible_keys,
        sink_share=None if sink_share is None else sink_share.squeeze(-1).expand(rows),
    )
    return p, stats


def dense_weights(
    query: Tensor,
    key: Tensor,
    *,
    path: ScorePath,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
) -> tuple[Tensor, AttentionStats | None]:
    """Softmax weights (..., H, L, S) in the accumulation dtype, for validated query (..., H, L, D)
    and key (..., Hkv, S, D), H a multiple of Hkv; with ``return_stats`` also their statistics.
    With ``sinks`` (H,) the weights of a row sum to one minus its sink's share."""
    acc = accumulation_dtype(query.dtype)
    H, L = query.shape[-3], query.shape[-2]
    Hkv, S = key.shape[-3], key.shape[-2]
    q = query.to(acc).unflatten(-3, (Hkv, head_groups(H, Hkv)))  # (..., Hkv, G, L, D)
    k = key.to(acc).unsqueeze(-3)  # (..., Hkv, 1, S, D)
    qk = (q @ k.transpose(-1, -2)).flatten(-4, -3)  # (..., H, L, S)

    q_pos, k_pos = path.positions(0, L, 0, S, query.device)
    keep = path.visibility(q_pos, k_pos)  # (L, S) or None
    additive = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask if keep is None else keep & attn_mask
        else:
            additive = attn_mask.to(acc)
            finite = additive != float("-inf")
            keep = finite if keep is None else keep & finite
    logits = path.logits(qk, q_pos=q_pos, k_pos=k_pos, alibi_slopes=alibi_slopes, additive=additive)
    sink = None if sinks is None else sinks.to(acc)[:, None, None]  # (H, 1, 1)
    return masked_softmax(logits, keep, with_stats=return_stats, sink=sink)


def dense_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    path: ScorePath,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    sinks: Tensor | None = None,
    return_stats: bool = False,
) -> tuple[Tensor, AttentionStats | None]:
    """Attention with inputs already validated: query (..., H, L, D), key (..., Hkv, S, D),
    value (..., Hkv, S, Dv), H a multiple of Hkv; returns (out (..., H, L, Dv), stats or None)."""
    p, stats = dense_weights(
        query, key, path=path, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=return_stats
    )
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p, training=True)
    Hkv = key.shape[-3]
    v = value.to(p.dtype).unsqueeze(-3)  # (..., Hkv, 1, S, Dv)
    out = (p.unflatten(-3, (Hkv, head_groups(p.shape[-3], Hkv))) @ v).flatten(-4, -3)  # (..., H, L, Dv)
    if stats is not None and stats.lse.shape != out.shape[:-1]:
        # The value's batch dims can widen the batch beyond the scores': statistics follow the output.
        stats = AttentionStats(
            **{f.name: getattr(stats, f.name) for f in fields(stats)}
            | {f.name: getattr(stats, f.name).expand(out.shape[:-1]) for f in fields(stats) if getattr(stats, f.name) is not None}
        )
    return out.to(query.dtype), stats
