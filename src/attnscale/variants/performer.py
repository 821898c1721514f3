r"""Performer FAVOR+ (Choromanski et al. 2020, "Rethinking Attention with Performers").

Positive random features turn the softmax kernel into a dot product of features::

    exp(x . y) = E_w[ phi(x) . phi(y) ],   phi(x) = exp(W x - |x|^2 / 2) / sqrt(m),   rows of W ~ N(0, I_D)

then attention is linear attention with these features (``attnscale.variants.linear``).

Where the scale goes: **split in two, before the features**. The target is
``softmax(scale * q . k)`` with ``scale = 1/sqrt(D)`` by default, so q and k are each multiplied
by ``sqrt(scale) = D^(-1/4)`` and then ``exp(x . y) = exp(q . k / sqrt(D))``. Without it the
kernel would estimate ``exp(q . k)``, the unscaled softmax, and its variance (which grows like
``exp(|x + y|^2)``) would explode with D.

Orthogonal random features: W is built from blocks of D orthonormal rows, each row rescaled
by the norm of an independent Gaussian vector, so every row is still marginally N(0, I_D) while
rows inside a block are exactly orthogonal, which lowers the estimator's variance. The QR factor's columns are sign-corrected by ``diag(R)``
so that the directions are uniform (Haar); without it they are biased and the error stops falling.

Stabilisation: features are computed as ``exp(W x - |x|^2/2 - c)``, with c the max of
``W x - |x|^2/2`` over features for each query row and over all keys and features per head for
the keys; both constants cancel between numerator and denominator, so the estimate is unchanged
and ``exp`` cannot overflow.

>>> import torch, attnscale
>>> from attnscale.variants import PerformerAttention
>>> favor = PerformerAttention(head_dim=16, num_features=256, seed=0)
>>> g = torch.Generator().manual_seed(0)
>>> q, k = 0.5 * torch.randn(1, 4, 32, 16, generator=g), 0.5 * torch.randn(1, 2, 32, 16, generator=g)
>>> v = torch.randn(1, 2, 32, 8, generator=g)
>>> approx = favor(q, k, v, is_causal=True)
>>> exact = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
>>> bool((approx - exact).norm() / exact.norm() < 0.2)
True
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._validate import FLOAT_DTYPES, check_bool, check_positive_finite, fail
from ..dense import accumulation_dtype
from ._checks import check_float, check_float_tensor, check_int, check_qkv, check_same_device
from .linear import kernel_attention

__all__ = ["PerformerAttention", "favor_attention", "favor_features", "gaussian_features"]


def gaussian_features(
    num_features: int, head_dim: int, *, orthogonal: bool = True, generator: torch.Generator | None = None
) -> Tensor:
    """Random projection W (num_features, head_dim), float64, rows marginally N(0, I_D).

    ``orthogonal=True``: blocks of ``head_dim`` orthonormal rows (QR of a Gaussian matrix), each row
    rescaled by the norm of a fresh Gaussian vector (a chi_D draw); ``False``: i.i.d. Gaussian rows.
    """
    m = check_int("num_features", num_features, minimum=1)
    D = check_int("head_dim", head_dim, minimum=1)
    orthogonal = check_bool("orthogonal", orthogonal)
    if generator is not None and not isinstance(generator, torch.Generator):
        fail("generator", "None or a torch.Generator", type(generator).__name__, "pass torch.Generator().manual_seed(seed)", exc=TypeError)
    if not orthogonal:
        return torch.randn(m, D, generator=generator, dtype=torch.float64)
    blocks = []
    for _ in range(math.ceil(m / D)):
        q, r = torch.linalg.qr(torch.randn(D, D, generator=generator, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r))  # sign fix: makes q Haar-distributed, so rows are unbiased directions
        blocks.append(q.T)  # (D, D): orthonormal rows
    rows = torch.cat(blocks)[:m]  # (m, D)
    norms = torch.randn(m, D, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)  # (m, 1)
    return rows * norms


def check_projection(projection: object, D: int, device: torch.device, *, owner: str = "the query's") -> Tensor:
    """A random projection W (m, D): floating, m >= 1, on ``device``."""
    fix = "use gaussian_features(m, D) or PerformerAttention"
    if not isinstance(projection, Tensor) or projection.dtype not in FLOAT_DTYPES:
        got = f"dtype {projection.dtype}" if isinstance(projection, Tensor) else type(projection).__name__
        fail("projection", f"a floating tensor (m, D = {D})", got, fix, exc=TypeError)
    if projection.ndim != 2 or projection.shape[0] == 0 or projection.shape[1] != D:
        fail("projection", f"shape (m, D = {D}) with m >= 1", f"shape {tuple(projection.shape)}", fix)
    check_same_device("projection", projection, device, owner=owner)
    return projection


def favor_features(x: Tensor, projection: Tensor, *, is_query: bool) -> Tensor:
    """Positive features ``exp(W x - |x|^2/2 - c) / sqrt(m)`` of x (..., N, D) -> (..., N, m).

    x must already carry its share of the scale (``sqrt(scale)``). c is detached: it cancels in
    attention, so it only guards ``exp`` against overflow.
    """
    check_float_tensor("x", x, min_ndim=2)
    return _favor_features(x, check_projection(projection, x.shape[-1], x.device, owner="x's"), is_query=check_bool("is_query", is_query))


def _favor_features(x: Tensor, projection: Tensor, *, is_query: bool) -> Tensor:
    wx = x @ projection.to(x.dtype).T  # (..., N, m)
    logits = wx - x.pow(2).sum(dim=-1, keepdim=True) / 2
    dims = (-1,) if is_query else (-2, -1)  # per query row; per head over all keys
    if logits.shape[-2] == 0:
        return logits  # no rows: nothing to stabilise (amax over no keys is undefined)
    c = logits.detach().amax(dim=dims, keepdim=True)
    return torch.exp(logits - c) / math.sqrt(projection.shape[0])


def favor_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    projection: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    eps: float = 1e-12,
    chunk_size: int = 64,
) -> Tensor:
    """FAVOR+ estimate of ``softmax(scale * q . k) v``: query (..., H, L, D), key (..., Hkv, S, D),
    value (..., Hkv, S, Dv), projection (m, D) -> (..., H, L, Dv).

    ``scale`` defaults to ``1/sqrt(D)``; causal needs L == S. ``eps`` is added to the denominator
    so that a row whose features all underflow gives 0, not NaN; ``eps=0.0`` is the exact
    estimator. Float32 (float64 for float64 inputs). Inputs are checked as in
    ``scaled_dot_product_attention``; ``projection`` must be a floating (m, D) tensor on the
    query's device. With no keys (S = 0) every row is 0, as a fully masked row of softmax
    attention; L = 0 gives an empty output. NaN or inf inputs propagate.
    """
    shapes = check_qkv(query, key, value)
    D, L, S = shapes.D, shapes.L, shapes.S
    check_projection(projection, D, query.device)
    is_causal = check_bool("is_causal", is_causal)
    scale = check_positive_finite("scale", scale)
    eps = check_float("eps", eps, positive=False)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    if is_causal and L != S:
        fail("key", f"length S = L = {L} for causal FAVOR+", f"S = {S}", "pass equal lengths, or is_causal=False")

    acc = accumulation_dtype(query.dtype)
    root = math.sqrt(D**-0.5 if scale is None else scale)  # D^(-1/4) by default, on q and on k
    phi_q = _favor_features(query.to(acc) * root, projection, is_query=True)  # (..., H, L, m)
    phi_k = _favor_features(key.to(acc) * root, projection, is_query=False)  # (..., Hkv, S, m)
    out = kernel_attention(phi_q, phi_k, value.to(acc), is_causal=is_causal, eps=eps, chunk_size=chunk_size)
    return out.to(query.dtype)


class PerformerAttention(nn.Module):
    """FAVOR+ attention with a seeded random projection (a buffer) and :meth:`redraw`.

    ``forward(q, k, v, is_causal=False) -> out`` estimates softmax attention at ``1/sqrt(head_dim)``.
    """

    def __init__(self, head_dim: int, num_features: int, *, orthogonal: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.num_features = check_int("num_features", num_features, minimum=1)
        self.orthogonal = check_bool("orthogonal", orthogonal)
        self._generator = torch.Generator().manual_seed(check_int("seed", seed, minimum=0))
        self.register_buffer("projection", self._draw())

    def _draw(self) -> Tensor:
        return gaussian_features(self.num_features, self.head_dim, orthogonal=self.orthogonal, generator=self._generator)

    def redraw(self, seed: int | None = None) -> None:
        """Draw a new projection: the next one of this module's seeded stream, or from ``seed``."""
        if seed is not None:
            self._generator.manual_seed(check_int("seed", seed, minimum=0))
        self.projection.copy_(self._draw())

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *, is_causal: bool = False) -> Tensor:
        if isinstance(query, Tensor) and query.ndim and query.shape[-1] != self.head_dim:
            fail("query", f"last dim head_dim = {self.head_dim}", f"shape {tuple(query.shape)}", "build PerformerAttention with the per-head dim")
        return favor_attention(query, key, value, self.projection, is_causal=is_causal)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_features={self.num_features}, orthogonal={self.orthogonal}"
