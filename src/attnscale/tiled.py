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

Only ``out`` and ``lse`` are kept for the backward pass, which recomputes the probabilities tile
by tile as ``p = exp(s - lse)`` and uses ``D_i = rowsum(dO * O)`` (FlashAttention-2), so memory is
O((L + S) * D) plus one tile. Accumulation is float32 (float64 for float64 inputs).

Semantics match the ``"math"`` backend exactly, with these choices:

* A row with no visible key returns zeros and ``lse = -inf``; its gradients are zero, never NaN.
* A visible key more than 87 nats below its row's maximum (float32; 708 in float64) gets the
  unnormalised weight exp(-87) = 1.6e-38 rather than something smaller: ATen's exp is ~50x slower
  for results below the normal range, and such a weight is below float32 resolution next to the
  maximum's 1. Hidden keys (mask, causal, window, -inf in a float mask) get exactly zero.
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

import torch
from torch import Tensor

from .dense import accumulation_dtype
from .score import ScorePath
from .stats import AttentionStats

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "attention_partial", "merge_partials", "tiled_attention"]

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
        return self.H // self.Hkv

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

    def hidden(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        return self.path.block_is_hidden(
            self.q_start + i0, self.q_start + i1 - 1, self.k_start + j0, self.k_start + j1 - 1
        )


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
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "alibi_slopes: expected constant slopes on the tiled backend, got a tensor that requires grad. "
            "Fix: pass alibi_slopes.detach(), or backend='math' to learn the slopes"
        )
    return alibi_slopes.detach().to(accumulation_dtype(dtype))


def _mask_block(mask: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """The part of a broadcastable (..., L or 1, S or 1) mask that covers rows i0:i1, keys j0:j1."""
    rows = slice(i0, i1) if mask.shape[-2] != 1 else slice(None)
    cols = slice(j0, j1) if mask.shape[-1] != 1 else slice(None)
    return mask[..., rows, cols]


def _tile_logits(
    plan: _Plan,
    q_blk: Tensor,
    k_blk: Tensor,
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    mask: Tensor | None,
    alibi: Tensor | None,
    *,
    qk: Tensor | None = None,
    defer_cap: bool = False,
    mask_hides: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logits of one tile, hidden keys at -inf, and the bool tile of hidden keys (None if none is).

    With ``defer_cap`` (only when softcap is the sole score-path op) the returned "logits" are
    ``tanh(qk)``, hidden keys at -inf, and the caller multiplies by the softcap in its next pass.
    ``mask_hides`` says the float mask holds -inf somewhere: its -inf positions then count as hidden.

    Shapes: q_blk (*batch, Hkv, G * Lb, D), k_blk (*batch, Hkv, Sb, D) -> s (*batch, H, Lb, Sb).
    """
    Lb, Sb = i1 - i0, j1 - j0
    if qk is None:
        qk = (q_blk @ k_blk.transpose(-1, -2)).view(*plan.batch, plan.H, Lb, Sb)  # (*batch, H, Lb, Sb)
    first, last = plan.q_start + i0, plan.q_start + i1 - 1
    # Most tiles are fully visible: decided on integers, without building (Lb, Sb) positions.
    partial = not plan.path.block_is_visible(first, last, plan.k_start + j0, plan.k_start + j1 - 1)
    q_pos = k_pos = None
    if partial or alibi is not None:
        q_pos, k_pos = plan.path.positions(first, Lb, plan.k_start + j0, Sb, q_blk.device)
    keep = plan.path.visibility(q_pos, k_pos) if partial else None  # (Lb, Sb)
    additive = None
    if mask is not None:
        mb = _mask_block(mask, i0, i1, j0, j1)
        if mb.dtype == torch.bool:
            keep = mb if keep is None else keep & mb
        else:
            additive = mb.to(qk.dtype)
    if plan.path.softcap is None and alibi is None and additive is None and plan.path.scale == 1.0:
        s = qk  # the score path is the identity once the scale sits in q: skip a pass over the tile
    elif defer_cap and alibi is None and additive is None:
        s = qk.tanh_()  # the softcap multiply is left to the caller's next pass over the tile
    else:
        s = plan.path.logits(qk, q_pos=q_pos, k_pos=k_pos, alibi_slopes=alibi, additive=additive)
    hidden = None if keep is None else ~keep
    # A -inf in the float mask is already -inf in s; only bool and positional hiding need a fill.
    if hidden is not None:
        s = s.masked_fill(hidden, _NEG_INF) if s.requires_grad else s.masked_fill_(hidden, _NEG_INF)
    if mask_hides and additive is not None:
        neg = additive == _NEG_INF
        hidden = neg if hidden is None else hidden | neg
    return s, hidden


# ATen's vectorized CPU exp leaves its fast path for results below the normal range (arguments under
# about -87.3 in float32, -inf included) and runs some 50x slower there. exp(-87) = 1.6e-38 is a
# weight below float32 resolution next to a row maximum's exp(0) = 1, so arguments are raised to
# this floor first, and hidden keys, whose -inf the floor also raises, are set back to exactly 0.
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}


def _exp_(centred: Tensor, hidden: Tensor | None, lowest: float) -> Tensor:
    """exp of a centred tile (every entry <= 0, hidden keys -inf) in place, on ATen's fast path.

    ``lowest`` bounds the finite entries from below when the score path does (softcap), else -inf.
    """
    if centred.device.type != "cpu":  # the slow path is ATen's CPU exp; elsewhere exp(-inf) = 0 as it is
        return centred.exp_()
    floor = _EXP_FLOOR.get(centred.dtype, -87.0)
    if hidden is not None or (lowest < floor and float(centred.amin()) < floor):
        centred.clamp_min_(floor)
    p = centred.exp_()
    return p if hidden is None else p.masked_fill_(hidden, 0.0)


def _has_neg_inf(mask: Tensor | None) -> bool:
    return mask is not None and mask.dtype != torch.bool and bool(torch.isneginf(mask.detach()).any())


def _group_rows(x: Tensor, plan: _Plan, i0: int, i1: int) -> Tensor:
    """Rows i0:i1 of x (*batch, H, L, E) stacked per key/value head: (*batch, Hkv, G * Lb, E)."""
    blk = x[..., i0:i1, :]
    return blk.reshape(*plan.batch, plan.Hkv, plan.G * (i1 - i0), x.shape[-1])


def _forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, alibi: Tensor | None
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Online softmax over key blocks, one query block at a time.

    q (*batch, H, L, D) already scaled, k (*batch, Hkv, S, D), v (*batch, Hkv, S, Dv), all in the
    accumulation dtype. Returns out (*batch, H, L, Dv), lse (*batch, H, L) and the statistics.
    """
    batch, H, L, Dv = plan.batch, plan.H, plan.L, v.shape[-1]
    acc_dtype = q.dtype
    out = q.new_empty(*batch, H, L, Dv)
    lse = q.new_empty(*batch, H, L)
    stats: dict[str, Tensor] = {}
    if plan.with_stats:
        for name in ("max_logit", "max_prob", "entropy"):
            stats[name] = q.new_empty(*batch, H, L)
        stats["visible_keys"] = torch.zeros(*batch, H, L, dtype=torch.int64, device=q.device)
    # Key/value blocks as the per-tile matmuls read them, sliced once rather than once per tile.
    kv_blocks = [(j0, j1, k[..., j0:j1, :], v[..., j0:j1, :].reshape(plan.groups, j1 - j0, Dv)) for j0, j1 in plan.k_blocks()]
    cap = plan.defer_cap(mask, alibi)  # tiles hold tanh values; logits = cap * tile
    lowest = _NEG_INF if cap is None else -2.0 * cap  # s - m >= -2 cap when |s| <= cap
    mask_hides = _has_neg_inf(mask)
    # The running max starts finite, so a row that has seen no key yet needs no special case:
    # alpha = exp(0) = 1 scales l = 0, and its hidden entries give exp(-inf) = 0.
    start = torch.finfo(acc_dtype).min
    for i0, i1 in plan.q_blocks():
        Lb = i1 - i0
        q_blk = _group_rows(q, plan, i0, i1)  # (*batch, Hkv, G * Lb, D)
        m = q.new_full((*batch, H, Lb), start)
        l = q.new_zeros(*batch, H, Lb)
        acc = q.new_zeros(*batch, plan.Hkv, plan.G * Lb, Dv)
        acc3, rows = acc.view(plan.groups, plan.G * Lb, Dv), (*batch, plan.Hkv, plan.G * Lb, 1)
        w = q.new_zeros(*batch, H, Lb) if plan.with_stats else None  # sum exp(s - m) (s - m)
        for j0, j1, k_blk, v3 in kv_blocks:
            if plan.hidden(i0, i1, j0, j1):
                continue
            # s is a fresh tile, so the steps below work in place: no (Lb, Sb) allocations.
            s, hidden = _tile_logits(
                plan, q_blk, k_blk, i0, i1, j0, j1, mask, alibi, defer_cap=cap is not None, mask_hides=mask_hides
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
                p = _exp_(centred.clone(), hidden, lowest)
                # Re-centre the running sum of p * (s - m) on the new max, then add this tile's.
                w = alpha * (w + l * (m - m_new)) + (p * centred.masked_fill_(p == 0, 0.0)).sum(dim=-1)
            else:
                p = _exp_(centred, hidden, lowest)
            l = torch.addcmul(p.sum(dim=-1), alpha, l)  # alpha l + rowsum(p)
            acc.mul_(alpha.view(rows))
            acc3.baddbmm_(p.view(plan.groups, plan.G * Lb, j1 - j0), v3)
            m = m_new
        has_key = l > 0
        safe_l = torch.where(has_key, l, torch.ones_like(l))
        out[..., i0:i1, :] = (acc / safe_l.view(rows)).view(*batch, H, Lb, Dv)
        lse[..., i0:i1] = torch.where(has_key, m + torch.log(safe_l), _NEG_INF)
        if w is not None:
            stats["max_logit"][..., i0:i1] = torch.where(has_key, m, _NEG_INF)
            stats["max_prob"][..., i0:i1] = torch.where(has_key, 1.0 / safe_l, torch.zeros_like(l))
            entropy = torch.log(safe_l) - w / safe_l
            stats["entropy"][..., i0:i1] = torch.where(has_key, entropy, torch.zeros_like(l)).clamp_min(0.0)
    assert out.dtype == acc_dtype
    return out, lse, stats


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
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """dq (of the scaled q), dk, dv and the float mask's gradient, tile by tile from the saved lse.

    Key blocks outside, query blocks inside (FlashAttention-2): dK and dV of a key block are
    finished before the next one; dQ accumulates per query block.
    """
    batch, H, Hkv, G = plan.batch, plan.H, plan.Hkv, plan.G
    # D_i = rowsum(dO * O) = sum_j p_ij dP_ij; a gradient on lse adds p_ij * dlse_i to dS_ij.
    delta = (dout * out).sum(dim=-1) - dlse  # (*batch, H, L)
    lse_ref = lse.masked_fill(lse == _NEG_INF, 0.0)  # empty rows: every s is -inf, so p = 0
    q_blocks = plan.q_blocks()
    qs = [_group_rows(q, plan, i0, i1) for i0, i1 in q_blocks]  # (*batch, Hkv, G * Lb, D)
    dos = [_group_rows(dout, plan, i0, i1) for i0, i1 in q_blocks]  # (*batch, Hkv, G * Lb, Dv)
    dqs = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in qs]  # contiguous: viewed as (n, rows, D)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)  # k may be an expanded view
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dmask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device) if mask_grad else None
    cap = plan.path.softcap
    deferred = plan.defer_cap(mask, alibi) is not None
    mask_hides = _has_neg_inf(mask)
    # With softcap, q carries scale / cap, so a tile's raw products x are tanh's argument and
    # d logits / dx = cap * (1 - tanh(x)^2): the tiles accumulate (1 - t^2) dS and the cap
    # multiplies dq and dk once at the end. With ALiBi or a float mask, the capped tile goes
    # through the rest of the score path (bias, mask) as ``uncapped`` describes it.
    uncapped = dataclasses.replace(plan, path=dataclasses.replace(plan.path, softcap=None, scale=1.0))
    for j0, j1 in plan.k_blocks():
        Sb = j1 - j0
        k_blk, v_blk = k[..., j0:j1, :], v[..., j0:j1, :]
        dk_blk, dv_blk = dk[..., j0:j1, :], dv[..., j0:j1, :]
        for b, (i0, i1) in enumerate(q_blocks):
            if plan.hidden(i0, i1, j0, j1):
                continue
            Lb = i1 - i0
            qk = (qs[b] @ k_blk.transpose(-1, -2)).view(*batch, H, Lb, Sb)
            neg_lse = lse_ref[..., i0:i1].neg().unsqueeze(-1)
            if cap is None:
                t = None
                s, hidden = _tile_logits(plan, qs[b], k_blk, i0, i1, j0, j1, mask, alibi, qk=qk, mask_hides=mask_hides)
                p = _exp_(s.add_(neg_lse), hidden, _NEG_INF)  # (*batch, H, Lb, Sb)
            elif deferred:
                t, hidden = _tile_logits(plan, qs[b], k_blk, i0, i1, j0, j1, mask, alibi, qk=qk, defer_cap=True)
                p = _exp_(torch.add(neg_lse, t, alpha=cap), hidden, _NEG_INF)  # exp(cap * tanh - lse)
                if hidden is not None:
                    t.masked_fill_(hidden, 0.0)  # finite slope where p = 0, so (1 - t^2) dS stays 0
            else:
                t = qk.tanh_()
                s, hidden = _tile_logits(
                    uncapped, qs[b], k_blk, i0, i1, j0, j1, mask, alibi, qk=t * cap, mask_hides=mask_hides
                )
                p = _exp_(s.add_(neg_lse), hidden, _NEG_INF)
            # accumulate in place (baddbmm_): a matmul then += would allocate and sweep each result again
            n = plan.groups
            p3, do3 = p.view(n, G * Lb, Sb), dos[b].reshape(n, G * Lb, -1)
            dv_blk.view(n, Sb, -1).baddbmm_(p3.transpose(1, 2), do3)
            dp = (dos[b] @ v_blk.transpose(-1, -2)).view(*batch, H, Lb, Sb)
            ds = dp.sub_(delta[..., i0:i1].unsqueeze(-1)).mul_(p)
            dqk = ds if t is None else torch.addcmul(ds, ds, t.square_(), value=-1.0, out=t)  # (1 - t^2) dS
            if dmask is not None:
                blk = _mask_block(dmask, i0, i1, j0, j1)
                blk += ds.sum_to_size(blk.shape)  # bias and float mask enter linearly, after the cap
            dqk = dqk.view(n, G * Lb, Sb)
            dqs[b].view(n, G * Lb, -1).baddbmm_(dqk, k_blk.reshape(n, Sb, -1))
            dk_blk.view(n, Sb, -1).baddbmm_(dqk.transpose(1, 2), qs[b].reshape(n, G * Lb, -1))
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
    """Autograd wrapper: saves the inputs, ``out`` and ``lse``; recomputes the rest."""

    @staticmethod
    def forward(ctx, query, key, value, mask, alibi, plan):  # type: ignore[override]
        acc = accumulation_dtype(query.dtype)
        q, k, v = _kernel_inputs(plan, query, key, value)
        out, lse, stats = _forward(plan, q, k, v, mask, alibi)
        ctx.save_for_backward(query, key, value, mask, alibi, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(*stats.values())
        result = out if query.dtype == acc else out.to(query.dtype)
        return (result, lse, *stats.values())

    @staticmethod
    def backward(ctx, dresult, dlse, *unused):  # type: ignore[override]
        query, key, value, mask, alibi, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        acc = out.dtype
        q, k, v = _kernel_inputs(plan, query, key, value)
        mask_grad = mask is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dmask = _backward(
            plan, q, k, v, mask, alibi, out, lse, dresult.to(acc), dlse.to(acc), mask_grad
        )
        dq = (dq * plan.q_factor).sum_to_size(query.shape).to(query.dtype)  # q was scaled before q k^T
        dk = dk.sum_to_size(key.shape).to(key.dtype)  # broadcast batch dims sum back
        dv = dv.sum_to_size(value.shape).to(value.dtype)
        if dmask is not None:
            dmask = dmask.to(mask.dtype)
        return dq, dk, dv, dmask, None, None


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
    return_stats: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, AttentionStats | None]:
    """Tiled attention on validated inputs (``backend="tiled"`` of ``scaled_dot_product_attention``).

    query (..., H, L, D), key (..., Hkv, S, D), value (..., Hkv, S, Dv), H a multiple of Hkv,
    attn_mask broadcastable to (..., H, L, S). Returns (out (..., H, L, Dv), stats or None).
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
    out, lse, *rest = _TiledAttention.apply(query, key, value, attn_mask, alibi, plan)
    if not return_stats:
        return out, None
    max_logit, max_prob, entropy, visible_keys = rest
    return out, AttentionStats(
        lse=lse, max_logit=max_logit, max_prob=max_prob, entropy=entropy, visible_keys=visible_keys
    )


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
    out, lse = _TiledAttention.apply(query.to(acc), key.to(acc), value.to(acc), attn_mask, alibi, plan)
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
        out, lse, stats = _forward(plan, q, k, v, None, alibi)
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
