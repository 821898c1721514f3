"""Exact merge of softmax statistics over disjoint key sets (shards of one row's keys).

For one query row and key sets ``A``, ``B`` with logits ``s_j``::

    lse         = logaddexp(lse_A, lse_B)                     (natural log)
    max_logit   = max(max_logit_A, max_logit_B)
    max_prob    = exp(max_logit - lse)
    entropy     = w_A (entropy_A + lse - lse_A) + w_B (entropy_B + lse - lse_B),   w_X = exp(lse_X - lse)
    visible_keys = visible_keys_A + visible_keys_B

The entropy line follows from ``entropy = lse - sum_j p_j s_j`` with ``p_j = w_X p_j^X`` on each
side. A side with no visible key (``lse = -inf``) has ``w = 0`` and drops out; a row empty on both
sides keeps ``lse = max_logit = -inf``, ``max_prob = entropy = 0``, ``visible_keys = 0``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..stats import AttentionStats, with_sinks

__all__ = ["merge_sink_stats", "merge_stats"]

_NEG_INF = float("-inf")


def _weighted(w: Tensor, entropy: Tensor, lse: Tensor, lse_part: Tensor) -> Tensor:
    # Where w == 0 the bracket may be inf - inf; the side contributes nothing there.
    return torch.where(w > 0, w * (entropy + lse - lse_part), torch.zeros_like(w))


def merge_stats(a: AttentionStats, b: AttentionStats, *, lse: Tensor | None = None) -> AttentionStats:
    """Statistics of the union of two disjoint key sets from those of each set.

    ``lse`` may pass the merged log-sum-exp when the caller has it already (e.g. from
    :func:`attnscale.tiled.merge_partials`); by default it is ``logaddexp(a.lse, b.lse)``.

    >>> import torch, attnscale
    >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    >>> _, whole = attnscale.scaled_dot_product_attention(q, k, v, return_stats=True)
    >>> _, left = attnscale.scaled_dot_product_attention(q, k[..., :3, :], v[..., :3, :], return_stats=True)
    >>> _, right = attnscale.scaled_dot_product_attention(q, k[..., 3:, :], v[..., 3:, :], return_stats=True)
    >>> torch.allclose(merge_stats(left, right).entropy, whole.entropy, atol=1e-5)
    True
    """
    if lse is None:
        lse = torch.logaddexp(a.lse, b.lse)
    lse_ref = lse.detach().masked_fill(lse == _NEG_INF, 0.0)  # empty rows: both weights become 0
    with torch.no_grad():
        wa, wb = torch.exp(a.lse - lse_ref), torch.exp(b.lse - lse_ref)
        entropy = (_weighted(wa, a.entropy, lse_ref, a.lse) + _weighted(wb, b.entropy, lse_ref, b.lse)).clamp_min(0.0)
        max_logit = torch.maximum(a.max_logit, b.max_logit)
        has_key = lse != _NEG_INF
        max_prob = torch.where(has_key, torch.exp(max_logit - lse_ref), torch.zeros_like(lse_ref))
        visible_keys = a.visible_keys + b.visible_keys
    return AttentionStats(lse=lse, max_logit=max_logit, max_prob=max_prob, entropy=entropy, visible_keys=visible_keys)


def merge_sink_stats(stats: AttentionStats, sinks: Tensor, lse: Tensor) -> AttentionStats:
    """Statistics of finished rows (every key shard merged) extended by their heads' sinks (H,):
    :func:`attnscale.stats.with_sinks`, with ``lse`` the differentiable log-sum-exp including the
    sink that :func:`attnscale.tiled.merge_sinks` returned; the other fields carry no gradient."""
    with torch.no_grad():
        merged = with_sinks(dataclasses.replace(stats, lse=stats.lse.detach()), sinks.detach())
    return dataclasses.replace(merged, lse=lse)
