"""Ranks that disagree on any argument of ``context_parallel_attention`` all raise the same error.

Each check runs one call on a 2-rank gloo group where rank 1 passes something different, expects
a ``ValueError`` naming the argument and both ranks' values, and checks that every rank raised the
same message. Before any of it a wrong call aborted a rank inside gloo, hung until the group's
timeout or mixed results silently; the launch's time limit turns a hang into a failure.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

import attnscale
from attnscale.distributed import context_parallel_attention, shard_sequence

from .spawn import launch

MHA = dict(B=2, H=4, Hkv=4, L=24, D=8)


def _inputs(*, B=2, H=4, Hkv=4, L=24, D=8, Dv=None):
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (B, H, L, D), "k": (B, Hkv, L, D), "v": (B, Hkv, L, Dv or D)}
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}


def _shards(t: dict, rank: int, N: int, layout: str = "contiguous") -> list[torch.Tensor]:
    return [shard_sequence(t[n], rank, N, layout) for n in "qkv"]


def _same_error_everywhere(message: str) -> None:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    assert every == [message] * len(every), every


def _disagree(expected: str, *, tensors=None, **options):
    """Rank 1 takes ``tensors(t, rank, N)`` / the options' second values; ``expected`` is the
    message up to its fix. ``options`` map a keyword to its (rank 0, rank 1) values."""

    def check(rank: int, N: int) -> None:
        t = _inputs(**MHA)
        mine = _shards(t, rank, N) if tensors is None else tensors(t, rank, N)
        kwargs = {name: values[rank] for name, values in options.items()}
        with pytest.raises(ValueError, match=re.escape(expected)) as error:
            context_parallel_attention(*mine, **kwargs)
        assert ". Fix: " in str(error.value)
        _same_error_everywhere(str(error.value))

    return check


def _on_rank1(change):
    """Rank 0's shards as they are, rank 1's changed by ``change(list of q, k, v shards)``."""
    return lambda t, rank, N: change(_shards(t, rank, N)) if rank == 1 else _shards(t, rank, N)


SLOPES = attnscale.alibi_slopes(4).double()
SINKS = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)


def _needs_grad(index: int):
    return _on_rank1(lambda s: [x.requires_grad_() if i == index else x for i, x in enumerate(s)])


def _gqa(t, rank, N):
    # H = 4, Hkv = 2 on rank 0; rank 1 keeps 2 query heads (MHA): the sizes of k, v agree.
    q, k, v = (shard_sequence(x, rank, N) for x in (t["q"], t["k"][:, :2], t["v"][:, :2]))
    return [q[:, :2] if rank == 1 else q, k, v]


def _batch(t, rank, N):
    # (2, 3) on rank 0 and (3, 2) on rank 1: the same number of elements, a different batch.
    shape = (2, 3) if rank == 0 else (3, 2)
    return [x.repeat(3, 1, 1, 1).reshape(*shape, *x.shape[1:]) for x in _shards(t, rank, N)]


CHECKS = [
    _disagree("query: expected the same dtype on every rank, got float64 on rank 0, float32 on rank 1.", tensors=_on_rank1(lambda s: [x.float() for x in s])),
    _disagree("query: expected the same device type on every rank, got cpu on rank 0, meta on rank 1.", tensors=_on_rank1(lambda s: [x.to("meta") for x in s])),
    _disagree("query: expected the same number of dims on every rank, got 4 on rank 0, 5 on rank 1.", tensors=_on_rank1(lambda s: [x[None] for x in s])),
    _disagree("query: expected the same number of heads H (dim -3) on every rank, got 4 on rank 0, 2 on rank 1.", tensors=_gqa),
    _disagree(
        "key: expected the same number of key/value heads Hkv (dim -3) on every rank, got 4 on rank 0, 2 on rank 1.",
        tensors=_on_rank1(lambda s: [s[0], s[1][:, :2], s[2][:, :2]]),
    ),
    _disagree("query: expected the same head dim D (dim -1) on every rank, got 8 on rank 0, 4 on rank 1.", tensors=_on_rank1(lambda s: [s[0][..., :4], s[1][..., :4], s[2]])),
    _disagree("value: expected the same value head dim Dv (dim -1) on every rank, got 8 on rank 0, 4 on rank 1.", tensors=_on_rank1(lambda s: [s[0], s[1], s[2][..., :4]])),
    _disagree("query: expected the same batch shape (the dims before -3) on every rank, got (2, 3) on rank 0, (3, 2) on rank 1.", tensors=_batch),
    _disagree("method: expected the same method on every rank, got 'ring' on rank 0, 'ulysses' on rank 1.", method=("ring", "ulysses")),
    _disagree("layout: expected the same layout on every rank, got 'contiguous' on rank 0, 'zigzag' on rank 1.", layout=("contiguous", "zigzag")),
    _disagree("is_causal: expected the same is_causal on every rank, got True on rank 0, False on rank 1.", is_causal=(True, False)),
    _disagree(
        "causal_alignment: expected the same causal_alignment on every rank, got 'top_left' on rank 0, 'bottom_right' on rank 1.",
        is_causal=(True, True), causal_alignment=("top_left", "bottom_right"),
    ),
    _disagree("scale: expected the same scale (after the 1/sqrt(D) default) on every rank, got 0.25 on rank 0, 0.5 on rank 1.", scale=(0.25, 0.5)),
    _disagree("softcap: expected the same softcap on every rank, got None on rank 0, 2.0 on rank 1.", softcap=(None, 2.0)),
    _disagree("window: expected the same window on every rank, got (4, 0) on rank 0, None on rank 1.", window=((4, 0), None)),
    _disagree("return_stats: expected the same return_stats on every rank, got False on rank 0, True on rank 1.", return_stats=(False, True)),
    _disagree("alibi_slopes: expected the same slopes on every rank, got None on rank 0, a tensor with checksum", alibi_slopes=(None, SLOPES)),
    _disagree("alibi_slopes: expected the same slopes on every rank, got a tensor with checksum", alibi_slopes=(SLOPES, 2 * SLOPES)),
    _disagree("sinks: expected the same sink logits on every rank, got a tensor with checksum", sinks=(SINKS, None)),
    _disagree("sinks: expected the same sink logits on every rank, got a tensor with checksum", sinks=(SINKS, SINKS + 1e-9)),
    _disagree("query: expected the same requires_grad (with grad mode on) on every rank, got no grad on rank 0, requires grad on rank 1.", tensors=_needs_grad(0)),
    _disagree("value: expected the same requires_grad (with grad mode on) on every rank, got no grad on rank 0, requires grad on rank 1.", tensors=_needs_grad(2)),
    _disagree(
        "sinks: expected the same requires_grad (with grad mode on) on every rank, got no grad on rank 0, requires grad on rank 1.",
        sinks=(SINKS, SINKS.clone().requires_grad_()),
    ),
]


def _values_named(rank: int, N: int) -> None:
    # Both ranks' checksums appear, and they differ: the message says which rank passed what.
    t = _inputs(**MHA)
    with pytest.raises(ValueError) as error:
        context_parallel_attention(*_shards(t, rank, N), sinks=SINKS if rank == 0 else SINKS.flip(0))
    sums = re.findall(r"checksum ([0-9a-f]{16}) on rank (\d)", str(error.value))
    assert [r for _, r in sums] == ["0", "1"] and sums[0][0] != sums[1][0], str(error.value)


def _one_rank_rejects(rank: int, N: int) -> None:
    # Rank 1's own check fails; rank 0 must not wait for it in a collective it never joins.
    t = _inputs(**MHA)
    if rank == 1:
        with pytest.raises(ValueError, match="scale: expected a finite float"):
            context_parallel_attention(*_shards(t, rank, N), scale=math.nan)  # (a negative scale is a formula, as torch's)
    else:
        with pytest.raises(ValueError, match="group: expected valid arguments on every rank of the group, got arguments that rank 1 rejected"):
            context_parallel_attention(*_shards(t, rank, N), scale=0.5)


def _invalid_sinks(rank: int, N: int) -> None:
    # Validated like the core's sinks, on every rank before any compute.
    t = _inputs(**MHA)
    for sinks, exc, expected in (
        (SINKS[:3], ValueError, "sinks: expected shape (H,) = (4,), one logit per query head, got shape (3,)"),
        (torch.tensor([0.0, math.nan, 0.0, 0.0]), ValueError, "sinks: expected finite logits in torch.float64 (or -inf for a head without a sink), got NaN or +inf at heads [1]"),
        ([0.0] * 4, TypeError, "sinks: expected a float tensor of shape (H,) = (4,), got list"),
    ):
        with pytest.raises(exc, match=re.escape(expected)):
            context_parallel_attention(*_shards(t, rank, N), sinks=sinks)


def _still_usable(rank: int, N: int) -> None:
    # After every rejected call the ranks are still in step: a good call gives the right result.
    t = _inputs(**MHA)
    out = context_parallel_attention(*_shards(t, rank, N, "zigzag"), layout="zigzag", is_causal=True)
    full = attnscale.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True)
    torch.testing.assert_close(out, shard_sequence(full, rank, N, "zigzag"), atol=1e-10, rtol=1e-10)


def test_every_disagreement_raises_on_every_rank():
    launch(2, [*CHECKS, _values_named, _one_rank_rejects, _invalid_sinks, _still_usable], limit_s=120.0, timeout_s=30.0)

