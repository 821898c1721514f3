"""The formula, once, in plain NumPy float64: the readable spec of attnscale and its test oracle.

::

    Attention(Q, K, V) = softmax(Q K^T / sqrt(D)) V

* ``D`` is the per-head query/key dimension (d_k): the last dim of ``q``. Not the model width,
  not the number of heads. A dot product of D unit-variance terms has variance D; dividing by
  sqrt(D) brings the logits back to unit variance, where softmax is soft and has gradients.
* ``V`` is what the weights blend: softmax alone is not an output.

The order of the score path (see ``attnscale.score``)::

    logits = softcap(scale * q.k) + alibi + float mask ; hide masked / causal / windowed keys ; softmax

Masks: bool True = attend; a float mask is added and its -inf entries hide keys. A row with no
visible key returns zeros. Causal alignment: query row i sits at key position ``i + offset``, with
offset 0 ("top_left", PyTorch) or S - L ("bottom_right", FlashAttention). GQA: query head h reads
key/value head ``h // (H // Hkv)``. Log-sum-exp is in natural log.

Non-finite inputs: a NaN or infinite entry of q, k or v marks that vector as missing. An output row
is NaN iff its query row has such an entry and the row has at least one visible key, or a key
visible to the row has one in k or v; keys hidden from a row never affect it. A row with no
visible key is zeros. (Rows that are NaN have NaN statistics, except ``visible_keys``.)

This module deliberately shares no code with the torch backends, so that it can judge them.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["attention"]


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    softcap: float | None = None,
    alibi_slopes: np.ndarray | None = None,
    window: tuple[int | None, int | None] | None = None,
    sinks: np.ndarray | None = None,
    return_stats: bool = False,
) -> np.ndarray | tuple[np.ndarray, dict[str, np.ndarray]]:
    """Attention in float64: q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) -> (..., H, L, Dv).

    ``sinks`` (H,): one logit per query head that joins every row's softmax denominator and has no
    value, ``p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sink_h))`` with ``s`` the finished logits
    (the sink is not scaled, capped or biased). The key weights of a row then sum to 1 - sink share.

    With ``return_stats`` also returns ``{"lse", "max_logit", "max_prob", "entropy", "visible_keys"}``,
    each (..., H, L); a row with no visible key has lse = max_logit = -inf, max_prob = entropy = 0
    and visible_keys = 0. With sinks the row's distribution is over its keys and the sink: ``lse``
    is the log of the whole denominator, ``entropy`` counts the sink as one more outcome,
    ``max_prob`` is over keys only, and ``"sink_share"`` (the sink's probability) is added; an
    empty row then has lse = sink, sink share 1, entropy 0.

    >>> q = np.array([[[[1.0, 0.0]]]]); k = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    >>> v = np.array([[[[1.0], [0.0]]]])
    >>> out = attention(q, k, v)  # weights softmax([1, 0] / sqrt(2))
    >>> round(float(out[0, 0, 0, 0]), 4), round(1 / (1 + math.exp(-1 / math.sqrt(2))), 4)
    (0.6698, 0.6698)
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    H, L, D = q.shape[-3:]
    Hkv, S = k.shape[-3], k.shape[-2]
    group = H // Hkv if Hkv else 0  # H = Hkv = 0: no heads, the empty output
    k = np.repeat(k, group, axis=-3)  # (..., H, S, D): head h reads kv head h // group
    v = np.repeat(v, group, axis=-3)  # (..., H, S, Dv)
    # Missing (non-finite) vectors are set to 0 for the arithmetic and mark their rows NaN at the end.
    bad_q = ~np.isfinite(q).all(axis=-1)  # (..., H, L)
    bad_kv = ~np.isfinite(k).all(axis=-1) | ~np.isfinite(v).all(axis=-1)  # (..., H, S)
    q, k, v = (np.where(np.isfinite(x), x, 0.0) for x in (q, k, v))
    if D == 0:  # every logit is the empty sum 0, whatever the scale (0 * 1/sqrt(0) is no number)
        scale = 1.0
    elif scale is None:
        scale = 1.0 / math.sqrt(D)

    logits = np.einsum("...hld,...hsd->...hls", q, k) * scale  # (..., H, L, S)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)

    offset = S - L if causal_alignment == "bottom_right" else 0
    i = np.arange(L)[:, None] + offset  # aligned query positions (L, 1)
    j = np.arange(S)[None, :]  # key positions (1, S)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        logits = logits - slopes[..., :, None, None] * np.abs(i - j)

    visible = np.ones((L, S), dtype=bool)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.dtype == bool:
            visible = visible & attn_mask
        else:
            logits = logits + attn_mask.astype(np.float64)
            visible = visible & (attn_mask != -np.inf)
    if is_causal:
        visible = visible & (j <= i)
    if window is not None:
        # |i - j| < max(L, S), so a longer side hides nothing (and could overflow int64).
        left, right = (None if w is None or w == -1 or w >= max(L, S) else w for w in window)
        if left is not None:
            visible = visible & (j >= i - left)
        if right is not None:
            visible = visible & (j <= i + right)
    logits, visible = np.broadcast_arrays(logits, visible)  # a mask may widen the batch of q and k

    logits = np.where(visible, logits, -np.inf)
    any_visible = visible.any(axis=-1, keepdims=True)
    nan_rows = (bad_q & any_visible[..., 0]) | (visible & bad_kv[..., None, :]).any(axis=-1)  # (..., H, L)
    if sinks is not None:
        return _missing(_with_sinks(logits, visible, v, np.asarray(sinks, dtype=np.float64), return_stats), nan_rows)
    row_max = np.where(any_visible, logits.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    weights = np.where(visible, np.exp(logits - row_max), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    probs = weights / np.where(any_visible, total, 1.0)
    out = np.einsum("...hls,...hsv->...hlv", probs, v)
    if not return_stats:
        return _missing(out, nan_rows)

    has = any_visible[..., 0]
    with np.errstate(divide="ignore"):
        plogp = np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1.0)), 0.0)
    stats = {
        "lse": np.where(has, row_max[..., 0] + np.log(np.where(has, total[..., 0], 1.0)), -np.inf),
        "max_logit": np.where(has, row_max[..., 0], -np.inf),
        "max_prob": probs.max(axis=-1, initial=0.0),
        "entropy": -plogp.sum(axis=-1),
        "visible_keys": visible.sum(axis=-1),
    }
    return _missing((out, stats), nan_rows)


def _missing(
    result: np.ndarray | tuple[np.ndarray, dict[str, np.ndarray]], nan_rows: np.ndarray
) -> np.ndarray | tuple[np.ndarray, dict[str, np.ndarray]]:
    """The result with NaN in the rows (..., H, L) that see a missing vector, statistics included."""
    out, stats = result if isinstance(result, tuple) else (result, None)
    nan_rows = np.broadcast_to(nan_rows, out.shape[:-1])
    out = np.where(nan_rows[..., None], np.nan, out)
    if stats is None:
        return out
    return out, {name: s if name == "visible_keys" else np.where(nan_rows, np.nan, s) for name, s in stats.items()}


def _with_sinks(
    logits: np.ndarray, visible: np.ndarray, v: np.ndarray, sinks: np.ndarray, return_stats: bool
) -> np.ndarray | tuple[np.ndarray, dict[str, np.ndarray]]:
    """The softmax over each row's visible keys and its head's sink, written out directly."""
    sink = np.broadcast_to(sinks[:, None, None], logits.shape[:-1] + (1,))  # (..., H, L, 1)
    row_max = np.maximum(logits.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # -inf sink and no key: nothing to attend
    weights = np.where(visible, np.exp(logits - row_max), 0.0)
    sink_weight = np.exp(sink - row_max)
    total = weights.sum(axis=-1, keepdims=True) + sink_weight
    safe = np.where(total > 0, total, 1.0)
    probs, sink_p = weights / safe, sink_weight / safe
    out = np.einsum("...hls,...hsv->...hlv", probs, v)
    if not return_stats:
        return out
    has = visible.any(axis=-1)
    with np.errstate(divide="ignore"):
        plogp = np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1.0)), 0.0).sum(axis=-1)
        plogp += np.where(sink_p > 0, sink_p * np.log(np.where(sink_p > 0, sink_p, 1.0)), 0.0)[..., 0]
        lse = np.where(total[..., 0] > 0, row_max[..., 0] + np.log(safe[..., 0]), -np.inf)
    stats = {
        "lse": lse,
        "max_logit": np.where(has, logits.max(axis=-1, initial=-np.inf), -np.inf),
        "max_prob": probs.max(axis=-1, initial=0.0),
        "entropy": -plogp,
        "visible_keys": visible.sum(axis=-1),
        "sink_share": sink_p[..., 0],
    }
    return out, stats
