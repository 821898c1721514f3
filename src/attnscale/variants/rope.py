r"""Rotary position embeddings (RoPE): rotate q and k, then attend with the usual scale.

Where the scale goes: **unchanged**, ``1/sqrt(D)`` after the rotation, on the full head dim D
(rotated and pass-through dims alike). A rotation preserves every norm and
``R(m) q . R(n) k = q . R(n - m) k``, so the logit depends only on the relative offset and its
variance is that of the unrotated ``q . k``: the variance argument for ``1/sqrt(D)`` still holds.
Because the rotation is linear, the scale commutes with it: ``R(m)(c q) = c R(m) q``.
Source: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding".

Pair ``i`` of the first ``rotary_dim`` dims turns by ``position * base ** (-2 i / rotary_dim)``.
Two layouts choose which dims form pair ``i``::

    RopeLayout.HALF         (GPT-NeoX, Llama)   dims (i, i + rotary_dim / 2)
    RopeLayout.INTERLEAVED  (GPT-J, RoFormer)   dims (2 i, 2 i + 1)

They are the same map up to a permutation of dims. With ``rotary_dim < D`` (partial rotary,
GPT-NeoX / GPT-J use D / 4) the tail ``x[..., rotary_dim:]`` passes through unchanged.
For KV-cache decoding, rotate the new tokens at ``offset = number of cached tokens``.

>>> import torch, attnscale
>>> from attnscale.variants import rope_qk
>>> q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
>>> qr, kr = rope_qk(q, k)
>>> out = attnscale.scaled_dot_product_attention(qr, kr, v, is_causal=True, enable_gqa=True)
>>> torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
True
"""

from __future__ import annotations

from enum import StrEnum

import torch
from torch import Tensor, nn

from .._validate import check_choice, fail
from ..dense import accumulation_dtype
from ._checks import check_float, check_float_tensor, check_int, check_same_device

__all__ = ["RopeLayout", "RotaryEmbedding", "apply_rope", "rope_angles", "rope_qk"]


class RopeLayout(StrEnum):
    """Which dims form a rotated pair: ``HALF`` (i, i + r/2) or ``INTERLEAVED`` (2i, 2i + 1)."""

    HALF = "half"
    INTERLEAVED = "interleaved"


_MAX_POSITION = 2**53  # float64 holds every integer up to 2**53; beyond, neighbouring positions share an angle


def rope_angles(positions: Tensor, rotary_dim: int, *, base: float = 10000.0) -> Tensor:
    """Float64 angles (..., rotary_dim / 2): ``positions[..., None] * base ** (-2 i / rotary_dim)``.

    Float64 because ``position * frequency`` loses the low bits of the angle in float32 at long
    positions; cos and sin are taken before casting down. ``positions`` is a real (integer or
    float) tensor of finite values with ``|position| <= 2**53``, the range float64 holds exactly.
    """
    r = check_int("rotary_dim", rotary_dim, minimum=2)
    if r % 2:
        fail("rotary_dim", "an even int >= 2 (dims rotate in pairs)", repr(r), f"pass rotary_dim={r - 1} or {r + 1}")
    return _angles(_check_positions(positions, shape=None), r, check_float("base", base))


def _check_positions(positions: object, *, shape: tuple[int, ...] | None, device: torch.device | None = None) -> Tensor:
    """Real positions (of ``shape`` and on ``device`` when given), finite, within +-_MAX_POSITION."""
    if not isinstance(positions, Tensor) or positions.dtype == torch.bool or positions.is_complex():
        got = f"dtype {positions.dtype}" if isinstance(positions, Tensor) else type(positions).__name__
        fail("positions", "an integer or float tensor", got, "pass e.g. torch.arange(offset, offset + L)", exc=TypeError)
    if shape is not None and positions.shape != shape:
        fail("positions", f"shape {shape}: one position per row", f"shape {tuple(positions.shape)}", "pass one position per query/key row")
    if device is not None:
        check_same_device("positions", positions, device, owner="x's")
    bad = (positions > _MAX_POSITION) | (positions < -_MAX_POSITION)
    if positions.is_floating_point():
        bad |= positions.isnan()
    if bool(bad.any()):
        fail("positions", "finite values in [-2**53, 2**53] (the integers float64 holds exactly)", f"{int(bad.sum())} NaN or out of range", "shift every position by the same amount: RoPE scores depend only on differences")
    return positions


def _angles(positions: Tensor, rotary_dim: int, base: float) -> Tensor:
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim)
    return positions.to(torch.float64)[..., None] * inv_freq


def apply_rope(
    x: Tensor,
    *,
    offset: int = 0,
    positions: Tensor | None = None,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    layout: RopeLayout | str = RopeLayout.HALF,
) -> Tensor:
    """Rotate ``x`` (..., H, L, D) at positions ``offset + arange(L)`` (or explicit ``positions`` (L,)).

    ``rotary_dim`` (default D, even, <= D) dims rotate; the rest pass through. Computed in float32
    (float64 for float64 inputs) and returned in ``x``'s dtype. Positions must be exact in the
    float64 angle computation: ``offset`` is an int >= 0 with ``offset + L - 1 <= 2**53``;
    explicit ``positions`` (integer or float, on x's device, any sign, ``offset`` left at 0) lie
    in ``[-2**53, 2**53]``.
    """
    return _rotate("x", x, offset=offset, positions=positions, base=base, rotary_dim=rotary_dim, layout=layout)


def _rotate(
    name: str,
    x: object,
    *,
    offset: object,
    positions: object,
    base: object,
    rotary_dim: object,
    layout: object,
) -> Tensor:
    x = check_float_tensor(name, x)
    L, D = x.shape[-2], x.shape[-1]
    if rotary_dim is None:
        if D % 2:
            fail(name, "an even head dim D when rotary_dim is None (dims rotate in pairs)", f"shape {tuple(x.shape)}", f"pass an even rotary_dim < D, e.g. rotary_dim={D - 1}")
        r = D
    else:
        r = check_int("rotary_dim", rotary_dim, minimum=2)
    if r > D or r % 2:
        fail("rotary_dim", f"an even int <= D = {D}", repr(r), "pass an even rotary_dim no larger than the head dim")
    base = check_float("base", base)
    layout = check_choice("layout", layout, RopeLayout)
    offset = check_int("offset", offset, minimum=0)
    if positions is None:
        if offset + L - 1 > _MAX_POSITION:
            fail(
                "offset",
                f"an int with offset + L - 1 <= 2**53 = {_MAX_POSITION} (positions exact in float64)",
                f"offset = {offset} with L = {L}",
                "shift q and k by the same amount: RoPE scores depend only on position differences",
            )
        positions = torch.arange(offset, offset + L, device=x.device)
    elif offset != 0:
        fail("offset", "0 when positions is given (positions are absolute)", repr(offset), "add the offset to positions instead")
    else:
        positions = _check_positions(positions, shape=(L,), device=x.device)

    acc = accumulation_dtype(x.dtype)
    angles = _angles(positions, r, base)  # (L, r/2)
    cos, sin = angles.cos().to(acc), angles.sin().to(acc)
    rot, tail = x[..., :r].to(acc), x[..., r:]
    if layout is RopeLayout.HALF:
        a, b = rot[..., : r // 2], rot[..., r // 2 :]  # (..., L, r/2) each
        turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., L, r)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]  # (..., L, r/2) each
        turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)  # (..., L, r)
    return torch.cat((turned.to(x.dtype), tail), dim=-1)


def rope_qk(
    query: Tensor,
    key: Tensor,
    *,
    offset: int = 0,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    layout: RopeLayout | str = RopeLayout.HALF,
) -> tuple[Tensor, Tensor]:
    """Rotate query (..., H, L, D) and key (..., Hkv, S, D), both from position ``offset``.

    Pass the result to ``scaled_dot_product_attention`` with the default scale ``1/sqrt(D)``.
    """
    opts = dict(offset=offset, positions=None, base=base, rotary_dim=rotary_dim, layout=layout)
    return _rotate("query", query, **opts), _rotate("key", key, **opts)


class RotaryEmbedding(nn.Module):
    """``forward(q, k, offset=0) -> (q, k)`` rotated; ``effective_scale`` is ``1/sqrt(head_dim)``.

    No parameters: the rotation is fixed by ``base``, ``rotary_dim`` and ``layout``.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        layout: RopeLayout | str = RopeLayout.HALF,
    ) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim, minimum=2)
        self.rotary_dim = self.head_dim if rotary_dim is None else check_int("rotary_dim", rotary_dim, minimum=2)
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            fail("rotary_dim", f"an even int <= head_dim = {self.head_dim}", repr(self.rotary_dim), "pass an even rotary_dim no larger than head_dim")
        self.base = check_float("base", base)
        self.layout = check_choice("layout", layout, RopeLayout)

    @property
    def effective_scale(self) -> float:
        return self.head_dim**-0.5

    def forward(self, query: Tensor, key: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        for name, t in (("query", query), ("key", key)):
            if check_float_tensor(name, t).shape[-1] != self.head_dim:
                fail(name, f"last dim head_dim = {self.head_dim}", f"shape {tuple(t.shape)}", "build RotaryEmbedding with the per-head dim")
        return rope_qk(query, key, offset=offset, base=self.base, rotary_dim=self.rotary_dim, layout=self.layout)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, layout={self.layout.value}"
