r"""Length-dependent logit scaling: Scalable-Softmax (SSMax) and log-length scaling.

Where the scale goes: **on top of** ``1/sqrt(D)``, as a per-row factor. Row i's logits become
``s * log(n_i) * q_i . k_j / sqrt(D)``, with ``n_i`` the number of keys row i can see (S without
a mask; ``i' + 1`` under a causal mask, ``i'`` the aligned position; fewer under a window or
padding). Why: with a fixed scale the largest probability of a softmax over n keys decays like
``1/n`` as n grows, so attention flattens on long contexts; multiplying by ``log n`` keeps a
peak able to stand out however many keys compete (Nakanishi 2025, "Scalable-Softmax Is Superior
for Attention", arXiv:2501.19399; ``s`` a learnable scalar per head). The fixed variant
``log(n) / log(n_train)`` equals 1 at the training length and sharpens beyond it (Chiang and
Cholak 2022, "Overcoming a Theoretical Limitation of Self-Attention"; Qwen's "logn" attention
clamps it below at 1: ``factor.clamp_min(1)``).

Multiply, do not subtract: ``softmax(z - s log n) = softmax(z)`` because a constant per row
cancels in softmax, so an additive ``log n`` term does nothing.

Implementation: the factor multiplies the rows of q, then ``scaled_dot_product_attention`` runs
with its usual scale. Everything proportional to ``q . k`` is scaled (softcap sees the scaled
logits); ALiBi biases and float masks, added afterwards, are not.

>>> import torch, attnscale
>>> from attnscale.variants import ScalableSoftmax
>>> ssmax = ScalableSoftmax(num_heads=4, head_dim=16, n_train=8)
>>> q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
>>> qs, ks = ssmax(q, k, is_causal=True)
>>> out = attnscale.scaled_dot_product_attention(qs, ks, v, is_causal=True, enable_gqa=True)
>>> visible_key_counts(3, 3, is_causal=True)
tensor([1, 2, 3])
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor, nn

from .._validate import FLOAT_DTYPES, check_bool, check_choice, check_window, fail
from ..masks import CausalAlignment, query_offset, visible
from ._checks import check_float, check_float_tensor, check_int, check_same_device

__all__ = ["ScalableSoftmax", "log_length_qk", "ssmax_factor", "ssmax_qk", "visible_key_counts"]


def visible_key_counts(
    L: int,
    S: int,
    *,
    is_causal: bool = False,
    causal_alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
    window: tuple[int | None, int | None] | None = None,
    attn_mask: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Number of keys each query row sees: int64 (L,), or (..., H or 1, L) for an ``attn_mask`` with those dims.

    Same semantics as ``scaled_dot_product_attention``: bool ``attn_mask`` True = attend, a float
    mask hides its ``-inf`` entries; causal mask and window aligned as ``causal_alignment`` says.
    """
    L, S = check_int("L", L, minimum=0), check_int("S", S, minimum=0)
    alignment = check_choice("causal_alignment", causal_alignment, CausalAlignment)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or (attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES):
            got = f"dtype {attn_mask.dtype}" if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
            fail("attn_mask", "None, or a bool (True = attend) or float tensor", got, "pass the mask given to attention; mask.bool() for a 0/1 mask", exc=TypeError)
        if attn_mask.ndim < 2 or not all(a in (1, b) for a, b in zip(attn_mask.shape[-2:], (L, S))):
            fail("attn_mask", f"last two dims broadcastable to (L, S) = ({L}, {S})", f"shape {tuple(attn_mask.shape)}", "pass the mask given to attention, with these L and S")
        device = attn_mask.device
    elif device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            fail("device", "None, a torch.device or a device string", repr(device), "pass e.g. device='cpu'")
    q_pos = torch.arange(L, device=device).unsqueeze(-1) + query_offset(L, S, alignment)  # (L, 1)
    k_pos = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
    keep = visible(q_pos, k_pos, causal=check_bool("is_causal", is_causal), window=check_window(window))  # (L, S) or None
    if keep is None:
        keep = torch.ones(L, S, dtype=torch.bool, device=device)
    if attn_mask is not None:
        keep = keep & (attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf"))
    return keep.sum(dim=-1)


def ssmax_factor(n: Tensor, s: Tensor | float) -> Tensor:
    """``s * log(n)``: counts n broadcastable to (..., H, L), s a float or (H,) -> broadcastable to (..., H, L).

    A row with ``n = 0`` sees no key and returns zeros whatever its factor; it gets factor 0.
    """
    _check_counts(n)
    s = _check_s(s)
    if isinstance(s, Tensor):
        check_same_device("s", s, n.device, owner="n's")
    log_n = n.clamp_min(1).to(torch.float64 if isinstance(s, float) else s.dtype).log()
    if isinstance(s, Tensor):
        return s[:, None] * log_n  # (H, 1) * (..., H or 1, L) -> (..., H, L)
    return s * log_n


def _check_counts(n: object) -> Tensor:
    if not isinstance(n, Tensor) or n.dtype == torch.bool or n.is_complex():
        got = f"dtype {n.dtype}" if isinstance(n, Tensor) else type(n).__name__
        fail("n", "an integer tensor of visible key counts", got, "use visible_key_counts(L, S, ...) with the attention's masks", exc=TypeError)
    return n


def _check_s(s: object) -> Tensor | float:
    if isinstance(s, Tensor):
        if s.dtype not in FLOAT_DTYPES or s.ndim != 1:
            fail("s", "a float or a float tensor of shape (H,)", f"dtype {s.dtype}, shape {tuple(s.shape)}", "pass one s per query head")
        return s
    if isinstance(s, bool) or not isinstance(s, Real):
        fail("s", "a float or a float tensor of shape (H,)", repr(s), "pass e.g. s=0.3", exc=TypeError)
    return float(s)


def ssmax_qk(query: Tensor, key: Tensor, s: Tensor | float, *, n: Tensor) -> tuple[Tensor, Tensor]:
    """Scale the rows of query (..., H, L, D) by ``s * log(n)``; key passes through.

    ``n`` comes from :func:`visible_key_counts` for the same masks you pass to attention.
    """
    check_float_tensor("query", query)
    check_float_tensor("key", key)
    H, L = query.shape[-3], query.shape[-2]
    rows = query.shape[:-1]  # (..., H, L)
    _check_counts(n)
    if n.ndim == 0 or n.ndim > len(rows) or not all(a in (1, b) for a, b in zip(n.shape[::-1], rows[::-1])) or n.shape[-1] != L:
        fail("n", f"visible key counts (L,) or broadcastable to (..., H, L) = {tuple(rows)}", f"shape {tuple(n.shape)}", "use visible_key_counts(L, S, ...) with the attention's masks")
    check_same_device("n", n, query.device)
    s = _check_s(s)
    if isinstance(s, Tensor):
        if s.shape != (H,):
            fail("s", f"a float or a tensor of shape (H,) = ({H},)", f"shape {tuple(s.shape)}", "pass one s per query head")
        check_same_device("s", s, query.device)
    factor = ssmax_factor(n, s)  # broadcastable to (..., H, L)
    return query * factor.unsqueeze(-1).to(query.dtype), key


def log_length_qk(query: Tensor, key: Tensor, *, n_train: int, n: Tensor) -> tuple[Tensor, Tensor]:
    """The fixed variant: scale the rows of q by ``log(n) / log(n_train)`` (1 at the training length)."""
    n_train = check_int("n_train", n_train, minimum=2)
    return ssmax_qk(query, key, 1.0 / math.log(n_train), n=n)


class ScalableSoftmax(nn.Module):
    """SSMax with one ``s`` per query head: ``forward(q, k, **masks) -> (q * s log n, k)``.

    ``s`` starts at ``s_init`` if given, else at ``1 / log(n_train)``, so that at the training
    length the factor is 1 and training starts from standard attention. With ``learnable=False``
    and the default init this is exactly the fixed ``log(n) / log(n_train)`` variant.
    ``effective_scale`` is the usual ``1/sqrt(head_dim)``: the length factor is already in q.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        n_train: int | None = None,
        s_init: float | None = None,
        learnable: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        if s_init is None:
            if n_train is None:
                fail("n_train", "the training length (>= 2) to initialise s = 1/log(n_train)", "None", "pass n_train=... or s_init=...")
            s_init = 1.0 / math.log(check_int("n_train", n_train, minimum=2))
        s = torch.full((self.num_heads,), check_float("s_init", s_init))
        if check_bool("learnable", learnable):
            self.s = nn.Parameter(s)
        else:
            self.register_buffer("s", s)

    @property
    def effective_scale(self) -> float:
        return self.head_dim**-0.5

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        *,
        is_causal: bool = False,
        causal_alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
        window: tuple[int | None, int | None] | None = None,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """query (..., H, L, D), key (..., Hkv, S, D); pass the same masks to attention afterwards."""
        check_float_tensor("query", query)
        check_float_tensor("key", key)
        if query.shape[-3] != self.num_heads or query.shape[-1] != self.head_dim:
            fail("query", f"(..., H = num_heads = {self.num_heads}, L, D = head_dim = {self.head_dim})", f"shape {tuple(query.shape)}", "build ScalableSoftmax with the query's heads and per-head dim")
        n = visible_key_counts(
            query.shape[-2],
            key.shape[-2],
            is_causal=is_causal,
            causal_alignment=causal_alignment,
            window=window,
            attn_mask=attn_mask,
            device=query.device,
        )
        return ssmax_qk(query, key, self.s, n=n)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"
