"""Shard layouts, the statistics merge and the ring's work plan: no process group needed."""

from __future__ import annotations

import pytest
import torch

import attnscale
from attnscale.distributed import Layout, context_parallel_attention, merge_stats, shard_sequence, unshard_sequence
from attnscale.distributed.layout import segments
from attnscale.distributed.ring import RingPlan
from attnscale.score import ScorePath
from attnscale.tiled import partial_forward


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity(layout, world_size):
    L = 24 if layout == "zigzag" else 23
    x = torch.arange(2 * L * 3).view(2, L, 3)
    shards = [shard_sequence(x, r, world_size, layout) for r in range(world_size)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    for r, shard in enumerate(shards):
        rows = torch.cat([torch.arange(s, s + n) for s, n in segments(Layout(layout), [t.shape[-2] for t in shards], r)])
        assert torch.equal(shard, x[:, rows])


def test_shard_along_another_dim():
    x = torch.arange(16).view(2, 8)
    assert shard_sequence(x, 1, 2, "zigzag", dim=-1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: shard_sequence(torch.zeros(10, 1), 0, 2, "zigzag"), "x: expected a sequence length divisible by 2 \\* world_size = 4"),
        (lambda: shard_sequence(torch.zeros(8, 1), 2, 2), "rank: expected an int in \\[0, 2\\)"),
        (lambda: shard_sequence(torch.zeros(8, 1), 0, 0), "world_size: expected a positive int"),
        (lambda: shard_sequence(torch.zeros(8, 1), 0, 2, "striped"), "layout: expected one of 'contiguous', 'zigzag'"),
        (lambda: unshard_sequence([torch.zeros(3, 1), torch.zeros(3, 1)], "zigzag"), "shards: expected zigzag shards of one even length"),
    ],
)
def test_layout_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_context_parallel_needs_a_process_group():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="group: expected an initialised torch.distributed process group"):
        context_parallel_attention(q, q, q)


@pytest.mark.parametrize("cut", [0, 1, 5, 11, 12])
def test_merge_stats_is_exact(cut):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 6, 8).double(), torch.randn(2, 3, 12, 8).double(), torch.randn(2, 3, 12, 4).double()
    options = dict(is_causal=True, causal_alignment="bottom_right", softcap=2.0, return_stats=True)
    _, whole = attnscale.scaled_dot_product_attention(q[..., :4, :], k, v, **options)
    # Split the keys at `cut`; k_start keeps the right part at its global positions.
    path = ScorePath(scale=8**-0.5, softcap=2.0, causal=True, q_offset=12 - 4)
    parts = [partial_forward(q[..., :4, :], k[..., a:b, :], v[..., a:b, :], path=path, k_start=a, with_stats=True)[2] for a, b in ((0, cut), (cut, 12))]
    merged = merge_stats(*parts)
    for field in ("lse", "max_logit", "max_prob", "entropy", "visible_keys"):
        torch.testing.assert_close(getattr(merged, field), getattr(whole, field), atol=1e-12, rtol=1e-12)


def _plan(layout: str, N: int, L: int, **path) -> list[RingPlan]:
    sizes = [len(r) for r in torch.arange(L).tensor_split(N)] if layout == "contiguous" else [L // N] * N
    runs = tuple(tuple(segments(Layout(layout), sizes, r)) for r in range(N))
    return [
        RingPlan(
            group=None, rank=r, size=N, send_to=(r + 1) % N, recv_from=(r - 1) % N, path=ScorePath(scale=1.0, **path),
            q_runs=runs[r], k_runs=runs, k_lengths=tuple(sizes), kv_dims=((1, 8), (1, 8)), alibi=None, with_stats=False,
        )
        for r in range(N)
    ]


def _visible_pairs(plan: RingPlan) -> int:
    """(query, key) position pairs the rank computes over the whole ring."""
    return sum((rows.stop - rows.start) * (cols.stop - cols.start) for src in range(plan.size) for rows, _, cols, _ in plan.pairs(src))


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    zigzag = [_visible_pairs(p) for p in _plan("zigzag", 4, 32, causal=True)]
    contiguous = [_visible_pairs(p) for p in _plan("contiguous", 4, 32, causal=True)]
    assert zigzag == [9 * 4 * 4] * 4  # 2N + 1 chunk pairs of 4 x 4 on every rank
    assert contiguous == [64, 128, 192, 256]


def test_window_skips_far_shards():
    # A causal window of 4 over shards of 8: each rank needs its own shard and its left neighbour's.
    assert [_visible_pairs(p) for p in _plan("contiguous", 4, 32, causal=True, window=(4, 0))] == [64, 128, 128, 128]
