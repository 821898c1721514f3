"""Context-parallel attention on 2 and 4 gloo ranks against single-process attention, in float64.

Every rank builds the same full tensors from one seed, runs single-process
``attnscale.scaled_dot_product_attention`` on the whole sequence as the oracle, and checks its own
shard of the output and of the gradients (dq, dk, dv). One process group runs many cases, so the
cost of starting ranks is paid once per group size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnscale
from attnscale import kernels
from attnscale.distributed import context_parallel_attention, shard_sequence

from .spawn import launch as _launch

TOL = dict(atol=1e-10, rtol=1e-10)  # float64: summation order differs from the oracle, nothing more
TOL32 = dict(atol=2e-5, rtol=2e-5)  # float32 (float32 accumulation on both sides): measured ~1e-6


def _inputs(seed: int, *, B=2, H=4, Hkv=4, L=24, S=None, D=8, Dv=None, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    S, Dv = S or L, Dv or D
    shapes = {"q": (B, H, L, D), "k": (B, Hkv, S, D), "v": (B, Hkv, S, Dv), "g": (B, H, L, Dv)}
    return {name: torch.randn(shape, generator=gen, dtype=dtype) for name, shape in shapes.items()}


def _compare(
    rank: int, N: int, *, seed: int, shape: dict, method: str, layout: str, stats: bool = False, group=None, **options
) -> None:
    """Forward, gradients and (optionally) statistics of one case on this rank's shard of ``group``."""
    t = _inputs(seed, **shape)
    leaves = {n: t[n].clone().requires_grad_() for n in "qkv"}
    full = attnscale.scaled_dot_product_attention(
        leaves["q"], leaves["k"], leaves["v"], enable_gqa=True, return_stats=stats, **options
    )
    out_full, stats_full = full if stats else (full, None)
    gl = torch.randn(out_full.shape[:-1], generator=torch.Generator().manual_seed(seed + 1), dtype=out_full.dtype)
    loss = (out_full * t["g"]).sum() + (0.0 if stats_full is None else (stats_full.lse * gl).sum())
    loss.backward()

    mine = {n: shard_sequence(t[n], rank, N, layout).requires_grad_() for n in "qkv"}
    result = context_parallel_attention(
        mine["q"], mine["k"], mine["v"], group=group, method=method, layout=layout, return_stats=stats, **options
    )
    out, part = result if stats else (result, None)
    if method == "ring":  # every shard pair on the compiled kernel where it is built
        assert attnscale.last_backend() == ("fused" if kernels.load() is not None else "tiled")
    tol = TOL if out.dtype == torch.float64 else TOL32
    torch.testing.assert_close(out, shard_sequence(out_full, rank, N, layout), **tol)
    loss = (out * shard_sequence(t["g"], rank, N, layout)).sum()
    if part is not None:
        loss = loss + (part.lse * shard_sequence(gl, rank, N, layout, dim=-1)).sum()
        for field in ("lse", "max_logit", "max_prob", "entropy", "visible_keys"):
            expected = shard_sequence(getattr(stats_full, field), rank, N, layout, dim=-1)
            torch.testing.assert_close(getattr(part, field), expected, **tol, msg=f"{field} {method} {layout}")
    loss.backward()
    for n in "qkv":
        expected = shard_sequence(leaves[n].grad, rank, N, layout)
        torch.testing.assert_close(mine[n].grad, expected, **tol, msg=f"d{n} {method} {layout} {options}")


def _case(**kwargs):
    def check(rank: int, N: int) -> None:
        _compare(rank, N, **kwargs)

    return check


def _expect_error(exc: type[Exception], match: str, *, shape=None, shards=None, **options):
    def check(rank: int, N: int) -> None:
        t = _inputs(0, **(shape or {}))
        mine = [shard_sequence(t[n], rank, N) for n in "qkv"] if shards is None else shards(t, rank, N)
        with pytest.raises(exc, match=match):
            context_parallel_attention(*mine, **options)

    return check


MHA = dict(B=2, H=4, Hkv=4, L=24, D=8)
GQA = dict(B=1, H=4, Hkv=2, L=24, D=8, Dv=6)
MQA = dict(B=1, H=4, Hkv=1, L=24, D=16)
SLOPES = attnscale.alibi_slopes(4).double()


def _two_rank_checks():
    return [
        _case(seed=1, shape=MHA, method="ring", layout="contiguous"),
        _case(seed=2, shape=GQA, method="ring", layout="zigzag", is_causal=True, softcap=2.0),
        _case(seed=3, shape=dict(MHA, L=25), method="ring", layout="contiguous", is_causal=True, alibi_slopes=SLOPES, window=(5, 2)),
        _case(seed=4, shape=dict(MHA, L=16, S=24), method="ring", layout="contiguous", is_causal=True, causal_alignment="bottom_right"),
        # L > S bottom-right: the first L - S rows see no key and must come back as zeros, not NaN.
        _case(seed=5, shape=dict(GQA, L=32, S=16), method="ring", layout="zigzag", is_causal=True, causal_alignment="bottom_right", stats=True),
        _case(seed=6, shape=MHA, method="ring", layout="zigzag", is_causal=True, window=(6, 0), alibi_slopes=SLOPES, stats=True),
        _case(seed=7, shape=MHA, method="ulysses", layout="contiguous", softcap=3.0, scale=0.2),
        _case(seed=8, shape=GQA, method="ulysses", layout="zigzag", is_causal=True, alibi_slopes=SLOPES, stats=True),
        _case(seed=9, shape=MQA, method="ulysses", layout="contiguous", is_causal=True, window=(4, 4)),
        _case(seed=10, shape=dict(MHA, L=16, S=24), method="ulysses", layout="zigzag", is_causal=True, causal_alignment="bottom_right"),
        _case(seed=17, shape=dict(GQA, dtype=torch.float32), method="ring", layout="zigzag", is_causal=True, stats=True),
        _case(seed=18, shape=dict(GQA, dtype=torch.float32), method="ulysses", layout="contiguous", softcap=2.0),
        _expect_error(ValueError, "method: expected one of", method="rings"),
        _expect_error(ValueError, "layout: expected one of", layout="striped"),
        _expect_error(ValueError, "query: expected a number of heads divisible by the group size 2", shape=dict(MHA, H=3, Hkv=3), method="ulysses"),
        _expect_error(ValueError, "query: expected equal shard lengths for method='ulysses'", shape=dict(MHA, L=25), method="ulysses"),
        _expect_error(
            ValueError, "query: expected a sequence length divisible by 2 \\* world_size = 4",
            method="ring", layout="zigzag", shards=lambda t, r, N: [x[..., r * 3 : r * 3 + 3, :] for x in (t["q"], t["k"], t["v"])],
        ),
    ]


def _four_rank_checks():
    return [
        _case(seed=11, shape=dict(GQA, L=32), method="ring", layout="zigzag", is_causal=True, softcap=1.5, alibi_slopes=SLOPES, stats=True),
        _case(seed=12, shape=dict(MHA, L=30), method="ring", layout="contiguous", window=(3, 3)),
        _case(seed=13, shape=dict(MHA, L=24, S=40), method="ring", layout="zigzag", is_causal=True),
        _case(seed=14, shape=dict(GQA, L=32), method="ulysses", layout="zigzag", is_causal=True, stats=True),
        _case(seed=15, shape=dict(MHA, L=32), method="ulysses", layout="contiguous", softcap=2.0, window=(8, 0), alibi_slopes=SLOPES),
        # L < N: the last rank holds no rows at all.
        _case(seed=19, shape=dict(MHA, L=3), method="ring", layout="contiguous", is_causal=True, stats=True),
        _subgroups,
    ]


def _subgroups(rank: int, N: int) -> None:
    # Two rings of two side by side: group ranks differ from global ranks, and both rings run at once.
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group = groups[rank % 2]
    for method in ("ring", "ulysses"):
        _compare(
            dist.get_rank(group), 2, seed=16 + rank % 2, shape=GQA, method=method, layout="zigzag", is_causal=True, group=group
        )


def test_two_ranks():
    _launch(2, _two_rank_checks())


def test_four_ranks():
    _launch(4, _four_rank_checks())


def test_a_failing_rank_fails_the_launch():
    def wrong(rank: int, N: int) -> None:
        # Shards of different whole tensors (one seed per rank): the result matches neither oracle.
        _compare(rank, N, seed=1 + rank, shape=MHA, method="ring", layout="contiguous")

    with pytest.raises(mp.ProcessRaisedException, match="not close"):
        _launch(2, [wrong])
