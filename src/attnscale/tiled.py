"""Tiled online-softmax attention: the FlashAttention-2 algorithm (Dao, 2023) in plain PyTorch.

The (L, S) score matrix is never held. Queries are cut into blocks of ``block_q`` rows and keys
into blocks of ``block_k`` columns; every tile goes through :class:`~attnscale.score.ScorePath`
(scale -> softcap -> ALiBi and float mask -> hidden keys), and each query row keeps a running
max ``m``, a running sum ``l = sum exp(s - m)`` and an accumulator ``acc = sum exp(s - m) v``,
all rescaled by ``exp(m_old - m_new)`` whenever the max grows::

    for each query block Q_i:                      m = -inf, l = 0, acc = 0
        for each key block K_j, V_j not hidden by causal / window:
            s      = ScorePath.logits(Q_i K_j^T), hidden keys -> -inf
            m_new  = max(m, rowmax(s));  alpha = exp(m - m_new)
            l      = alpha l + rowsum(exp(s - m_new))
            acc    = alpha acc + exp(s - m_new) V_j
        out_i = acc / l,  lse_i = m + log(l)       (natural log)

Where every logit of a row is bounded in advance, ``|s_ij| <= u_i``, the row needs no running max
(a static offset, like FlashDecoding++'s unified max value, but from a bound by proof, so no weight
can overflow). The bound is Cauchy-Schwarz, ``|q_i . k_j| <= |q_i| max_j |k_j|``, and with
softcap ``softcap * tanh`` of that. A query block takes it when the score path has no ALiBi and no
float mask, no statistics are asked for, and every ``u_i <= 34.5`` (float32; 345 in float64:
:data:`attnscale.constants.OFFSET_LIMIT`). Its weights are then ``exp(s)`` itself, in
``[exp(-u), exp(u)]`` (1.0e-15 to 9.6e14 in float32), where ``S e^u max |v|`` fits the dtype; else
``exp(s - u)``, in ``[exp(-2 u), 1]``. Each tile skips the row max and the rescaling of the sum
and the accumulator. Offset 0 subtracts nothing, so a weight carries only its logit's own
rounding, as with the running max; offset ``u`` puts up to ``2 u`` on exp's argument,
``(u - M) eps`` of relative error on the largest weights. The block
is kept if every row's sum of weights shows a largest weight of at least sqrt(tiny); a row whose
maximum sits far below its bound (only possible with offset ``u``) fails this and the block is
recomputed with the running max.

Only ``out`` and ``lse`` are kept for the backward pass, which recomputes the probabilities tile
by tile as ``p = exp(s - lse)`` and uses ``D_i = rowsum(dO * O)`` (FlashAttention-2), so memory is
O((L + S) * D) plus one tile. Accumulation is float32 (float64 for float64 inputs).

Semantics match the ``"math"`` backend exactly, with these choices:

* A row with no visible key returns zeros and ``lse = -inf``; its gradients are zero, never NaN.
* A visible key more than 69 nats below its row's maximum (float32; 690 in float64:
  :data:`attnscale.constants.EXP_FLOOR`) gets the unnormalised weight exp(-69) = 1.1e-30 rather
  than something smaller: ATen's exp is ~50x slower for results below the normal range and its
  matmuls ~100x slower for products there, and such a weight is far below float32 resolution next
  to the maximum's 1. Hidden keys (mask, causal, window, -inf in a float mask) get exactly zero.
* With softcap, ``scale / softcap`` is folded into the query and ``softcap`` into the pass that
  subtracts the running max, so capping costs one pass (tanh) per tile.
* Dropout is not implemented: :func:`scaled_dot_product_attention` rejects ``dropout_p > 0`` with
  ``backend="tiled"`` and ``backend="auto"`` sends dropout to ``"math"``.
* ALiBi slopes are constants (they are fixed by the head count, never learned): no gradient flows
  to them, and slopes that require grad are rejected.
* A float ``attn_mask`` that requires grad receives its gradient (``dS`` summed to its shape).
* ``lse`` is differentiable; the other statistics (max logit, max probability, entropy, visible
  keys) carry no gradient.

GQA never repeats K/V: the G query heads that share a key/value head are stacked along the row
axis, so one matmul per tile serves the whole group, (..., Hkv, G * Lb, D) @ (..., Hkv, D, Sb).

For context parallelism, :func:`attention_partial` computes ``(out, lse)`` of a query shard
against a key shard at global positions, and :func:`merge_partials` combines two partials exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ._autograd import first_order
from ._tracing import tracing
from .dense import accumulation_dtype, head_groups
from .masks import slopes_learned
from .constants import EXP_FLOOR, OFFSET_LIMIT
from .score import ScorePath
from .stats import AttentionStats, with_sinks

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "attention_partial", "merge_partials", "merge_sinks", "sink_scaled", "tiled_attention"]

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 256
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Plan:
    """How one call is tiled.

    The query carries ``q_factor = scale / path.scale``: the whole scale (``path.scale`` is 1), or
    with softcap ``scale / softcap`` (``path.scale`` is the softcap), so that a tile's raw products
    are already the argument of tanh and the score path spends no pass on multiplying them.
    """

    path: ScorePath
    scale: float
    batch: tuple[int, ...]
    H: int
    Hkv: int
    L: int
    S: int
    block_q: int
    block_k: int
    q_start: int
    k_start: int
    with_stats: bool

    @property
    def G(self) -> int:
        return head_groups(self.H, self.Hkv)

    @property
    def groups(self) -> int:
        """Number of (batch, key/value head) pairs: the batch of every per-tile matmul."""
        return math.prod(self.batch) * self.Hkv

    def q_blocks(self) -> list[tuple[int, int]]:
        return [(i, min(i + self.block_q, self.L)) for i in range(0, self.L, self.block_q)]

    def k_blocks(self) -> list[tuple[int, int]]:
        return [(j, min(j + self.block_k, self.S)) for j in range(0, self.S, self.block_k)]

    @property
    def q_factor(self) -> float:
        return self.scale / self.path.scale

    def defer_cap(self, mask: Tensor | None, alibi: Tensor | None) -> float | None:
        """The softcap when it is the only score-path op (no ALiBi, no float mask): the kernel then
        keeps tiles as tanh values and multiplies by the cap inside its next pass; else None."""
        plain_mask = mask is None or mask.dtype == torch.bool
        return self.path.softcap if alibi is None and plain_mask else None

    def key_range(self, i0: int, i1: int) -> tuple[int, int]:
        """The local keys [lo, hi) that causal/window leave visible to some row of i0:i1."""
        first, last = self.path.key_span(self.q_start + i0, self.q_start + i1 - 1)
        lo = 0 if first is None else min(max(first - self.k_start, 0), self.S)
        hi = self.S if last is None else min(max(last - self.k_start + 1, lo), self.S)
        return lo, hi


def _check_block(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}. Fix: pass e.g. {name}=256, or None for the default")
    return value


def _check_offset(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0 (a global position), got {value!r}. Fix: pass the shard's first position")
    return value


def _constant_slopes(alibi_slopes: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The slopes as the kernel reads them (detached, in ``dtype``'s accumulation dtype); slopes
    that require grad are refused, since no gradient flows to them."""
    if alibi_slopes is None:
        return None
    if slopes_learned(alibi_slopes):  # (the pipeline refuses them first: backends' Refusal)
        raise ValueError(
            "alibi_slopes: expected constant slopes on the tiled backend, got a tensor that requires grad. "
            "Fix: pass alibi_slopes.detach(), or backend='math' to learn the slopes"
        )
    return alibi_slopes.detach().to(accumulation_dtype(dtype))


_MAX_CACHED_TILES = 64  # distinct partial-tile patterns kept per call (odd block sizes can make many)


class _Pattern(NamedTuple):
    """Causal / window visibility of one tile, (Lb, Sb) each."""

    keep: Tensor  # bool
    weight: Tensor  # 1.0 where visible, 0.0 where hidden: multiplies weights
    bias: Tensor  # 0.0 where visible, -inf where hidden: added to logits


class _Visibility:
    """Causal / window visibility of tiles, built once per pattern.

    Visibility depends on ``i' - j`` alone, so tiles whose first row and first key lie on the same
    diagonal (and that have the same size) share one pattern: a causal call of any length has one
    or two distinct partial tiles. Multiplying by ``weight`` and adding ``bias`` run at the speed
    of any elementwise pass, where ``masked_fill`` with a broadcast bool tile is 5-19x slower
    (``bench_tiled.py --op-probe``, CPU, float32, 8 x 128 x 256 tiles).
    """

    def __init__(self, plan: _Plan, dtype: torch.dtype, device: torch.device) -> None:
        self.plan, self.dtype, self.device = plan, dtype, device
        self._cache: dict[tuple[int, int, int], _Pattern] = {}

    def tile(self, i0: int, i1: int, j0: int, j1: int) -> _Pattern | None:
        """The tile's pattern, or None when causal and window hide none of its keys."""
        path = self.plan.path
        first, k_first = self.plan.q_start + i0, self.plan.k_start + j0
        Lb, Sb = i1 - i0, j1 - j0
        if path.block_is_visible(first, first + Lb - 1, k_first, k_first + Sb - 1):
            return None  # decided on integers, without building (Lb, Sb) positions
        key = (first - k_first, Lb, Sb)
        hit = self._cache.get(key)
        if hit is None:
            keep = path.visibility(*path.positions(first, Lb, k_first, Sb, self.device))  # (Lb, Sb)
            weight = keep.to(self.dtype)
            hit = _Pattern(keep, weight, torch.zeros_like(weight).masked_fill_(~keep, _NEG_INF))
            if len(self._cache) < _MAX_CACHED_TILES:
                self._cache[key] = hit
        return hit


def _mask_block(mask: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """The part of a broadcastable (..., L or 1, S or 1) mask that covers rows i0:i1, keys j0:j1."""
    rows = slice(i0, i1) if mask.shape[-2] != 1 else slice(None)
    cols = slice(j0, j1) if mask.shape[-1] != 1 else slice(None)
    return mask[..., rows, cols]


def _tile_logits(
    plan: _Plan,
    qk: Tensor,
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    mask: Tensor | None,
    alibi: Tensor | None,
    tiles: _Visibility,
    *,
    fill: bool,
    defer_cap: bool = False,
    mask_hides: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logits of one tile from its raw products ``qk`` (*batch, H, Lb, Sb), in place where autograd
    allows, and ``keep``: what the tile's weights are multiplied by so that hidden keys get exactly
    0 (a float or bool tile broadcastable to the logits; None when no key is hidden).

    ``fill`` also puts -inf at hidden keys, as a row maximum needs; without it hidden keys keep what
    the score path gives them and only ``keep`` hides them. With ``defer_cap`` (only when softcap is
    the sole score-path op) the returned "logits" are ``tanh(qk)`` and the caller multiplies by the
    softcap in its next pass. ``mask_hides`` says the float mask holds -inf somewhere: those keys are
    hidden too (they are -inf in the logits already; ``keep`` zeroes their weights).
    """
    pattern = tiles.tile(i0, i1, j0, j1)
    keep_bool = None if pattern is None else pattern.keep
    keep = None if pattern is None else pattern.weight
    additive = None
    if mask is not None:
        mb = _mask_block(mask, i0, i1, j0, j1)
        if mb.dtype == torch.bool:
            keep = keep_bool = mb if keep_bool is None else keep_bool & mb
        else:
            additive = mb.to(qk.dtype)
    q_pos = k_pos = None
    if alibi is not None:
        Lb, Sb = i1 - i0, j1 - j0
        q_pos, k_pos = plan.path.positions(plan.q_start + i0, Lb, plan.k_start + j0, Sb, qk.device)
    inplace = not qk.requires_grad
    if plan.path.softcap is None and alibi is None and additive is None and plan.path.scale == 1.0:
        s = qk  # the score path is the identity once the scale sits in q: skip a pass over the tile
    elif defer_cap and alibi is None and additive is None:
        s = qk.tanh_() if inplace else qk.tanh()  # the caller multiplies by the softcap in its next pass
    else:
        s = plan.path.logits(qk, q_pos=q_pos, k_pos=k_pos, alibi_slopes=alibi, additive=additive)
    if fill and pattern is not None and keep is pattern.weight:
        s = s.add_(pattern.bias) if inplace else s + pattern.bias
    elif fill and keep_bool is not None:
        s = s.masked_fill_(~keep_bool, _NEG_INF) if inplace else s.masked_fill(~keep_bool, _NEG_INF)
    if mask_hides and additive is not None:
        finite = additive != _NEG_INF
        keep = finite if keep_bool is None else keep_bool & finite
    return s, keep


# Two CPU slow paths bound how small a weight may get. ATen's vectorized exp leaves its fast path
# for results below the normal range (arguments under about -87.3 in float32, -inf included) and
# runs some 50x slower there; and a matmul whose products fall below the normal range runs some
# 90x slower (``bench_tiled.py --op-probe``: p v of one 8 x 128 x 256 tile with every weight
# 1.6e-38, 47.9 ms against 0.53 ms). So no weight goes below exp(floor) (1.1e-30 in float32, floor
# -69, and -690 in float64; attnscale.constants.EXP_FLOOR, which the compiled kernel reads too):
# arguments are raised to the floor before exp, weights times values down to 1.1e-8 stay normal
# numbers, and hidden keys are set back to exactly 0 afterwards. A weight of 1.1e-30 next to a
# row maximum's exp(0) = 1 is far below float32 resolution.
_EXP_FLOOR = EXP_FLOOR


def _exp_(centred: Tensor, keep: Tensor | None, lowest: float) -> Tensor:
    """exp of a centred tile in place, on ATen's fast path, with hidden keys at exactly 0.

    Visible entries are <= 0 with a running max, and at most the offset limit (34.5 in float32)
    in rows whose static offset is 0 (:func:`_centre`); hidden ones (``keep`` 0) may hold anything,
    -inf included, and are clamped into [floor, limit] before the exp. ``lowest`` bounds the
    visible entries from below when the score path does (softcap), else it is -inf.
    """
    cpu = centred.device.type == "cpu"  # the slow path is ATen's CPU exp; elsewhere exp(-inf) = 0 as it is
    floor = _EXP_FLOOR[centred.dtype] if cpu else None
    if keep is not None:
        centred.clamp_(floor, -_EXP_FLOOR[centred.dtype] / 2)
    elif floor is not None and lowest < floor and (tracing(centred) or float(centred.amin()) < floor):
        centred.clamp_min_(floor)
    p = centred.exp_()
    return p if keep is None else p.mul_(keep)


def _has_neg_inf(mask: Tensor | None) -> bool:
    """Whether a float mask holds -inf (traced: assumed, as that is right either way)."""
    if mask is None or mask.dtype == torch.bool:
        return False
    return tracing(mask) or bool(torch.isneginf(mask.detach()).any())


def _group_rows(x: Tensor, plan: _Plan, i0: int, i1: int) -> Tensor:
    """Rows i0:i1 of x (*batch, H, L, E) stacked per key/value head: (*batch, Hkv, G * Lb, E)."""
    blk = x[..., i0:i1, :]
    return blk.reshape(*plan.batch, plan.Hkv, plan.G * (i1 - i0), x.shape[-1])


# A row whose logits are known to satisfy |s_ij| <= u_i needs no running max: exp(s_ij) lies in
# [exp(-u_i), exp(u_i)] and exp(s_ij - u_i) in [exp(-2 u_i), 1]. While 2 u_i <= -floor (u_i <= 34.5
# in float32, 345 in float64: attnscale.constants.OFFSET_LIMIT) no weight overflows or falls below
# the exp floor, so exp and the matmuls stay on their fast paths without any clamp.
_OFFSET_LIMIT = OFFSET_LIMIT


def _row_bounds(plan: _Plan, q: Tensor, k: Tensor, mask: Tensor | None, alibi: Tensor | None) -> Tensor | None:
    """u (*batch, H, L) with |logit_ij| <= u_i for every key j of row i, or None where the score path
    has no such bound (ALiBi, a float mask) or the statistics need the running max.

    Cauchy-Schwarz gives |q_i . k_j| <= |q_i| max_j |k_j| (q already carries the scale); with softcap
    the logit is cap * tanh(q_i . k_j), bounded by cap * tanh of the same. One pass over q and k.
    """
    if plan.with_stats or alibi is not None or (mask is not None and mask.dtype != torch.bool) or plan.S == 0:
        return None
    if tracing(q, k):  # choosing it needs the bounds' values: traced calls take the running max
        return None
    if q.dtype not in _OFFSET_LIMIT:
        return None
    k_norm = torch.linalg.vector_norm(k, dim=-1).amax(dim=-1)  # (*batch, Hkv)
    q_norm = torch.linalg.vector_norm(q, dim=-1).view(*plan.batch, plan.Hkv, plan.G, plan.L)
    bound = (q_norm * k_norm[..., None, None]).view(*plan.batch, plan.H, plan.L)
    return bound if plan.path.softcap is None else bound.tanh_().mul_(plan.path.softcap)


def _resolved(l: Tensor, S: int) -> bool:
    """Whether a block computed with the static offset kept full precision: every row with a visible
    key has ``l >= S sqrt(tiny)``, so its largest weight is at least sqrt(tiny) (1e-19 in float32)
    and weights times values down to sqrt(tiny) are normal numbers. A row whose maximum logit lies
    far below its bound fails this, and its block is recomputed with the running max."""
    floor = S * math.sqrt(torch.finfo(l.dtype).tiny)
    return not bool(((l > 0) & (l < floor)).any())


def _abs_peak(x: Tensor) -> float:
    """max |x| (NaN if x holds one, 0 if empty)."""
    if x.numel() == 0:
        return 0.0
    lo, hi = (float(t) for t in torch.aminmax(x))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


def _centre(u: Tensor, v_peak: float, S: int) -> Tensor:
    """The offset a static row subtracts: 0 where its weights exp(s) <= exp(u) times S values of up
    to ``v_peak`` fit the dtype, else u.

    Offset 0 subtracts nothing, so a weight carries only the rounding its logit already has, as
    with the running max; subtracting u puts up to 2u on exp's argument and (u - max) eps of
    relative error on the largest weights, which shows where the Cauchy-Schwarz bound is loose
    (D = 80: tests/test_tiled.py, test_static_offset_costs_no_float32_precision_against_the_running_max).
    Weights are then in [exp(-u), exp(u)], 1.0e-15 to 9.6e14 at u = 34.5 in float32: above the
    exp floor, and no weight or sum overflows."""
    fits = u.exp().mul_(S * v_peak) < torch.finfo(u.dtype).max / 2  # False for NaN or inf values
    return torch.where(fits, torch.zeros_like(u), u)


def _static_offset(bounds: Tensor | None, i0: int, i1: int) -> Tensor | None:
    """The rows' bounds u (*batch, H, Lb) when every one is within the static limit, else None."""
    if bounds is None:
        return None
    u = bounds[..., i0:i1]
    return u if float(u.amax()) <= _OFFSET_LIMIT[u.dtype] else None  # NaN / inf bounds fail the test


class _Tiler:
    """What every tile of one forward call shares: the key/value blocks, the visibility patterns,
    and a reused buffer for the raw products of full-size tiles."""

    def __init__(self, plan: _Plan, q: Tensor, k: Tensor, v: Tensor) -> None:
        n, D, Dv = plan.groups, q.shape[-1], v.shape[-1]
        self.plan = plan
        # k^T laid out once per key block as contiguous (n, D, Sb): the per-tile q k^T is then a
        # plain matmul on dense memory. ``bench_tiled.py --op-probe``, the 272 q k^T tiles of L = 4096,
        # D = 64: 111.5 ms reading k transposed, 105.3 ms from one (n, D, S) copy (its rows 16 KiB
        # apart), 96.2 ms from per-block copies. v as (n, S, Dv), whose blocks are dense already.
        kt = k.reshape(n, plan.S, D).transpose(1, 2)
        self.kt_blocks = {j0: kt[:, :, j0:j1].contiguous() for j0, j1 in plan.k_blocks()}
        self.v = v.reshape(n, plan.S, Dv)
        self.tiles = _Visibility(plan, q.dtype, q.device)
        self._buffer = q.new_empty(n, plan.G * min(plan.block_q, plan.L), min(plan.block_k, plan.S))

    def key_tiles(self, i0: int, i1: int) -> list[tuple[int, int, int]]:
        """The key tiles ``(block start, j0, j1)`` of query block i0:i1: the fixed key blocks cut
        down to the keys [j0, j1) that causal/window leave visible to the block (a causal diagonal
        block computes only up to its last row's key), blocks with none left out."""
        lo, hi = self.plan.key_range(i0, i1)
        return [(b0, max(b0, lo), min(b1, hi)) for b0, b1 in self.plan.k_blocks() if b0 < hi and b1 > lo]

    def products(self, q3: Tensor, b0: int, j0: int, j1: int, Lb: int) -> Tensor:
        """q k^T of one tile as (*batch, H, Lb, Sb); full-size tiles reuse one buffer (no allocation)."""
        out = self._buffer if self._buffer.shape[1:] == (q3.shape[1], j1 - j0) else None
        kt = self.kt_blocks[b0][:, :, j0 - b0 : j1 - b0]
        return torch.bmm(q3, kt, out=out).view(*self.plan.batch, self.plan.H, Lb, j1 - j0)


def _forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, alibi: Tensor | None
) -> tuple[Tensor, Tensor, dict[str, Tensor], tuple[Tensor, Tensor]]:
    """Online softmax over key blocks, one query block at a time.

    q (*batch, H, L, D) already scaled, k (*batch, Hkv, S, D), v (*batch, Hkv, S, Dv), all in the
    accumulation dtype. Returns out (*batch, H, L, Dv), lse (*batch, H, L), the statistics, and
    the normaliser ``(m, l)`` (*batch, H, L) each: the offset every row's exp used last (its
    running max, or its static bound) and ``l = sum exp(s - m)``, so that the backward pass can
    recompute the forward's weights ``exp(s - m) / l`` exactly.

    A query block whose rows have a static offset (:func:`_row_bounds`) subtracts that instead of a
    running max: no row maximum, no rescaling of the sum and the accumulator. The others run the
    online softmax of FlashAttention-2.
    """
    batch, H, L, Dv = plan.batch, plan.H, plan.L, v.shape[-1]
    acc_dtype = q.dtype
    out = q.new_empty(*batch, H, L, Dv)
    lse = q.new_empty(*batch, H, L)
    offset, total = q.new_empty(*batch, H, L), q.new_empty(*batch, H, L)
    stats: dict[str, Tensor] = {}
    if plan.with_stats:
        for name in ("max_logit", "max_prob", "entropy"):
            stats[name] = q.new_empty(*batch, H, L)
        stats["visible_keys"] = torch.zeros(*batch, H, L, dtype=torch.int64, device=q.device)
    if lse.numel() == 0:  # no query rows (an empty batch, H or L): nothing to compute
        return out, lse, stats, (offset, total)
    tiler = _Tiler(plan, q, k, v)
    bounds = _row_bounds(plan, q, k, mask, alibi)
    v_peak = _abs_peak(v) if bounds is not None else math.nan
    mask_hides = _has_neg_inf(mask)
    n, G = plan.groups, plan.G
    for i0, i1 in plan.q_blocks():
        Lb = i1 - i0
        q3 = _group_rows(q, plan, i0, i1).reshape(n, G * Lb, q.shape[-1])  # (n, G * Lb, D); sizes named: n may be 0
        acc = q.new_zeros(n, G * Lb, Dv)
        u = _static_offset(bounds, i0, i1)
        if u is not None:
            u = _centre(u, v_peak, plan.S)
            m, l, w = u, _static_block(plan, tiler, q3, i0, i1, mask, u, acc), None
            if not _resolved(l, plan.S):
                acc.zero_()
                u = None
        if u is None:
            m, l, w = _online_block(plan, tiler, q3, i0, i1, mask, alibi, mask_hides, acc, stats)
        has_key = l > 0
        safe_l = torch.where(has_key, l, torch.ones_like(l))
        out[..., i0:i1, :] = acc.view(*batch, H, Lb, Dv) / safe_l.unsqueeze(-1)
        lse[..., i0:i1] = torch.where(has_key, m + torch.log(safe_l), _NEG_INF)
        offset[..., i0:i1], total[..., i0:i1] = m, safe_l
        if w is not None:
            stats["max_logit"][..., i0:i1] = torch.where(has_key, m, _NEG_INF)
            stats["max_prob"][..., i0:i1] = torch.where(has_key, 1.0 / safe_l, torch.zeros_like(l))
            entropy = torch.log(safe_l) - w / safe_l
            stats["entropy"][..., i0:i1] = torch.where(has_key, entropy, torch.zeros_like(l)).clamp_min(0.0)
    assert out.dtype == acc_dtype
    return out, lse, stats, (offset, total)


def _static_block(
    plan: _Plan, tiler: _Tiler, q3: Tensor, i0: int, i1: int, mask: Tensor | None, u: Tensor, acc: Tensor
) -> Tensor:
    """One query block with the static offset u (*batch, H, Lb; 0 or the rows' bounds, see
    :func:`_centre`): accumulates ``sum exp(s - u) v`` into acc (n, G * Lb, Dv) and returns
    ``l = sum exp(s - u)`` (*batch, H, Lb).

    Per tile: q k^T, tanh (softcap only), ``cap * t - u``, exp, the visibility multiply (partial tiles
    only), a row sum, and p v. Hidden keys keep their finite logits, so exp stays on its fast path.
    """
    Lb, cap = i1 - i0, plan.path.softcap
    neg_u = u.neg().unsqueeze(-1)  # (*batch, H, Lb, 1)
    l = torch.zeros_like(u)
    for b0, j0, j1 in tiler.key_tiles(i0, i1):
        qk = tiler.products(q3, b0, j0, j1, Lb)
        t, keep = _tile_logits(plan, qk, i0, i1, j0, j1, mask, None, tiler.tiles, fill=False, defer_cap=True)
        centred = t.add_(neg_u) if cap is None else torch.add(neg_u, t, alpha=cap, out=t)  # in [-2u, u]
        p = centred.exp_()
        if keep is not None:
            p.mul_(keep)
        l.add_(p.sum(dim=-1))
        acc.baddbmm_(p.view(acc.shape[0], -1, j1 - j0), tiler.v[:, j0:j1])
    return l


def _online_block(
    plan: _Plan,
    tiler: _Tiler,
    q3: Tensor,
    i0: int,
    i1: int,
    mask: Tensor | None,
    alibi: Tensor | None,
    mask_hides: bool,
    acc: Tensor,
    stats: dict[str, Tensor],
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One query block with a running max: returns ``(m, l, w)`` (*batch, H, Lb) and accumulates
    ``sum exp(s - m) v`` into acc (n, G * Lb, Dv); ``w = sum exp(s - m) (s - m)`` with statistics."""
    batch, H, Lb = plan.batch, plan.H, i1 - i0
    cap = plan.defer_cap(mask, alibi)  # tiles hold tanh values; logits = cap * tile
    lowest = _NEG_INF if cap is None else -2.0 * cap  # s - m >= -2 cap when |s| <= cap
    # The running max starts finite, so a row that has seen no key yet needs no special case:
    # alpha = exp(0) = 1 scales l = 0, and its hidden entries give exp(-inf) = 0.
    m = acc.new_full((*batch, H, Lb), torch.finfo(acc.dtype).min)
    l = acc.new_zeros(*batch, H, Lb)
    rows = (acc.shape[0], acc.shape[1], 1)
    w = acc.new_zeros(*batch, H, Lb) if plan.with_stats else None  # sum exp(s - m) (s - m)
    for b0, j0, j1 in tiler.key_tiles(i0, i1):
        qk = tiler.products(q3, b0, j0, j1, Lb)
        # s is the product tile, so the steps below work in place: no (Lb, Sb) allocations.
        s, keep = _tile_logits(
            plan, qk, i0, i1, j0, j1, mask, alibi, tiler.tiles, fill=True, defer_cap=cap is not None, mask_hides=mask_hides
        )
        tile_max = s.amax(dim=-1) if cap is None else s.amax(dim=-1).mul_(cap)  # tanh is increasing
        m_new = torch.maximum(m, tile_max)
        alpha = torch.exp(m - m_new)
        if w is not None:
            stats["visible_keys"][..., i0:i1] += (s != _NEG_INF).sum(dim=-1)
        if cap is None:
            centred = s.sub_(m_new.unsqueeze(-1))  # (*batch, H, Lb, Sb)
        else:  # cap * tanh - m in one pass
            centred = torch.add(m_new.neg().unsqueeze(-1), s, alpha=cap, out=s)
        if w is not None:
            p = _exp_(centred.clone(), keep, lowest)
            # Re-centre the running sum of p log p on the new max (where alpha = 0 the old keys'
            # share is 0: m - m_new may be -inf beside l = 0), then add this tile's. log p is the
            # centred logit as _exp_ clamped it: p * (s - m) would give a floored weight a term
            # of 1.1e-30 times a logit gap of any size (0.15 at a gap of 1e29).
            w = torch.where(alpha == 0, 0.0, alpha * (w + l * (m - m_new)))
            if centred.device.type == "cpu":
                centred.clamp_min_(_EXP_FLOOR[centred.dtype])
            w = w + (p * centred.masked_fill_(p == 0, 0.0)).sum(dim=-1)
        else:
            p = _exp_(centred, keep, lowest)
        l = torch.addcmul(p.sum(dim=-1), alpha, l)  # alpha l + rowsum(p)
        acc.mul_(alpha.view(rows))
        acc.baddbmm_(p.view(acc.shape[0], -1, j1 - j0), tiler.v[:, j0:j1])
        m = m_new
    return m, l, w


def _backward(
    plan: _Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    alibi: Tensor | None,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor,
    mask_grad: bool,
    norm: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """dq (of the scaled q), dk, dv and the float mask's gradient, tile by tile from the saved lse.

    Key blocks outside, query blocks inside (FlashAttention-2): dK and dV of a key block are
    finished before the next one; dQ accumulates per query block. The tiles are the forward's
    (the same key ranges, k^T blocks and products, see :class:`_Tiler`), so the logits are
    recomputed bit for bit. With the forward's normaliser ``norm = (m, l)`` the weights are
    ``exp(s - m) / l``, the forward's own (a row with one visible key gets exactly 1); without it
    (a partial whose rows were merged over key shards) they are ``exp(s - lse)``.
    """
    batch, H, Hkv, G = plan.batch, plan.H, plan.Hkv, plan.G
    D, Dv = q.shape[-1], v.shape[-1]
    # D_i = rowsum(dO * O) = sum_j p_ij dP_ij; a gradient on lse adds p_ij * dlse_i to dS_ij.
    delta = (dout * out).sum(dim=-1) - dlse  # (*batch, H, L)
    if norm is None:
        offset, total = lse.masked_fill(lse == _NEG_INF, 0.0), None  # empty rows: keep hides every key, so p = 0
    else:
        offset, total = norm  # total > 0: the forward made it 1 for empty rows
    q_blocks = plan.q_blocks()
    tiler = _Tiler(plan, q, k, v)
    spans = [{b0: (j0, j1) for b0, j0, j1 in tiler.key_tiles(i0, i1)} for i0, i1 in q_blocks]
    qs = [_group_rows(q, plan, i0, i1) for i0, i1 in q_blocks]  # (*batch, Hkv, G * Lb, D)
    dos = [_group_rows(dout, plan, i0, i1) for i0, i1 in q_blocks]  # (*batch, Hkv, G * Lb, Dv)
    dqs = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in qs]  # contiguous: viewed as (n, rows, D)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)  # k may be an expanded view
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dmask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device) if mask_grad else None
    if lse.numel() == 0:  # no query rows: every gradient is empty or zero
        return torch.zeros_like(q), dk, dv, dmask
    cap = plan.path.softcap
    deferred = plan.defer_cap(mask, alibi) is not None
    mask_hides = _has_neg_inf(mask)
    tiles = tiler.tiles
    n = plan.groups
    # With softcap, q carries scale / cap, so a tile's raw products x are tanh's argument and
    # d logits / dx = cap * (1 - tanh(x)^2): the tiles accumulate (1 - t^2) dS and the cap
    # multiplies dq and dk once at the end. With ALiBi or a float mask, the capped tile goes
    # through the rest of the score path (bias, mask) as ``uncapped`` describes it.
    # No -inf is placed at hidden keys (no row maximum is taken here): p = exp(s - lse) * keep, so
    # t stays finite and (1 - t^2) dS is 0 wherever p is.
    uncapped = dataclasses.replace(plan, path=dataclasses.replace(plan.path, softcap=None, scale=1.0))
    for b0, _ in plan.k_blocks():
        for b, (i0, i1) in enumerate(q_blocks):
            if b0 not in spans[b]:
                continue  # causal / window hide the whole tile
            j0, j1 = spans[b][b0]
            Lb, Sb = i1 - i0, j1 - j0
            k_blk, v_blk = k[..., j0:j1, :], v[..., j0:j1, :]
            dk_blk, dv_blk = dk[..., j0:j1, :], dv[..., j0:j1, :]
            qk = tiler.products(qs[b].reshape(n, G * Lb, D), b0, j0, j1, Lb)  # (*batch, H, Lb, Sb)
            neg_lse = offset[..., i0:i1].neg().unsqueeze(-1)
            if cap is None:
                t = None
                s, keep = _tile_logits(plan, qk, i0, i1, j0, j1, mask, alibi, tiles, fill=False, mask_hides=mask_hides)
                p = _exp_(s.add_(neg_lse), keep, _NEG_INF)  # (*batch, H, Lb, Sb)
            elif deferred:
                t, keep = _tile_logits(plan, qk, i0, i1, j0, j1, mask, alibi, tiles, fill=False, defer_cap=True)
                p = _exp_(torch.add(neg_lse, t, alpha=cap), keep, _NEG_INF)  # exp(cap * tanh - lse)
            else:
                t = qk.tanh_()
                s, keep = _tile_logits(
                    uncapped, t * cap, i0, i1, j0, j1, mask, alibi, tiles, fill=False, mask_hides=mask_hides
                )
                p = _exp_(s.add_(neg_lse), keep, _NEG_INF)
            if total is not None:
                p = p.div_(total[..., i0:i1].unsqueeze(-1))
            # accumulate in place (baddbmm_): a matmul then += would allocate and sweep each result again
            p3, do3 = p.view(n, G * Lb, Sb), dos[b].reshape(n, G * Lb, Dv)
            dv_blk.view(n, Sb, Dv).baddbmm_(p3.transpose(1, 2), do3)
            dp = (dos[b] @ v_blk.transpose(-1, -2)).view(*batch, H, Lb, Sb)
            ds = dp.sub_(delta[..., i0:i1].unsqueeze(-1)).mul_(p)
            dqk = ds if t is None else torch.addcmul(ds, ds, t.square_(), value=-1.0, out=t)  # (1 - t^2) dS
            if dmask is not None:
                blk = _mask_block(dmask, i0, i1, j0, j1)
                blk += ds.sum_to_size(blk.shape)  # bias and float mask enter linearly, after the cap
            dqk = dqk.view(n, G * Lb, Sb)
            dqs[b].view(n, G * Lb, D).baddbmm_(dqk, k_blk.reshape(n, Sb, D))
            dk_blk.view(n, Sb, D).baddbmm_(dqk.transpose(1, 2), qs[b].reshape(n, G * Lb, D))
    dq = torch.empty_like(q)
    for b, (i0, i1) in enumerate(q_blocks):
        dq[..., i0:i1, :] = dqs[b].view(*batch, H, i1 - i0, q.shape[-1])
    if cap is not None:
        dq.mul_(cap)
        dk.mul_(cap)
    return dq, dk, dv, dmask


def _kernel_inputs(plan: _Plan, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (*batch, H, L, D) times ``plan.q_factor``, k (*batch, Hkv, S, D), v (*batch, Hkv, S, Dv),
    all in the accumulation dtype and broadcast to the plan's batch shape."""
    acc = accumulation_dtype(query.dtype)
    q = query.to(acc).expand(*plan.batch, plan.H, plan.L, query.shape[-1]) * plan.q_factor
    k = key.to(acc).expand(*plan.batch, *key.shape[-3:])
    v = value.to(acc).expand(*plan.batch, *value.shape[-3:])
    return q, k, v


class _TiledAttention(torch.autograd.Function):
    """Autograd wrapper: saves the inputs, ``out``, ``lse`` and the normaliser; recomputes the
    rest. Its backward has no derivative of its own (:func:`attnscale._autograd.first_order`)."""

    @staticmethod
    def forward(query, key, value, mask, alibi, plan):  # type: ignore[override]
        acc = accumulation_dtype(query.dtype)
        q, k, v = _kernel_inputs(plan, query, key, value)
        out, lse, stats, (offset, total) = _forward(plan, q, k, v, mask, alibi)
        if query.dtype == acc:
            return (out, lse, *stats.values(), offset, total)
        return (out.to(query.dtype), lse, *stats.values(), offset, total, out)  # the backward needs out in acc

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        query, key, value, mask, alibi, plan = inputs
        n = 2 + (4 if plan.with_stats else 0)
        offset, total, *wide = output[n:]
        out = wide[0] if wide else output[0]
        ctx.save_for_backward(query, key, value, mask, alibi, out, output[1], offset, total)
        ctx.plan = plan
        ctx.mark_non_differentiable(*output[2:])  # statistics, normaliser: no gradients

    @staticmethod
    def backward(ctx, dresult, dlse, *unused):  # type: ignore[override]
        query, key, value, mask, alibi, out, lse, offset, total = ctx.saved_tensors
        plan: _Plan = ctx.plan
        acc = out.dtype
        mask_grad = mask is not None and ctx.needs_input_grad[3]
        with torch.no_grad():  # out= products inside: no graph of the backward (see first_order)
            q, k, v = _kernel_inputs(plan, query, key, value)
            dq, dk, dv, dmask = _backward(
                plan, q, k, v, mask, alibi, out, lse, dresult.to(acc), dlse.to(acc), mask_grad, (offset, total)
            )
            dq = (dq * plan.q_factor).sum_to_size(query.shape).to(query.dtype)  # q was scaled before q k^T
            dk = dk.sum_to_size(key.shape).to(key.dtype)  # broadcast batch dims sum back
            dv = dv.sum_to_size(value.shape).to(value.dtype)
            if dmask is not None:
                dmask = dmask.to(mask.dtype)
        return (*first_order("tiled", (query, key, value, mask), dq, dk, dv, dmask), None, None)


def _apply(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, alibi: Tensor | None, plan: _Plan) -> tuple[Tensor, ...]:
    """(out, lse, *statistics) of :class:`_TiledAttention` (without the normaliser it keeps)."""
    outputs = _TiledAttention.apply(query, key, value, mask, alibi, plan)
    return outputs[: 2 + (4 if plan.with_stats else 0)]


def _plan(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    path: ScorePath,
    *,
    block_q: int | None,
    block_k: int | None,
    q_start: int,
    k_start: int,
    with_stats: bool,
) -> _Plan:
    batch = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3]))
    H, L = query.shape[-3], query.shape[-2]
    Hkv, S = key.shape[-3], key.shape[-2]
    return _Plan(
        path=dataclasses.replace(path, scale=1.0 if path.softcap is None else path.softcap),
        scale=path.scale,
        batch=batch,
        H=H,
        Hkv=Hkv,
        L=L,
        S=S,
        block_q=DEFAULT_BLOCK_Q if block_q is None else _check_block("block_q", block_q),
        block_k=DEFAULT_BLOCK_K if block_k is None else _check_block("block_k", block_k),
        q_start=_check_offset("q_start", q_start),
        k_start=_check_offset("k_start", k_start),
        with_stats=with_stats,
    )


def tiled_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    path: ScorePath,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, AttentionStats | None]:
    """Tiled attention on validated inputs (``backend="tiled"`` of ``scaled_dot_product_attention``).

    query (..., H, L, D), key (..., Hkv, S, D), value (..., Hkv, S, Dv), H a multiple of Hkv,
    attn_mask broadcastable to (..., H, L, S). Returns (out (..., H, L, Dv), stats or None).
    ``sinks`` (H,) enter after the last key tile, through :func:`sink_scaled` on the finished
    ``(out, lse)`` in the accumulation dtype, so every tile runs as without them.
    ``block_q`` / ``block_k`` (default :data:`DEFAULT_BLOCK_Q` / :data:`DEFAULT_BLOCK_K`) set the
    tile; any positive size gives the same result up to rounding.

    >>> import math, torch
    >>> q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 3)
    >>> path = ScorePath(scale=0.5, causal=True)
    >>> out, _ = tiled_attention(q, k, v, path=path, block_q=2, block_k=4)
    >>> weights = torch.softmax((q @ k.mT * 0.5).masked_fill(torch.ones(5, 9).triu(1).bool(), -math.inf), -1)
    >>> torch.allclose(out, weights @ v, atol=1e-6)
    True
    """
    alibi = _constant_slopes(alibi_slopes, query.dtype)
    plan = _plan(query, key, value, path, block_q=block_q, block_k=block_k, q_start=0, k_start=0, with_stats=return_stats)
    if sinks is None:
        out, lse, *rest = _apply(query, key, value, attn_mask, alibi, plan)
    else:  # the kernel's output stays in the accumulation dtype until the sink has rescaled it
        acc = accumulation_dtype(query.dtype)
        out, lse, *rest = _apply(query.to(acc), key.to(acc), value.to(acc), attn_mask, alibi, plan)
        out = sink_scaled(out, lse, sinks).to(query.dtype)
    if not return_stats:
        return out, None
    max_logit, max_prob, entropy, visible_keys = rest
    stats = AttentionStats(lse=lse, max_logit=max_logit, max_prob=max_prob, entropy=entropy, visible_keys=visible_keys)
    return out, stats if sinks is None else with_sinks(stats, sinks)


def attention_partial(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    path: ScorePath,
    q_start: int = 0,
    k_start: int = 0,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Partial attention of a query shard against a key shard: ``(out, lse)``, both differentiable.

    The shard's query row ``i`` sits at global row ``q_start + i`` and key ``j`` at global key
    position ``k_start + j``; ``path`` describes the whole problem (its ``q_offset`` is the full
    problem's alignment), so causal masks, windows and ALiBi see global positions. ``attn_mask``
    covers only this shard pair. ``out`` (..., H, Lq, Dv) and ``lse`` (..., H, Lq) are in the
    accumulation dtype (float32, or float64 for float64) so that :func:`merge_partials` is exact;
    a shard pair where a row sees no key gives ``out = 0`` and ``lse = -inf`` for that row.
    """
    alibi = _constant_slopes(alibi_slopes, query.dtype)
    plan = _plan(
        query, key, value, path, block_q=block_q, block_k=block_k, q_start=q_start, k_start=k_start, with_stats=False
    )
    acc = accumulation_dtype(query.dtype)
    out, lse, *_ = _apply(query.to(acc), key.to(acc), value.to(acc), attn_mask, alibi, plan)
    return out, lse


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Exact merge of two partials over disjoint key sets: ``(out, lse)`` of their union.

    ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = (exp(lse_a) out_a + exp(lse_b) out_b) / exp(lse)``,
    computed relative to the larger lse. A row that is empty on both sides (``-inf`` twice) stays
    ``out = 0``, ``lse = -inf``, with zero gradients.

    >>> import torch
    >>> q, k, v = torch.randn(1, 3, 4), torch.randn(1, 6, 4), torch.randn(1, 6, 2)
    >>> path = ScorePath(scale=0.5)
    >>> a = attention_partial(q, k[:, :2], v[:, :2], path=path)
    >>> b = attention_partial(q, k[:, 2:], v[:, 2:], path=path, k_start=2)
    >>> out, lse = merge_partials(*a, *b)
    >>> torch.allclose(out, torch.softmax(q @ k.mT * 0.5, -1) @ v, atol=1e-6)
    True
    """
    m = torch.maximum(lse_a, lse_b)
    m_ref = m.masked_fill(m == _NEG_INF, 0.0)
    wa, wb = torch.exp(lse_a - m_ref), torch.exp(lse_b - m_ref)
    total = wa + wb
    has_key = total > 0
    safe = torch.where(has_key, total, torch.ones_like(total))
    out = (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / safe.unsqueeze(-1)
    lse = torch.where(has_key, m_ref + torch.log(safe), torch.full_like(m, _NEG_INF))
    return out, lse


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Add attention sinks to finished attention: ``(out, lse)`` of the row's softmax over every
    visible key, and ``sinks`` (H,), one logit per query head, give ``(out, lse)`` with the sink in
    the denominator::

        p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sink_h)),   out_i = sum_j p_ij v_j

    The sink is a partial with no value (``out = 0``, ``lse = sink_h``), so this is
    :func:`merge_partials` with it: ``out * exp(lse_old - lse)`` and ``lse = log(exp(lse_old) +
    exp(sink))``. Call it once, after every key shard is merged (the sink enters a row once). A row
    with no visible key gives ``out = 0``, ``lse = sink``. Differentiable in all three inputs.
    ``out`` (..., H, L, Dv) and ``lse`` (..., H, L) are in the accumulation dtype; ``sinks`` is
    cast to it.

    >>> import torch
    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    >>> sinks = torch.tensor([0.5, -1.0])
    >>> out, lse = merge_sinks(*attention_partial(q, k, v, path=ScorePath(scale=0.5)), sinks)
    >>> logits = q @ k.mT * 0.5
    >>> p = logits.exp() / (logits.exp().sum(-1, keepdim=True) + sinks.exp()[:, None, None])
    >>> torch.allclose(out, p @ v, atol=1e-6)
    True
    """
    sink = sinks.to(lse.dtype)[..., None].expand(lse.shape)  # (..., H, L)
    return merge_partials(out, lse, torch.zeros_like(out), sink)


def sink_scaled(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """The output of :func:`merge_sinks` alone, in four ops: each row's weights shrink by its keys'
    share of the denominator, ``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``. A row
    with no visible key (``lse = -inf``) stays 0 whatever the sink, with zero gradients (the
    difference, NaN there for a sink of -inf, is never read)."""
    empty = lse == _NEG_INF
    gap = torch.where(empty, lse, lse - sinks.to(lse.dtype)[..., None])  # (..., H, L): -inf where no key
    return out * torch.sigmoid(gap).unsqueeze(-1)


def partial_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    path: ScorePath,
    q_start: int = 0,
    k_start: int = 0,
    alibi_slopes: Tensor | None = None,
    with_stats: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor, AttentionStats | None]:
    """:func:`attention_partial` without autograd, for callers that write their own backward.

    Returns ``(out, lse, stats)`` of a query shard against a key shard at global positions, in the
    accumulation dtype and the broadcast batch shape; ``stats`` (or None) holds the statistics of
    this shard pair alone (its ``lse`` is ``lse``). :func:`partial_backward` is its gradient.
    """
    alibi = _constant_slopes(alibi_slopes, query.dtype)
    plan = _plan(
        query, key, value, path, block_q=block_q, block_k=block_k, q_start=q_start, k_start=k_start, with_stats=with_stats
    )
    with torch.no_grad():
        q, k, v = _kernel_inputs(plan, query, key, value)
        out, lse, stats, _ = _forward(plan, q, k, v, None, alibi)
    if not with_stats:
        return out, lse, None
    return out, lse, AttentionStats(lse=lse, **stats)


def partial_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None = None,
    *,
    path: ScorePath,
    q_start: int = 0,
    k_start: int = 0,
    alibi_slopes: Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` contributed by one shard pair (FlashAttention-2 backward).

    ``out`` (..., H, Lq, Dv) and ``lse`` (..., H, Lq) must be the rows' *final* values over every
    key shard, and ``dout`` / ``dlse`` their gradients: then ``p = exp(s - lse)`` is the true
    probability and ``D_i = rowsum(dO * O) - dlse_i`` the true row term, so summing the returned
    gradients over all shard pairs gives the gradients of the whole problem. Results are in the
    accumulation dtype and the broadcast batch shape (sum them to the input shapes at the end).
    """
    alibi = _constant_slopes(alibi_slopes, query.dtype)
    plan = _plan(query, key, value, path, block_q=block_q, block_k=block_k, q_start=q_start, k_start=k_start, with_stats=False)
    acc = accumulation_dtype(query.dtype)
    with torch.no_grad():
        q, k, v = _kernel_inputs(plan, query, key, value)
        dlse = torch.zeros_like(lse, dtype=acc) if dlse is None else dlse.to(acc)
        dq, dk, dv, _ = _backward(plan, q, k, v, None, alibi, out.to(acc), lse.to(acc), dout.to(acc), dlse, False)
    return dq * plan.q_factor, dk, dv
