"""The compiled kernel's shard-pair partials (``attnscale.kernels.fused.partial_forward`` and
``partial_backward``, what the ring runs every shard pair on) against the tiled kernel's, which
``tests/distributed`` and ``tiled``'s own tests hold to the float64 reference: the same outputs,
log-sum-exps, statistics and gradient contributions, at global positions, for every score-path
feature, GQA and batch dims."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnscale import kernels, tiled
from attnscale.kernels import fused
from attnscale.score import ScorePath

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the compiled kernel's partials need it built")

# Measured over the cases below (the largest difference from the tiled kernel's partials, outputs,
# lse, statistics and gradients): 2.5e-6 in float32, 5.7e-15 in float64.
TOL = {torch.float32: 5e-6, torch.float64: 2e-14}
PATHS = {
    "plain": dict(),
    "causal, bottom-right offset": dict(causal=True, q_offset=3),
    "window": dict(window=(5, 2), causal=True, q_offset=3),
    "softcap": dict(softcap=4.0),
}
# (query start, key start): keys after, before and around the queries, so that some rows see no key
STARTS = [(10, 4), (0, 12), (20, 0)]
CASES = list(itertools.product(PATHS, (torch.float32, torch.float64), (False, True), ((), (2,))))


def _ids(case) -> str:
    path, dtype, alibi, batch = case
    return f"{path}-{str(dtype).removeprefix('torch.')}{'-alibi' if alibi else ''}{'-batch' if batch else ''}"


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), f"{what}: non-finite entries differ"
    assert torch.equal(got[~finite], want[~finite]), f"{what}: non-finite entries differ"
    assert torch.le((got[finite].double() - want[finite].double()).abs(), tol).all(), what


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_compiled_kernels_partials_are_the_tiled_kernels(case):
    name, dtype, alibi, batch = case
    gen = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = draw(*batch, 4, 7, 8), draw(*batch, 2, 9, 8), draw(*batch, 2, 9, 5)
    path = ScorePath(scale=0.4, **PATHS[name])
    slopes = torch.rand(4, generator=gen, dtype=torch.float64).to(dtype) if alibi else None
    tol = TOL[dtype]
    assert fused.partials_cannot(q) is None
    empty_rows = 0
    for q0, k0 in STARTS:
        where = dict(path=path, q_start=q0, k_start=k0, alibi_slopes=slopes)
        out, lse, stats = tiled.partial_forward(q, k, v, **where, with_stats=True)
        got_out, got_lse, got_stats = fused.partial_forward(q, k, v, **where, with_stats=True)
        _close(got_out, out, tol, "out")
        _close(got_lse, lse, tol, "lse")
        for field in ("max_logit", "max_prob", "entropy", "visible_keys"):
            _close(getattr(got_stats, field), getattr(stats, field), tol, field)
        # as one pair of several: this pair's rows as the final ones, some without a visible key (lse = -inf)
        dout, dlse = draw(*out.shape), draw(*lse.shape)
        want = tiled.partial_backward(q, k, v, out, lse, dout, dlse, **where)
        got = fused.partial_backward(q, k, v, out, lse, dout, dlse, **where)
        for name_, g, w in zip(("dq", "dk", "dv"), got, want):
            _close(g, w, tol, name_)
        empty_rows += int((lse == -math.inf).sum())
    if path.causal:
        assert empty_rows > 0, "rows without a visible key (the backward's m = 0 rows) are among the cases"


def test_16_bit_inputs_and_tracing_take_the_tiled_kernels_partials():
    assert "bfloat16 inputs" in fused.partials_cannot(torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16))
    assert fused.partials_cannot(torch.zeros(1, 1, 2, 4, device="meta")) == "tracing"
