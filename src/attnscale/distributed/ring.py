"""Ring attention: key/value shards travel round the ring, queries stay put.

Each of the ``N`` ranks keeps its query shard and passes its key/value shard to the next rank
``N - 1`` times, so every query shard meets every key shard once::

    step t: rank r holds the key/value shard of rank (r - t) mod N
            post  isend(K, V -> r + 1), irecv(K, V <- r - 1)     the next transfer ...
            (out, lse) of Q_r against the held shard             ... overlaps this compute
            merge into the running (out, lse) through their log-sum-exp (exact)

The backward runs the same ring with the *final* ``out`` and ``lse`` (FlashAttention-2): every
(query, key) shard pair recomputes ``p = exp(s - lse)`` and uses ``D_i = rowsum(dO * O)``, so each
pair's gradient is exact on its own. ``dK`` and ``dV`` accumulators travel with their key/value
shard and take one last hop back to the shard's owner. Memory per rank is O((L + S) / N) plus
one tile; activations for the backward are the local q, k, v, out and lse only.

Attention sinks join each row once, after the last step: :func:`~attnscale.tiled.merge_sinks` on
the finished ``(out, lse)``, outside the autograd function, so autograd carries their gradient
and the ring's backward sees the gradients of the keys-only ``out`` and ``lse``.

Each shard pair runs on the compiled kernel where it runs (float32 or float64 CPU tensors, the
kernel built, not tracing), else on the tiled kernel: :func:`ring_walk` is the choice
:func:`attnscale.backends.choose` makes between the two.

Shard pairs that causal or window masks hide entirely are skipped
(:meth:`~attnscale.score.ScorePath.block_is_hidden`); with the zigzag layout every rank then does
the same work. Sends and receives are posted one by one, even ranks sending first, and each
request is waited on (``batch_isend_irecv`` can hang on gloo).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._validate import Backend
from ..backends import Call, Implementation, Refusal, Result, Step, Walk
from ..dense import accumulation_dtype
from ..kernels import fused
from ..score import ScorePath
from ..stats import AttentionStats
from ..tiled import merge_partials, merge_sinks, partial_backward, partial_forward
from .merge import merge_sink_stats, merge_stats

__all__ = ["Partials", "RingPlan", "ring_attention", "ring_implementation", "ring_walk"]

_KV_TAG, _GRAD_TAG = 0, 1
_STAT_FIELDS = ("max_logit", "max_prob", "entropy", "visible_keys")


class Partials(NamedTuple):
    """The kernel every shard pair runs on: its partial forward and backward, with
    :func:`attnscale.tiled.partial_forward`'s and :func:`~attnscale.tiled.partial_backward`'s
    signatures and results."""

    backend: Backend
    forward: Callable[..., tuple[Tensor, Tensor, AttentionStats | None]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


TILED_PARTIALS = Partials(Backend.TILED, partial_forward, partial_backward)
FUSED_PARTIALS = Partials(Backend.FUSED, fused.partial_forward, fused.partial_backward)


@dataclass(frozen=True)
class RingPlan:
    """Who talks to whom and where every shard sits in the global sequence.

    ``q_runs`` are this rank's query runs ``(global start, length)``; ``k_runs[r]`` and
    ``k_lengths[r]`` describe rank ``r``'s key/value shard. ``kv_dims`` are the key and value
    shapes with the sequence axis left out: ``(*batch, Hkv, D)`` and ``(*batch, Hkv, Dv)``.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    send_to: int
    recv_from: int
    path: ScorePath
    q_runs: tuple[tuple[int, int], ...]
    k_runs: tuple[tuple[tuple[int, int], ...], ...]
    k_lengths: tuple[int, ...]
    kv_dims: tuple[tuple[int, ...], tuple[int, ...]]
    alibi: Tensor | None
    with_stats: bool
    partials: Partials = TILED_PARTIALS

    def pairs(self, src: int) -> Iterator[tuple[slice, int, slice, int]]:
        """(local query rows, their global start, local key rows, their global start) of every
        run pair of this rank's queries against rank ``src``'s keys that is not entirely hidden."""
        q_off = 0
        for q0, q_len in self.q_runs:
            k_off = 0
            for k0, k_len in self.k_runs[src]:
                if q_len and k_len and not self.path.block_is_hidden(q0, q0 + q_len - 1, k0, k0 + k_len - 1):
                    yield slice(q_off, q_off + q_len), q0, slice(k_off, k_off + k_len), k0
                k_off += k_len
            q_off += q_len

    def kv_shapes(self, src: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        (*kb, Dk), (*vb, Dv) = self.kv_dims
        return (*kb, self.k_lengths[src], Dk), (*vb, self.k_lengths[src], Dv)

    def kv_numel(self, src: int) -> int:
        return sum(math.prod(shape) for shape in self.kv_shapes(src))

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        """One contiguous buffer per transfer: half the messages of sending k and v apart."""
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def unpack(self, buf: Tensor, src: int) -> tuple[Tensor, Tensor]:
        k_shape, v_shape = self.kv_shapes(src)
        n = math.prod(k_shape)
        return buf[:n].view(k_shape), buf[n:].view(v_shape)

    def shift(self, buf: Tensor, src: int, tag: int) -> tuple[Tensor, list[dist.Work]]:
        """Post the send of ``buf`` to the next rank and the receive of rank ``src - 1``'s buffer."""
        incoming = buf.new_empty(self.kv_numel((src - 1) % self.size))
        # Even ranks send first, odd ranks receive first: with two ranks both directions share one
        # channel, and a backend whose send blocks until matched (NCCL) would otherwise deadlock.
        if self.rank % 2 == 0:
            send = dist.isend(buf, self.send_to, group=self.group, tag=tag)
            recv = dist.irecv(incoming, self.recv_from, group=self.group, tag=tag)
        else:
            recv = dist.irecv(incoming, self.recv_from, group=self.group, tag=tag)
            send = dist.isend(buf, self.send_to, group=self.group, tag=tag)
        return incoming, [send, recv]


def _empty_stats(lse: Tensor) -> dict[str, Tensor]:
    return {
        "max_logit": torch.full_like(lse, float("-inf")),
        "max_prob": torch.zeros_like(lse),
        "entropy": torch.zeros_like(lse),
        "visible_keys": torch.zeros(lse.shape, dtype=torch.int64, device=lse.device),
    }


def _ring_forward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """q (*batch, H, Lq, D); k, v (*batch, Hkv, Sr, D / Dv). Returns out, lse and the statistics
    of this rank's rows, in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    *batch, H, Lq, _ = q.shape
    Dv = v.shape[-1]
    out = torch.zeros(*batch, H, Lq, Dv, dtype=acc, device=q.device)
    lse = torch.full((*batch, H, Lq), float("-inf"), dtype=acc, device=q.device)
    stats = _empty_stats(lse) if plan.with_stats else {}
    buf, src = plan.pack(k, v), plan.rank
    for step in range(plan.size):
        incoming, works = plan.shift(buf, src, _KV_TAG) if step < plan.size - 1 else (None, [])
        k_src, v_src = plan.unpack(buf, src)
        for rows, q0, cols, k0 in plan.pairs(src):
            o, l, part = plan.partials.forward(
                q[..., rows, :], k_src[..., cols, :], v_src[..., cols, :],
                path=plan.path, q_start=q0, k_start=k0, alibi_slopes=plan.alibi, with_stats=plan.with_stats,
            )
            o, merged = merge_partials(out[..., rows, :], lse[..., rows], o, l)
            if part is not None:
                held = AttentionStats(lse=lse[..., rows], **{f: stats[f][..., rows] for f in _STAT_FIELDS})
                both = merge_stats(held, part, lse=merged)
                for f in _STAT_FIELDS:
                    stats[f][..., rows] = getattr(both, f)
            out[..., rows, :], lse[..., rows] = o, merged
        for work in works:
            work.wait()
        if incoming is not None:
            buf, src = incoming, (src - 1) % plan.size
    return out, lse, stats


def _ring_backward(
    plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of this rank's q and of its own k, v (accumulation dtype, broadcast batch shape)."""
    acc = out.dtype
    dq = torch.zeros(*out.shape[:-1], q.shape[-1], dtype=acc, device=q.device)  # (*batch, H, Lq, D)
    buf, src = plan.pack(k, v), plan.rank
    grads = torch.zeros(plan.kv_numel(src), dtype=acc, device=q.device)  # dK, dV of shard src, packed
    for step in range(plan.size):
        incoming, works = plan.shift(buf, src, _KV_TAG) if step < plan.size - 1 else (None, [])
        k_src, v_src = plan.unpack(buf, src)
        dk_src, dv_src = plan.unpack(grads, src)
        for rows, q0, cols, k0 in plan.pairs(src):
            dq_part, dk_part, dv_part = plan.partials.backward(
                q[..., rows, :], k_src[..., cols, :], v_src[..., cols, :],
                out[..., rows, :], lse[..., rows], dout[..., rows, :], dlse[..., rows],
                path=plan.path, q_start=q0, k_start=k0, alibi_slopes=plan.alibi,
            )
            dq[..., rows, :] += dq_part
            dk_src[..., cols, :] += dk_part
            dv_src[..., cols, :] += dv_part
        if plan.size > 1:
            # After the last step this hop brings every accumulator home to its owner.
            incoming_grads, grad_works = plan.shift(grads, src, _GRAD_TAG)
            works += grad_works
        for work in works:
            work.wait()
        if plan.size > 1:
            grads = incoming_grads
        if incoming is not None:
            buf = incoming
        src = (src - 1) % plan.size
    dk, dv = plan.unpack(grads, plan.rank)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """Saves the local q, k, v, out and lse; the backward runs the ring again. ``out`` stays in the
    accumulation dtype, so that sinks merge into it before the one rounding to the input dtype."""

    @staticmethod
    def forward(ctx, query, key, value, plan):  # type: ignore[override]
        out, lse, stats = _ring_forward(plan, query, key, value)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(*stats.values())
        return (out, lse, *stats.values())

    @staticmethod
    def backward(ctx, dout, dlse, *unused):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.plan, query, key, value, out, lse, dout, dlse)
        dq = dq.sum_to_size(query.shape).to(query.dtype)
        dk = dk.sum_to_size(key.shape).to(key.dtype)
        dv = dv.sum_to_size(value.shape).to(value.dtype)
        return dq, dk, dv, None


def ring_attention(
    query: Tensor, key: Tensor, value: Tensor, plan: RingPlan, sinks: Tensor | None = None
) -> tuple[Tensor, AttentionStats | None]:
    """This rank's output rows (and statistics) of attention over the whole sequence.

    query (*batch, H, Lq, D) and key/value (*batch, Hkv, Sr, D / Dv) are this rank's shards with
    the batch dims already broadcast, so that every rank sends buffers of the shapes ``plan`` expects.
    ``sinks`` (H,) join each row once, after the ring has merged every key shard; their gradient
    comes from this rank's rows only (autograd through :func:`~attnscale.tiled.merge_sinks`).
    """
    out, lse, *rest = _RingAttention.apply(query, key, value, plan)  # keys only
    stats = AttentionStats(lse=lse, **dict(zip(_STAT_FIELDS, rest))) if plan.with_stats else None
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
        if stats is not None:
            stats = merge_sink_stats(stats, sinks, lse)
    return out.to(query.dtype), stats


def ring_implementation(geometry: RingPlan) -> Implementation:
    """The ring as the backend of one call, for :func:`attnscale.guard.check_sharded`, which may
    run it again on indicators, on inputs with non-finite entries zeroed, or in float64: ``run``
    takes the score path, ALiBi slopes, sinks and statistics from the call (``c.spec`` is the whole
    problem's) and the dims from its tensors; ``geometry`` gives the rest, its ``partials`` the
    kernel of every shard pair. Collective: every rank runs it, the same number of times."""

    def run(c: Call, query: Tensor, key: Tensor, value: Tensor) -> Result:
        slopes = c.alibi_slopes
        plan = dataclasses.replace(
            geometry,
            path=c.spec.path,
            kv_dims=((*key.shape[:-2], key.shape[-1]), (*value.shape[:-2], value.shape[-1])),
            alibi=None if slopes is None else slopes.detach().to(accumulation_dtype(query.dtype)),
            with_stats=c.spec.return_stats,
        )
        out, stats = ring_attention(query, key, value, plan, c.sinks)
        return Result(out, stats, None)

    tiled = geometry.partials is TILED_PARTIALS
    return Implementation(geometry.partials.backend, (lambda c: None) if tiled else _fused_partials_cannot, run, floors_exp=tiled)


def _fused_partials_cannot(c: Call) -> Refusal | None:
    reason = fused.partials_cannot(c.query)
    if reason is None:
        return None
    return Refusal(reason, "backend", "shard pairs the compiled kernel can run", f"'fused' with {reason}", "none: auto's next step, the tiled kernel, runs them")


def ring_walk(geometry: RingPlan) -> Walk:
    """:func:`attnscale.backends.choose`'s walk of a ring call: every shard pair on the compiled
    kernel where :func:`attnscale.kernels.fused.partials_cannot` finds no reason against it, else
    on the tiled kernel. The choice changes no collective step (the two compute the same partials
    to rounding), so ranks whose choices differ, such as one without the compiled kernel, still
    run the same ring."""
    on_kernel = ring_implementation(dataclasses.replace(geometry, partials=FUSED_PARTIALS))
    on_tiles = ring_implementation(dataclasses.replace(geometry, partials=TILED_PARTIALS))
    return Walk((Step(on_kernel, lambda c: None), Step(on_tiles, lambda c: None)), {b: on_kernel if b is Backend.FUSED else on_tiles for b in Backend})
