"""What softmax did, per query row: :class:`AttentionStats` and its reductions.

All four statistics are exact functions of one row's logits ``s_j`` over its visible keys:

* ``lse``        log-sum-exp, natural log: ``log sum_j exp(s_j)``
* ``max_logit``  ``max_j s_j`` (the logit after scale, softcap and bias: QK-Clip's S_max)
* ``max_prob``   ``max_j p_j = exp(max_logit - lse)``
* ``entropy``    ``-sum_j p_j log p_j`` in nats, ``= lse - sum_j p_j s_j``

``visible_keys`` counts the keys the row may attend to (not hidden by a mask, causality or the
window). A row with no visible key has ``lse = max_logit = -inf``, ``max_prob = 0``,
``entropy = 0`` and ``visible_keys = 0``. Statistics describe the softmax before dropout.

With attention sinks (``sinks=``) a row's softmax runs over its visible keys and one more outcome,
the sink, which has no value: the mass it takes is what the row gives to "nothing". Then

* ``lse``        includes the sink: ``log(sum_j exp(s_j) + exp(sink))``, so ``p_j = exp(s_j - lse)``
* ``max_logit``  over keys only (the sink is not a logit of q.k)
* ``max_prob``   over keys only: ``exp(max_logit - lse)``
* ``entropy``    of the whole distribution, the sink counted as one outcome
* ``sink_share`` ``exp(sink - lse)``, the sink's probability; None without sinks

and a row with no visible key has ``lse = sink``, ``sink_share = 1``, ``entropy = 0``.

Reductions for diagnostics (all ignore empty rows): :func:`normalized_entropy` (entropy over
``log(visible_keys)``, 1 = uniform), :func:`summarize` (per-head mean, min, max and quantiles over
rows and batch) and :func:`share_above` (per-head share of rows whose statistic exceeds a threshold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

__all__ = ["AttentionStats", "HeadSummary", "join_rows", "normalized_entropy", "rows_of", "share_above", "summarize", "with_nan_rows", "with_sinks"]


@dataclass(frozen=True)
class AttentionStats:
    """Per-row softmax statistics, each a tensor (..., H, L): float32 (float64 for float64 inputs),
    except ``visible_keys`` (int64)."""

    lse: Tensor
    max_logit: Tensor
    max_prob: Tensor
    entropy: Tensor
    visible_keys: Tensor
    sink_share: Tensor | None = None

    @classmethod
    def _of(cls, *, lse: Tensor, max_logit: Tensor, max_prob: Tensor, entropy: Tensor, visible_keys: Tensor) -> AttentionStats:
        """The statistics without sinks as the kernels make them for every call, without the frozen
        ``__init__``'s five ``object.__setattr__`` (a decoding step's share of a microsecond)."""
        stats = object.__new__(cls)
        stats.__dict__.update(lse=lse, max_logit=max_logit, max_prob=max_prob, entropy=entropy, visible_keys=visible_keys, sink_share=None)
        return stats

    def to_dict(self) -> dict[str, list]:
        """Nested lists, ready for ``json.dumps``; -inf becomes None (JSON has no infinity).
        ``sink_share`` is present only with sinks."""
        out = {}
        for f in fields(self):
            if getattr(self, f.name) is None:
                continue
            t = getattr(self, f.name).detach().double()
            out[f.name] = torch.where(torch.isfinite(t), t, torch.nan).tolist()
        return {k: _nan_to_none(v) for k, v in out.items()}


def _nan_to_none(x):
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return None if x != x else x


_STATISTICS = ("lse", "max_logit", "max_prob", "entropy", "normalized_entropy", "sink_share")


def with_sinks(stats: AttentionStats, sinks: Tensor) -> AttentionStats:
    """Statistics of a row's softmax over its keys, extended by its head's sink (H,) (see above).

    Exact: with ``a = exp(lse_keys - lse)`` the key probabilities are ``a`` times the keys-only ones,
    so ``entropy = a entropy_keys - a log a - share log share``, ``share = 1 - a = exp(sink - lse)``.
    """
    sink = sinks.to(stats.lse.dtype)[..., None].expand(stats.lse.shape)  # (..., H, L)
    lse = torch.logaddexp(stats.lse, sink)
    # lse = -inf only with no key and a -inf sink: nothing to attend, every share 0.
    ref = torch.where(lse == -math.inf, 0.0, lse)
    keys = torch.exp(stats.lse - ref)
    share = torch.exp(sink - ref)
    plogp = torch.where(keys > 0, keys * torch.log(torch.where(keys > 0, keys, 1.0)), 0.0)
    plogp = plogp + torch.where(share > 0, share * torch.log(torch.where(share > 0, share, 1.0)), 0.0)
    entropy = (keys * stats.entropy - plogp).clamp_min(0.0)
    max_prob = torch.exp(stats.max_logit - ref).masked_fill(lse == -math.inf, 0.0)
    return AttentionStats(
        lse=lse,
        max_logit=stats.max_logit,
        max_prob=max_prob,
        entropy=entropy,
        visible_keys=stats.visible_keys,
        sink_share=share,
    )


def with_nan_rows(stats: AttentionStats, rows: Tensor) -> AttentionStats:
    """``stats`` with NaN in every statistic of the rows ``rows`` (..., H, L) marks, ``visible_keys``
    kept: the statistics of rows whose output the NaN semantics make NaN."""
    return replace(
        stats,
        **{f.name: getattr(stats, f.name).masked_fill(rows, math.nan) for f in fields(stats) if f.name != "visible_keys" and getattr(stats, f.name) is not None},
    )


def normalized_entropy(stats: AttentionStats) -> Tensor:
    """Entropy over its maximum ``log(outcomes)``, per row (..., H, L): 1 = uniform, 0 = one-hot.

    The outcomes are the visible keys, plus the sink with sinks. A row with one outcome has entropy
    0 and gets 0 (it is as peaked as it can be); a row with no visible key gets NaN, which the
    reductions below skip.

    >>> s = AttentionStats(*(torch.tensor([0.0, 0.0, math.log(4)]) for _ in range(4)), visible_keys=torch.tensor([0, 1, 4]))
    >>> normalized_entropy(s)
    tensor([nan, 0., 1.])
    """
    keys = stats.visible_keys.to(stats.entropy.dtype)
    n = keys if stats.sink_share is None else keys + 1
    denom = torch.log(n.clamp_min(2.0))
    ratio = torch.where(n > 1, stats.entropy.detach() / denom, torch.zeros_like(denom))
    return ratio.masked_fill(keys == 0, math.nan)


def _per_head(stats: AttentionStats, statistic: str) -> tuple[Tensor, Tensor]:
    """Values (H, N) over rows and batch, and the (H, N) mask of non-empty rows."""
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic: expected one of {_STATISTICS}, got {statistic!r}. Fix: pick one of those names")
    if statistic == "sink_share" and stats.sink_share is None:
        raise ValueError("statistic: expected a statistic these stats hold, got 'sink_share' without sinks. Fix: pick another, or attend with sinks=")
    values = normalized_entropy(stats) if statistic == "normalized_entropy" else getattr(stats, statistic).detach()
    H = values.shape[-2]
    values = values.movedim(-2, 0).reshape(H, -1)  # (H, batch * L)
    rows = stats.visible_keys.expand(stats.lse.shape).movedim(-2, 0).reshape(H, -1) > 0
    return values.double(), rows


def _none_if_nan(x: float) -> float | None:
    return None if math.isnan(x) else x


@dataclass(frozen=True)
class HeadSummary:
    """One statistic summarised per head over rows and batch, empty rows left out.

    Each tuple has one entry per head; a head with no non-empty row has None everywhere.
    """

    statistic: str
    rows: tuple[int, ...]
    mean: tuple[float | None, ...]
    min: tuple[float | None, ...]
    max: tuple[float | None, ...]
    quantiles: tuple[tuple[float, tuple[float | None, ...]], ...]

    def to_dict(self) -> dict:
        """JSON-ready: quantile levels become string keys (``"0.5"``)."""
        return {
            "statistic": self.statistic,
            "rows": list(self.rows),
            "mean": list(self.mean),
            "min": list(self.min),
            "max": list(self.max),
            "quantiles": {str(q): list(v) for q, v in self.quantiles},
        }


def summarize(
    stats: AttentionStats, statistic: str = "entropy", *, quantiles: tuple[float, ...] = (0.05, 0.5, 0.95)
) -> HeadSummary:
    """Per-head mean, min, max and quantiles of one statistic, over rows and batch dims.

    ``statistic`` is a field of :class:`AttentionStats` or ``"normalized_entropy"``. Rows with no
    visible key are left out.

    >>> s = AttentionStats(*(torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 9.0]]) for _ in range(4)),
    ...                    visible_keys=torch.tensor([[3, 3, 3], [3, 3, 0]]))
    >>> summarize(s, "max_logit", quantiles=(0.5,)).to_dict()["quantiles"]
    {'0.5': [2.0, 5.0]}
    """
    for q in quantiles:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise ValueError(f"quantiles: expected levels in [0, 1], got {quantiles!r}. Fix: pass e.g. (0.05, 0.5, 0.95)")
    values, rows = _per_head(stats, statistic)
    n, mean, lo, hi, qs = [], [], [], [], {q: [] for q in quantiles}
    for v, r in zip(values, rows):
        kept = v[r & ~torch.isnan(v)]
        n.append(int(r.sum()))
        if kept.numel() == 0:
            for out in (mean, lo, hi, *qs.values()):
                out.append(None)
            continue
        mean.append(_none_if_nan(float(kept.mean())))
        lo.append(float(kept.min()))
        hi.append(float(kept.max()))
        for q in quantiles:
            qs[q].append(float(torch.quantile(kept, q)))
    return HeadSummary(
        statistic=statistic,
        rows=tuple(n),
        mean=tuple(mean),
        min=tuple(lo),
        max=tuple(hi),
        quantiles=tuple((float(q), tuple(v)) for q, v in qs.items()),
    )


def share_above(stats: AttentionStats, threshold: float, statistic: str = "max_prob") -> tuple[float | None, ...]:
    """Per head, the share of non-empty rows whose ``statistic`` exceeds ``threshold`` (None if none).

    With ``max_prob`` and a threshold like 0.9 this is the share of saturated (near one-hot) rows.

    >>> s = AttentionStats(*(torch.tensor([[0.95, 0.5, 0.99]]) for _ in range(4)), visible_keys=torch.tensor([[4, 4, 0]]))
    >>> share_above(s, 0.9)
    (0.5,)
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise ValueError(f"threshold: expected a number, got {threshold!r}. Fix: pass e.g. threshold=0.9")
    values, rows = _per_head(stats, statistic)
    out = []
    for v, r in zip(values, rows):
        count = int(r.sum())
        out.append(None if count == 0 else int((r & (v > threshold)).sum()) / count)
    return tuple(out)


def rows_of(stats: AttentionStats, q0: int, q1: int) -> AttentionStats:
    """Rows q0:q1 of packed (H, total_q) statistics, in the per-sequence (1, H, L_b) layout."""
    return AttentionStats(**{f.name: None if getattr(stats, f.name) is None else getattr(stats, f.name)[None, :, q0:q1] for f in fields(AttentionStats)})


def join_rows(parts: list[AttentionStats]) -> AttentionStats:
    """Per-sequence statistics (1, H, L_b) joined along the rows: (H, total_q)."""
    joined = {}
    for f in fields(AttentionStats):
        tensors = [getattr(s, f.name) for s in parts]
        joined[f.name] = None if tensors[0] is None else torch.cat([t[0] for t in tensors], dim=-1)
    return AttentionStats(**joined)
