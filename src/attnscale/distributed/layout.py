"""How a sequence is cut into per-rank shards: the contiguous and zigzag layouts.

With ``N`` ranks, rank ``r`` holds (positions along the sequence axis, length ``L``)::

    contiguous   one run: rows [start_r, start_r + L_r), L_r = L // N, the first L % N ranks one more
                 (any sizes work for ring attention: each rank passes its own run)
    zigzag       chunks r and 2N-1-r of 2N equal chunks (L divisible by 2N), N = 2:
                     chunk   0 1 2 3
                     rank    0 1 1 0

Under causal attention a contiguous layout gives the last rank N times the work of the first; the
zigzag layout pairs an early chunk with a late one, so every rank sees the same number of visible
(query, key) pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import torch
from torch import Tensor

from .._validate import check_choice, fail

__all__ = ["Layout", "segments", "shard_sequence", "unshard_sequence", "zigzag_order"]


class Layout(StrEnum):
    """Which positions of the sequence each rank holds (see the module docstring)."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"


def _check_rank(rank: object, world_size: object) -> tuple[int, int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        fail("world_size", "a positive int", repr(world_size), "pass the number of ranks, e.g. dist.get_world_size()")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        fail("rank", f"an int in [0, {world_size})", repr(rank), "pass this process's rank in the group")
    return rank, world_size


def check_zigzag_length(arg: str, length: int, world_size: int) -> int:
    """Chunk length of a zigzag layout; the length must be a multiple of 2 * world_size."""
    if length % (2 * world_size) != 0:
        fail(
            arg,
            f"a sequence length divisible by 2 * world_size = {2 * world_size} for layout='zigzag'",
            f"length {length}",
            "pad the sequence to a multiple of 2 * world_size, or use layout='contiguous'",
        )
    return length // (2 * world_size)


def segments(layout: Layout, sizes: Sequence[int], rank: int) -> list[tuple[int, int]]:
    """Global ``(start, length)`` runs of rank ``rank``'s shard, in the order the shard stores them.

    ``sizes`` are the shard lengths of all ranks (equal for zigzag).

    >>> segments(Layout.CONTIGUOUS, [3, 3, 2], 2)
    [(6, 2)]
    >>> segments(Layout.ZIGZAG, [4, 4], 0)
    [(0, 2), (6, 2)]
    """
    if layout is Layout.CONTIGUOUS:
        return [(sum(sizes[:rank]), sizes[rank])]
    n, chunk = len(sizes), sizes[rank] // 2
    return [(rank * chunk, chunk), ((2 * n - 1 - rank) * chunk, chunk)]


def zigzag_order(length: int, world_size: int, device: torch.device | None = None) -> Tensor:
    """Global position of each row of the rank-ordered concatenation of zigzag shards.

    ``full[..., zigzag_order(L, N), :]`` is ``cat(shards)``; its inverse permutation restores the
    natural order.

    >>> zigzag_order(8, 2)
    tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    chunk = check_zigzag_length("length", length, world_size)
    runs = [segments(Layout.ZIGZAG, [2 * chunk] * world_size, r) for r in range(world_size)]
    return torch.cat([torch.arange(s, s + n, device=device) for rank_runs in runs for s, n in rank_runs])


def shard_sequence(x: Tensor, rank: int, world_size: int, layout: Layout | str = Layout.CONTIGUOUS, dim: int = -2) -> Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (the sequence axis) in ``layout``.

    ``contiguous`` allows any length (the first ``L % world_size`` ranks get one more row);
    ``zigzag`` needs a length divisible by ``2 * world_size``.

    >>> x = torch.arange(8).view(1, 8, 1)
    >>> shard_sequence(x, 1, 2, "zigzag").flatten().tolist()
    [2, 3, 4, 5]
    >>> shard_sequence(torch.arange(5).view(5, 1), 0, 2).flatten().tolist()
    [0, 1, 2]
    """
    layout = check_choice("layout", layout, Layout)
    rank, world_size = _check_rank(rank, world_size)
    if layout is Layout.CONTIGUOUS:
        return torch.tensor_split(x, world_size, dim=dim)[rank]
    chunk = check_zigzag_length("x", x.shape[dim], world_size)
    first = x.narrow(dim, rank * chunk, chunk)
    second = x.narrow(dim, (2 * world_size - 1 - rank) * chunk, chunk)
    return torch.cat([first, second], dim=dim)


def unshard_sequence(shards: Sequence[Tensor], layout: Layout | str = Layout.CONTIGUOUS, dim: int = -2) -> Tensor:
    """The whole sequence from every rank's shard (in rank order): the inverse of :func:`shard_sequence`.

    >>> x = torch.arange(12).view(12, 1)
    >>> parts = [shard_sequence(x, r, 3, "zigzag") for r in range(3)]
    >>> torch.equal(unshard_sequence(parts, "zigzag"), x)
    True
    """
    layout = check_choice("layout", layout, Layout)
    if not isinstance(shards, Sequence) or len(shards) == 0 or not all(isinstance(s, Tensor) for s in shards):
        fail("shards", "a non-empty list of tensors, one per rank in rank order", type(shards).__name__, "pass [shard_0, shard_1, ...]", exc=TypeError)
    full = torch.cat(list(shards), dim=dim)
    if layout is Layout.CONTIGUOUS:
        return full
    sizes = {s.shape[dim] for s in shards}
    if len(sizes) != 1 or sizes.pop() % 2 != 0:
        fail("shards", "zigzag shards of one even length", f"lengths {[s.shape[dim] for s in shards]}", "pass the shards that shard_sequence(..., layout='zigzag') made")
    order = zigzag_order(full.shape[dim], len(shards), device=full.device)
    return full.index_select(dim, torch.argsort(order))
