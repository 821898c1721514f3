"""Attention sinks in context-parallel attention against plain torch on the whole sequence.

The oracle is the formula written out: the sink is one more column of each row's logits, with no
value, ``p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sink_h))``. Every rank checks its shard of
the output, of ``lse`` and the other statistics, and of dq, dk, dv; the sinks' gradient on each
rank is its share (ring: its query rows, ulysses: its heads) and the shares sum to the whole.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from attnscale.distributed import context_parallel_attention, shard_sequence

from .spawn import launch

TOL = dict(atol=1e-10, rtol=1e-10)  # float64: summation order differs from the oracle, nothing more
TOL32 = dict(atol=2e-5, rtol=2e-5)


def _reference(q, k, v, sinks, *, is_causal=False, causal_alignment="top_left", window=None):
    """out, lse and statistics of (B, H, L, D) attention with one sink per head, in plain torch."""
    G = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    logits = q @ k.mT / math.sqrt(q.shape[-1])  # (B, H, L, S)
    i = torch.arange(L)[:, None] + (S - L if causal_alignment == "bottom_right" else 0)
    j = torch.arange(S)[None, :]
    visible = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        visible &= j <= i
    if window is not None:
        visible &= (i - window[0] <= j) & (j <= i + window[1])
    logits = logits.masked_fill(~visible, -math.inf)
    every = torch.cat([logits, sinks.to(q.dtype)[:, None, None].expand(*logits.shape[:-1], 1)], dim=-1)  # (B, H, L, S + 1)
    p = torch.softmax(every, dim=-1)
    plogp = torch.where(p > 0, p * torch.log(p.clamp_min(1e-300)), torch.zeros_like(p))
    stats = {
        "lse": torch.logsumexp(every, dim=-1),
        "max_logit": logits.max(dim=-1).values,
        "max_prob": p[..., :-1].max(dim=-1).values,
        "entropy": -plogp.sum(dim=-1),
        "visible_keys": visible.sum(-1).expand(logits.shape[:-1]),
        "sink_share": p[..., -1],
    }
    return p[..., :-1] @ v, stats


def _case(seed, *, method, layout, B=1, H=4, Hkv=4, L=24, S=None, D=8, Dv=None, dtype=torch.float64, stats=False, sinks=None, **options):
    def check(rank: int, N: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        S_, Dv_ = S or L, Dv or D
        shapes = {"q": (B, H, L, D), "k": (B, Hkv, S_, D), "v": (B, Hkv, S_, Dv_), "g": (B, H, L, Dv_), "gl": (B, H, L)}
        t = {n: torch.randn(s, generator=gen, dtype=dtype) for n, s in shapes.items()}
        t["sinks"] = torch.randn(H, generator=gen, dtype=dtype) if sinks is None else sinks.to(dtype)

        leaves = {n: t[n].to(torch.float64, copy=True).requires_grad_() for n in ("q", "k", "v", "sinks")}
        out_full, stats_full = _reference(*(leaves[n] for n in ("q", "k", "v", "sinks")), **options)
        # The share of this rank: the loss of its own rows (ring) or of its own heads (ulysses).
        keep = torch.zeros(H, L, dtype=torch.float64)
        if method == "ring":
            keep[:, shard_sequence(torch.arange(L), rank, N, layout, dim=-1)] = 1.0
        else:
            keep[rank * H // N : (rank + 1) * H // N] = 1.0
        lse_loss = stats_full["lse"] * t["gl"] * stats
        (share_full,) = torch.autograd.grad((out_full * t["g"] * keep[..., None]).sum() + (lse_loss * keep).sum(), leaves["sinks"], retain_graph=True)
        ((out_full * t["g"]).sum() + lse_loss.sum()).backward()

        mine = {n: shard_sequence(t[n], rank, N, layout).requires_grad_() for n in "qkv"}
        sink = t["sinks"].clone().requires_grad_()
        result = context_parallel_attention(
            mine["q"], mine["k"], mine["v"], method=method, layout=layout, sinks=sink, return_stats=stats, **options
        )
        out, part = result if stats else (result, None)
        tol = TOL if dtype == torch.float64 else TOL32
        what = f"{method} {layout} {options}"
        torch.testing.assert_close(out, shard_sequence(out_full, rank, N, layout).to(dtype), **tol, msg=f"out {what}")
        loss = (out * shard_sequence(t["g"], rank, N, layout)).sum()
        if part is not None:
            loss = loss + (part.lse * shard_sequence(t["gl"], rank, N, layout, dim=-1)).sum()
            for field, expected in stats_full.items():
                expected = shard_sequence(expected.detach(), rank, N, layout, dim=-1)
                got = getattr(part, field)
                torch.testing.assert_close(got, expected.to(got.dtype), **tol, msg=f"{field} {what}")
        loss.backward()
        for n in "qkv":
            expected = shard_sequence(leaves[n].grad, rank, N, layout).to(dtype)
            torch.testing.assert_close(mine[n].grad, expected, **tol, msg=f"d{n} {what}")
        torch.testing.assert_close(sink.grad, share_full.to(dtype), **tol, msg=f"this rank's share of dsinks {what}")
        dist.all_reduce(sink.grad)
        torch.testing.assert_close(sink.grad, leaves["sinks"].grad.to(dtype), **tol, msg=f"dsinks summed over ranks {what}")

    return check


NEG = torch.tensor([0.5, -math.inf, 1.0, -2.0])  # -inf: head 1 has no sink


def _two_rank_checks():
    return [
        _case(1, method="ring", layout="contiguous"),
        _case(2, method="ring", layout="zigzag", is_causal=True, stats=True),
        _case(3, method="ring", layout="contiguous", is_causal=True, L=25, Hkv=2, Dv=6),
        _case(4, method="ring", layout="zigzag", sinks=NEG, stats=True),
        # L > S bottom-right: the first L - S rows see no key, give zeros and lse = sink.
        _case(5, method="ring", layout="zigzag", is_causal=True, causal_alignment="bottom_right", L=32, S=16, stats=True),
        _case(6, method="ulysses", layout="contiguous"),
        _case(7, method="ulysses", layout="zigzag", is_causal=True, stats=True, Hkv=2),
        _case(8, method="ulysses", layout="contiguous", is_causal=True, window=(5, 0), sinks=NEG),
        _case(9, method="ulysses", layout="zigzag", is_causal=True, causal_alignment="bottom_right", L=32, S=16, stats=True),
        _case(10, method="ring", layout="zigzag", is_causal=True, dtype=torch.float32, stats=True),
        _case(11, method="ulysses", layout="zigzag", is_causal=True, dtype=torch.float32, Hkv=1),
    ]


def test_sinks_two_ranks():
    launch(2, _two_rank_checks())


def test_sinks_four_ranks():
    launch(4, [
        _case(12, method="ring", layout="zigzag", is_causal=True, L=32, Hkv=2, stats=True),
        _case(13, method="ulysses", layout="contiguous", is_causal=True, L=32, stats=True),
    ])
