"""Context-parallel attention on hostile inputs: NaN and inf entries, and logits beyond the
accumulation dtype, against single-process attention on the whole sequence (whose rules the
docstring of ``attnscale.scaled_dot_product_attention`` states): the same NaN rows, the same float64
recompute, the same gradients, and a refusal on every rank where nothing fits. A rank whose shard
holds nothing unusual must take the same steps as one that does, or the collectives hang (the
launch fails the test then).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnscale
from attnscale.distributed import context_parallel_attention, shard_sequence

from .spawn import launch

TOL = dict(atol=1e-10, rtol=1e-10)  # float64: summation order differs from the oracle, nothing more


def _inputs(dtype: torch.dtype, poison) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    t = {n: torch.randn(1, 4, 16, 8, generator=gen, dtype=dtype) for n in ("q", "k", "v", "g")}
    poison(t)
    return t


def _at(name: str, index: tuple[int, ...], value: float):
    def poison(t: dict[str, torch.Tensor]) -> None:
        t[name][index] = value

    return poison


def _scaled(factor: float):
    def poison(t: dict[str, torch.Tensor]) -> None:
        t["q"] *= factor
        t["k"] *= factor

    return poison


def _compare(rank: int, N: int, *, poison, dtype=torch.float64, method="ring", layout="contiguous", tol=TOL, **options) -> None:
    """Output, statistics and gradients of this rank's shard against the whole call's."""
    t = _inputs(dtype, poison)
    leaves = {n: t[n].clone().requires_grad_() for n in "qkv"}
    out_full, stats_full = attnscale.scaled_dot_product_attention(leaves["q"], leaves["k"], leaves["v"], return_stats=True, **options)
    (out_full * t["g"]).sum().backward()
    mine = {n: shard_sequence(t[n], rank, N, layout).requires_grad_() for n in "qkv"}
    out, stats = context_parallel_attention(mine["q"], mine["k"], mine["v"], method=method, layout=layout, return_stats=True, **options)
    what = f"{method} {layout} {options}"
    torch.testing.assert_close(out, shard_sequence(out_full, rank, N, layout), equal_nan=True, **tol, msg=f"out {what}")
    for field in ("lse", "max_logit", "max_prob", "entropy", "visible_keys"):
        want = shard_sequence(getattr(stats_full, field), rank, N, layout, dim=-1)
        torch.testing.assert_close(getattr(stats, field), want, equal_nan=True, **tol, msg=f"{field} {what}")
    (out * shard_sequence(t["g"], rank, N, layout)).sum().backward()
    for n in "qkv":
        grad = mine[n].grad
        assert grad is not None and bool(torch.isfinite(grad).all()), f"d{n} {what}: gradients stay finite"
        torch.testing.assert_close(grad, shard_sequence(leaves[n].grad, rank, N, layout), **tol, msg=f"d{n} {what}")


def _case(**kwargs):
    def check(rank: int, N: int) -> None:
        _compare(rank, N, **kwargs)

    return check


def _refused(rank: int, N: int) -> None:
    # float64 inputs whose logits' bound is beyond float64: every rank refuses, naming the inputs
    t = _inputs(torch.float64, _scaled(1e160))
    with pytest.raises(ValueError, match=r"query/key: expected products q\.k \* scale .* that fit torch\.float64"):
        context_parallel_attention(*(shard_sequence(t[n], rank, N) for n in "qkv"))
    with pytest.raises(ValueError, match=r"query/key: expected products"):
        attnscale.scaled_dot_product_attention(t["q"], t["k"], t["v"])


# Positions (batch, head, row, dim) on a sequence of 16 split in two: rows 0-7 on rank 0 and 8-15
# on rank 1 (contiguous); rank 0 holds rows 0-3 and 12-15 (zigzag).
CHECKS = [
    _case(poison=_at("q", (0, 1, 11, 2), math.nan), is_causal=True),
    _case(poison=_at("k", (0, 2, 5, 0), math.nan), layout="zigzag", is_causal=True),  # rows before 5 stay finite
    _case(poison=_at("k", (0, 0, 9, 3), math.inf)),  # a visible key with an inf in k: its rows are NaN
    _case(poison=_at("k", (0, 3, 2, 1), -math.inf), is_causal=True, window=(3, 0)),
    _case(poison=_at("v", (0, 1, 14, 4), math.inf), layout="zigzag", softcap=2.0),
    _case(poison=_at("q", (0, 0, 3, 0), math.inf), method="ulysses"),
    # float32 logits beyond float32's range: recomputed in float64, rounded once
    _case(poison=_scaled(1e20), dtype=torch.float32, is_causal=True, tol=dict(atol=0.0, rtol=0.0)),
    _case(poison=_scaled(1e20), dtype=torch.float32, layout="zigzag", tol=dict(atol=0.0, rtol=0.0)),
    _case(poison=_scaled(1e20), dtype=torch.float32, method="ulysses", tol=dict(atol=0.0, rtol=0.0)),
    _refused,
]


def test_hostile_inputs_on_two_ranks():
    launch(2, CHECKS)
