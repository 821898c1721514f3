"""What softmax did, per query row: :class:`AttentionStats` and its reductions.

All four statistics are exact functions of one row's logits ``s_j`` over its visible keys:

* ``lse``        log-sum-exp, natural log: ``log sum_j exp(s_j)``
* ``max_logit``  ``max_j s_j`` (the logit after scale, softcap and bias: QK-Clip's S_max)
* ``max_prob``   ``max_j p_j = exp(max_logit - lse)``
* ``entropy``    ``-sum_j p_j log p_j`` in nats, ``= lse - sum_j p_j s_j``

A row with no visible key has ``lse = max_logit = -inf``, ``max_prob = 0`` and ``entropy = 0``.
Statistics describe the softmax before dropout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["AttentionStats"]


@dataclass(frozen=True)
class AttentionStats:
    """Per-row softmax statistics, each a float32 (float64 for float64 inputs) tensor (..., H, L)."""

    lse: Tensor
    max_logit: Tensor
    max_prob: Tensor
    entropy: Tensor

    def to_dict(self) -> dict[str, list]:
        """Nested lists, ready for ``json.dumps``; -inf becomes None (JSON has no infinity)."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name).detach().double()
            out[f.name] = torch.where(torch.isfinite(t), t, torch.nan).tolist()
        return {k: _nan_to_none(v) for k, v in out.items()}


def _nan_to_none(x):
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return None if x != x else x
